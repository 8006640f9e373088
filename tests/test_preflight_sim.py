"""run_check end to end over a backend: a test double of ProbeBackend and the sim."""

from __future__ import annotations

import pytest

from ringwatch.agents.groups import nodes_of, split_member
from ringwatch.agents.sim import SimBackend
from ringwatch.agents.spec import (
    BackendDefaults,
    Finding,
    GroupSpec,
    Measurement,
    RankInfo,
    RoundResult,
)
from ringwatch.services.check import run_check
from tests.scenarios import DESIGN_SCENARIO


class SlowRankBackend(BackendDefaults):
    """A ProbeBackend double: a group runs at the pace of its slowest rank; hung ranks hang."""

    name = "gloo"

    def __init__(self, n_nodes: int, gpus: int, slow: dict[str, float] | None = None,
                 hung: set[str] | None = None) -> None:
        self._ranks = [RankInfo(f"node-{i:03d}", g, f"host{i}") for i in range(n_nodes)
                       for g in range(gpus)]
        self.slow = slow or {}
        self.hung = hung or set()
        self.rounds: list[list[GroupSpec]] = []

    def ranks(self) -> list[RankInfo]:
        return self._ranks

    def run_round(self, groups: list[GroupSpec]) -> RoundResult:
        self.rounds.append(groups)
        out = RoundResult()
        for g in groups:
            hung = sorted(self.hung.intersection(g.members))
            if hung:
                node, gpu = split_member(hung[0])
                out.findings.append(Finding(kind="hang", node=node, gpu=gpu))
                out.fabric_time_s = max(out.fabric_time_s, g.deadline_s)
                continue
            pace = min(self.slow.get(m, 1.0) for m in g.members)
            base = 10.0 if len(nodes_of(g.members)) == 1 else 2.0
            for op in g.ops:
                for size in g.sizes:
                    bw = base * pace
                    out.measurements.append(Measurement(
                        op=op, scope=g.scope, members=list(g.members), size_bytes=size,
                        dtype=g.dtype, warmup=g.warmup, iters=g.iters,
                        time_us=size / bw / 1e3, algbw_gbs=bw, busbw_gbs=bw, wrong=0))
            out.fabric_time_s = max(out.fabric_time_s, 0.5)
        return out


def test_healthy_fleet_is_healthy():
    b = SlowRankBackend(4, 2)
    v = run_check(b, None).verdict()
    assert v["healthy"] and v["exclude"] == [] and v["nodes_checked"] == 4
    assert v["rounds"] == len(b.rounds) and v["duration_s"] == 0.5 * len(b.rounds)
    assert v["backend"] == "gloo" and "wall_s" in v


def test_slow_rank_excludes_only_its_node():
    b = SlowRankBackend(3, 2, slow={"node-001/1": 0.4})
    v = run_check(b, None).verdict()
    assert not v["healthy"] and v["exclude"] == ["node-001"]
    assert {f["node"] for f in v["findings"]} == {"node-001"}


def test_hang_is_a_finding_not_an_exception():
    b = SlowRankBackend(3, 2, hung={"node-002/1"})
    v = run_check(b, None).verdict()
    assert v["exclude"] == ["node-002"]
    assert {"kind": "hang", "node": "node-002", "gpu": 1, "severity": "critical"} in v["findings"]


def test_nodes_argument_limits_the_check():
    b = SlowRankBackend(4, 2, slow={"node-003/0": 0.3})
    v = run_check(b, ["node-000", "node-001"]).verdict()
    assert v["healthy"] and v["nodes_checked"] == 2
    assert all(m.startswith(("node-000", "node-001")) for r in b.rounds for g in r
               for m in g.members)


# --- on the sim backend -----------------------------------------------------------------

def sim_verdict(faults, nodes=10, gpus=4, noise=0.03, seed=3):
    b = SimBackend({"nodes": nodes, "gpus_per_node": gpus, "noise": noise, "seed": seed,
                    "faults": faults})
    return run_check(b, None).verdict()


def where(f):
    return (f["kind"], f.get("node") or f.get("nodes"), f.get("gpus"), f.get("gpu"))


@pytest.mark.parametrize(("fault", "want"), [
    ({"kind": "nvlink", "node": "node-004", "gpus": [1, 3], "factor": 0.7},
     ("nvlink_degraded", "node-004", [1, 3], None)),
    ({"kind": "pcie_only", "node": "node-006", "gpus": [0, 2]},
     ("topology_mismatch", "node-006", [0, 2], None)),
    ({"kind": "nic", "node": "node-002", "factor": 0.7}, ("nic_degraded", "node-002", None, None)),
    ({"kind": "net_path", "nodes": ["node-001", "node-008"], "factor": 0.7},
     ("net_path_degraded", ["node-001", "node-008"], None, None)),
    ({"kind": "hang", "node": "node-009", "gpu": 2}, ("hang", "node-009", None, 2)),
    ({"kind": "corrupt", "node": "node-000", "gpu": 3}, ("data_corruption", "node-000", None, 3)),
    ({"kind": "error", "node": "node-005", "gpu": 2}, ("probe_error", "node-005", None, 2)),
])
def test_each_fault_kind_is_found_and_localized(fault, want):
    v = sim_verdict([fault])
    assert [where(f) for f in v["findings"]] == [want]
    blamed = [] if fault["kind"] == "net_path" else [fault["node"]]
    assert v["exclude"] == blamed and not v["healthy"] and v["backend"] == "sim"


@pytest.mark.parametrize("seed", range(6))
def test_fault_free_fabric_at_five_percent_noise_excludes_nothing(seed):
    v = sim_verdict([], nodes=24, noise=0.05, seed=seed)
    assert v["exclude"] == []
    assert v["healthy"], v["findings"]


def test_design_example_scenario_gives_the_design_verdict():
    v = run_check(SimBackend(DESIGN_SCENARIO), None).verdict()
    assert v["exclude"] == ["node-002", "node-003", "node-004", "node-009", "node-011"]
    assert sorted(where(f) for f in v["findings"]) == sorted([
        ("nvlink_degraded", "node-003", [2, 5], None),
        ("nic_degraded", "node-011", None, None),
        ("net_path_degraded", ["node-001", "node-007"], None, None),
        ("hang", "node-004", None, 1),
        ("data_corruption", "node-009", None, 6),
        ("topology_mismatch", "node-002", [0, 1], None),
    ])
    nvlink = next(f for f in v["findings"] if f["kind"] == "nvlink_degraded")
    assert nvlink["measured_gbs"] < 0.6 * nvlink["expected_gbs"]
    assert v["rounds"] >= 4 and v["duration_s"] > 0 and v["wall_s"] >= 0


def test_duration_is_the_sum_of_modeled_round_times():
    b = SimBackend({"nodes": 6, "gpus_per_node": 2, "seed": 2,
                    "faults": [{"kind": "nic", "node": "node-001", "factor": 0.5}]})
    seen = []
    run_round = b.run_round

    def recording(groups):
        r = run_round(groups)
        seen.append(r.fabric_time_s)
        return r

    b.run_round = recording  # type: ignore[method-assign]
    v = run_check(b, None).verdict()
    assert v["rounds"] == len(seen)
    assert v["duration_s"] == pytest.approx(sum(seen), abs=1e-3)


def test_two_slow_paths_in_a_larger_fleet_are_both_found():
    faults = [{"kind": "net_path", "nodes": ["node-003", "node-031"], "factor": 0.6},
              {"kind": "net_path", "nodes": ["node-010", "node-022"], "factor": 0.7}]
    v = sim_verdict(faults, nodes=40, gpus=2)
    assert sorted(f["nodes"] for f in v["findings"]) == [["node-003", "node-031"],
                                                         ["node-010", "node-022"]]
    assert v["exclude"] == []


def test_single_node_and_two_node_fleets():
    v = sim_verdict([{"kind": "nvlink", "node": "node-000", "gpus": [0, 1], "factor": 0.5}],
                    nodes=1)
    assert v["exclude"] == ["node-000"]
    assert sim_verdict([], nodes=2)["healthy"]
