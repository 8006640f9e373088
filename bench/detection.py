"""Detection benchmark: random sim scenarios through preflight; recall, false exclusions, time.

``python -m bench.detection [--quick] [--seed N]`` prints a table of figures. Every fault
kind the sim models is drawn (agents.sim.FAULT_KINDS). Faults sit on distinct nodes: a node
already excluded for one fault is not probed further, so a second fault on it could never
be told apart (docs/analysis.md, "Detection benchmark").
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

from ringwatch.agents.nic_counters import THRESHOLDS
from ringwatch.agents.sim import FAULT_KINDS, NET_FALLBACKS, PAIR_FALLBACKS, SimBackend, node_name
from ringwatch.services.check import run_check

# The recall target applies to faults at least this strong (factor at most this).
TARGET_FACTOR = 0.75
GPUS = 8

# A fallback slows one op under one algorithm: a workload profile's to find (its job phase,
# bench.workloads), not the fabric check's, which sees busbw alone and may blame the node's
# links for it. A scenario with a fallback is checked with this profile, and the fallback is
# found when the workload section names its node. That section names the job's slowest
# communicator of each kind, op and size, so a scenario holds one fallback at most: a second
# could never be told apart.
FALLBACK_PROFILE = "ddp"
# The finding each kind is found as.
FOUND_AS = {"nvlink": "nvlink_degraded", "nic": "nic_degraded", "net_path": "net_path_degraded",
            "hang": "hang", "corrupt": "data_corruption", "pcie_only": "topology_mismatch",
            "error": "probe_error", "transport": "transport_fallback",
            "nic_errors": "nic_errors", "fallback": "communicator_slow"}
# The InfiniBand counters a nic_errors fault may raise (those agents.sim accepts), each by
# five times its threshold a cycle; a counter judged by its error rate at the port's speed
# (symbol_error) by 500, past the rate a 400 Gb/s port allows.
NIC_RISE = {t.counter: 500 if t.ber else 5 * t.min_delta
            for t in THRESHOLDS if "ib" in t.kinds}


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


def fault_of(kind: str, a: str, b: str, factor: float, gpus: list[int],
             rng: random.Random | None = None) -> dict[str, Any]:
    """A scenario fault of ``kind`` on node ``a`` (a path: ``a`` to ``b``), two GPUs where
    it needs them; ``rng`` picks a transport's scope and a counter (None: the first)."""
    def pick(options: Sequence[Any]) -> Any:
        return options[0] if rng is None else rng.choice(options)

    if kind == "transport":
        if pick([False, True]):
            return {"kind": "transport", "node": a, "gpus": gpus,
                    "transport": pick(sorted(PAIR_FALLBACKS))}
        return {"kind": "transport", "node": a, "transport": pick(sorted(NET_FALLBACKS))}
    if kind == "nic_errors":
        counter = pick(sorted(NIC_RISE))
        return {"kind": "nic_errors", "node": a, "counter": counter,
                "per_cycle": NIC_RISE[counter]}
    by_kind: dict[str, dict[str, Any]] = {
        "nvlink": {"kind": "nvlink", "node": a, "gpus": gpus, "factor": factor},
        "nic": {"kind": "nic", "node": a, "factor": factor},
        "net_path": {"kind": "net_path", "nodes": sorted([a, b]), "factor": factor},
        "hang": {"kind": "hang", "node": a, "gpu": gpus[0]},
        "corrupt": {"kind": "corrupt", "node": a, "gpu": gpus[0]},
        "error": {"kind": "error", "node": a, "gpu": gpus[0]},
        "pcie_only": {"kind": "pcie_only", "node": a, "gpus": gpus},
        "fallback": {"kind": "fallback", "node": a, "op": "allreduce", "factor": factor},
    }
    return by_kind[kind]


def random_scenario(rng: random.Random, nodes: int, n_faults: int, noise: float,
                    kinds: Sequence[str] = FAULT_KINDS) -> dict[str, Any]:
    picked = rng.sample(range(nodes), min(nodes, 2 * n_faults))
    faults: list[dict[str, Any]] = []
    for k in range(n_faults):
        if 2 * k + 1 >= len(picked):
            break
        kind = rng.choice(kinds)
        if kind == "fallback" and any(f["kind"] == "fallback" for f in faults):
            kind = rng.choice([k for k in kinds if k != "fallback"])
        a, b = node_name(picked[2 * k]), node_name(picked[2 * k + 1])
        factor = round(rng.uniform(0.4, 0.8), 3)
        faults.append(fault_of(kind, a, b, factor, sorted(rng.sample(range(GPUS), 2)), rng))
    return {"nodes": nodes, "gpus_per_node": GPUS, "gpu": "H100-SXM", "noise": noise,
            "seed": rng.randrange(1 << 30), "faults": faults}


def matches(fault: dict[str, Any], f: dict[str, Any]) -> bool:
    """Found and localized: the right kind on the right node, GPU pair, GPU or node pair;
    a transport fallback over the right scope, NIC errors on the right counter. A fallback
    is found by a workload section (``found``), never by a fabric finding."""
    kind = fault["kind"]
    if kind == "fallback" or f["kind"] != FOUND_AS[kind]:
        return False
    if kind == "net_path":
        # As sets: a verdict lists nodes in node order (node-259 before node-1136).
        return set(f.get("nodes") or ()) == set(fault["nodes"])
    if f.get("node") != fault["node"]:
        return False
    if kind in ("nvlink", "pcie_only"):
        return f.get("gpus") == sorted(fault["gpus"])
    if kind in ("hang", "corrupt", "error"):
        return f.get("gpu") == fault["gpu"]
    if kind == "transport":
        return sorted(f.get("gpus") or []) == sorted(fault.get("gpus") or [])
    if kind == "nic_errors":
        return f.get("counter") == fault["counter"]
    return True


def found(fault: dict[str, Any], verdict: dict[str, Any]) -> bool:
    """Whether the check found ``fault``: a fallback when the workload section names its
    node, any other kind when a fabric finding localizes it."""
    if fault["kind"] == "fallback":
        workload = verdict.get("workload") or {}
        return any(f["kind"] == FOUND_AS["fallback"]
                   and fault["node"] in (f.get("nodes") or [f.get("node")])
                   for f in workload.get("findings", []))
    return any(matches(fault, f) for f in verdict["findings"])


def fallback_nodes(scenario: dict[str, Any]) -> set[str]:
    return {f["node"] for f in scenario["faults"] if f["kind"] == "fallback"}


def check(scenario: dict[str, Any]) -> dict[str, Any]:
    """One preflight of ``scenario``'s fleet at default settings; with the workload profile
    where a fallback is there to find."""
    profile = FALLBACK_PROFILE if fallback_nodes(scenario) else None
    return run_check(SimBackend(scenario), None, profile=profile).verdict()


def faulty_nodes(scenario: dict[str, Any]) -> set[str]:
    return {f["node"] for f in scenario["faults"] if f["kind"] != "net_path"}


def score(scenario: dict[str, Any], verdict: dict[str, Any], t: Tally) -> None:
    t.scenarios += 1
    t.rounds.append(verdict["rounds"])
    t.fabric_s.append(verdict["duration_s"])
    ok = True
    for fault in scenario["faults"]:
        hit = found(fault, verdict)
        if fault.get("factor", 0.0) <= TARGET_FACTOR:
            t.total[fault["kind"]] += 1
            t.found[fault["kind"]] += hit
            ok = ok and hit
        else:
            t.weak_total += 1
            t.weak_found += hit
    t.scenarios_ok += ok
    t.false_excluded_nodes += len(set(verdict["exclude"]) - faulty_nodes(scenario))
    # A fabric finding on a fallback's node is the fallback seen as slow links: not false.
    slowed = fallback_nodes(scenario)
    t.false_findings += sum(not any(matches(x, f) for x in scenario["faults"])
                            and f.get("node") not in slowed for f in verdict["findings"])


def node_count(rng: random.Random) -> int:
    # Log-uniform over 16..1024: small and large fleets alike.
    return int(round(2 ** rng.uniform(4, 10)))


def detection(n: int, rng: random.Random, noise: float) -> Tally:
    t = Tally()
    for _ in range(n):
        sc = random_scenario(rng, node_count(rng), rng.randint(0, 5), noise)
        score(sc, check(sc), t)
    return t


def fault_free(n: int, rng: random.Random, noise: float) -> Tally:
    t = Tally()
    for _ in range(n):
        sc = random_scenario(rng, node_count(rng), 0, noise)
        score(sc, check(sc), t)
    return t


def timing(nodes: int, faults: int, rng: random.Random, noise: float) -> tuple[float, float, int]:
    """The fabric check alone: a fallback's job phase would time the profile, not the check."""
    sc = random_scenario(rng, nodes, faults, noise,
                         kinds=[k for k in FAULT_KINDS if k != "fallback"])
    started = time.perf_counter()
    v = run_check(SimBackend(sc), None).verdict()
    return v["duration_s"], time.perf_counter() - started, v["rounds"]


def pct(a: int, b: int) -> str:
    return f"{100.0 * a / b:6.2f} % ({a}/{b})" if b else "   n/a"


def report(t: Tally, clean: Tally, times: list[tuple[int, int, float, float, int]]) -> None:
    print("\nrecall (faults with factor <= 0.75, and every kind without a factor; fallback "
          f"through the {FALLBACK_PROFILE} profile's job phase)")
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
