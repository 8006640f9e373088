"""Sharing the fleet with its jobs, rule by rule: a scheduled cycle probes idle nodes only,
the tournament stays drawn over the whole fleet, a contended measurement is stored and shown
but never judged, and the API shows a busy node as busy (docs/operations.md, "Occupancy and
contention"). The whole path through the real scheduler is tests/test_busy_fleet.py."""

from __future__ import annotations

import itertools
import uuid
from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ringwatch.agents.hostlist import compress_hostlist, expand_hostlist, index_ranges
from ringwatch.agents.sim import SimBackend
from ringwatch.agents.spec import Measurement, Occupant
from ringwatch.services.check.loop import judged, set_aside
from ringwatch.services.check.planner import rotation_matching
from ringwatch.services.cli.status import busy_text
from ringwatch.services.scheduler.cycle import CycleResult, ProbeOptions, Sharing, run_cycle
from ringwatch.services.scheduler.occupancy import Occupancy, read_occupancy
from tests.api_fixtures import api_client, fleet_batch


def names(n: int) -> list[str]:
    return [f"node-{i:03d}" for i in range(n)]


# ---- the tournament over the whole fleet --------------------------------------------------


def test_every_pair_of_always_idle_nodes_meets_once_a_tournament_whatever_else_is_busy() -> None:
    fleet = names(20)
    idle = [n for i, n in enumerate(fleet) if i % 3]  # a third of the fleet always busy
    met: set[frozenset[str]] = set()
    for k in range(len(fleet) - 1):
        pairs = rotation_matching(idle, k, fleet)
        flat = [n for p in pairs for n in p]
        assert len(flat) == len(set(flat)) and set(flat) <= set(idle)
        assert len(flat) >= len(idle) - 1  # every idle node probed but for an odd one out
        met |= {frozenset(p) for p in pairs}
    assert {frozenset(p) for p in itertools.combinations(idle, 2)} <= met


def test_a_pairs_turn_stays_where_it_is_as_jobs_come_and_go() -> None:
    fleet = names(16)
    everyone = set(rotation_matching(fleet, 5, fleet))
    some_busy = [n for n in fleet if n not in ("node-003", "node-009")]
    kept = set(rotation_matching(some_busy, 5, fleet))
    # Every pair of the full matching between two idle nodes is still this cycle's pair.
    assert {p for p in everyone if "node-003" not in p and "node-009" not in p} <= kept


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["node-", "gpu", "rack7-n"]),
                          st.integers(0, 1200), st.sampled_from([1, 3, 4])), max_size=60))
def test_a_compressed_host_list_expands_to_the_names_it_was_made_of(parts) -> None:
    names = [f"{p}{n:0{w}d}" for p, n, w in parts]
    assert sorted(expand_hostlist(compress_hostlist(names))) == sorted(set(names))


def test_gpu_indices_read_as_ranges() -> None:
    assert index_ranges((0, 1, 2, 3, 4, 5, 6, 7)) == "0-7"
    assert index_ranges([5, 0, 2, 4]) == "0,2,4-5"


# ---- a scheduled cycle on a busy sim fleet ------------------------------------------------


def busy_fleet(first: int = 1, last: int = 2) -> dict:
    return {"nodes": 12, "gpus_per_node": 4, "seed": 5, "noise": 0.02,
            "jobs": [{"id": "train-7", "nodes": "node-[000-005]", "cycles": [first, last],
                      "traffic": {"nvlink": 0.6, "network": 0.5}}]}


def test_a_scheduled_cycle_probes_idle_nodes_only_and_says_what_held_the_rest() -> None:
    backend = SimBackend.from_dict(busy_fleet())
    said: list[str] = []
    cycle = run_cycle(backend, ProbeOptions(), skip_busy=True, progress=said.append)
    busy = set(names(6))
    assert set(cycle.skipped) == busy
    assert all("job train-7" in r and "sim" in r for r in cycle.skipped.values())
    probed = {n for m in cycle.measurements for n in m.nodes}
    assert probed and probed.isdisjoint(busy)
    assert not any(m.contended for m in cycle.measurements)
    batch = cycle.to_batch()
    assert batch["occupancy"]["source"] == "sim" and set(batch["occupancy"]["busy"]) == busy
    assert batch["occupancy"]["busy"]["node-002"]["job"] == "train-7"
    # One line for the job, not one per node.
    assert [s for s in said if s.startswith("skipping")] == [
        "skipping 6 node(s) node-[000-005]: job train-7 on GPUs 0-3 (running), per sim"]


def test_busy_nodes_probed_on_purpose_are_contended_and_never_found_faulty() -> None:
    backend = SimBackend.from_dict(busy_fleet())
    cycle = run_cycle(backend, ProbeOptions(), skip_busy=True,
                      sharing=Sharing(probe_busy=True))
    contended = [m for m in cycle.measurements if m.contended]
    assert contended and all(set(m.nodes) & set(names(6)) for m in contended)
    assert all("other traffic" in m.contended for m in contended)
    # At 40-50 % of their bandwidth the busy links would read as faults if judged.
    assert cycle.judged == []
    # The plan left the contended nodes out after their first round, not re-tested them.
    assert set_aside(cycle.measurements) == set(names(6))


def test_a_preflight_through_busy_nodes_says_it_could_not_judge_them() -> None:
    from ringwatch.services.check import run_check

    backend = SimBackend.from_dict(busy_fleet())  # a preflight counts as cycle 1: in the job
    verdict = run_check(backend, names(8)).verdict()
    assert verdict["contended"] == names(6)
    assert verdict["healthy"] is False and verdict["exclude"] == []
    quiet = run_check(backend, names(12)[6:]).verdict()
    assert "contended" not in quiet and quiet["healthy"] is True


def test_after_its_job_a_node_is_probed_again() -> None:
    backend = SimBackend.from_dict(busy_fleet(1, 1))
    first = run_cycle(backend, ProbeOptions(), skip_busy=True, rotation=0)
    second = run_cycle(backend, ProbeOptions(), skip_busy=True, rotation=1)
    assert first.skipped and not second.skipped
    assert set(names(12)) == {n for m in second.measurements for n in m.nodes}


class Failing:
    name = "slurm"

    def read(self, nodes):
        raise OSError("scontrol: Unable to contact slurm controller")


def test_a_source_that_fails_leaves_every_node_busy_and_nothing_probed() -> None:
    backend = SimBackend.from_dict({"nodes": 4, "gpus_per_node": 2, "seed": 1})
    said: list[str] = []
    cycle = run_cycle(backend, ProbeOptions(), skip_busy=True, progress=said.append,
                      sharing=Sharing(source=Failing()))
    assert set(cycle.skipped) == set(names(4)) and cycle.measurements == []
    assert cycle.occupancy["error"] and "controller" in cycle.occupancy["error"]
    assert all(o["unknown"] for o in cycle.occupancy["busy"].values())
    assert any(s.startswith("occupancy:") for s in said)


def test_judged_leaves_out_contended_measurements_only() -> None:
    def m(contended: str | None) -> Measurement:
        return Measurement(op="allreduce", scope="intra_node", members=["a/0", "a/1"],
                           size_bytes=1, dtype="float32", warmup=0, iters=1, time_us=1.0,
                           algbw_gbs=1.0, busbw_gbs=1.0, wrong=0, contended=contended)
    quiet, busy = m(None), m("other traffic: NVLink 90.0 GB/s at a/0")
    assert judged([quiet]) == [quiet] and judged([quiet, busy]) == [quiet]


def test_status_says_how_many_nodes_jobs_hold_and_which_could_not_be_read() -> None:
    assert "none" in busy_text({"nodes": 0, "jobs": 0, "unknown": [], "sources": []})
    text = busy_text({"nodes": 3, "jobs": 2, "unknown": ["node-009"], "sources": ["slurm"]})
    assert "3 node(s) in 2 job(s) per slurm" in text and "1 counted busy" in text


def test_occupancy_read_by_the_cycle_is_the_source_answer() -> None:
    occ = read_occupancy(type("S", (), {"name": "sim", "read": lambda self, nodes: {
        "node-001": Occupant(source="sim", job="j")}})(), names(3), timeout_s=5)
    assert isinstance(occ, Occupancy) and set(occ.busy) == {"node-001"} and occ.error is None


# ---- through the API ----------------------------------------------------------------------


@pytest.fixture
def api(clean_db):
    with api_client(clean_db, {"metrics_cache_s": 0}) as client:
        yield client


def scheduled_batch(busy: dict[str, dict], nodes: int = 4, **extra) -> dict:
    batch = fleet_batch(nodes=nodes)
    batch["ranks"] = [{"node": n, "local_index": i, "hostname": n}
                      for n in names(nodes) for i in (0, 1)]
    batch["occupancy"] = {"source": "slurm", "read_s": 0.02, "busy": busy, **extra}
    return batch


def test_a_busy_node_is_shown_busy_with_its_job_and_idle_once_released(api) -> None:
    busy = {"node-003": {"source": "slurm", "job": "4242", "gpus": [0, 1], "state": "ALLOCATED"}}
    first = scheduled_batch(busy)
    first["measurements"] = [m for m in first["measurements"]
                             if not any(x.startswith("node-003/") for x in m["members"])]
    assert api.post("/v1/measurements", json=first, headers=api.h["agent"]).status_code == 200
    nodes = {n["name"]: n for n in api.get("/v1/nodes", headers=api.h["reader"]).json()}
    held = nodes["node-003"]["occupied"]
    assert held["job"] == "4242" and held["gpus"] == [0, 1] and held["since"]
    assert "job 4242" in held["reason"] and nodes["node-000"]["occupied"] is None
    states = {n["name"]: n for n in api.get("/v1/fleet/nodes", headers=api.h["reader"]).json()["nodes"]}
    assert states["node-003"]["state"] == "busy" and states["node-000"]["state"] == "ok"
    scrape = api.get("/metrics").text
    assert 'ringwatch_node_busy{job="4242",node="node-003",source="slurm"} 1.0' in scrape
    assert 'ringwatch_node_healthy{node="node-003"} 1.0' in scrape
    assert 'ringwatch_occupancy_source_up{source="slurm"} 1.0' in scrape
    assert 'ringwatch_occupancy_busy_nodes{kind="job",source="slurm"} 1.0' in scrape

    # The same job a cycle later keeps its ``since``; released, the node is idle.
    again = scheduled_batch(busy)
    api.post("/v1/measurements", json=again, headers=api.h["agent"]).raise_for_status()
    node = api.get("/v1/nodes/node-003", headers=api.h["reader"]).json()
    assert node["occupied"]["since"] == held["since"]
    api.post("/v1/measurements", json=scheduled_batch({}), headers=api.h["agent"]).raise_for_status()
    assert api.get("/v1/nodes/node-003", headers=api.h["reader"]).json()["occupied"] is None
    assert "ringwatch_node_busy{" not in api.get("/metrics").text


def test_a_failed_source_shows_on_metrics(api) -> None:
    busy = {n: {"source": "slurm", "unknown": True, "state": "timed out after 10 s"}
            for n in names(4)}
    batch = scheduled_batch(busy, error="timed out after 10 s")
    batch["measurements"] = []
    api.post("/v1/measurements", json=batch, headers=api.h["agent"]).raise_for_status()
    scrape = api.get("/metrics").text
    assert 'ringwatch_occupancy_source_up{source="slurm"} 0.0' in scrape
    assert 'ringwatch_occupancy_busy_nodes{kind="unknown",source="slurm"} 4.0' in scrape


def test_contended_measurements_are_stored_and_shown_but_never_judged(api) -> None:
    old = datetime.now(UTC) - timedelta(hours=1)
    calm = fleet_batch(nodes=4)
    for m in calm["measurements"]:
        m["time"] = old.isoformat()
    api.post("/v1/measurements", json=calm, headers=api.h["agent"]).raise_for_status()
    # node-001 at 30 % of its bandwidth, but its links carried a job's traffic: judged,
    # three such cycles would open an incident under the default hysteresis.
    slow = fleet_batch(slow_node="node-001", factor=0.3, nodes=4)
    for m in slow["measurements"]:
        if any(x.startswith("node-001/") for x in m["members"]):
            m["contended"] = "other traffic: NVLink 180.0 GB/s at node-001/0"
    for _ in range(3):
        slow["batch_id"] = str(uuid.uuid4())
        answer = api.post("/v1/measurements", json=slow, headers=api.h["agent"]).json()
        assert answer["findings"] == [] and answer["degraded"] == []
    assert api.get("/v1/findings", headers=api.h["reader"]).json() == []
    # Its last judged probe is the calm one: the contended ones do not make it fresh.
    node = api.get("/v1/nodes/node-001", headers=api.h["reader"]).json()
    assert datetime.fromisoformat(node["last_probed_at"]) < old + timedelta(seconds=1)
    points = api.get("/v1/series", params={"members": "node-001/0,node-001/1"},
                     headers=api.h["reader"]).json()["points"]
    assert [p["contended"] for p in points].count(None) == 1
    assert sum(1 for p in points if p["contended"] and "NVLink" in p["contended"]) == 3
    links = api.get("/v1/links", params={"node": "node-001", "scope": "intra_node"},
                    headers=api.h["reader"]).json()
    assert links and all(link["status"] == "ok" for link in links)


def test_an_occupant_the_schema_cannot_hold_is_refused(api) -> None:
    bad = scheduled_batch({"node-001": {"source": "slurm", "job": "job with spaces"}})
    resp = api.post("/v1/measurements", json=bad, headers=api.h["agent"])
    assert resp.status_code == 422 and "job" in resp.text
    bad = scheduled_batch({"node-001": {"source": "lsf"}})
    assert api.post("/v1/measurements", json=bad, headers=api.h["agent"]).status_code == 422
    bad = fleet_batch()
    bad["measurements"][0]["contended"] = "line one\nline two"
    assert api.post("/v1/measurements", json=bad, headers=api.h["agent"]).status_code == 422


def test_cycle_results_without_occupancy_leave_nodes_as_they_were(api) -> None:
    busy = {"node-002": {"source": "slurm", "job": "77"}}
    api.post("/v1/measurements", json=scheduled_batch(busy), headers=api.h["agent"]).raise_for_status()
    # A preflight's batch says nothing of occupancy: node-002 stays busy.
    preflight = CycleResult(backend="gloo", ranks=[]).to_batch()
    assert "occupancy" not in preflight
    plain = fleet_batch(nodes=4)
    api.post("/v1/measurements", json=plain, headers=api.h["agent"]).raise_for_status()
    assert api.get("/v1/nodes/node-002", headers=api.h["reader"]).json()["occupied"]["job"] == "77"
