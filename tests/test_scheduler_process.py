"""A real `ringwatch scheduler` process answers a preflight request whose first claimer died."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import uuid
from datetime import UTC, datetime, timedelta

import httpx
import pytest

from ringwatch.agents.sim import SimBackend
from ringwatch.services.scheduler.api_client import SchedulerApi
from ringwatch.services.scheduler.cycle import ProbeOptions, serve_preflight
from ringwatch.services.scheduler.shipper import Shipper
from tests.api_fixtures import fleet_batch
from tests.procs import running_api

ADMIN = "rw_sched_" + uuid.uuid4().hex


@pytest.fixture
def server(database_url, clean_db, tmp_path):
    with running_api(database_url, tmp_path, ADMIN) as env:
        yield env


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

    sched = subprocess.Popen([sys.executable, "-m", "ringwatch.services.cli.main", "scheduler", "--fabric",
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
    assert body["complete"] is (body["undecided"] == 0) and body.get("stopped_by") is None


def _scheduler_once(env: dict[str, str], fabric) -> str:
    out = subprocess.run([sys.executable, "-m", "ringwatch.services.cli.main", "scheduler", "--fabric",
                          str(fabric), "--once"], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stderr


def test_a_restarted_scheduler_goes_on_with_the_next_matching(server, tmp_path) -> None:
    """Above 8 nodes each cycle probes one node-pair matching of the round-robin
    tournament; the fleet keeps its position in the database, so three runs of `scheduler
    --once` (each a restart, each with a state folder of its own) probe three different
    matchings, not the first one three times."""
    api, h = server["RINGWATCH_API_URL"], {"Authorization": f"Bearer {ADMIN}"}
    fabric = tmp_path / "fabric.json"
    fabric.write_text(json.dumps({"nodes": 12, "gpus_per_node": 2, "seed": 3}))
    logs = [_scheduler_once({**server, "RINGWATCH_STATE_DIR": str(tmp_path / f"state-{n}")},
                            fabric) for n in range(3)]
    # Each run numbers its cycle by the kept position, and its lines carry their UTC time.
    for n, log in enumerate(logs, 1):
        line = next(x for x in log.splitlines() if f"cycle {n}: " in x)
        assert re.match(r"  \.\. \d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ cycle", line), line
    links = httpx.get(f"{api}/v1/links", params={"scope": "inter_node"}, headers=h).json()
    pairs = {tuple(x["nodes"]) for x in links if len(x["nodes"]) == 2}
    assert len(pairs) == 3 * 6  # three matchings of six pairs each, none repeated
    fleets = httpx.get(f"{api}/v1/scheduler/fleets", headers=h).json()
    assert [(f["name"], f["cycle"], f["nodes"]) for f in fleets] == [("default", 3, 12)]
    assert fleets[0]["holder"] is None  # each run handed the lease back as it stopped


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
    fresh = subprocess.run([sys.executable, "-m", "ringwatch.services.cli.main", "preflight", "--fabric",
                            str(fabric), "--json"], env=server, capture_output=True, text=True,
                           timeout=300)
    assert fresh.returncode == 1, fresh.stderr[-2000:]

    def place(f: dict) -> tuple:
        return (f["kind"], f.get("node"), tuple(f.get("gpus") or ()), tuple(f.get("nodes") or ()))

    want = sorted(place(f) for f in json.loads(fresh.stdout)["findings"])
    assert want == [("net_path_degraded", None, (), ("node-004", "node-009")),
                    ("nic_degraded", "node-011", (), ()),
                    ("nvlink_degraded", "node-003", (2, 5), ())]
    logs = [_scheduler_once(server, fabric) for _ in range(3)]
    # Each run numbers its cycle by the kept position, and its lines carry their UTC time.
    for n, log in enumerate(logs, 1):
        line = next(x for x in log.splitlines() if f"cycle {n}: " in x)
        assert re.match(r"  \.\. \d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ cycle", line), line
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


def test_a_profiled_preflight_runs_the_jobs_groups_and_ships_ring_and_tree_apart(
        server, tmp_path) -> None:
    """A profile through the API: the scheduler that claims it runs the job's own groups
    (ring and tree apart), completes it with the workload section, and the API stores the
    two algorithms' series apart."""
    api, h = server["RINGWATCH_API_URL"], {"Authorization": f"Bearer {ADMIN}"}
    nodes = [f"node-{i:03d}" for i in range(8)]
    slow_tree = {"kind": "fallback", "node": "node-005", "op": "allreduce", "algo": "tree",
                 "factor": 0.5}
    backend = SimBackend({"nodes": 8, "gpus_per_node": 8, "noise": 0.02, "variation": 0.02,
                          "seed": 3, "faults": [slow_tree]})
    # The nodes are known and fresh, which would answer a plain request at once.
    client = SchedulerApi(api, ADMIN, "sched")
    try:
        shipper = Shipper(api, ADMIN, tmp_path / "spool")
        req = httpx.post(f"{api}/v1/preflight", json={"nodes": nodes, "profile": "ddp"},
                         headers=h)
        assert req.status_code == 404  # nothing known of these nodes yet
        assert run_scheduler_once(backend, shipper, client)
        req = httpx.post(f"{api}/v1/preflight", json={"nodes": nodes, "profile": "ddp"},
                         headers=h)
        assert req.status_code == 202 and req.json()["profile"] == "ddp"
        assert serve_preflight(backend, shipper, client, ProbeOptions())
        body = httpx.get(f"{api}/v1/preflight/{req.json()['id']}", headers=h).json()
    finally:
        client.close()
    assert body["status"] == "done" and body["source"] == "probed"
    work = body["workload"]
    assert work["profile"] == "ddp" and work["layout"]["tp"] == 8 and work["layout"]["dp"] == 8
    slow = [(f["nodes"], f.get("algo")) for f in work["findings"]]
    assert slow == [(["node-005"], "tree")]
    assert body["healthy"] is False and body["exclude"] == []
    links = httpx.get(f"{api}/v1/links", params={"limit": 10_000}, headers=h).json()
    ops = {link["op"] for link in links}
    assert {"allreduce:ring", "allreduce:tree"} <= ops
    # The job's data-parallel groups (one GPU of each node) hold both algorithms' series.
    dp = sorted(f"{n}/0" for n in nodes)
    for algo in ("ring", "tree"):
        points = httpx.get(f"{api}/v1/series", params={"members": ",".join(dp),
                                                       "op": f"allreduce:{algo}"},
                           headers=h).json()["points"]
        assert points and all(p["op"] == f"allreduce:{algo}" for p in points)


def run_scheduler_once(backend: SimBackend, shipper: Shipper, client: SchedulerApi) -> bool:
    """One monitoring cycle shipped: the nodes become known to the API."""
    from ringwatch.services.scheduler.cycle import run_scheduler

    return run_scheduler(backend, shipper, ProbeOptions(), interval_s=3600, once=True,
                         api=client) == 1


def test_monitoring_with_a_profile_keeps_the_jobs_series_and_says_how_they_ran(
        server, tmp_path) -> None:
    from ringwatch.services.scheduler.cycle import run_scheduler

    api, h = server["RINGWATCH_API_URL"], {"Authorization": f"Bearer {ADMIN}"}
    backend = SimBackend({"nodes": 4, "gpus_per_node": 8, "noise": 0.02, "seed": 5,
                          "faults": [{"kind": "fallback", "node": "node-001", "op": "allreduce",
                                      "algo": "ring", "factor": 0.5}]})
    lines: list[str] = []
    client = SchedulerApi(api, ADMIN, "sched")
    try:
        assert run_scheduler(backend, Shipper(api, ADMIN, tmp_path / "spool"),
                             ProbeOptions(profile="ddp"), interval_s=3600, once=True,
                             api=client, progress=lines.append) == 1
    finally:
        client.close()
    cycle = [line for line in lines if line.startswith("cycle 1:")]
    assert cycle and "ddp job groups: 1 workload finding(s) (communicator_slow)" in cycle[0]
    assert any("job round" in line and "(ring)" in line for line in lines)
    links = httpx.get(f"{api}/v1/links", params={"limit": 10_000}, headers=h).json()
    tp_ring = [link for link in links
               if link["op"] == "allreduce:ring" and link["scope"] == "intra_node"]
    assert sorted(link["nodes"][0] for link in tp_ring) == [f"node-{i:03d}" for i in range(4)]


def test_a_preflight_naming_a_node_not_seen_yet_looks_for_it_before_refusing() -> None:
    """A node whose worker joined after the scheduler's last cycle (a new GPU node's
    DaemonSet pod) is looked for (the backend follows its cluster) before the request is
    refused as naming a node not in this cluster."""

    class Joining(SimBackend):
        refreshed = 0

        def refresh_ranks(self) -> None:
            self.refreshed += 1

    class Api:
        completed: dict = {}

        def claim_preflight(self, lease_s: float) -> dict:
            return {"id": "req-1", "nodes": ["node-000", "node-009"]}

        def complete_preflight(self, request_id: str, **answer) -> dict:
            self.completed = answer
            return {}

    backend, api = Joining({"nodes": 2, "gpus_per_node": 2, "seed": 1}), Api()
    assert serve_preflight(backend, None, api, ProbeOptions())  # type: ignore[arg-type]
    assert backend.refreshed == 1
    assert api.completed == {"error": "nodes not in this cluster: node-009"}
