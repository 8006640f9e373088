"""`ringwatch serve` as the README starts it: no RINGWATCH_DATABASE_URL (the embedded Postgres),
no RINGWATCH_API_URL, no RINGWATCH_SECRET_KEY, no RINGWATCH_WEBHOOK_ALLOWED_NETWORKS. It
delivers signed webhooks to a receiver on this machine, its links point at the port it
serves, its key survives a restart, and it says all that in one whole line."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import httpx

from ringwatch.services.cli.api_process import wait_ready
from ringwatch.services.notifier.receiver import WebhookReceiver
from ringwatch.services.settings import LOCAL_KEY_FILE
from tests.api_fixtures import TEST_SECRET_KEY, fleet_batch
from tests.procs import cli, free_port

ADMIN = "rw_local_" + uuid.uuid4().hex
SECRET = "a receiver's own secret"


def _env(state: Path) -> dict[str, str]:
    unset = ("RINGWATCH_DATABASE_URL", "RINGWATCH_API_URL", "RINGWATCH_SECRET_KEY",
             "RINGWATCH_WEBHOOK_ALLOWED_NETWORKS", "RINGWATCH_DEMO")
    env = {k: v for k, v in os.environ.items() if k not in unset}
    return {**env, "RINGWATCH_STATE_DIR": str(state), "RINGWATCH_BOOTSTRAP_ADMIN_TOKEN": ADMIN,
            "RINGWATCH_NOTIFIER_POLL_S": "0.5"}


def _serve(env: dict[str, str], port: int) -> tuple[subprocess.Popen, str]:
    """``ringwatch serve --port PORT`` once it answers; its URL."""
    proc = subprocess.Popen([sys.executable, "-m", "ringwatch.services.cli.main", "serve", "--port", str(port)],
                            env=env, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    wait_ready(proc, url, timeout_s=180)
    return proc, url


def _stop(proc: subprocess.Popen) -> str:
    proc.terminate()
    return proc.communicate(timeout=60)[1]


def test_serve_on_the_embedded_database_delivers_to_a_local_receiver(tmp_path) -> None:
    env = _env(tmp_path / "state")
    key = tmp_path / "state" / LOCAL_KEY_FILE
    auth = {"Authorization": f"Bearer {ADMIN}"}
    port = free_port()
    try:
        with WebhookReceiver(SECRET) as rx:
            proc, api = _serve(env, port)
            try:
                hook = httpx.post(f"{api}/v1/webhooks", headers=auth, timeout=30, json={
                    "url": rx.url, "secret": SECRET, "events": ["health.degraded"]})
                assert hook.status_code == 201, hook.text
                for _ in range(2):  # a fault in 2 cycles of 3 opens an incident
                    httpx.post(f"{api}/v1/measurements", headers=auth, timeout=60,
                               json=fleet_batch(slow_node="node-002")).raise_for_status()
                events = rx.wait_for(1, timeout_s=120)
            finally:
                err = _stop(proc)
            assert [e["event"] for e in events] == ["health.degraded"]
            assert events[0]["verified"]
            # No RINGWATCH_API_URL: the incident's link points where serve listened.
            assert events[0]["body"]["url"].startswith(f"http://127.0.0.1:{port}/v1/findings/")
            assert key.stat().st_mode & 0o777 == 0o600
            generated = key.read_text()

            # The banner: one whole line, after the server listens, saying all of it.
            banner = [line for line in err.splitlines() if line.startswith("ringwatch serve:")]
            assert len(banner) == 1, err
            assert f"API at http://127.0.0.1:{port} " in banner[0]
            assert "webhook notifier running" in banner[0]
            assert banner[0].endswith(f"127.0.0.0/8, ::1/128, their secrets sealed with the key "
                                      f"in {key}")
            assert "RINGWATCH_SECRET_KEY is unset" not in err

            # Restarted on another port: the same key opens the stored secret.
            port = free_port()
            proc, api = _serve(env, port)
            try:
                test = httpx.post(f"{api}/v1/webhooks/{hook.json()['id']}/test", headers=auth,
                                  timeout=30)
                assert test.status_code == 202, test.text
                events = rx.wait_for(2, timeout_s=120)
            finally:
                _stop(proc)
            assert events[-1]["event"] == "webhook.test" and events[-1]["verified"]
            assert key.read_text() == generated
    finally:
        cli("db", "stop", env=env)


def test_on_a_named_database_links_follow_the_port_unless_the_api_url_is_set(
        database_url, clean_db, tmp_path) -> None:
    """Production's shape (a named database, the key and the receivers' network set): the
    settings are its own, and with RINGWATCH_API_URL unset the links still name the port
    served; set, they name it, and the banner says where they point."""
    env = {**_env(tmp_path), "RINGWATCH_DATABASE_URL": database_url,
           "RINGWATCH_SECRET_KEY": TEST_SECRET_KEY,
           "RINGWATCH_WEBHOOK_ALLOWED_NETWORKS": "127.0.0.1/32"}
    auth = {"Authorization": f"Bearer {ADMIN}"}
    port = free_port()
    with WebhookReceiver(SECRET) as rx:
        proc, api = _serve(env, port)
        try:
            httpx.post(f"{api}/v1/webhooks", headers=auth, timeout=30, json={
                "url": rx.url, "secret": SECRET, "events": ["health.degraded"]}
            ).raise_for_status()
            for _ in range(2):
                httpx.post(f"{api}/v1/measurements", headers=auth, timeout=60,
                           json=fleet_batch(slow_node="node-001")).raise_for_status()
            events = rx.wait_for(1, timeout_s=120)
        finally:
            err = _stop(proc)
    assert events and events[0]["body"]["url"].startswith(f"http://127.0.0.1:{port}/v1/findings/")
    banner = next(line for line in err.splitlines() if line.startswith("ringwatch serve:"))
    assert banner.endswith("webhook notifier running")  # nothing of this machine's own
    assert not (tmp_path / LOCAL_KEY_FILE).exists()

    proxy = "https://ringwatch.example"
    proc, _ = _serve({**env, "RINGWATCH_API_URL": proxy}, free_port())
    banner = next(line for line in _stop(proc).splitlines() if line.startswith("ringwatch serve:"))
    assert f"(OpenAPI at /docs; links point at {proxy})" in banner
