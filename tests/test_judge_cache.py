"""A check judges everything again after every round, keeping what it worked out in a
``JudgeCache``: the judgement must be the one a fresh call reaches, round after round."""

from __future__ import annotations

import random

import pytest

from ringwatch.agents.sim import SimBackend
from ringwatch.services.analyzer.assess import PREFLIGHT_THRESHOLDS
from ringwatch.services.analyzer.judge import JudgeCache, Judgement, judge
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
