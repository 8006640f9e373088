"""The real server process and the real CLI: spooling while the API is down, preflight exit codes."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import httpx
import pytest

from ringwatch.services.scheduler.shipper import Shipper
from tests.api_fixtures import fleet_batch
from tests.procs import api_env, cli, free_port, start_server, stop_server

ADMIN = "rw_admin_" + uuid.uuid4().hex


@pytest.fixture
def env(database_url: str, clean_db, tmp_path: Path) -> dict[str, str]:
    return api_env(database_url, tmp_path, ADMIN)


@pytest.fixture
def server(env):
    proc = start_server(env)
    yield env
    stop_server(proc)


def test_batches_spool_while_the_api_is_down_and_arrive_once(env, tmp_path) -> None:
    shipper = Shipper(env["RINGWATCH_API_URL"], ADMIN, tmp_path / "spool", timeout_s=2)
    batches = [fleet_batch(), fleet_batch(slow_node="node-001")]
    assert shipper.ship(batches[0]) == 1
    assert shipper.ship(batches[1]) == 2  # nothing listens yet: both wait on disk

    proc = start_server(env)
    try:
        assert shipper.flush() == 0
        assert shipper.flush() == 0  # nothing left, nothing sent twice
        headers = {"Authorization": f"Bearer {ADMIN}"}
        series = httpx.get(f"{env['RINGWATCH_API_URL']}/v1/series", headers=headers,
                           params={"members": "node-000/0,node-000/1,node-001/0,node-001/1"}).json()
        assert len(series["points"]) == 2
        # Re-sending an already stored batch (a crash between send and unlink) stores nothing new.
        shipper.spool(batches[0])
        assert shipper.flush() == 0
        series = httpx.get(f"{env['RINGWATCH_API_URL']}/v1/series", headers=headers,
                           params={"members": "node-000/0,node-000/1,node-001/0,node-001/1"}).json()
        assert len(series["points"]) == 2
    finally:
        stop_server(proc)
        shipper.close()


def test_rejected_batch_is_set_aside_not_retried_forever(server, tmp_path) -> None:
    shipper = Shipper(server["RINGWATCH_API_URL"], ADMIN, tmp_path / "spool")
    bad = fleet_batch()
    bad["measurements"][0]["size_bytes"] = -5
    assert shipper.ship(bad) == 0
    assert len(list((tmp_path / "spool" / "rejected").glob("*.json"))) == 1
    shipper.close()


def test_preflight_cli_exit_codes_through_the_api(server) -> None:
    headers = {"Authorization": f"Bearer {ADMIN}"}
    api = server["RINGWATCH_API_URL"]
    nodes = "node-000,node-001,node-002,node-003"
    for _ in range(2):  # a fault that lasts two cycles (the default hysteresis)
        httpx.post(f"{api}/v1/measurements", json=fleet_batch(slow_node="node-002"),
                   headers=headers).raise_for_status()
    r = cli("preflight", "--nodes", nodes, "--json", env=server)
    assert r.returncode == 1, r.stderr
    assert json.loads(r.stdout)["exclude"] == ["node-002"]

    for _ in range(2):
        httpx.post(f"{api}/v1/measurements", json=fleet_batch(), headers=headers).raise_for_status()
    r = cli("preflight", "--nodes", nodes, env=server)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("HEALTHY")

    r = cli("preflight", "--nodes", "node-000,node-777", env=server)
    assert r.returncode == 2
    assert len(r.stderr.strip().splitlines()) == 1 and "node-777" in r.stderr


def test_cli_errors_are_one_line_exit_2(env) -> None:
    down = {**env, "RINGWATCH_API_URL": f"http://127.0.0.1:{free_port()}"}
    for args in (["preflight", "--nodes", "node-000"],           # API unreachable
                 ["preflight"],                                 # nothing to check
                 ["probe", "--local", "2", "--inject", "{bad"],  # bad JSON
                 ["probe", "--local", "2", "--sizes", "-4K"],
                 ["bogus-command"]):
        r = cli(*args, env=down)
        assert r.returncode == 2, (args, r.stdout, r.stderr)
        assert len(r.stderr.strip().splitlines()) == 1, (args, r.stderr)


def test_token_create_and_db_upgrade(env) -> None:
    r = cli("db", "upgrade", env=env)
    assert r.returncode == 0, r.stderr
    r = cli("token", "create", "--role", "reader", env=env)
    assert r.returncode == 0, r.stderr
    token = r.stdout.split()[-1]
    proc = start_server(env)
    try:
        ok = httpx.get(f"{env['RINGWATCH_API_URL']}/v1/nodes", headers={"Authorization": f"Bearer {token}"})
        assert ok.status_code == 200
        no = httpx.post(f"{env['RINGWATCH_API_URL']}/v1/measurements", json=fleet_batch(),
                        headers={"Authorization": f"Bearer {token}"})
        assert no.status_code == 403
        # The token shows in the list as used, and once revoked it opens nothing.
        token_id = r.stdout.split()[3]
        listed = json.loads(cli("token", "list", "--json", env=env).stdout)
        mine = next(t for t in listed if str(t["id"]) == token_id)
        assert mine["role"] == "reader" and mine["last_used_at"] is not None
        revoked = cli("token", "revoke", token_id, env=env)
        assert revoked.returncode == 0 and f"revoked token {token_id}" in revoked.stdout
        gone = httpx.get(f"{env['RINGWATCH_API_URL']}/v1/nodes",
                         headers={"Authorization": f"Bearer {token}"})
        assert gone.status_code == 401
        assert token_id not in [str(t["id"]) for t in
                                json.loads(cli("token", "list", "--json", env=env).stdout)]
        missing = cli("token", "revoke", "999999", env=env)
        assert missing.returncode == 2 and len(missing.stderr.strip().splitlines()) == 1
    finally:
        stop_server(proc)


def test_a_batch_the_api_keeps_failing_moves_aside_and_the_rest_flow(tmp_path) -> None:
    """The API answering 500 for one batch (a bug it has with that batch) while it takes
    the others: that batch is tried a bounded number of times, then kept on disk under
    failed/, and the batches behind it arrive meanwhile. The receiving end is a local HTTP
    server that fails exactly one batch, since the real API cannot be made to on demand."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    got: list[str] = []

    class Api(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            code = 500 if body["batch_id"] == "poison" else 200
            if code == 200:
                got.append(body["batch_id"])
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(b'{"error": "internal", "message": "boom"}' if code == 500 else b"{}")

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Api)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        shipper = Shipper(f"http://127.0.0.1:{server.server_port}", "t", tmp_path / "spool",
                          max_failures=3)
        shipper.ship({"batch_id": "poison", "measurements": []})
        for i in range(3):
            shipper.ship({"batch_id": f"b{i}", "measurements": []})
        shipper.close()
    finally:
        server.shutdown()
    assert got == ["b0", "b1", "b2"]
    assert [p.name.split("-", 1)[1] for p in (tmp_path / "spool" / "failed").glob("*.json")] == [
        "poison.json"]
    assert shipper.pending() == [] and shipper.moved_aside == 1


def test_an_unexpected_server_error_is_json_with_a_reference(admin_url) -> None:
    """Whatever breaks inside, the client sees the JSON error shape, not a plain-text 500.
    A database of its own, broken on purpose (a table dropped under the running app)."""
    from fastapi.testclient import TestClient
    from sqlalchemy import text

    from ringwatch.api.app import create_app
    from ringwatch.services.settings import Settings
    from ringwatch.services.store import db, tokens

    name = f"rw_broken_{uuid.uuid4().hex[:8]}"
    url = db.create_database(admin_url, name)
    engine = db.make_engine(url)
    try:
        db.upgrade(url)
        factory = db.make_session_factory(engine)
        with db.transaction(factory) as s:
            token = tokens.create_token(s, "reader")
            s.execute(text("DROP TABLE link_health CASCADE"))
        app = create_app(Settings(database_url="unused"), factory)
        with TestClient(app, raise_server_exceptions=False) as client:
            r = client.get("/v1/links", headers={"Authorization": f"Bearer {token}"})
    finally:
        engine.dispose()
        db.drop_database(admin_url, name)
    assert r.status_code == 500
    body = r.json()
    assert body["error"] == "internal" and "reference" in body["message"]


def test_serve_refuses_an_external_database_not_yet_migrated(admin_url, tmp_path) -> None:
    """An operator's database is migrated in its own step: serve says so in one line
    instead of answering /healthz while its notifier finds no tables."""
    from ringwatch.services.store import db

    name = f"rw_bare_{uuid.uuid4().hex[:8]}"
    url = db.create_database(admin_url, name)
    try:
        env = api_env(url, tmp_path, ADMIN)
        r = cli("serve", "--port", env["RINGWATCH_API_URL"].rsplit(":", 1)[1], env=env, timeout=60)
    finally:
        db.drop_database(admin_url, name)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "ringwatch db upgrade" in r.stderr and "(none)" in r.stderr


def test_serve_migrates_the_embedded_database_it_starts(tmp_path) -> None:
    """With no RINGWATCH_DATABASE_URL, serve starts its own Postgres: a fresh one is
    brought to the schema before the API answers."""
    env = api_env("", tmp_path / "state", ADMIN)
    env.pop("RINGWATCH_DATABASE_URL")
    proc = start_server(env)
    try:
        r = httpx.get(f"{env['RINGWATCH_API_URL']}/v1/links",
                      headers={"Authorization": f"Bearer {ADMIN}"}, timeout=30)
        assert r.status_code == 200 and r.json() == []
    finally:
        stop_server(proc)
        cli("db", "stop", env=env)
