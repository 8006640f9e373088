"""bench.scenario_sets draws the fleets its issue asks for (every kind, 64-2048 nodes, 1-8 %
noise, fault-free fleets at 6-8 %, fleets short of the model, weak paths, a cause beside a
slowdown) and scores a verdict fault by fault as its report says."""

from __future__ import annotations

import pytest

from bench import scenario_sets as sets
from ringwatch.agents.sim import FAULT_KINDS, SimBackend


@pytest.fixture(scope="module")
def fleets() -> list[dict]:
    return [sc for seed in sets.SETS for sc in sets.scenario_set(seed)]


def test_each_set_draws_what_the_issue_asks_for(fleets: list[dict]) -> None:
    for seed in sets.SETS:
        one_set = sets.scenario_set(seed)
        assert one_set == sets.scenario_set(seed)  # the same fleets every time
        kinds = {f["kind"] for sc in one_set for f in sc["faults"]}
        assert kinds == set(FAULT_KINDS)
        clean = [sc for sc in one_set if not sc["faults"] and "net_gbs" not in sc
                 and "nvlink_gbs" not in sc]
        assert len(clean) >= 6 and all(0.06 <= sc["noise"] <= 0.08 for sc in clean)
        assert any("net_gbs" in sc or "nvlink_gbs" in sc for sc in one_set)
        # Up to 8 places at fault a fleet (a cause beside its slowdown: two faults, one node).
        assert all(64 <= sc["nodes"] <= 2048 and 0.01 <= sc["noise"] <= 0.08
                   and len({tuple(sorted(sets.place_nodes(f))) for f in sc["faults"]}) <= 8
                   for sc in one_set)
        weak = [f for sc in one_set for f in sc["faults"] if f["kind"] == "net_path"
                and 0.15 - 1e-9 <= 1 - f["factor"] <= 0.20 + 1e-9]
        assert len(weak) >= 5
        assert any(sets.colocated_cause(f, sc) for sc in one_set for f in sc["faults"])
    # The sets are of their own: no two fleets alike.
    assert len({sc["seed"] for sc in fleets}) == len(fleets)


def test_every_fleet_is_one_the_sim_takes(fleets: list[dict]) -> None:
    for sc in fleets:
        if sc["nodes"] <= 256:  # the larger ones build the same way, only bigger
            SimBackend(sc)


def test_a_cause_beside_a_slowdown_is_exact_only_with_its_figure() -> None:
    cause = {"kind": "nic_errors", "node": "node-004", "counter": "symbol_error",
             "per_cycle": 500}
    slow = {"kind": "nic", "node": "node-004", "factor": 0.7}
    sc = {"nodes": 64, "faults": [cause, slow]}
    bare = {"kind": "nic_errors", "node": "node-004", "counter": "symbol_error"}
    figured = {**bare, "measured_gbs": 30.0, "expected_gbs": 48.0}
    assert sets.exact(slow, sc, {"findings": [figured]})
    assert not sets.exact(slow, sc, {"findings": [bare]})
    # Seen all the same: a finding at its node.
    assert sets.seen(slow, sc, {"findings": [bare]})
    assert sets.exact(slow, sc, {"findings": [{"kind": "nic_degraded", "node": "node-004"}]})


def test_a_path_matches_whatever_order_its_nodes_are_named_in() -> None:
    """A verdict names a path's nodes in node order (node-259 before node-1136), a scenario
    file in any order: the same path either way."""
    path = {"kind": "net_path", "nodes": ["node-1136", "node-259"], "factor": 0.75}
    named = {"kind": "net_path_degraded", "nodes": ["node-259", "node-1136"]}
    sc = {"nodes": 1306, "faults": [path]}
    assert sets.exact(path, sc, {"findings": [named]})
    assert not sets.exact(path, sc, {"findings": [{**named, "nodes": ["node-259", "node-113"]}]})


def test_a_stray_is_a_finding_at_no_faults_place() -> None:
    path = {"kind": "net_path", "nodes": ["node-001", "node-009"], "factor": 0.8}
    nic = {"kind": "nic", "node": "node-020", "factor": 0.6}
    sc = {"nodes": 64, "faults": [path, nic]}
    assert not sets.stray({"kind": "net_path_degraded", "nodes": ["node-001", "node-009"]}, sc)
    assert not sets.stray({"kind": "nvlink_degraded", "node": "node-020", "gpus": [0, 1]}, sc)
    assert sets.stray({"kind": "nic_degraded", "node": "node-030"}, sc)
    assert sets.stray({"kind": "net_path_degraded", "nodes": ["node-001", "node-002"]}, sc)
    # The shortfall of a fleet short of its model is no stray; in another fleet it is.
    short = {"kind": "fabric_below_rated", "nodes": ["node-000", "node-001"]}
    assert not sets.stray(short, {**sc, "net_gbs": 30.0})
    assert sets.stray(short, sc)


def test_one_fleet_is_checked_and_scored_fault_by_fault() -> None:
    smallest = min(range(sets.FLEETS), key=lambda i: sets.scenario_set(sets.SETS[0])[i]["nodes"])
    sc = sets.scenario_set(sets.SETS[0])[smallest]
    r = sets.one((smallest, sc))
    assert r.nodes == sc["nodes"] and r.n_faults == len(sc["faults"]) == len(r.faults)
    assert r.rounds > 0 and r.fabric_s > 0 and r.cpu_s > 0
    # That fleet (64 x 8, 5 % noise, 9 faults) is found whole and nothing healthy is named.
    assert all(seen for _, _, seen, _, _ in r.faults) and r.strays == []
    assert r.false_excluded == [] and r.workload_repeats == 0
    assert r.healthy_nodes == sc["nodes"] - len(sets.faulty_nodes(sc))
