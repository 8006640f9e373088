"""A check judges everything again after every round, keeping what it worked out in a
``JudgeCache``: the judgement must be the one a fresh call reaches, round after round."""

from __future__ import annotations

import random

import pytest

from ringwatch.agents.groups import Group
from ringwatch.agents.sim import SimBackend
from ringwatch.services.analyzer.assess import PREFLIGHT_THRESHOLDS, KindGroups, node_weights
from ringwatch.services.analyzer.judge import JudgeCache, Judgement, judge
from ringwatch.services.analyzer.localize import NicMemo, by_node, proven_nodes, weigh_nics
from ringwatch.services.check import loop, run_check


def scenario(seed: int) -> dict:
    return {"nodes": 12, "gpus_per_node": 8, "gpu": "H100-SXM", "noise": 0.06,
            "variation": 0.05, "seed": seed, "faults": [
                {"kind": "nic", "node": "node-002", "factor": 0.8},
                {"kind": "net_path", "nodes": ["node-004", "node-009"], "factor": 0.78},
                {"kind": "nvlink", "node": "node-007", "gpus": [1, 5], "factor": 0.8}]}


def seen(j: Judgement) -> tuple:
    """Everything a judgement says: each measurement's assessment, each group's decisions,
    the findings."""
    assessed = [(a.ratio, a.bad, a.source, a.expected_gbs, a.spread, a.centre_se, a.variation,
                 a.judged) for a in j.assessments]
    decisions = {key: (v.decisions, v.pending_ops, v.suspect) for key, v in j.verdicts.items()}
    return assessed, decisions, [f.to_dict() for f in j.findings]


def shortfall(seed: int) -> dict:
    """A fleet whose network runs at 60 % of its rating, one node's NIC at half of that:
    most measurements are explained by the fleet's shortfall, round after round."""
    return {"nodes": 12, "gpus_per_node": 8, "gpu": "H100-SXM", "net_gbs": 30, "noise": 0.03,
            "seed": seed, "faults": [{"kind": "nic", "node": "node-005", "factor": 0.5}]}


@pytest.mark.parametrize("make", [scenario, shortfall], ids=["faults", "shortfall"])
def test_a_cached_judgement_is_the_fresh_one_after_every_round(monkeypatch, make):
    real = loop.judge
    compared = []

    def both(*args, **kwargs):
        cached = real(*args, **kwargs)
        if kwargs.pop("cache", None) is not None:
            assert seen(cached) == seen(real(*args, **kwargs))
            compared.append(len(cached.assessments))
        return cached

    monkeypatch.setattr(loop, "judge", both)
    verdict = run_check(SimBackend(make(5))).verdict()
    # Many rounds, and the faults found: the comparison ran over a whole check.
    assert len(compared) == verdict["rounds"] >= 5
    assert compared == sorted(compared)
    kinds = {f["kind"] for f in verdict["findings"]}
    if make is scenario:
        assert verdict["rounds"] >= 20 and kinds >= {"nic_degraded", "nvlink_degraded"}
    else:
        assert kinds == {"fabric_below_rated", "nic_degraded"}


def test_a_list_that_does_not_extend_the_last_one_is_judged_afresh():
    backend = SimBackend(scenario(8))
    first = run_check(backend).verdict()
    assert first["rounds"] > 1
    checked = run_check(SimBackend(scenario(9)))
    ms = checked.measurements
    cache = JudgeCache()
    t = PREFLIGHT_THRESHOLDS
    judge(ms, [], thresholds=t, cache=cache)
    # A shorter list, then another list altogether, then the first list grown again.
    shuffled = random.Random(1).sample(ms, len(ms))
    for other in (ms[: len(ms) // 2], shuffled, ms):
        assert seen(judge(other, [], thresholds=t, cache=cache)) == seen(
            judge(other, [], thresholds=t))


@pytest.mark.parametrize("other", ["thresholds", "history"])
def test_other_settings_start_the_cache_afresh(other):
    ms = run_check(SimBackend(scenario(3))).measurements
    cache = JudgeCache()
    t = PREFLIGHT_THRESHOLDS
    judge(ms, [], thresholds=t, cache=cache)
    if other == "thresholds":
        kwargs = {"thresholds": type(t)(degraded_ratio=0.95)}
    else:
        m = ms[0]
        kwargs = {"thresholds": t, "history": {
            (m.series, m.scope, m.size_bytes, m.dtype, m.group): [m.busbw_gbs * 2] * 10}}
    assert seen(judge(ms, [], cache=cache, **kwargs)) == seen(judge(ms, [], **kwargs))


def test_the_check_reads_from_its_indexes_what_a_pass_over_every_verdict_gives(monkeypatch):
    """The check keeps what the rules and the plan read of the verdicts from round to round
    (``VerdictIndex``, ``NicMemo``): after every round the verdicts come in the order a
    fresh judgement gives them, and the node pairs by node, the slow pairs, the groups with
    ops pending and the NICs weighed are those a pass over every verdict finds."""
    real = loop.judge
    rounds = []

    def both(*args, **kwargs):
        cache = kwargs.get("cache")
        cached = real(*args, **kwargs)
        if cache is not None:
            kwargs.pop("cache")
            assert list(cached.verdicts) == list(real(*args, **kwargs).verdicts)
            v, index = cached.verdicts, cache.localize.index
            blamed = cached.blamed
            pairs = [x for (scope, _), x in v.items() if scope == "inter_node"
                     and len(x.nodes) == 2 and blamed.isdisjoint(x.nodes)]
            assert index.by_node(blamed) == by_node(pairs)
            assert index.slow_pairs(blamed) == [x for x in pairs if x.bad]
            assert index.with_pending() == [(k, x) for k, x in v.items() if x.pending_ops]
            memo = NicMemo()
            memo.update(by_node(pairs))
            assert memo.nics == weigh_nics(by_node(pairs))
            assert memo.proven == proven_nodes(by_node(pairs), memo.nics)
            rounds.append(len(v))
        return cached

    monkeypatch.setattr(loop, "judge", both)
    verdict = run_check(SimBackend(scenario(6))).verdict()
    assert len(rounds) == verdict["rounds"] >= 10
    assert {f["kind"] for f in verdict["findings"]} >= {"nic_degraded", "nvlink_degraded"}


def test_node_weights_kept_as_groups_join_are_the_ones_worked_out_afresh():
    rng = random.Random(4)
    kind = KindGroups()
    groups: list[Group] = []
    for _ in range(200):
        for _ in range(rng.randint(1, 3)):
            nodes = rng.sample([f"node-{i:03d}" for i in range(30)], rng.randint(1, 3))
            groups.append(Group([f"{n}/{rng.randint(0, 7)}" for n in nodes]))
        groups = list(dict.fromkeys(groups))
        kind._join(groups)
        assert kind.weights.tolist() == node_weights(groups).tolist()
