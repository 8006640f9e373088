"""Every check ends: within its budget, with ``complete`` saying exactly whether anything
was left undecided, on any fleet (all-slow ones among them)."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ringwatch.agents.sim import SimBackend
from ringwatch.services.check import CheckBudget, run_check

BUDGET = CheckBudget(max_rounds=60, max_fabric_s=30.0, max_wall_s=120.0)


@st.composite
def scenarios(draw) -> dict:
    nodes = draw(st.integers(2, 20))
    scenario: dict = {"nodes": nodes, "gpus_per_node": 4, "gpu": "H100-SXM",
                      "seed": draw(st.integers(0, 10_000)),
                      "noise": draw(st.sampled_from([0.0, 0.03, 0.08]))}
    shared = draw(st.sampled_from([None, "net", "nvlink"]))
    if shared == "net":  # the whole network below its rating
        scenario["net_gbs"] = 50 * draw(st.sampled_from([0.2, 0.4, 0.6]))
    elif shared == "nvlink":
        scenario["nvlink_gbs"] = 450 * draw(st.sampled_from([0.2, 0.4, 0.6]))
    faults = []
    for n in draw(st.lists(st.integers(0, nodes - 1), max_size=3, unique=True)):
        kind = draw(st.sampled_from(["nic", "hang", "corrupt"]))
        fault: dict = {"kind": kind, "node": f"node-{n:03d}"}
        if kind == "nic":
            fault["factor"] = draw(st.sampled_from([0.3, 0.5, 0.8]))
        else:
            fault["gpu"] = draw(st.integers(0, 3))
        faults.append(fault)
    scenario["faults"] = faults
    return scenario


# Derandomized: CI runs the same 60 scenarios every time, so a run fails for a change, not
# for a draw; the random search found the known false exclusion below.
@settings(max_examples=60, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_every_check_ends_within_its_budget(scenario) -> None:
    v = run_check(SimBackend(scenario), None, budget=BUDGET).verdict()
    assert v["rounds"] <= BUDGET.max_rounds
    assert v["complete"] is (v["undecided"] == 0 and v["stopped_by"] is None)
    assert len(v["undecided_groups"]) == min(v["undecided"], 100)
    if v["stopped_by"] is None:
        assert v["duration_s"] <= BUDGET.max_fabric_s
    # A shortfall the whole fleet shares excludes nobody by itself.
    if not scenario["faults"]:
        assert v["exclude"] == []


def test_the_check_stands_below_the_scheduler_store_and_api() -> None:
    """services.check is the room every caller shares: it imports none of its callers (the
    scheduler, the CLI, the API) and no database code."""
    import subprocess
    import sys

    code = ("import sys, services.check; print(sorted({m for m in sys.modules if m.split('.')[0] "
            "== 'api' or m.startswith(('ringwatch.services.scheduler', 'ringwatch.services.store', 'ringwatch.services.cli'))}))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


def test_a_fault_free_two_node_fleet_is_decided_in_a_few_rounds() -> None:
    """At the sim's defaults, as `ringwatch preflight --fabric` runs a 2-node scenario:
    its intra-node groups, then its node pair. (Other seeds whose draws look slow follow
    them up with GPU pairs; docs/analysis.md has the spread.)"""
    result = run_check(SimBackend({"nodes": 2, "gpus_per_node": 8, "gpu": "H100-SXM"}))
    assert result.verdict()["healthy"] and result.verdict()["complete"]
    assert result.rounds <= 4


def test_tiny_noisy_fleets_exclude_no_one_before_their_noise_is_measured() -> None:
    """Two and three fault-free nodes at 8 % noise: the stand-in for the unmeasured noise
    (a few peers' spread, or the variation prior under the hardware model) read about half
    of it, and two low readings of one GPU pair excluded a healthy node. A slow decision
    on a stand-in must now also stand at ``Weighing.unmeasured_noise``."""
    for nodes, seed in ((2, 5450), (3, 2252)):
        v = run_check(SimBackend({"nodes": nodes, "gpus_per_node": 4, "gpu": "H100-SXM",
                                  "seed": seed, "noise": 0.08}), None, budget=BUDGET).verdict()
        assert v["exclude"] == [] and v["findings"] == [], (nodes, seed, v["findings"])


def test_a_check_sweeps_young_objects_less_often_and_puts_the_threshold_back() -> None:
    import gc

    from ringwatch.services.check import loop

    before = gc.get_threshold()
    seen, frozen = [], []
    backend = SimBackend({"nodes": 4, "gpus_per_node": 4, "gpu": "H100-SXM"})
    run_round = backend.run_round

    def watched(groups):  # what the collector is set to while the check runs
        seen.append(gc.get_threshold())
        frozen.append(gc.get_freeze_count())
        return run_round(groups)

    backend.run_round = watched  # type: ignore[method-assign]
    run_check(backend)
    assert seen and all(t[0] >= loop.YOUNG_THRESHOLD for t in seen)
    assert all(min(t[1:]) >= loop.OLDER_THRESHOLD for t in seen)
    # Each round's survivors are out of the sweeps while it runs, and back after it.
    assert len(frozen) > 1 and all(n > 0 for n in frozen[1:])
    assert gc.get_threshold() == before and gc.get_freeze_count() == 0


def test_a_few_noisy_gpu_pairs_judge_a_healthy_one_fairly() -> None:
    """Found by the property test below: with fewer than eight peers a kind is centred on
    their 75th percentile, which two lucky single readings at 8 % noise lifted 16 % above the
    pairs measured twenty times; each group now counts for as much as its repeats say."""
    v = run_check(SimBackend({"nodes": 2, "gpus_per_node": 4, "gpu": "H100-SXM", "seed": 3816,
                              "noise": 0.08}), None, budget=BUDGET).verdict()
    assert v["exclude"] == []
