"""Workload profiles: the job's own communicators, ring and tree apart, and the identity
ReduceScatter + AllGather = AllReduce (agents.workloads, services.check.workload)."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import pytest

from bench.detection import found as fault_found
from ringwatch.agents import outcome
from ringwatch.agents.collectives import default_sizes
from ringwatch.agents.groups import Group, member
from ringwatch.agents.probe import ProbeAgent
from ringwatch.agents.sim import SimBackend, node_name
from ringwatch.agents.spec import GroupSpec, InjectedFault, Measurement
from ringwatch.agents.workloads import WORKLOADS, JobLayout, LayoutError, disjoint_rounds
from ringwatch.services.analyzer.assess import link_key
from ringwatch.services.check import run_check
from ringwatch.services.check.planner import node_members
from ringwatch.services.check.shape import ProbeShape
from ringwatch.services.check.workload import (
    SLOW_SHARE,
    doubtful,
    identity,
    job_groups,
    judge_job,
)
from ringwatch.services.cli.main import main as cli
from tests.fake_cuda import FakeCuda
from tests.test_nccl_path import run_agents


def ranks(nodes: int, gpus: int = 8) -> list[str]:
    return [member(node_name(n), g) for n in range(nodes) for g in range(gpus)]


def sim(nodes: int, *faults: dict[str, Any], noise: float = 0.02) -> SimBackend:
    return SimBackend({"nodes": nodes, "gpus_per_node": 8, "noise": noise, "variation": 0.02,
                       "seed": 3, "faults": list(faults)})


# ---- the plan -----------------------------------------------------------------------------


def test_a_layout_gives_the_jobs_own_communicators_in_megatron_order() -> None:
    comms = JobLayout(tp=8, pp=2).communicators(ranks(4))
    # Tensor parallel inside each node; data parallel across the two nodes of each stage,
    # one group per local GPU (a rail); pipeline pairs join the same GPU of stage 0 and 1.
    assert comms["tp"] == [tuple(member(node_name(n), g) for g in range(8)) for n in range(4)]
    assert len(comms["dp"]) == 16 and all(len(g) == 2 for g in comms["dp"])
    assert comms["dp"][0] == ("node-000/0", "node-001/0")
    assert comms["dp"][8] == ("node-002/0", "node-003/0")
    assert len(comms["pp"]) == 16 and comms["pp"][0] == ("node-000/0", "node-002/0")
    assert JobLayout(tp=8, pp=2).resolve(32).dp == 2


@pytest.mark.parametrize("tp,pp,dp", [(3, 1, None), (8, 2, 3), (0, 1, None)])
def test_a_layout_that_does_not_fit_the_ranks_is_refused(tp: int, pp: int, dp: int | None) -> None:
    with pytest.raises(LayoutError):
        JobLayout(tp=tp, pp=pp, dp=dp).communicators(ranks(4))


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_each_profile_plans_its_ops_and_sizes_on_its_communicators(name: str) -> None:
    w = WORKLOADS[name]
    layout = JobLayout(tp=8, pp=2) if name == "pipeline" else JobLayout(tp=8)
    comms = layout.communicators(ranks(4))
    rounds = job_groups(w, comms, ProbeShape(), algos=w.algos)
    assert rounds, name
    for groups in rounds:
        members = [m for g in groups for m in g.members]
        assert len(members) == len(set(members)), "a rank in two groups of one round"
        for g in groups:
            kind = next(k for k, gs in comms.items() if g.members in gs)
            probe = w.comms[kind]
            assert g.sizes == probe.sizes
            assert set(g.ops) <= set(probe.ops)
            assert g.algo is None or (g.ops == ("allreduce",) and g.algo in w.algos)
            assert g.scope == ("intra_node" if kind == "tp" else "world")
    planned = {(g.ops, g.algo) for groups in rounds for g in groups}
    assert any(algo is None for _, algo in planned)
    if "allreduce" in {op for p in w.comms.values() for op in p.ops} and w.algos:
        assert {algo for _, algo in planned} == {None, "ring", "tree"}
    assert {op for ops, _ in planned for op in ops} == {op for p in w.comms.values()
                                                        for op in p.ops}


def test_pipeline_pairs_overlap_at_inner_stages_and_are_packed_apart() -> None:
    pairs = JobLayout(tp=1, pp=4).communicators(ranks(1, 4))["pp"]
    assert pairs == [("node-000/0", "node-000/1"), ("node-000/1", "node-000/2"),
                     ("node-000/2", "node-000/3")]
    assert disjoint_rounds(pairs) == [[pairs[0], pairs[2]], [pairs[1]]]


# ---- ring and tree apart --------------------------------------------------------------


def test_ring_and_tree_are_series_apart_with_their_own_costs_on_the_sim() -> None:
    backend = sim(4, noise=0.0)
    members = tuple(node_members({node_name(n): list(range(8)) for n in range(4)},
                                 [node_name(n) for n in range(4)]))
    out = {}
    for algo in (None, "ring", "tree"):
        result = backend.run_round([GroupSpec("world", members, ops=("allreduce",),
                                              sizes=(1 << 16, 1 << 28), algo=algo)])
        out[algo] = {m.size_bytes: m for m in result.measurements}
    assert {m.algo for ms in out.values() for m in ms.values()} == {None, "ring", "tree"}
    assert len({link_key(out[a][1 << 28]) for a in out}) == 3
    # A ring of 32 ranks takes 31 steps each way, a tree log2(32): small messages favour
    # the tree; each further byte costs the tree more (its share of the links' rate).
    assert out["tree"][1 << 16].time_us < out["ring"][1 << 16].time_us

    def per_byte(algo: str | None) -> float:
        return out[algo][1 << 28].time_us - out[algo][1 << 16].time_us

    assert per_byte("tree") > per_byte("ring")
    assert out["tree"][1 << 28].to_dict()["algo"] == "tree"
    assert "algo" not in out[None][1 << 28].to_dict()


def test_a_degradation_in_the_tree_alone_is_found_and_named_with_its_algorithm() -> None:
    slow = {"kind": "fallback", "node": "node-005", "op": "allreduce", "algo": "tree",
            "factor": 0.5}
    verdict = run_check(sim(8, slow), profile="ddp").verdict()
    found = [f for f in verdict["workload"]["findings"] if f["kind"] == "communicator_slow"]
    assert [(f["nodes"], f.get("algo")) for f in found] == [(["node-005"], "tree")]
    # NCCL's own choice and the ring on the same node are fine: nothing on the fabric.
    assert verdict["findings"] == [] and not verdict["healthy"]
    assert verdict["workload"]["ok"] is False


def test_every_slow_group_of_a_row_is_named_not_only_the_slowest() -> None:
    # Two nodes slow under the tree alone share one row (tp, AllReduce 16 MiB, tree): the
    # slower must not hide the other. A third slows NCCL's own choice only, another row.
    faults = [{"kind": "fallback", "node": "node-005", "op": "allreduce", "algo": "tree",
               "factor": 0.5},
              {"kind": "fallback", "node": "node-011", "op": "allreduce", "algo": "tree",
               "factor": 0.6},
              {"kind": "fallback", "node": "node-002", "op": "allreduce", "factor": 0.6}]
    verdict = run_check(sim(16, *faults), profile="ddp").verdict()
    workload = verdict["workload"]
    found = [(f["nodes"], f.get("algo")) for f in workload["findings"]
             if f["kind"] == "communicator_slow"]
    assert sorted(found, key=str) == sorted(
        [(["node-005"], "tree"), (["node-011"], "tree"), (["node-002"], None)], key=str)
    tree = next(r for r in workload["communicators"]
                if (r["kind"], r.get("algo")) == ("tp", "tree"))
    # Slowest first; the slowest keeps its own fields.
    assert tree["slow_nodes"] == [["node-005"], ["node-011"]]
    assert tree["slowest_nodes"] == ["node-005"] and tree["slow_below"] == SLOW_SHARE
    assert all(fault_found(f, verdict) for f in faults)
    ring = next(r for r in workload["communicators"]
                if (r["kind"], r.get("algo")) == ("tp", "ring"))
    assert "slow_nodes" not in ring and ring["slowest_share"] > SLOW_SHARE


def test_at_high_noise_a_group_is_named_only_beyond_its_kinds_spread() -> None:
    # At 8 % noise healthy groups reach far under their row's median (here a data-parallel
    # rail, which spans every node, under 80 % of its row's): the bar falls below
    # SLOW_SHARE to four spreads of the kind's groups, and a node at a third of the median
    # is named below it all the same.
    slow = {"kind": "fallback", "node": "node-040", "op": "allreduce", "algo": "tree",
            "factor": 0.35}
    workload = run_check(SimBackend({"nodes": 64, "gpus_per_node": 8, "noise": 0.08,
                                     "variation": 0.05, "seed": 9, "faults": [slow]}),
                         profile="ddp").verdict()["workload"]
    rows = workload["communicators"]
    assert all(r["slow_below"] < SLOW_SHARE for r in rows), rows
    # Healthy rails read under SLOW_SHARE by the noise were measured again, and cleared.
    assert any(r["kind"] == "dp" and r.get("measured_again") for r in rows)
    assert [(r["kind"], r.get("algo")) for r in rows if "slow_nodes" in r] == [("tp", "tree")]
    assert [f["nodes"] for f in workload["findings"]] == [["node-040"]]


def _tp_reading(node: int, busbw: float, algo: str | None = None) -> Measurement:
    members = [member(node_name(node), g) for g in range(8)]
    return Measurement(op="allreduce", scope="intra_node", members=members,
                       size_bytes=16 << 20, dtype="float32", warmup=1, iters=1, time_us=1.0,
                       algbw_gbs=busbw, busbw_gbs=busbw, wrong=0, algo=algo)


def test_a_group_the_noise_could_explain_is_measured_again_and_judged_on_its_mean() -> None:
    # Forty tensor-parallel groups at 6 % noise: one reading each puts the bar near 0.79 of
    # the row's median. A node whose AllReduce fell back to 0.81 sits over it, a healthy
    # one read low by the noise (0.83) too: both are run again.
    spread = [1.0 + 0.06 * ((i * 37) % 11 - 5) / 5 for i in range(40)]
    first = [_tp_reading(n, 300.0 * spread[n]) for n in range(40)]
    first[7] = _tp_reading(7, 300.0 * 0.81)
    first[12] = _tp_reading(12, 300.0 * 0.83)
    kind_of = {m.group: "tp" for m in first}
    again = sorted(g.members[0] for g, _ in doubtful(kind_of, first))
    assert again == ["node-007/0", "node-012/0"]
    # Three more readings: the fallback stays at 0.81, the healthy group reads its normal.
    more = [_tp_reading(7, 300.0 * 0.81) for _ in range(3)]
    more += [_tp_reading(12, 300.0 * x) for x in (1.02, 0.98, 1.0)]
    comms = {"tp": [m.group.members for m in first]}
    judged = judge_job(WORKLOADS["ddp"], JobLayout(), comms, first + more)
    slow = [(f["nodes"], f["readings"]) for f in judged["findings"]]
    assert slow == [(["node-007"], 4)]
    (row,) = judged["communicators"]
    assert row["measured_again"] == 2 and row["groups"] == 40


def test_a_job_reading_that_met_other_traffic_is_neither_judged_nor_run_again() -> None:
    # A tensor-parallel group read at half its row while a job's traffic shared its links
    # (contended): it says nothing of the communicator.
    first = [_tp_reading(n, 300.0) for n in range(20)]
    first[3] = dataclasses.replace(_tp_reading(3, 150.0), contended=True)
    kind_of = {m.group: "tp" for m in first}
    assert doubtful(kind_of, first) == []
    comms = {"tp": [m.group.members for m in first]}
    judged = judge_job(WORKLOADS["ddp"], JobLayout(), comms, first)
    assert judged["findings"] == [] and judged["communicators"][0]["groups"] == 19


def test_a_verdict_lists_a_transport_fallback_once_though_every_job_round_saw_it() -> None:
    socket = {"kind": "transport", "node": "node-003", "transport": "socket"}
    verdict = run_check(sim(16, socket), profile="ddp").verdict()
    assert [(f["kind"], f.get("node")) for f in verdict["findings"]] == [
        ("transport_fallback", "node-003")]
    assert fault_found(socket, verdict)
    workload = [(f["kind"], tuple(f["nodes"]), f.get("communicator"), f.get("op"),
                 f.get("size_bytes"), f.get("algo")) for f in verdict["workload"]["findings"]]
    assert len(workload) == len(set(workload))


def test_the_job_phase_leaves_out_the_groups_of_a_rank_the_fabric_check_found_hung() -> None:
    # A GPU that hangs makes each job group holding it wait out its deadline: its node's
    # tensor-parallel group and one data-parallel rail. They are not run; the other rails
    # and nodes are, and a fallback on another node is still named by them.
    hang = {"kind": "hang", "node": "node-004", "gpu": 2}
    fallback = {"kind": "fallback", "node": "node-001", "op": "allreduce", "algo": "tree",
                "factor": 0.5}
    backend = sim(8, hang, fallback)
    verdict = run_check(backend, profile="ddp").verdict()
    work = verdict["workload"]
    assert [(x["communicator"], x["hung"]) for x in work["left_out"]] == [
        ("tp", ["node-004/2"]), ("dp", ["node-004/2"])]
    assert fault_found(hang, verdict) and fault_found(fallback, verdict)
    # No job round waited on the hang: each is far under the sim's group deadline.
    assert work["fabric_s"] < work["rounds"] * backend.preflight_deadline_s / 2
    # Eight nodes give 8 tensor-parallel groups and 8 rails: each row judged 7 of them.
    assert work["groups"] == {"tp": 7, "dp": 7}
    assert {row["groups"] for row in work["communicators"]} == {7}


def test_an_allreduce_fallback_across_every_rail_is_one_identity_finding_per_size() -> None:
    # Each of the eight data-parallel rails spans every node: each breaks the identity at
    # each size, and each says the same (these nodes, dp, that size).
    fallback = {"kind": "fallback", "node": "node-002", "op": "allreduce", "factor": 0.5}
    found = run_check(sim(8, fallback), profile="fsdp").verdict()["workload"]["findings"]
    dp = [f["size_bytes"] for f in found
          if f["kind"] == "collective_identity" and f["communicator"] == "dp"]
    assert sorted(dp) == sorted(WORKLOADS["fsdp"].comms["dp"].sizes)


def test_a_fault_free_fleet_passes_every_profile() -> None:
    for name in WORKLOADS:
        layout = JobLayout(tp=8, pp=2) if name == "pipeline" else None
        verdict = run_check(sim(8), profile=name, job=layout).verdict()
        assert verdict["healthy"], (name, verdict["findings"], verdict["workload"]["findings"])
        assert verdict["workload"]["profile"] == name and verdict["workload"]["rounds"] > 0


def test_the_agent_forms_its_communicator_under_the_groups_nccl_algo(fake_cuda: FakeCuda) -> None:
    os.environ.pop("NCCL_ALGO", None)
    agents = [ProbeAgent("node-000", i, backend="nccl") for i in range(2)]
    for algo in ("tree", None):
        spec = GroupSpec("intra_node", ("node-000/0", "node-000/1"), ops=("allreduce",),
                         sizes=(4096,), warmup=1, iters=2, deadline_s=30, algo=algo)
        replies = run_agents(agents, spec)
        assert [r["status"] for r in replies] == ["ok", "ok"], replies
        assert [m.algo for m in outcome.measurements(spec, dict(enumerate(replies)))] == [algo]
    assert fake_cuda.nccl_algo == ["tree", "tree", None, None]
    assert "NCCL_ALGO" not in os.environ


# ---- ReduceScatter + AllGather = AllReduce ----------------------------------------------


def test_an_allreduce_fallback_breaks_the_identity_on_the_sim_and_names_the_node() -> None:
    fallback = {"kind": "fallback", "node": "node-002", "op": "allreduce", "factor": 0.5}
    verdict = run_check(sim(8, fallback), profile="fsdp").verdict()
    off = [f for f in verdict["workload"]["findings"] if f["kind"] == "collective_identity"]
    intra = [f for f in off if f["communicator"] == "intra_node"]
    assert intra and {tuple(f["nodes"]) for f in intra} == {("node-002",)}
    assert all(f["ratio"] < 0.7 and f["expected_ratio"] == pytest.approx(1.0, abs=0.1)
               for f in intra)
    healthy = run_check(sim(8), profile="fsdp").verdict()["workload"]
    assert not [f for f in healthy["findings"] if f["kind"] == "collective_identity"]
    assert all(0.8 < row["ratio_median"] < 1.25 for row in healthy["identity"])


def test_an_injected_slow_allreduce_on_gloo_breaks_the_identity_of_its_group_only() -> None:
    ops = ("reducescatter", "allgather", "allreduce")
    size = 1 << 22
    ms: list[Measurement] = []
    for n in range(4):
        node = node_name(n)
        injected = [{"kind": "slow", "node": node, "gpu": 1, "factor": 0.25,
                     "op": "allreduce"}] if n == 2 else []
        agents = [ProbeAgent(node, i, backend="gloo", injected=injected) for i in range(2)]
        spec = GroupSpec("intra_node", (member(node, 0), member(node, 1)), ops=ops,
                         sizes=(size,), warmup=2, iters=5, deadline_s=60)
        replies = run_agents(agents, spec, calibrate=True)
        assert [r["status"] for r in replies] == ["ok", "ok"], replies
        ms += outcome.measurements(spec, dict(enumerate(replies)))
    assert all(m.wrong == 0 for m in ms)
    ratios = {}  # per group: time(ReduceScatter) + time(AllGather) over time(AllReduce)
    for group in {m.group for m in ms}:
        t = {m.op: m.time_us for m in ms if m.group == group and m.size_bytes == size}
        ratios[(group, size)] = (t["reducescatter"] + t["allgather"]) / t["allreduce"]
    # Gloo's ReduceScatter is slow beside its AllReduce and its timings scatter on a busy
    # machine (healthy ratios of 2-3 here), so the band is the sim's to test; what gloo
    # shows is the slowed AllReduce pulling its own group's ratio far below its peers' (a
    # quarter of it, less the noise of a shared machine, which can halve one peer's).
    slowed = ratios[(Group(["node-002/0", "node-002/1"]), size)]
    peers = sorted(r for (g, _), r in ratios.items() if g.members[0] != "node-002/0")
    assert slowed < 0.6 * peers[1], ratios


def test_a_single_rank_has_no_identity_to_check() -> None:
    spec = GroupSpec("intra_node", ("node-000/0",), ops=("reducescatter", "allgather",
                                                         "allreduce"), sizes=(1 << 24,))
    ms = sim(1).run_round([spec]).measurements
    assert len(ms) == 3 and identity(ms, {}, (1 << 24,)) == ([], [])


def test_a_slow_fault_names_only_an_op_it_can_slow() -> None:
    assert InjectedFault.from_dict({"kind": "slow", "node": "n", "op": "allreduce"}).op == "allreduce"
    with pytest.raises(ValueError, match="op"):
        InjectedFault.from_dict({"kind": "slow", "node": "n", "op": "broadcast"})
    with pytest.raises(ValueError, match="op"):
        InjectedFault.from_dict({"kind": "hang", "node": "n", "op": "allreduce"})


# ---- the command line ---------------------------------------------------------------------


def _scenario(tmp_path: Path, *faults: dict[str, Any]) -> str:
    path = tmp_path / "fabric.json"
    path.write_text(json.dumps({"nodes": 8, "gpus_per_node": 8, "noise": 0.02,
                                "variation": 0.02, "seed": 3, "faults": list(faults)}))
    return str(path)


def test_cli_preflight_with_a_profile_and_layout_reports_the_jobs_traffic(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = cli(["preflight", "--fabric", _scenario(tmp_path), "--profile", "pipeline",
                "--tp", "8", "--pp", "4", "--json"])
    verdict = json.loads(capsys.readouterr().out)
    assert code == 0 and verdict["healthy"]
    assert verdict["workload"]["layout"] == {"tp": 8, "pp": 4, "dp": 2}
    assert verdict["workload"]["groups"] == {"tp": 8, "dp": 32, "pp": 48}
    assert {r["op"] for r in verdict["workload"]["communicators"] if r["kind"] == "pp"} == {
        "sendrecv"}


@pytest.mark.parametrize("args,message", [
    (["--profile", "ddp", "--tp", "3"], "does not divide"),
    (["--tp", "8"], "add --profile"),
    (["--profile", "ddp", "--pp", "0"], ">= 1"),
])
def test_cli_refuses_a_layout_it_cannot_use_in_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str) -> None:
    code = cli(["preflight", "--fabric", _scenario(tmp_path), *args])
    err = capsys.readouterr().err
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err


def test_cli_probe_with_a_profile_adds_its_ops_and_runs_the_jobs_groups(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = cli(["probe", "--fabric", _scenario(tmp_path), "--profile", "fsdp", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0
    fabric = [m for m in out["measurements"] if m["size_bytes"] in default_sizes("sim")]
    job = [m for m in out["measurements"] if m["size_bytes"] in WORKLOADS["fsdp"].sizes]
    assert len(fabric) + len(job) == len(out["measurements"])
    # The check monitoring runs (AllReduce, AllToAll at the sim's sizes) and the profile's
    # AllGather and ReduceScatter beside them...
    assert {m["op"] for m in fabric} == {"allreduce", "alltoall", "allgather", "reducescatter"}
    # ...then the job's own groups at the profile's sizes, AllReduce also as ring and tree.
    assert {(m["op"], m.get("algo")) for m in job} == {
        ("allgather", None), ("reducescatter", None), ("allreduce", None),
        ("allreduce", "ring"), ("allreduce", "tree")}
    assert out["workload"]["layout"] == {"tp": 8, "pp": 1, "dp": 8} and out["workload"]["ok"]
    assert cli(["probe", "--fabric", _scenario(tmp_path), "--profile", "moe",
                "--sizes", "1M", "--json"]) == 0
    sizes = {m["size_bytes"] for m in json.loads(capsys.readouterr().out)["measurements"]}
    assert sizes == {1 << 20, *WORKLOADS["moe"].sizes}


def test_cli_probe_refuses_a_layout_that_does_not_fit_before_probing(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = cli(["probe", "--fabric", _scenario(tmp_path), "--profile", "ddp", "--tp", "3"])
    captured = capsys.readouterr()
    assert code == 2 and "does not divide the job's 64 ranks" in captured.err
    assert captured.out == "" and "round" not in captured.err


# ---- through the API ----------------------------------------------------------------------


def _with_ranks(batch: dict[str, Any], nodes: int, gpus: int) -> dict[str, Any]:
    """A batch that also reports each node's GPUs, as an agent's does."""
    return {**batch, "ranks": [{"node": node_name(n), "local_index": g}
                               for n in range(nodes) for g in range(gpus)]}


def test_a_profiled_preflight_always_waits_for_a_scheduler_and_carries_its_job(api) -> None:
    from tests.api_fixtures import fleet_batch

    api.post("/v1/measurements", json=fleet_batch(), headers=api.h["agent"]).raise_for_status()
    nodes = [node_name(n) for n in range(4)]
    # Fresh, healthy results answer a plain request at once...
    assert api.post("/v1/preflight", json={"nodes": nodes},
                    headers=api.h["reader"]).status_code == 200
    # ...but monitoring never ran the job's communicators: a profiled one waits.
    r = api.post("/v1/preflight", json={"nodes": nodes, "profile": "fsdp", "tp": 2},
                 headers=api.h["reader"])
    assert r.status_code == 202, r.text
    body = r.json()
    assert body["status"] == "pending" and body["profile"] == "fsdp"
    assert body["job"] == {"tp": 2, "pp": 1, "dp": None}
    claimed = api.post("/v1/preflight/claim", json={"worker": "s"}, headers=api.h["agent"]).json()
    assert claimed["id"] == body["id"]
    assert (claimed["profile"], claimed["job"]) == ("fsdp", body["job"])


@pytest.mark.parametrize("extra, reason", [
    ({"tp": 2}, "give a profile"),
    ({"profile": "zero3"}, "profile"),
    ({"profile": "ddp", "tp": 0}, "tp"),
    ({"profile": "ddp", "tp": 3}, "does not divide the job's 8 ranks"),
    ({"profile": "pipeline", "tp": 2, "pp": 2, "dp": 3}, "but the job has 8"),
])
def test_a_profiled_preflight_that_cannot_fit_is_refused_with_a_reason(
        api, extra: dict[str, Any], reason: str) -> None:
    from tests.api_fixtures import fleet_batch

    api.post("/v1/measurements", json=_with_ranks(fleet_batch(), 4, 2),
             headers=api.h["agent"]).raise_for_status()
    r = api.post("/v1/preflight", json={"nodes": [node_name(n) for n in range(4)], **extra},
                 headers=api.h["reader"])
    assert r.status_code == 422, r.text
    assert reason in r.text
    # Nothing was queued for a scheduler.
    assert api.post("/v1/preflight/claim", json={"worker": "s"},
                    headers=api.h["agent"]).status_code == 204


def test_ring_and_tree_are_stored_as_series_apart(api) -> None:
    from tests.api_fixtures import measurement

    members = [member(node_name(n), 0) for n in range(4)]
    rows = [measurement(members, bw, op="allreduce", size=25 << 20) | extra
            for bw, extra in ((40.0, {}), (38.0, {"algo": "ring"}), (12.0, {"algo": "tree"}))]
    api.post("/v1/measurements", json={"batch_id": "rt", "backend": "nccl", "measurements": rows},
             headers=api.h["agent"]).raise_for_status()
    ops = {link["op"] for link in api.get("/v1/links", headers=api.h["reader"]).json()}
    assert ops == {"allreduce", "allreduce:ring", "allreduce:tree"}
    for op, busbw in (("allreduce", 40.0), ("allreduce:ring", 38.0), ("allreduce:tree", 12.0)):
        points = api.get("/v1/series", params={"members": ",".join(members), "op": op},
                         headers=api.h["reader"]).json()["points"]
        assert [p["busbw_gbs"] for p in points] == [busbw]
    r = api.post("/v1/measurements", json={"batch_id": "rt2", "backend": "nccl", "measurements": [
        {**rows[0], "algo": "bogus"}]}, headers=api.h["agent"])
    assert r.status_code == 422 and "algo" in r.text
