"""A real `ringwatch scheduler` process answers a preflight request whose first claimer died."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from datetime import UTC, datetime, timedelta

import httpx
import pytest

from agents.sim import SimBackend
from services.scheduler.api_client import SchedulerApi
from services.scheduler.cycle import ProbeOptions, serve_preflight
from services.scheduler.shipper import Shipper
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


NODES = ["node-000", "node-001", "node-002", "node-003"]


def _waiting_preflight(api: str, h: dict[str, str]) -> dict:
    """A preflight request on four nodes known only from results two days old: it waits
    for a scheduler."""
    old = fleet_batch()
    for m in old["measurements"]:
        m["time"] = (datetime.now(UTC) - timedelta(days=2)).isoformat()
    httpx.post(f"{api}/v1/measurements", json=old, headers=h).raise_for_status()
    return httpx.post(f"{api}/v1/preflight", json={"nodes": NODES, "max_age_s": 60},
                      headers=h).json()


def test_preflight_of_a_dead_scheduler_completes_after_restart(server, tmp_path) -> None:
    api, h = server["RINGWATCH_API_URL"], {"Authorization": f"Bearer {ADMIN}"}
    fabric = tmp_path / "fabric.json"
    fabric.write_text(json.dumps({"nodes": 4, "gpus_per_node": 2, "seed": 1, "faults": [
        {"kind": "nic", "node": "node-002", "factor": 0.4}]}))
    # The nodes are known, but only from results too old for this preflight.
    req = _waiting_preflight(api, h)
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
    # The scheduler completes it with the verdict `ringwatch preflight` prints, cap and all.
    assert body["complete"] is True and body["undecided"] >= 0


def _scheduler_once(env: dict[str, str], fabric) -> str:
    out = subprocess.run([sys.executable, "-m", "services.cli.main", "scheduler", "--fabric",
                          str(fabric), "--once"], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stderr


def test_a_restarted_scheduler_goes_on_with_the_next_matching(server, tmp_path) -> None:
    """Above 8 nodes each cycle probes one node-pair matching of the round-robin
    tournament; its position is kept on disk, so three runs of `scheduler --once` (each a
    restart) probe three different matchings, not the first one three times."""
    api, h = server["RINGWATCH_API_URL"], {"Authorization": f"Bearer {ADMIN}"}
    fabric = tmp_path / "fabric.json"
    fabric.write_text(json.dumps({"nodes": 12, "gpus_per_node": 2, "seed": 3}))
    for _ in range(3):
        _scheduler_once(server, fabric)
    links = httpx.get(f"{api}/v1/links", params={"scope": "inter_node"}, headers=h).json()
    pairs = {tuple(x["nodes"]) for x in links if len(x["nodes"]) == 2}
    assert len(pairs) == 3 * 6  # three matchings of six pairs each, none repeated
    state = list((tmp_path / "scheduler").glob("rotation-*.json"))
    assert len(state) == 1 and json.loads(state[0].read_text())["position"] == 3


def test_monitoring_finds_what_preflight_finds(server, tmp_path) -> None:
    """The issue's fleet, scaled to 16 x 8: a NIC at 0.55, one NVLink GPU pair at 0.5, one
    node-pair path at 0.5. Default scheduled cycles open exactly one incident per fault,
    named as `ringwatch preflight --fabric` names them, and the stored preflight agrees."""
    api, h = server["RINGWATCH_API_URL"], {"Authorization": f"Bearer {ADMIN}"}
    fabric = tmp_path / "fabric.json"
    fabric.write_text(json.dumps({"nodes": 16, "gpus_per_node": 8, "seed": 5, "faults": [
        {"kind": "nic", "node": "node-011", "factor": 0.55},
        {"kind": "nvlink", "node": "node-003", "gpus": [2, 5], "factor": 0.5},
        {"kind": "net_path", "nodes": ["node-004", "node-009"], "factor": 0.5}]}))
    fresh = subprocess.run([sys.executable, "-m", "services.cli.main", "preflight", "--fabric",
                            str(fabric), "--json"], env=server, capture_output=True, text=True,
                           timeout=300)
    assert fresh.returncode == 1, fresh.stderr[-2000:]

    def place(f: dict) -> tuple:
        return (f["kind"], f.get("node"), tuple(f.get("gpus") or ()), tuple(f.get("nodes") or ()))

    want = sorted(place(f) for f in json.loads(fresh.stdout)["findings"])
    assert want == [("net_path_degraded", None, (), ("node-004", "node-009")),
                    ("nic_degraded", "node-011", (), ()),
                    ("nvlink_degraded", "node-003", (2, 5), ())]
    for _ in range(3):
        _scheduler_once(server, fabric)
    # Sizes that reveal: at defaults every link was judged at a bandwidth-bound size.
    links = httpx.get(f"{api}/v1/links", headers=h).json()
    assert links and {x["size_bytes"] for x in links} == {1 << 28}
    incidents = httpx.get(f"{api}/v1/findings", headers=h).json()
    assert sorted(place(f["detail"]) for f in incidents) == want  # one each, all open
    assert all(f["status"] == "open" and f["detail"]["evidence"] for f in incidents)
    nodes = [f"node-{i:03d}" for i in range(16)]
    stored = httpx.post(f"{api}/v1/preflight", json={"nodes": nodes}, headers=h).json()
    assert stored["healthy"] is False and stored["exclude"] == ["node-003", "node-011"]
    assert sorted(place(f) for f in stored["findings"]) == want


class SlowRounds(SimBackend):
    """The sim, each round taking ``pause_s`` of real time: a check that outlasts its lease."""

    pause_s = 0.3

    def run_round(self, groups):
        time.sleep(self.pause_s)
        return super().run_round(groups)


def test_a_check_that_outlasts_its_lease_still_completes(server, tmp_path) -> None:
    api, h = server["RINGWATCH_API_URL"], {"Authorization": f"Bearer {ADMIN}"}
    req = _waiting_preflight(api, h)
    backend = SlowRounds({"nodes": 4, "gpus_per_node": 2, "seed": 1, "faults": [
        {"kind": "nic", "node": "node-002", "factor": 0.4}]})
    client = SchedulerApi(api, ADMIN, "slow")
    try:
        # A 1 s lease; the check takes several rounds of 0.3 s each.
        assert serve_preflight(backend, Shipper(api, ADMIN, tmp_path / "spool"), client,
                               ProbeOptions(), lease_s=1.0)
        body = httpx.get(f"{api}/v1/preflight/{req['id']}", headers=h).json()
    finally:
        client.close()
    assert body["rounds"] * SlowRounds.pause_s > 1.0
    assert body["status"] == "done" and body["attempts"] == 1
    assert body["exclude"] == ["node-002"]
