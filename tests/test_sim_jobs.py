"""The sim's jobs: a scenario's training jobs hold their nodes for a span of cycles, their
traffic takes its share of those nodes' links, and the ranks' counters see it."""

from __future__ import annotations

import pytest

from ringwatch.agents.contention import contention
from ringwatch.agents.groups import member
from ringwatch.agents.sim import Scenario, SimBackend
from ringwatch.agents.spec import GroupSpec, Occupant

# 4 GiB (modeled, never allocated): latency is well under 1% of the time, so the ratio of
# two readings is the ratio of their links.
SIZE = 1 << 32
ALL_OPS = ("allreduce", "allgather", "reducescatter", "alltoall")
JOB = {"id": "train-a", "nodes": "node-[001-002]", "cycles": [2, 3],
       "traffic": {"nvlink": 0.5, "network": 0.6}}


def sim(jobs=(), faults=(), nodes=4, variation=0.02, **kw) -> SimBackend:
    return SimBackend({"nodes": nodes, "gpus_per_node": 8, "noise": 0.0, "seed": 5,
                       "variation": variation, "faults": list(faults), "jobs": list(jobs),
                       **kw})


def intra(node: int, ops=ALL_OPS, algo: str | None = None) -> GroupSpec:
    return GroupSpec("intra_node", tuple(member(f"node-{node:03d}", g) for g in range(8)),
                     ops=ops, sizes=(SIZE,), algo=algo)


def pair(node: int, a: int, b: int, ops=("allreduce",)) -> GroupSpec:
    return GroupSpec("gpu_pair", (member(f"node-{node:03d}", a), member(f"node-{node:03d}", b)),
                     ops=ops, sizes=(SIZE,))


def nodes(*ix: int, ops=ALL_OPS, algo: str | None = None) -> GroupSpec:
    return GroupSpec("inter_node", tuple(member(f"node-{i:03d}", g) for i in ix
                                         for g in range(8)), ops=ops, sizes=(SIZE,), algo=algo)


def busbw(b: SimBackend, group: GroupSpec) -> dict[str, float]:
    return {m.op: m.busbw_gbs for m in b.run_round([group]).measurements}


def refused(job, nodes: int = 4) -> str:
    """The one line a scenario whose second job is ``job`` is refused with."""
    ok = {"nodes": ["node-000"], "cycles": [1, 1]}
    with pytest.raises(ValueError) as err:
        sim([ok, job], nodes=nodes)
    return str(err.value)


@pytest.mark.parametrize(("job", "message"), [
    ("node-001", "jobs[1] must be an object"),
    ({"nodes": "node-001", "gpus": [0, 1]}, "unknown field(s) gpus; a job takes id, nodes"),
    ({"cycles": [1, 2]}, "nodes must be a host list"),
    ({"nodes": 3}, "nodes must be a host list"),
    ({"nodes": []}, "nodes names no node"),
    ({"nodes": ["node-004"]}, "no node 'node-004' in a fabric of 4 node(s)"),
    ({"nodes": ["gpu-1"]}, "node must be named node-000"),
    ({"nodes": "node-[002-009]"}, "no node 'node-004'"),
    ({"nodes": "node-[001-"}, "nodes: unclosed '['"),
    ({"nodes": "node-[003-001]"}, "runs backwards"),
    ({"nodes": "node-[a-b]"}, "bad range"),
    ({"nodes": "node-1"}, "no node 'node-1'"),
    ({"nodes": "node-001", "traffic": {"pcie": 0.1}}, "unknown traffic kind(s) pcie"),
    ({"nodes": "node-001", "traffic": [0.5]}, "traffic must be an object"),
    ({"nodes": "node-001", "traffic": {"nvlink": 1}}, "traffic nvlink must be a number in [0, 1)"),
    ({"nodes": "node-001", "traffic": {"network": -0.1}}, "traffic network must be"),
    ({"nodes": "node-001", "traffic": {"network": True}}, "traffic network must be"),
    ({"nodes": "node-001", "traffic": {"nvlink": "0.5"}}, "traffic nvlink must be"),
    ({"nodes": "node-001", "traffic": {"nvlink": float("nan")}}, "traffic nvlink must be"),
    ({"nodes": "node-001", "cycles": [4, 1]}, "cycles must be [first, last]"),
    ({"nodes": "node-001", "cycles": [1]}, "cycles must be"),
    ({"nodes": "node-001", "cycles": [1, 2, 3]}, "cycles must be"),
    ({"nodes": "node-001", "cycles": [1.5, 2]}, "cycles must be"),
    ({"nodes": "node-001", "cycles": ["1", 2]}, "cycles must be"),
    ({"nodes": "node-001", "cycles": [True, 2]}, "cycles must be"),
    ({"nodes": "node-001", "cycles": [0, 2]}, "cycles must be"),
    ({"nodes": "node-001", "cycles": "1-4"}, "cycles must be"),
    ({"nodes": "node-001", "id": 7}, "id must be"),
    ({"nodes": "node-001", "id": ""}, "id must be"),
    ({"nodes": "node-001", "id": "a job\n"}, "id must be"),
    ({"nodes": "node-001", "id": "x" * 65}, "id must be"),
    ({"nodes": "node-001", "id": "job-0"}, "id 'job-0' is already jobs[0]'s"),
    ({"nodes": "node-[000-001]", "cycles": [1, 2]}, "node-000 is held by job-0 in cycle(s) 1-1"),
    ({"nodes": "node-000"}, "node-000 is held by job-0"),
])
def test_a_bad_job_is_refused_in_one_line_naming_the_entry(job, message):
    line = refused(job)
    assert line.startswith("jobs[1]") and message in line and "\n" not in line.rstrip()


def test_jobs_must_be_a_list_of_entries():
    with pytest.raises(ValueError, match="jobs must be a list"):
        SimBackend({"nodes": 4, "jobs": {"nodes": "node-001"}})


def test_a_good_job_list_is_accepted_as_written():
    s = Scenario.from_dict({"nodes": 8, "jobs": [
        {"nodes": "node-[001,003-005]", "cycles": [3, 3]},  # one cycle: first == last
        {"id": "b.2_x", "nodes": ["node-007", "node-001", "node-007"], "cycles": [4, 9],
         "traffic": {"network": 0}},  # the same node again later: no overlap
        {"nodes": "node-002"},  # no cycles: every cycle
    ]})
    a, b, c = s.jobs
    assert (a.id, a.nodes, a.first, a.last, a.nvlink, a.network) == \
        ("job-0", (1, 3, 4, 5), 3, 3, 0.0, 0.0)
    assert (b.id, b.nodes, b.first, b.last) == ("b.2_x", (7, 1), 4, 9)
    assert (c.id, c.first, c.last) == ("job-2", 1, None)
    assert [j.id for j in s.running(2)] == ["job-0", "job-2"]  # cycle number 3
    assert [j.id for j in s.running(3)] == ["b.2_x", "job-2"]
    assert [j.id for j in s.running(999)] == ["job-2"]


def test_a_host_list_and_a_list_of_names_hold_the_same_nodes():
    listed = sim([{"nodes": ["node-001", "node-003"], "cycles": [1, 2]}], nodes=5)
    compressed = sim([{"nodes": "node-[001,003]", "cycles": [1, 2]}], nodes=5)
    assert list(listed.busy_nodes()) == list(compressed.busy_nodes()) == ["node-001", "node-003"]
    assert busbw(listed, intra(3)) == busbw(compressed, intra(3))


def test_busy_nodes_follow_the_cycles_of_the_job():
    b = sim([JOB])
    # A preflight outside a scheduler is cycle 1: the job starts at 2.
    assert b.busy_nodes() == {} and b.running_jobs() == ()
    held = Occupant(source="sim", job="train-a", gpus=tuple(range(8)), state="running")
    for index, busy in ((0, False), (1, True), (2, True), (3, False), (1, True)):
        b.begin_cycle(index)  # cycle number index + 1
        assert b.busy_nodes() == ({"node-001": held, "node-002": held} if busy else {})
        assert [j.id for j in b.running_jobs()] == (["train-a"] if busy else [])
    assert held.reason == "job train-a on GPUs 0-7 (running), per sim"


def test_a_preflight_without_a_cycle_sees_the_jobs_of_cycle_one():
    b = sim([{**JOB, "cycles": [1, 1]}])
    assert sorted(b.busy_nodes()) == ["node-001", "node-002"]
    (m, *_) = b.run_round([intra(1)]).measurements
    assert m.contended is not None
    b.begin_cycle(1)  # cycle 2: over
    assert b.busy_nodes() == {} and b.run_round([intra(1)]).measurements[0].contended is None


@pytest.mark.parametrize(("group", "share"), [
    (intra(1), 0.5),  # NVLink-bound: the node's pairs
    (intra(1, ops=("allreduce",), algo="tree"), 0.5),
    (intra(1, ops=("allreduce",), algo="ring"), 0.5),
    (pair(2, 3, 6, ops=("allreduce", "sendrecv")), 0.5),
    (nodes(0, 1), 0.4),  # network-bound: the busy node's NICs
    (nodes(0, 1, ops=("allreduce",), algo="tree"), 0.4),
    (nodes(1, 3, 0, 2), 0.4),
    (GroupSpec("inter_node", (member("node-002", 4), member("node-003", 4)),
               ops=("sendrecv", "allreduce"), sizes=(SIZE,)), 0.4),
])
def test_a_probe_through_a_busy_node_gets_what_the_job_leaves(group, share):
    # No variation: which of two nodes' NICs is the slower is then the job's doing alone.
    b = sim([JOB], variation=0.0)
    idle = busbw(b, group)
    b.begin_cycle(1)
    busy = busbw(b, group)
    assert set(busy) == set(group.ops)
    for op in group.ops:
        assert busy[op] / idle[op] == pytest.approx(share, rel=0.01), op
    b.begin_cycle(3)
    assert busbw(b, group) == idle


def test_a_probe_through_idle_nodes_is_untouched_by_a_job_elsewhere():
    b = sim([JOB])
    idle = {k: busbw(b, g) for k, g in (("intra", intra(3)), ("pair", nodes(0, 3)))}
    b.begin_cycle(1)
    assert {k: busbw(b, g) for k, g in (("intra", intra(3)), ("pair", nodes(0, 3)))} == idle


def test_job_traffic_composes_with_the_faults_on_the_same_links():
    faults = [{"kind": "nvlink", "node": "node-001", "gpus": [2, 5], "factor": 0.5},
              {"kind": "nic", "node": "node-002", "factor": 0.5}]
    healthy = sim(variation=0.0)
    b = sim([JOB], faults, variation=0.0)
    b.begin_cycle(1)
    assert busbw(b, pair(1, 2, 5))["allreduce"] == pytest.approx(
        0.25 * busbw(healthy, pair(1, 2, 5))["allreduce"], rel=0.01)
    assert busbw(b, pair(1, 2, 3))["allreduce"] == pytest.approx(
        0.5 * busbw(healthy, pair(1, 2, 3))["allreduce"], rel=0.01)
    # NIC at 0.5, and the job takes 0.6 of what is there: 0.2 of a healthy node's.
    assert busbw(b, nodes(2, 3))["alltoall"] == pytest.approx(
        0.2 * busbw(healthy, nodes(2, 3))["alltoall"], rel=0.01)
    b.begin_cycle(0)  # the job has not begun: the faults alone
    assert busbw(b, pair(1, 2, 5))["allreduce"] == pytest.approx(
        0.5 * busbw(healthy, pair(1, 2, 5))["allreduce"], rel=0.01)


def test_every_measurement_through_a_busy_node_is_contended_naming_the_traffic():
    b = sim([JOB])
    b.begin_cycle(2)
    busy_groups = [intra(1), nodes(0, 1), nodes(3, 2), pair(2, 0, 7),
                   nodes(0, 1, 2, 3, ops=("allreduce",))]
    for group in busy_groups:
        found = b.run_round([group]).measurements
        assert len(found) == len(group.ops)
        (line,) = {m.contended for m in found}
        assert line is not None and line.startswith("other traffic: ")
        # 0.5 of 450 GB/s of NVLink per GPU; 0.6 of the node's 8 x 50 GB/s of NICs.
        assert "NVLink 225.0 GB/s" in line and "network 240.0 GB/s" in line
        assert "GPU 90% busy" in line and "1 other process(es)" in line
        # The rank named is one of the group's on a busy node.
        busiest = line.split(" at ")[1].split(";")[0]
        assert busiest in group.members and busiest.split("/")[0] in ("node-001", "node-002")
        assert all(m.to_dict()["contended"] == line for m in found)
    for group in (intra(0), intra(3), nodes(0, 3), pair(3, 1, 2)):
        found = b.run_round([group]).measurements
        assert found and all(m.contended is None for m in found)
        assert all("contended" not in m.to_dict() for m in found)


def test_a_busy_node_with_quiet_links_is_still_contended_by_the_jobs_process():
    b = sim([{"nodes": "node-001"}])
    (m, *_) = b.run_round([intra(1)]).measurements
    assert m.contended is not None
    assert "NVLink" not in m.contended and "network" not in m.contended
    assert "other process(es) on the GPU" in m.contended and "GPU 90% busy" in m.contended


def test_the_counters_read_each_ranks_traffic_and_zeros_where_nothing_runs():
    b = sim([JOB])
    b.begin_cycle(1)
    busy, idle = b.traffic("node-002/5"), b.traffic("node-000/5")
    assert (busy.member, busy.nvlink_gbs, busy.net_gbs, busy.gpu_util, busy.processes) == \
        ("node-002/5", 225.0, 240.0, 0.9, 1)
    assert (idle.nvlink_gbs, idle.net_gbs, idle.gpu_util, idle.processes) == (0.0, 0.0, 0.0, 0)
    assert contention([idle]) is None
    # The group's verdict is the one its every rank's reading gives.
    group = nodes(0, 2)
    (m, *_) = b.run_round([group]).measurements
    assert m.contended == contention([b.traffic(x) for x in group.members])


@pytest.mark.parametrize("variation", [0.0, 0.02])
def test_no_cached_cost_or_verdict_crosses_from_an_idle_cycle_to_a_busy_one(variation):
    # Without variation every idle link is alike: the cost model keys its times by a group's
    # shape, so node-000's and node-001's intra-node groups would share one entry if the
    # cache outlived a cycle. With it, each group's times are kept under its members.
    b = sim([JOB], variation=variation)
    idle = busbw(b, intra(1))
    assert (busbw(b, intra(0)) == idle) is (variation == 0)
    b.begin_cycle(1)
    busy = busbw(b, intra(1))
    assert busy["allreduce"] == pytest.approx(0.5 * idle["allreduce"], rel=0.01)
    if variation == 0:
        assert busbw(b, intra(0)) == idle  # the same shape on an idle node
    contended = b.run_round([intra(1)]).measurements[0].contended
    assert contended is not None
    for index, want, verdict in ((3, idle, None), (2, busy, contended), (0, idle, None)):
        b.begin_cycle(index)
        assert busbw(b, intra(1)) == want
        assert b.run_round([intra(1)]).measurements[0].contended == verdict


def test_a_scenario_without_jobs_measures_as_it_always_did():
    plain = SimBackend({"nodes": 4, "gpus_per_node": 8, "seed": 5, "noise": 0.03})
    empty = SimBackend({"nodes": 4, "gpus_per_node": 8, "seed": 5, "noise": 0.03, "jobs": []})
    groups = [intra(0), nodes(1, 2), pair(3, 0, 1)]
    for b in (plain, empty):
        b.begin_cycle(4)
    first, second = plain.run_round(groups), empty.run_round(groups)
    assert [m.time_us for m in first.measurements] == [m.time_us for m in second.measurements]
    assert all(m.contended is None for m in first.measurements)
    assert plain.busy_nodes() == {} and plain.scenario.jobs == []
