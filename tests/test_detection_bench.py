"""bench.detection draws every fault kind the sim models, each one a fault the sim accepts and
one preflight can find, and scores it by where it was found."""

from __future__ import annotations

import random

import pytest

from bench import detection
from ringwatch.agents.sim import FAULT_KINDS, SimBackend, node_name


def test_the_benchmark_draws_every_kind_the_sim_has() -> None:
    assert detection.FAULT_KINDS == FAULT_KINDS
    assert set(detection.FOUND_AS) == set(FAULT_KINDS)
    rng = random.Random(5)
    scenarios = [detection.random_scenario(rng, 64, 5, 0.03) for _ in range(40)]
    assert {f["kind"] for sc in scenarios for f in sc["faults"]} == set(FAULT_KINDS)
    # One fallback a scenario, as when the workload section named only the slowest of a
    # row, where a second could not be told apart (it names every slow one now; the draw
    # is kept so that the figures compare with earlier runs).
    assert max(sum(f["kind"] == "fallback" for f in sc["faults"]) for sc in scenarios) == 1


@pytest.mark.parametrize("kind", FAULT_KINDS)
def test_each_kind_is_a_fault_the_sim_takes_and_one_preflight_finds(kind: str) -> None:
    for seed in range(2):  # both scopes of a transport fault, two counters
        fault = detection.fault_of(kind, node_name(3), node_name(9), 0.5, [1, 4],
                                   random.Random(seed))
        scenario = {"nodes": 16, "gpus_per_node": 8, "gpu": "H100-SXM", "noise": 0.03,
                    "seed": seed, "faults": [fault]}
        SimBackend(scenario)  # refuses a fault it does not model
        verdict = detection.check(scenario)
        assert detection.found(fault, verdict), (fault, verdict["findings"])
        tally = detection.Tally()
        detection.score(scenario, verdict, tally)
        assert (tally.found[kind], tally.total[kind]) == (1, 1)
        assert tally.false_excluded_nodes == tally.false_findings == 0


def test_a_fallback_is_found_by_the_workload_section_not_by_a_slow_link() -> None:
    fallback = {"kind": "fallback", "node": "node-003", "op": "allreduce", "factor": 0.5}
    slow_link = {"kind": "nvlink_degraded", "node": "node-003", "gpu": 0, "gpus": [0]}
    assert not detection.matches(fallback, slow_link)
    assert not detection.found(fallback, {"findings": [slow_link]})
    named = {"findings": [slow_link], "workload": {"findings": [
        {"kind": "communicator_slow", "nodes": ["node-003"]}]}}
    assert detection.found(fallback, named)
    other = {"findings": [], "workload": {"findings": [
        {"kind": "communicator_slow", "nodes": ["node-004"]}]}}
    assert not detection.found(fallback, other)
