"""The real server process and the real CLI: spooling while the API is down, preflight exit codes."""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path

import httpx
import pytest

from services.scheduler.shipper import Shipper
from tests.api_fixtures import fleet_batch
from tests.procs import cli, free_port, start_server, stop_server

ADMIN = "rw_admin_" + uuid.uuid4().hex


@pytest.fixture
def env(database_url: str, clean_db, tmp_path: Path) -> dict[str, str]:
    port = free_port()
    return {**os.environ, "RINGWATCH_DATABASE_URL": database_url,
            "RINGWATCH_API_URL": f"http://127.0.0.1:{port}", "RINGWATCH_TOKEN": ADMIN,
            "RINGWATCH_BOOTSTRAP_ADMIN_TOKEN": ADMIN, "RINGWATCH_STATE_DIR": str(tmp_path)}


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
    finally:
        stop_server(proc)
