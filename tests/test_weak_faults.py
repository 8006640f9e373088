"""Weak faults in noisy, uneven fleets: a link's own normal, repeated evidence, and a path
search that one unlucky measurement cannot mislead (docs/analysis.md, "Weighing evidence")."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest

from ringwatch.agents.groups import Group, nodes_of
from ringwatch.agents.sim import SimBackend
from ringwatch.agents.spec import Measurement, RoundResult
from ringwatch.services.analyzer.assess import Thresholds, link_key
from ringwatch.services.analyzer.evidence import DEGRADED, HEALTHY, UNDECIDED, Weighing, weigh
from ringwatch.services.analyzer.judge import judge
from ringwatch.services.check import CheckBudget, run_check

SIM = Thresholds(degraded_ratio=0.85)


def intra(node: int, busbw: float) -> Measurement:
    members = [f"node-{node:03d}/{g}" for g in range(8)]
    return Measurement(op="allreduce", scope="intra_node", members=members, size_bytes=1 << 28,
                       dtype="float32", warmup=5, iters=20, time_us=1.0, algbw_gbs=busbw,
                       busbw_gbs=busbw, wrong=0)


def test_a_link_always_slower_but_stable_is_normal_for_itself():
    rng = random.Random(3)
    noisy = [100.0 * (1 + rng.gauss(0, 0.05)) for _ in range(16)]
    ms = [intra(n, bw) for n, bw in enumerate(noisy)]
    # node-005 has always run 5 % under its peers, with the same jitter as they have.
    slow = intra(5, 95.0)
    ms[5] = slow
    history = {("allreduce", "intra_node", 1 << 28, "float32", Group(slow.members)):
               [95.0 * (1 + rng.gauss(0, 0.05)) for _ in range(50)]}
    j = judge(ms, [], thresholds=SIM, history=history)
    assert j.findings == []
    mine = next(a for a in j.assessments if a.measurement is slow)
    assert mine.source == "history" and mine.ratio == pytest.approx(1.0, abs=0.06)
    # Without its history the same link is judged against its peers: 5 % under them is
    # not a finding either, but it is no longer "its own normal".
    bare = judge(ms, [], thresholds=SIM)
    assert next(a for a in bare.assessments if a.measurement is slow).source == "peers"


def test_the_weighing_needs_repeats_under_noise_and_decides_a_true_loss():
    w = Weighing()
    rng = random.Random(11)
    healthy = [1.0 + rng.gauss(0, 0.08) for _ in range(w.max_repeats)]
    lossy = [0.82 * (1 + rng.gauss(0, 0.08)) for _ in range(w.max_repeats)]
    first = weigh(healthy[:1], noise=0.08, variation=0.03, centre_se=0.005, w=w)
    assert first.decision == UNDECIDED  # one measurement under 8 % noise decides nothing
    assert weigh(healthy, noise=0.08, variation=0.03, centre_se=0.005, w=w).decision == HEALTHY
    bad = weigh(lossy, noise=0.08, variation=0.03, centre_se=0.005, w=w)
    assert bad.decision == DEGRADED and bad.confidence > 0.95
    # A link whose lasting offset could explain its mean is never decided degraded.
    offset = [0.94] * 50
    assert weigh(offset, noise=0.08, variation=0.03, centre_se=0.0,
                 w=Weighing(max_repeats=100)).decision != DEGRADED


def sim(nodes: int, faults: list[dict], *, noise: float, seed: int) -> dict:
    return {"nodes": nodes, "gpus_per_node": 8, "gpu": "H100-SXM", "noise": noise,
            "variation": 0.05, "seed": seed, "faults": faults}


def test_a_fault_of_15_percent_under_8_percent_noise_is_found():
    # One seeded fleet; how often such faults are found over many is the benchmark's
    # figure (make bench: weak_faults), not a test's.
    seed = 3
    faults = [{"kind": "nvlink", "node": "node-006", "gpus": [2, 5], "factor": 0.85},
              {"kind": "nic", "node": "node-019", "factor": 0.85}]
    v = run_check(SimBackend(sim(32, faults, noise=0.08, seed=seed)), None).verdict()
    found = {(f["kind"], f.get("node"), tuple(f.get("gpus") or ())) for f in v["findings"]}
    assert ("nvlink_degraded", "node-006", (2, 5)) in found
    assert ("nic_degraded", "node-019", ()) in found
    assert set(v["exclude"]) == {"node-006", "node-019"}
    named = [f for f in v["findings"] if f["kind"] == "nvlink_degraded"]
    assert 0.5 < named[0]["confidence"] <= 1.0


class GlitchOnce(SimBackend):
    """The sim, with the first group of many nodes the path search runs measured at half
    its speed once: one unlucky measurement in the middle of the search."""

    glitched = 0

    def run_round(self, groups):
        out: RoundResult = super().run_round(groups)
        for m in out.measurements:
            if (not self.glitched and m.scope == "inter_node"
                    and len(nodes_of(m.members)) > 2 and m.op == "alltoall"):
                m.busbw_gbs *= 0.5
                m.algbw_gbs *= 0.5
                self.glitched = 1
        return out


def test_a_noisy_measurement_in_the_slow_path_search_excludes_no_healthy_node():
    faults = [{"kind": "net_path", "nodes": ["node-004", "node-027"], "factor": 0.6}]
    backend = GlitchOnce(sim(32, faults, noise=0.03, seed=5))
    v = run_check(backend, None).verdict()
    assert backend.glitched == 1
    assert v["exclude"] == []
    assert [(f["kind"], f.get("nodes")) for f in v["findings"]] == [
        ("net_path_degraded", ["node-004", "node-027"])]


def test_a_check_the_round_cap_stops_says_it_is_incomplete():
    scenario = sim(32, [{"kind": "net_path", "nodes": ["node-003", "node-017"], "factor": 0.8}],
                   noise=0.08, seed=5)
    cut = run_check(SimBackend(scenario), None, budget=CheckBudget(max_rounds=3)).verdict()
    # Cut short, it is incomplete whatever its places showed so far.
    assert cut["rounds"] == 3 and cut["complete"] is False
    assert cut["stopped_by"] == "rounds (3)"
    assert len(cut["undecided_groups"]) == min(cut["undecided"], 100)
    full = run_check(SimBackend({**scenario, "faults": []}), None).verdict()
    assert full["stopped_by"] is None
    # Complete exactly when nothing is undecided (8 % noise may leave a few groups so).
    assert full["complete"] is (full["undecided"] == 0)


def test_a_check_stops_at_its_fabric_time_budget():
    scenario = sim(32, [{"kind": "net_path", "nodes": ["node-003", "node-017"], "factor": 0.8}],
                   noise=0.08, seed=5)
    v = run_check(SimBackend(scenario), None, budget=CheckBudget(max_fabric_s=0.5)).verdict()
    assert v["complete"] is False and v["stopped_by"] == "fabric time (0.5 s)"
    # It stops at the first round that ends past the budget, not later.
    assert v["duration_s"] < 0.5 + 1.0 and v["rounds"] >= 1


def test_the_error_rates_are_settings(monkeypatch):
    from ringwatch.services.settings import Settings

    monkeypatch.setenv("RINGWATCH_FALSE_ALARM", "0.001")
    monkeypatch.setenv("RINGWATCH_MAX_REPEATS", "8")
    monkeypatch.setenv("RINGWATCH_LINK_VARIATION", "0.05")
    w = Settings().thresholds("sim").weighing
    assert (w.false_alarm, w.max_repeats, w.variation_prior, w.miss) == (
        0.001, 8, 0.05, Weighing().miss)
    monkeypatch.setenv("RINGWATCH_MISS", "0.7")
    with pytest.raises(ValueError):
        Settings()


def test_a_gross_nic_fault_among_four_nodes_is_found_though_half_the_pairs_are_slow():
    # Three of the six node pairs run through the bad NIC: their peers spread so widely
    # that, alone, they would leave the centre too uncertain to decide anything; the
    # hardware model agreeing with the healthy half bounds that uncertainty.
    scenario = {"nodes": 4, "gpus_per_node": 2, "seed": 1,
                "faults": [{"kind": "nic", "node": "node-002", "factor": 0.4}]}
    v = run_check(SimBackend(scenario), None).verdict()
    assert v["exclude"] == ["node-002"]
    assert [f["kind"] for f in v["findings"]] == ["nic_degraded"]


def test_a_union_is_judged_by_its_path_model_not_by_its_few_peers():
    from ringwatch.services.analyzer.assess import assess, slowest_path_share

    def group(nodes: list[int], busbw: float) -> Measurement:
        members = [f"node-{n:03d}/{g}" for n in nodes for g in range(2)]
        return Measurement(op="alltoall", scope="inter_node", members=members,
                           size_bytes=1 << 28, dtype="float32", warmup=5, iters=20,
                           time_us=1.0, algbw_gbs=busbw, busbw_gbs=busbw, wrong=0)

    pairs = [group([2 * i, 2 * i + 1], 90.0 + i) for i in range(5)]
    # Four unions of four nodes: two hold a slow path and pull the peers' centre apart.
    unions = [group([0, 1, 2, 3], 88.0), group([4, 5, 6, 7], 87.0),
              group([0, 1, 4, 5], 60.0), group([2, 3, 6, 7], 61.0)]
    out = assess(pairs + unions, SIM, expected=lambda m: 100.0)
    judged = out[len(pairs):]
    assert {a.source for a in judged} == {"paths"}
    expected = 92.0 * slowest_path_share(4, SIM.weighing.variation_prior)
    assert judged[0].expected_gbs == pytest.approx(expected)
    assert judged[0].ratio is not None and judged[0].ratio > 0.95
    assert judged[2].ratio is not None and judged[2].ratio < 0.7


def test_the_union_model_counts_each_node_pair_once_not_its_repeats():
    """The union model's centre is the node pairs' median: a pair that looked slow and was
    measured again twenty times must not drag it down and hide a slow path from the world
    group."""
    from ringwatch.services.analyzer.assess import assess, slowest_path_share

    def group(nodes: list[int], busbw: float) -> Measurement:
        members = [f"node-{n:03d}/{g}" for n in nodes for g in range(2)]
        return Measurement(op="alltoall", scope="inter_node", members=members,
                           size_bytes=1 << 28, dtype="float32", warmup=5, iters=20,
                           time_us=1.0, algbw_gbs=busbw, busbw_gbs=busbw, wrong=0)

    firsts = [group([2 * i, 2 * i + 1], 100.0) for i in range(5)]
    # Two of the five pairs drew a low first value and were measured twenty times more.
    repeats = [group([2 * i, 2 * i + 1], 80.0) for i in (0, 1) for _ in range(20)]
    world = group(list(range(10)), 90.0)
    out = assess(firsts + repeats + [world], SIM, expected=lambda m: 100.0)
    assert out[-1].source == "paths"
    assert out[-1].expected_gbs == pytest.approx(
        100.0 * slowest_path_share(10, SIM.weighing.variation_prior))


def test_a_world_group_below_the_hardware_floor_keeps_its_own_normal():
    """A world group runs at its slowest path, under the node pairs' hardware model's 90 %
    floor: its own normal, learnt by monitoring, is still what it is judged against."""
    from ringwatch.services.analyzer.assess import assess

    members = [f"node-{n:03d}/{g}" for n in range(64) for g in range(2)]
    world = Measurement(op="alltoall", scope="world", members=members, size_bytes=1 << 28,
                        dtype="float32", warmup=5, iters=20, time_us=1.0, algbw_gbs=80.0,
                        busbw_gbs=80.0, wrong=0)
    pairs = [dataclasses.replace(node_pair(2 * i, 2 * i + 1, 100.0), op="alltoall")
             for i in range(4)]
    rng = random.Random(5)
    history = {link_key(world): [86.0 * (1 + rng.gauss(0, 0.02)) for _ in range(30)]}
    out = assess(pairs + [world], SIM, expected=lambda m: 100.0, history=history)
    assert out[-1].source == "history"
    assert out[-1].expected_gbs == pytest.approx(86.0, rel=0.02)
    assert out[-1].ratio is not None and out[-1].ratio < 0.95


def node_pair(a: int, b: int, busbw: float) -> Measurement:
    members = [f"node-{n:03d}/{g}" for n in (a, b) for g in range(8)]
    return Measurement(op="allreduce", scope="inter_node", members=members, size_bytes=1 << 28,
                       dtype="float32", warmup=5, iters=20, time_us=1.0, algbw_gbs=busbw,
                       busbw_gbs=busbw, wrong=0)


def measured_pairs(pairs: dict[tuple[int, int], float], rng: random.Random,
                   repeats: int = 20) -> list[Measurement]:
    """Each node pair measured ``repeats`` times about its rate, under 6 % noise."""
    return [node_pair(a, b, rate * math.exp(rng.gauss(0, 0.06)))
            for (a, b), rate in pairs.items() for _ in range(repeats)]


def test_a_nic_no_single_partner_can_convict_is_found_by_its_partners_together():
    rng = random.Random(7)
    # Twenty healthy node pairs, each a little off the others for good.
    pairs = {(2 * i, 2 * i + 1): 100.0 * (1 + rng.uniform(-0.03, 0.03)) for i in range(20)}
    # node-040's NIC has lost 11-12 %: each of its four partners sees it.
    pairs.update({(40, 41): 88.5, (40, 42): 89.0, (40, 43): 88.0, (40, 44): 88.5})
    j = judge(measured_pairs(pairs, rng), [], thresholds=SIM)
    mine = [v for (scope, _), v in j.verdicts.items() if "node-040" in v.nodes]
    # Alone, not every one of the four is sure enough on its twenty readings (its lasting
    # offset could be most of it; one that is sure is so on its last look) ...
    assert len(mine) == 4 and not all(v.bad for v in mine)
    # ... together they are: a NIC loss slows every pair through it alike, and no pair
    # decided alone is taken for a path.
    nic = [f for f in j.findings if f.kind == "nic_degraded"]
    assert [f.node for f in nic] == ["node-040"]
    assert nic[0].detail["partners"] == 4 and nic[0].detail["confidence"] > 0.99
    assert {f.kind for f in j.findings} == {"nic_degraded"}


def test_one_slow_path_among_a_nodes_partners_is_not_taken_for_its_nic():
    rng = random.Random(7)
    pairs = {(2 * i, 2 * i + 1): 100.0 * (1 + rng.uniform(-0.03, 0.03)) for i in range(20)}
    # As slow on average over its partners as the NIC above, but all on one path: with
    # its other partners node-040 runs as its peers do, or a little under (its own offset).
    pairs.update({(40, 41): 60.0, (40, 42): 94.0, (40, 43): 93.0, (40, 44): 94.0})
    j = judge(measured_pairs(pairs, rng), [], thresholds=SIM)
    assert "nic_degraded" not in {f.kind for f in j.findings}


def test_the_api_serves_each_links_normal_and_never_learns_a_slow_value(api):
    """``GET /v1/baselines`` gives a scheduler each link's own normal; a value the judgement
    found slow stays out of it, so a lasting loss never becomes the link's normal."""
    from ringwatch.services.scheduler.api_client import SchedulerApi
    from tests.api_fixtures import fleet_batch, pair

    def auth(client, role: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {client.tokens[role]}"}

    agent = auth(api, "agent")
    for _ in range(6):
        api.post("/v1/measurements", json=fleet_batch(), headers=agent).raise_for_status()
    api.post("/v1/measurements", json=fleet_batch(slow_node="node-001"),
             headers=agent).raise_for_status()
    rows = api.get("/v1/baselines", headers=auth(api, "reader")).json()
    assert len(rows) == 6 + 4  # six node pairs, four intra-node groups; one op each
    for row in rows:
        slow = any(m.startswith("node-001/") for m in row["members"])
        assert len(row["values"]) == (6 if slow else 7), row
        assert set(row["values"]) == {20.0 if row["scope"] == "intra_node" else 10.0}
    # Pages: a full one names the next.
    first = api.get("/v1/baselines", params={"limit": 4}, headers=agent)
    rest = api.get("/v1/baselines", params={"limit": 100,
                                            "after": first.headers["X-Next-Cursor"]},
                   headers=agent).json()
    assert [r["group_key"] for r in first.json() + rest] == [r["group_key"] for r in rows]
    # The scheduler reads them keyed as the judgement looks history up.
    sched = SchedulerApi("http://unused", "unused", worker="test")
    sched.client.close()
    sched.client = api
    api.headers.update(agent)
    history = sched.baselines(page=3)
    key = link_key(Measurement(op="allreduce", scope="inter_node",
                               members=pair("node-002", "node-003"), size_bytes=1 << 20,
                               dtype="float32", warmup=5, iters=20, time_us=1.0,
                               algbw_gbs=10.0, busbw_gbs=10.0, wrong=0))
    assert len(history) == 10 and history[key] == [10.0] * 7


def test_a_scheduler_that_cannot_reach_the_api_reads_no_baselines():
    from ringwatch.services.scheduler.api_client import SchedulerApi
    from tests.procs import free_port

    sched = SchedulerApi(f"http://127.0.0.1:{free_port()}", "token", worker="test",
                         timeout_s=2.0)
    try:
        assert sched.baselines() == {}
    finally:
        sched.close()


def test_a_check_judges_each_link_against_its_own_normal_where_history_holds_one():
    """The scheduler's check (a monitoring cycle, a preflight it serves) judges as the API
    judges the batch it ships: against the link's own normal where the store holds one."""
    backend = SimBackend({"nodes": 8, "gpus_per_node": 2, "seed": 2})
    bare = run_check(backend)
    intra = next(a for a in bare.judgement.assessments
                 if a.judged and a.measurement.scope == "intra_node")
    assert intra.source != "history"
    history = {link_key(intra.measurement): [intra.measurement.busbw_gbs] * 10}
    run = run_check(backend, history=history)
    mine = [a for a in run.judgement.assessments
            if link_key(a.measurement) == link_key(intra.measurement)]
    assert mine and all(a.source == "history" for a in mine)
    assert mine[0].expected_gbs == pytest.approx(intra.measurement.busbw_gbs)


def test_the_path_search_leaves_out_a_node_whose_nic_is_in_doubt():
    """A NIC 10 % slow, too weak to convict, slows every union it is in: the world group
    and the search run over the nodes whose NIC is proven, so the search never chases it as
    a slow path through every region."""
    backend = SimBackend({"nodes": 16, "gpus_per_node": 2, "seed": 4, "variation": 0.0,
                          "faults": [{"kind": "nic", "node": "node-005", "factor": 0.9}]})
    run = run_check(backend)
    worlds = [x for (scope, _), x in run.judgement.verdicts.items() if scope == "world"]
    assert len(worlds) == 1
    assert "node-005" not in worlds[0].nodes and len(worlds[0].nodes) >= 12
    assert run.judgement.findings == [] or all(
        "node-005" in (f.node or "") for f in run.judgement.findings)


def test_a_few_past_values_that_agree_by_chance_are_not_trusted_past_the_noise():
    """Five past values within 1 % of each other under 6.5 % noise: the link's own normal
    takes their median, but its uncertainty no smaller than its peers' spread, so a value
    8 % under that lucky median is not read as a loss of many sigmas."""
    from ringwatch.services.analyzer.assess import assess

    rng = random.Random(8)
    peers = [intra(n, 100.0 * math.exp(rng.gauss(0, 0.065))) for n in range(1, 24)]
    mine = intra(0, 97.0)
    history = {link_key(mine): [105.0, 105.4, 104.6, 105.2, 104.9]}
    out = assess([mine, *peers], SIM, history=history)[0]
    assert out.source == "history" and out.expected_gbs == pytest.approx(105.0)
    assert out.spread > 0.04
    assert out.centre_se > 1.2 * 0.04 / math.sqrt(5)


def test_a_pair_slow_on_one_op_only_is_not_named_a_path():
    rng = random.Random(11)
    healthy = {(2 * i, 2 * i + 1): 100.0 * (1 + rng.uniform(-0.03, 0.03)) for i in range(20)}
    healthy |= {(40, 41): 100.0, (44, 45): 100.0}

    def both_ops(pairs: dict[tuple[int, int], float]) -> list[Measurement]:
        ms = measured_pairs(pairs, rng)
        return ms + [dataclasses.replace(m, op="alltoall") for m in measured_pairs(pairs, rng)]

    def at(a: int, b: int, op: str, busbw: float) -> Measurement:
        return dataclasses.replace(node_pair(a, b, busbw), op=op)

    # AllReduce read 20 % under three times on the pair; AllToAll, over the same path,
    # read as its peers do: a rare run of one op's noise, not a path.
    one_op = [at(40, 44, "allreduce", 80.0) for _ in range(3)]
    one_op += [at(40, 44, "alltoall", busbw) for busbw in (98.0, 101.0, 99.0)]
    j = judge(both_ops(healthy) + one_op, [], thresholds=SIM)
    pair = next(v for v in j.verdicts.values() if set(v.nodes) == {"node-040", "node-044"})
    assert pair.decisions["allreduce"].degraded
    assert "net_path_degraded" not in {f.kind for f in j.findings}
    # Both ops 20 % under: the path.
    slow = [at(40, 44, op, 80.0) for op in ("allreduce", "alltoall") for _ in range(3)]
    j = judge(both_ops(healthy) + slow, [], thresholds=SIM)
    assert [f.nodes for f in j.findings if f.kind == "net_path_degraded"] == [
        ["node-040", "node-044"]]
