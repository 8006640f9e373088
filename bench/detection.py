"""Detection benchmark: random sim scenarios through preflight; recall, false exclusions, time.

``python -m bench.detection [--quick] [--seed N]`` prints a table of figures. Faults sit on
distinct nodes: a node already excluded for one fault is not probed further, so a second
fault on it could never be told apart (docs/analysis.md, "Detection benchmark").
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from agents.sim import FAULT_KINDS as SIM_FAULT_KINDS
from agents.sim import SimBackend, node_name
from services.check import run_check

# The recall target applies to faults at least this strong (factor at most this).
TARGET_FACTOR = 0.75
GPUS = 8

# A fallback slows one op under one algorithm: a workload profile's to find
# (bench.workloads), not the fabric check's.
FAULT_KINDS = tuple(k for k in SIM_FAULT_KINDS if k != "fallback")


@dataclass
class Tally:
    found: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    total: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    weak_found: int = 0
    weak_total: int = 0
    scenarios_ok: int = 0
    scenarios: int = 0
    false_excluded_nodes: int = 0
    false_findings: int = 0
    rounds: list[int] = field(default_factory=list)
    fabric_s: list[float] = field(default_factory=list)


def fault_of(kind: str, a: str, b: str, factor: float, gpus: list[int]) -> dict[str, Any]:
    """A scenario fault of ``kind`` on node ``a`` (a path: ``a`` to ``b``), two GPUs where
    it needs them."""
    return {
        "nvlink": {"kind": "nvlink", "node": a, "gpus": gpus, "factor": factor},
        "nic": {"kind": "nic", "node": a, "factor": factor},
        "net_path": {"kind": "net_path", "nodes": sorted([a, b]), "factor": factor},
        "hang": {"kind": "hang", "node": a, "gpu": gpus[0]},
        "corrupt": {"kind": "corrupt", "node": a, "gpu": gpus[0]},
        "error": {"kind": "error", "node": a, "gpu": gpus[0]},
        "pcie_only": {"kind": "pcie_only", "node": a, "gpus": gpus},
    }[kind]


def random_scenario(rng: random.Random, nodes: int, n_faults: int, noise: float) -> dict[str, Any]:
    picked = rng.sample(range(nodes), min(nodes, 2 * n_faults))
    faults = []
    for k in range(n_faults):
        if 2 * k + 1 >= len(picked):
            break
        kind = rng.choice(FAULT_KINDS)
        a, b = node_name(picked[2 * k]), node_name(picked[2 * k + 1])
        factor = round(rng.uniform(0.4, 0.8), 3)
        faults.append(fault_of(kind, a, b, factor, sorted(rng.sample(range(GPUS), 2))))
    return {"nodes": nodes, "gpus_per_node": GPUS, "gpu": "H100-SXM", "noise": noise,
            "seed": rng.randrange(1 << 30), "faults": faults}


def matches(fault: dict[str, Any], f: dict[str, Any]) -> bool:
    """Found and localized: the right kind on the right node, GPU pair, GPU or node pair."""
    kind = fault["kind"]
    want = {"nvlink": "nvlink_degraded", "nic": "nic_degraded", "net_path": "net_path_degraded",
            "hang": "hang", "corrupt": "data_corruption", "pcie_only": "topology_mismatch",
            "error": "probe_error"}[kind]
    if f["kind"] != want:
        return False
    if kind == "net_path":
        return f.get("nodes") == sorted(fault["nodes"])
    if f.get("node") != fault["node"]:
        return False
    if kind in ("nvlink", "pcie_only"):
        return f.get("gpus") == sorted(fault["gpus"])
    if kind in ("hang", "corrupt", "error"):
        return f.get("gpu") == fault["gpu"]
    return True


def faulty_nodes(scenario: dict[str, Any]) -> set[str]:
    return {f["node"] for f in scenario["faults"] if f["kind"] != "net_path"}


def score(scenario: dict[str, Any], verdict: dict[str, Any], t: Tally) -> None:
    t.scenarios += 1
    t.rounds.append(verdict["rounds"])
    t.fabric_s.append(verdict["duration_s"])
    ok = True
    for fault in scenario["faults"]:
        hit = any(matches(fault, f) for f in verdict["findings"])
        if fault.get("factor", 0.0) <= TARGET_FACTOR:
            t.total[fault["kind"]] += 1
            t.found[fault["kind"]] += hit
            ok = ok and hit
        else:
            t.weak_total += 1
            t.weak_found += hit
    t.scenarios_ok += ok
    t.false_excluded_nodes += len(set(verdict["exclude"]) - faulty_nodes(scenario))
    t.false_findings += sum(not any(matches(x, f) for x in scenario["faults"])
                            for f in verdict["findings"])


def node_count(rng: random.Random) -> int:
    # Log-uniform over 16..1024: small and large fleets alike.
    return int(round(2 ** rng.uniform(4, 10)))


def detection(n: int, rng: random.Random, noise: float) -> Tally:
    t = Tally()
    for _ in range(n):
        sc = random_scenario(rng, node_count(rng), rng.randint(0, 5), noise)
        score(sc, run_check(SimBackend(sc), None).verdict(), t)
    return t


def fault_free(n: int, rng: random.Random, noise: float) -> Tally:
    t = Tally()
    for _ in range(n):
        sc = random_scenario(rng, node_count(rng), 0, noise)
        score(sc, run_check(SimBackend(sc), None).verdict(), t)
    return t


def timing(nodes: int, faults: int, rng: random.Random, noise: float) -> tuple[float, float, int]:
    sc = random_scenario(rng, nodes, faults, noise)
    started = time.perf_counter()
    v = run_check(SimBackend(sc), None).verdict()
    return v["duration_s"], time.perf_counter() - started, v["rounds"]


def pct(a: int, b: int) -> str:
    return f"{100.0 * a / b:6.2f} % ({a}/{b})" if b else "   n/a"


def report(t: Tally, clean: Tally, times: list[tuple[int, int, float, float, int]]) -> None:
    print("\nrecall (faults with factor <= 0.75, hang, corrupt, pcie_only)")
    for kind in FAULT_KINDS:
        print(f"  {kind:<10} {pct(t.found[kind], t.total[kind])}")
    print(f"  {'all':<10} {pct(sum(t.found.values()), sum(t.total.values()))}")
    print(f"  weaker faults (0.75 < factor <= 0.8): {pct(t.weak_found, t.weak_total)}")
    print(f"  scenarios with every target fault found: {pct(t.scenarios_ok, t.scenarios)}")
    print(f"  healthy nodes excluded in faulty scenarios: {t.false_excluded_nodes}")
    print(f"  findings matching no fault in faulty scenarios: {t.false_findings}")
    print(f"  rounds per scenario: mean {statistics.mean(t.rounds):.1f}, max {max(t.rounds)}; "
          f"fabric s: mean {statistics.mean(t.fabric_s):.2f}, max {max(t.fabric_s):.2f}")
    print(f"\nfault-free scenarios: {clean.scenarios}")
    print(f"  healthy nodes excluded: {clean.false_excluded_nodes}")
    print(f"  findings of any kind:   {clean.false_findings}")
    print("\npreflight time (8 GPUs per node)")
    print(f"  {'nodes':>6} {'faults':>6} {'rounds':>6} {'fabric_s':>9} {'wall_s':>7}")
    for nodes, faults, fabric, wall, rounds in times:
        print(f"  {nodes:>6} {faults:>6} {rounds:>6} {fabric:>9.2f} {wall:>7.2f}")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.detection", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="40 + 20 scenarios instead of 200 + 100")
    p.add_argument("--seed", type=int, default=2024)
    p.add_argument("--noise", type=float, default=0.03)
    args = p.parse_args(argv)
    rng = random.Random(args.seed)
    started = time.perf_counter()
    n_faulty, n_clean = (40, 20) if args.quick else (200, 100)
    t = detection(n_faulty, rng, args.noise)
    clean = fault_free(n_clean, rng, args.noise)
    times = []
    for nodes in (64, 256, 1024):
        for faults in (0, 5):
            fabric, wall, rounds = timing(nodes, faults, rng, args.noise)
            times.append((nodes, faults, fabric, wall, rounds))
    report(t, clean, times)
    print(f"\nbenchmark wall time {time.perf_counter() - started:.1f} s")
    target_met = (t.scenarios_ok >= 0.99 * t.scenarios and clean.false_excluded_nodes == 0)
    print("targets met" if target_met else "targets NOT met")
    return 0


if __name__ == "__main__":
    sys.exit(main())
