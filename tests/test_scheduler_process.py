"""A real `ringwatch scheduler` process answers a preflight request whose first claimer died."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid

import httpx
import pytest

from tests.api_fixtures import fleet_batch
from tests.procs import free_port, start_server, stop_server

ADMIN = "rw_sched_" + uuid.uuid4().hex


@pytest.fixture
def server(database_url, clean_db, tmp_path):
    env = {**os.environ, "RINGWATCH_DATABASE_URL": database_url,
           "RINGWATCH_API_URL": f"http://127.0.0.1:{free_port()}", "RINGWATCH_TOKEN": ADMIN,
           "RINGWATCH_BOOTSTRAP_ADMIN_TOKEN": ADMIN, "RINGWATCH_STATE_DIR": str(tmp_path)}
    proc = start_server(env)
    yield env
    stop_server(proc)


def test_preflight_of_a_dead_scheduler_completes_after_restart(server, tmp_path) -> None:
    api, h = server["RINGWATCH_API_URL"], {"Authorization": f"Bearer {ADMIN}"}
    fabric = tmp_path / "fabric.json"
    fabric.write_text(json.dumps({"nodes": 4, "gpus_per_node": 2, "seed": 1, "faults": [
        {"kind": "nic", "node": "node-002", "factor": 0.4}]}))
    # The nodes are known, but only from results too old for this preflight.
    old = fleet_batch()
    for m in old["measurements"]:
        m["time"] = "2020-01-01T00:00:00+00:00"
    httpx.post(f"{api}/v1/measurements", json=old, headers=h).raise_for_status()
    nodes = ["node-000", "node-001", "node-002", "node-003"]
    req = httpx.post(f"{api}/v1/preflight", json={"nodes": nodes, "max_age_s": 60}, headers=h).json()
    assert req["status"] == "pending"

    # A scheduler claims it and dies before completing (its lease runs out in 1 s).
    dead = httpx.post(f"{api}/v1/preflight/claim", json={"worker": "dead", "lease_s": 1}, headers=h)
    assert dead.json()["id"] == req["id"]

    sched = subprocess.Popen([sys.executable, "-m", "services.cli.main", "scheduler", "--fabric",
                              str(fabric), "--interval", "3600"], env=server,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        body = req
        while body["status"] != "done" and time.monotonic() < deadline:
            assert sched.poll() is None, sched.stderr.read() if sched.stderr else ""
            time.sleep(0.3)
            body = httpx.get(f"{api}/v1/preflight/{req['id']}", headers=h).json()
    finally:
        sched.terminate()
        sched.wait(timeout=15)
    assert body["status"] == "done" and body["attempts"] == 2
    assert body["healthy"] is False and body["exclude"] == ["node-002"]
    assert body["backend"] == "sim"
