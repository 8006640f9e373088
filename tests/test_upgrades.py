"""Upgrades and rollbacks: alembic by hand on RINGWATCH_DATABASE_URL, `ringwatch db downgrade`
one release back with the data kept, an API serving a database one additive migration
ahead of it (and refusing one that does more), `ringwatch --version`, and the pool and
timeouts as settings. Against real Postgres databases and real processes."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from sqlalchemy import create_engine, inspect, text
from sqlalchemy.exc import OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout

from ringwatch.services.settings import Settings, get_settings
from ringwatch.services.store import db
from ringwatch.services.version import ringwatch_version
from tests.procs import api_env, cli, free_port, start_server, stop_server

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "upgrades-admin-token-0123456789"


@pytest.fixture
def fresh_url(admin_url: str) -> Iterator[str]:
    name = f"rw_upg_{uuid.uuid4().hex[:10]}"
    url = db.create_database(admin_url, name)
    try:
        yield url
    finally:
        db.drop_database(admin_url, name)


def _env(url: str, **more: str) -> dict[str, str]:
    """This environment with RINGWATCH_DATABASE_URL set to ``url`` and no other RINGWATCH_
    variable: what an operator's shell holds."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RINGWATCH_")}
    return {**env, "RINGWATCH_DATABASE_URL": url, **more}


def _one_line(proc: subprocess.CompletedProcess) -> str:
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, (proc.returncode, proc.stderr)
    return lines[0]


# -- alembic by hand -------------------------------------------------------------------------


def test_alembic_by_hand_migrates_the_database_ringwatch_database_url_names(
        fresh_url: str, tmp_path: Path) -> None:
    """alembic.ini names no database: `alembic upgrade head`, from any folder, migrates the one
    RINGWATCH_DATABASE_URL names, and refuses in one line when it is unset (it used to
    migrate postgres@127.0.0.1:5432/ringwatch whatever was set)."""
    alembic = [sys.executable, "-m", "alembic", "-c", str(ROOT / "alembic.ini")]

    def run(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
        return subprocess.run([*alembic, *args], cwd=tmp_path, env=env, capture_output=True,
                              text=True, timeout=300)

    up = run("upgrade", "head", env=_env(fresh_url))
    assert up.returncode == 0, up.stderr
    assert db.current_revision(fresh_url) == db.head_revision()
    down = run("downgrade", "-1", env=_env(fresh_url))
    assert down.returncode == 0, down.stderr
    below = [*db.revisions_between(db.head_revision() or "", "0016"), "0016"][1]
    assert db.current_revision(fresh_url) == below

    unset = {k: v for k, v in _env(fresh_url).items() if k != "RINGWATCH_DATABASE_URL"}
    refused = run("upgrade", "head", env=unset)
    assert refused.returncode != 0 and "set RINGWATCH_DATABASE_URL" in refused.stderr
    assert db.current_revision(fresh_url) == below


# -- downgrade one release back --------------------------------------------------------------


def _nodes(url: str) -> dict[str, dict]:
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            return {r["name"]: dict(r) for r in conn.execute(text("SELECT * FROM nodes")).mappings()}
    finally:
        engine.dispose()


def _columns(url: str, table: str) -> set[str]:
    engine = create_engine(url)
    try:
        return {c["name"] for c in inspect(engine).get_columns(table)}
    finally:
        engine.dispose()


def test_downgrade_goes_back_one_release_step_by_step_keeping_the_data(fresh_url: str) -> None:
    """From head down to the previous release's migration (0016), one step at a time and by
    the release's name: each step drops what its migration added (docs/operations.md says
    what), keeps every row, and puts renamed values back; below the release it refuses in one
    line, and an upgrade afterwards brings the same data back to head."""
    floor_release, floor = db.downgrade_floor()
    assert floor == "0016"
    head = db.head_revision() or ""
    env = _env(fresh_url)
    db.upgrade(fresh_url, floor)
    engine = create_engine(fresh_url)
    with engine.begin() as conn:  # a name from before the strict rule (0017 renames it)
        conn.execute(text("INSERT INTO nodes (name) VALUES ('node-1.'), ('node-2')"))
        conn.execute(text("INSERT INTO fleets (name, holder, cycle) VALUES ('default', 's1', 7)"))
    up = cli("db", "upgrade", env=env, timeout=300)
    assert up.returncode == 0 and f"from {floor} to {head}" in up.stdout, up.stderr
    at_head = _nodes(fresh_url)
    assert "node-1." not in at_head and any(n.startswith("quarantined-") for n in at_head)
    with engine.begin() as conn:
        conn.execute(text("UPDATE nodes SET retired_at = now() WHERE name = 'node-2'"))

    steps = db.revisions_between(head, floor)
    assert steps[-2:] == ["0018", "0017"]
    for undone, target in zip(steps, [*steps[1:], floor], strict=True):
        down = cli("db", "downgrade", "--to", target, env=env, timeout=300)
        assert down.returncode == 0, down.stderr
        assert f"downgraded from {undone} to {target}, undoing {undone}" in down.stdout
        assert db.current_revision(fresh_url) == target
        if target == "0017":  # 0018's columns are gone, its nodes stay (retired ones rejoin)
            assert not {"retired_at", "added_at", "added_by_token_id"} & _columns(fresh_url, "nodes")
            assert {"node-2"} <= set(_nodes(fresh_url))
    assert set(_nodes(fresh_url)) == {"node-1.", "node-2"}  # 0017's renames undone
    assert "quarantined_names" not in inspect(engine).get_table_names()
    with engine.connect() as conn:
        assert conn.execute(text("SELECT holder, cycle FROM fleets")).one() == ("s1", 7)

    below = cli("db", "downgrade", "--to", "0015", env=env)
    assert "one release at most, to 0016" in _one_line(below)
    assert db.current_revision(fresh_url) == floor
    unknown = cli("db", "downgrade", "--to", "9.9.9", env=env)
    assert "no such migration or release" in _one_line(unknown)
    same = cli("db", "downgrade", "--to", floor_release, env=env)
    assert same.returncode == 0 and f"already at {floor}" in same.stdout

    again = cli("db", "upgrade", env=env, timeout=300)
    assert again.returncode == 0, again.stderr
    assert db.current_revision(fresh_url) == head and set(_nodes(fresh_url)) == set(at_head)
    # The release's version names its migration: back in one go.
    whole = cli("db", "downgrade", "--to", floor_release, env=env, timeout=300)
    assert whole.returncode == 0, whole.stderr
    assert f"undoing {', '.join(steps)}" in whole.stdout
    assert db.current_revision(fresh_url) == floor
    engine.dispose()


# -- a database one migration ahead ----------------------------------------------------------

AHEAD = '''"""a newer ringwatch's migration, for tests/test_upgrades.py"""
import sqlalchemy as sa
from alembic import op

revision = "9001"
down_revision = {head!r}
branch_labels = None
depends_on = None

ADDITIVE = {additive}


def upgrade() -> None:
    if ADDITIVE:
        op.add_column("nodes", sa.Column("rack", sa.Text(), nullable=True))
        op.create_table("racks", sa.Column("name", sa.Text(), primary_key=True))
    else:  # what the code before it reads, under another name
        op.alter_column("nodes", "hostname", new_column_name="host_name")


def downgrade() -> None:
    if ADDITIVE:
        op.drop_table("racks")
        op.drop_column("nodes", "rack")
    else:
        op.alter_column("nodes", "host_name", new_column_name="hostname")
'''


def _migrate_ahead(url: str, where: Path, additive: bool) -> None:
    """Bring ``url`` to this code's head and one migration past it, as a newer ringwatch's
    `db upgrade` would: the newer code's migrations are this code's and one more."""
    from alembic import command

    where.mkdir()
    (where / "9001_ahead.py").write_text(AHEAD.format(head=db.head_revision(), additive=additive))
    cfg = db.alembic_config(url)
    cfg.set_main_option("path_separator", "os")
    cfg.set_main_option("version_locations",
                        os.pathsep.join([str(db.MIGRATIONS_DIR / "versions"), str(where)]))
    command.upgrade(cfg, "heads")
    assert db.current_revision(url) == "9001"


def test_the_api_serves_a_database_one_additive_migration_ahead(
        fresh_url: str, tmp_path: Path) -> None:
    """A rolling upgrade: the new ringwatch's Job has migrated, and this (older) code's
    replicas go on serving, reading and writing, because the migration past its own only
    adds. Before, `serve` refused any migration it did not have."""
    _migrate_ahead(fresh_url, tmp_path / "ahead", additive=True)
    engine = db.make_engine(fresh_url)
    assert db.schema_state(engine) == (True, "")
    engine.dispose()
    env = {**api_env(fresh_url, tmp_path / "state", TOKEN)}
    waited = cli("db", "wait", "--timeout", "30", env=env, timeout=60)
    assert waited.returncode == 0 and "ahead of this code's" in waited.stdout, waited.stderr
    # This code's Job run again (a rollback): the database is left as it is.
    upgraded = cli("db", "upgrade", env=env, timeout=60)
    assert upgraded.returncode == 0 and "left as it is" in upgraded.stdout, upgraded.stderr
    assert db.current_revision(fresh_url) == "9001"

    proc = start_server(env)
    try:
        auth = {"Authorization": f"Bearer {TOKEN}"}
        api = env["RINGWATCH_API_URL"]
        ready = httpx.get(f"{api}/readyz", timeout=10)
        assert ready.status_code == 200, ready.text
        made = httpx.post(f"{api}/v1/tokens", json={"role": "reader", "name": "ahead"},
                          headers=auth, timeout=10)
        assert made.status_code in (200, 201), made.text
        listed = httpx.get(f"{api}/v1/fleet/nodes", headers=auth, timeout=10)
        assert listed.status_code == 200, listed.text
    finally:
        stop_server(proc)


def test_a_database_ahead_by_a_migration_that_does_more_than_add_is_refused(
        fresh_url: str, tmp_path: Path) -> None:
    """A migration past this code's that renames what this code reads: `serve`, `db wait` and
    `db upgrade` refuse in one line naming it, and /readyz-style checks say why."""
    _migrate_ahead(fresh_url, tmp_path / "ahead", additive=False)
    engine = db.make_engine(fresh_url)
    ok, why = db.schema_state(engine)
    engine.dispose()
    assert not ok and "9001" in why and "does more than add" in why, why
    env = api_env(fresh_url, tmp_path / "state", TOKEN)
    port = str(free_port())
    served = subprocess.run([sys.executable, "-m", "ringwatch.services.cli.main", "serve", "--port", port],
                            env=env, capture_output=True, text=True, timeout=120)
    assert "migration 9001 does more than add" in _one_line(served)
    for argv in (("db", "wait", "--timeout", "600"), ("db", "upgrade")):
        refused = cli(*argv, env=env, timeout=60)  # at once, not after the timeout
        assert "migration 9001 does more than add" in _one_line(refused), argv
    assert db.current_revision(fresh_url) == "9001"


def test_judge_ahead_walks_back_to_this_codes_head_through_additive_migrations_only() -> None:
    known = frozenset({"0018", "0019"})
    assert db.judge_ahead("0020", "0019", known, {"0020": ("0019", True)}).ok
    assert db.judge_ahead("0021", "0019", known,
                          {"0020": ("0019", True), "0021": ("0020", True)}).ok
    ok, why = db.judge_ahead("0021", "0019", known,
                             {"0020": ("0019", False), "0021": ("0020", True)})
    assert not ok and "migration 0020 does more than add" in why
    ok, why = db.judge_ahead("0020", "0019", known, {})  # nobody recorded it
    assert not ok and "does not have" in why
    ok, why = db.judge_ahead("0020", "0019", known, {"0020": ("0018", True)})  # another line
    assert not ok and "does not have" in why
    ok, why = db.judge_ahead("0021", "0019", known,  # a record that goes round
                             {"0020": ("0021", True), "0021": ("0020", True)})
    assert not ok and "does not have" in why


# -- the version -----------------------------------------------------------------------------


def test_ringwatch_version_says_pyprojects_version(tmp_path: Path) -> None:
    import tomllib

    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    shown = subprocess.run([sys.executable, "-m", "ringwatch.services.cli.main", "--version"],
                           capture_output=True, text=True, timeout=60, cwd=tmp_path,
                           env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert shown.returncode == 0 and shown.stdout.strip() == f"ringwatch {version}", shown
    assert ringwatch_version() == version


# -- pool and timeouts -----------------------------------------------------------------------


@pytest.fixture
def settings_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    """Settings read again from the environment this test sets, and afterwards from the
    environment as it was."""
    get_settings.cache_clear()
    yield monkeypatch
    monkeypatch.undo()
    get_settings.cache_clear()


def test_pool_size_pool_timeout_and_statement_timeout_are_settings(
        database_url: str, settings_env: pytest.MonkeyPatch) -> None:
    for name, value in {"POOL_SIZE": "2", "MAX_OVERFLOW": "1", "POOL_TIMEOUT_S": "0.5",
                        "STATEMENT_TIMEOUT_MS": "300"}.items():
        settings_env.setenv(f"RINGWATCH_DB_{name}", value)
    engine = db.make_engine(database_url)
    try:
        with engine.connect() as conn:
            assert conn.execute(text("SHOW statement_timeout")).scalar() == "300ms"
            with pytest.raises(OperationalError, match="statement timeout"):
                conn.execute(text("SELECT pg_sleep(5)"))
        held = [engine.connect() for _ in range(3)]  # the pool and its one overflow
        try:
            with pytest.raises(PoolTimeout):
                engine.connect()
        finally:
            for conn in held:
                conn.close()
    finally:
        engine.dispose()
    maintenance = db.make_maintenance_engine(database_url)
    try:
        with maintenance.connect() as conn:  # its statements are bounded by their chunks
            assert conn.execute(text("SHOW statement_timeout")).scalar() == "0"
    finally:
        maintenance.dispose()


def test_the_default_pools_of_the_kubernetes_base_fit_postgres_default_connections() -> None:
    """docs/operations.md, "Database connections": two API replicas and two notifiers of the
    Kubernetes base, at the default settings, at their most, and the migration Job, stay
    under Postgres' default max_connections (100) less its 3 reserved for superusers."""
    from tests.test_deploy import find, manifests

    fields = Settings.model_fields
    per_engine = fields["db_pool_size"].default + fields["db_max_overflow"].default
    docs = manifests()
    api = find(docs, "Deployment", "ringwatch-api")["spec"]["replicas"]
    notifier = find(docs, "Deployment", "ringwatch-notifier")["spec"]["replicas"]
    # An API replica: its requests' engine and the maintenance pass's; a notifier: its
    # engine and its LISTEN connection; the migration Job: one.
    most = (api * (per_engine + db.MAINTENANCE_CONNECTIONS) + notifier * (per_engine + 1) + 1)
    assert (api, notifier) == (2, 2) and most <= 97, most
