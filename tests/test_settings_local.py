"""A server of this machine alone (the demo's, one on the embedded Postgres) makes its own
webhook secret key and delivers to loopback receivers; one on a named database runs on what
production sets."""

from __future__ import annotations

import pytest

from ringwatch.services.notifier.secret_box import box_from_settings
from ringwatch.services.notifier.url_policy import UrlRefused, check_url
from ringwatch.services.settings import LOCAL_KEY_FILE, LOOPBACK_NETWORKS, Settings

EXTERNAL = "postgresql+psycopg://ring@db.example:5432/fleet"
RECEIVER = "http://127.0.0.1:9000/hook"


def test_the_embedded_servers_key_is_made_once_private_and_reused(tmp_path) -> None:
    embedded = Settings(database_url="", secret_key="", state_dir=tmp_path)
    assert embedded.local
    first = embedded.with_local_defaults()
    key = tmp_path / LOCAL_KEY_FILE
    assert key.stat().st_mode & 0o777 == 0o600
    assert first.secret_key.get_secret_value() == key.read_text().strip() != ""
    # A restart reads the same key, so the secrets stored under it still open.
    again = Settings(database_url="", secret_key="", state_dir=tmp_path).with_local_defaults()
    assert again.secret_key == first.secret_key
    sealed = box_from_settings(first).seal("s3cret")  # type: ignore[union-attr]
    assert box_from_settings(again).open(sealed) == "s3cret"  # type: ignore[union-attr]


def test_a_key_file_others_could_read_is_made_private(tmp_path) -> None:
    key = tmp_path / LOCAL_KEY_FILE
    Settings(database_url="", state_dir=tmp_path).with_local_defaults()
    key.chmod(0o644)
    Settings(database_url="", state_dir=tmp_path).with_local_defaults()
    assert key.stat().st_mode & 0o777 == 0o600


def test_the_embedded_server_delivers_to_loopback_receivers(tmp_path) -> None:
    local = Settings(database_url="", state_dir=tmp_path).with_local_defaults()
    check_url(RECEIVER, local.webhook_allowed_networks)
    check_url("http://[::1]:9000/hook", local.webhook_allowed_networks)
    # What an operator allows besides is kept; loopback is not a licence for the rest.
    mine = Settings(database_url="", state_dir=tmp_path,
                    webhook_allowed_networks="10.1.0.0/16").with_local_defaults()
    assert mine.webhook_allowed_networks == ["10.1.0.0/16", *LOOPBACK_NETWORKS]
    with pytest.raises(UrlRefused, match="private"):
        check_url("http://192.168.1.5/hook", mine.webhook_allowed_networks)


def test_the_demo_on_a_named_database_is_local_too(tmp_path) -> None:
    demo = Settings(database_url=EXTERNAL, demo=True, state_dir=tmp_path)
    assert demo.local
    check_url(RECEIVER, demo.with_local_defaults().webhook_allowed_networks)
    assert (tmp_path / LOCAL_KEY_FILE).exists()


def test_a_server_on_a_named_database_runs_on_what_production_sets(tmp_path) -> None:
    production = Settings(database_url=EXTERNAL, secret_key="", state_dir=tmp_path)
    assert not production.local
    same = production.with_local_defaults()
    assert same.secret_key.get_secret_value() == "" and same.webhook_allowed_networks == []
    assert box_from_settings(same) is None
    with pytest.raises(UrlRefused, match="loopback"):
        check_url(RECEIVER, same.webhook_allowed_networks)
    assert not (tmp_path / LOCAL_KEY_FILE).exists()


def test_a_key_the_operator_sets_is_kept(tmp_path) -> None:
    passphrase = "an operator's own passphrase"
    local = Settings(database_url="", secret_key=passphrase, state_dir=tmp_path)
    assert local.with_local_defaults().secret_key.get_secret_value() == passphrase
    assert not (tmp_path / LOCAL_KEY_FILE).exists()
