"""Scenario sets: preflights on sim fleets no test or other benchmark uses, scored fault by fault.

Each set is drawn from its own seed: fleets of 64-2048 x 8 GPUs, measurement noise of
1-8 %, between-link variation of 2-5 %, up to 8 places at fault a fleet, of every kind the sim
models, weak (15-25 % loss) and strong (25-60 %) alike, node-pair paths losing 15-20 %,
a counter or transport cause on a node whose bandwidth is also slow, fleets whose whole
network or NVLink falls short of the hardware model, and fault-free fleets at 6-8 % noise.
Every fleet is one ``run_check`` at default settings, as ``ringwatch preflight --fabric``
runs it (a fleet with a fallback fault through the ``ddp`` profile's job phase, which is
what finds one). Printed (docs/analysis.md, "Scenario sets"):

- recall over faults losing at least 15 % (every kind without a loss counts), and over
  node-pair paths losing 15-20 %;
- exact kind and place; a cause read beside a slowdown carrying the slow figure;
- healthy nodes excluded, findings that match no fault (none may be in a fault-free fleet);
- checks that end ``complete: true``, the modeled fabric time (median, max, max at
  1024 x 8 and below), and each check's CPU seconds, the slowest named.

    python -m bench.run scenario_sets            # 3 sets of 54
    python -m bench.run scenario_sets --quick    # 1 set of 54
    python -m bench.scenario_sets --set 7 --only 12   # one fleet, its misses and strays

Nothing is asserted.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import random
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from bench.detection import FALLBACK_PROFILE, GPUS, fallback_nodes, fault_of, found, matches
from ringwatch.agents.sim import SimBackend, node_name
from ringwatch.services.check import run_check
from ringwatch.services.check.workload import NAMED_BY

SETS = (5301, 5302, 5303)
FLEETS = 54
# Of each set: fault-free fleets at high noise, and fleets that fall short as a whole.
CLEAN = 7
SHORTFALL = 4
# Every kind the sim models; the loss kinds drawn twice as often (their losses vary).
LOSS_KINDS = ("nvlink", "nic", "net_path")
OTHER_KINDS = ("hang", "corrupt", "pcie_only", "error", "transport", "nic_errors", "fallback")
# A cause read on a node (its NIC counters, its transport) beside a slowdown of its NIC.
CAUSE_KINDS = ("nic_errors", "transport")
# The recall target's losses, and the weak band of node-pair paths.
TARGET_LOSS = 0.15
WEAK_PATH = (0.15, 0.20)
# The sizes the fabric-time target applies to.
FABRIC_TIME_NODES = 1024


def log_uniform_nodes(rng: random.Random, lo: int = 64, hi: int = 2048) -> int:
    return int(round(2 ** rng.uniform(*(x.bit_length() - 1 for x in (lo, hi)))))


def fleet(rng: random.Random, i: int) -> dict[str, Any]:
    """The ``i``-th fleet of a set: the first ``CLEAN`` fault-free at 6-8 % noise, the next
    ``SHORTFALL`` short of the hardware model as a whole, the rest with 1-8 faults."""
    nodes = log_uniform_nodes(rng)
    noise = round(rng.uniform(0.06, 0.08) if i < CLEAN else rng.uniform(0.01, 0.08), 4)
    sc: dict[str, Any] = {"nodes": nodes, "gpus_per_node": GPUS, "gpu": "H100-SXM",
                          "noise": noise, "variation": round(rng.uniform(0.02, 0.05), 3),
                          "seed": rng.randrange(1 << 30), "faults": []}
    if i < CLEAN:
        return sc
    if i < CLEAN + SHORTFALL:
        # The whole network (or NVLink) at 55-80 % of the model: one finding, not a fault
        # per node; a few faults beside it must still be told apart.
        if rng.random() < 0.5:
            sc["net_gbs"] = round(48.0 * rng.uniform(0.55, 0.8), 1)
        else:
            sc["nvlink_gbs"] = round(360.0 * rng.uniform(0.55, 0.8), 1)
        sc["faults"] = faults(rng, nodes, rng.randint(0, 3), kinds=("hang", "corrupt", "error"))
        return sc
    sc["faults"] = faults(rng, nodes, rng.randint(1, 8))
    return sc


def faults(rng: random.Random, nodes: int, n: int,
           kinds: Sequence[str] | None = None) -> list[dict[str, Any]]:
    picked = rng.sample(range(nodes), min(nodes, 2 * n))
    out: list[dict[str, Any]] = []
    for k in range(min(n, len(picked) // 2)):
        a, b = node_name(picked[2 * k]), node_name(picked[2 * k + 1])
        gpus = sorted(rng.sample(range(GPUS), 2))
        draw = rng.random()
        if kinds is not None:
            kind = rng.choice(kinds)
        elif draw < 0.12:
            # A node-pair path in the weak band, where a union holding it hides it best.
            out.append(fault_of("net_path", a, b, round(1 - rng.uniform(*WEAK_PATH), 3), gpus))
            continue
        elif draw < 0.22:
            # A cause the agents read, and the slowdown it brings, on one node.
            if rng.random() < 0.5:
                out.append(fault_of("nic_errors", a, b, 1.0, gpus, rng))
            else:  # the node's network over sockets: a transport its NIC's slowdown shows
                out.append({"kind": "transport", "node": a, "transport": "socket"})
            out.append(fault_of("nic", a, b, round(1 - rng.uniform(0.15, 0.5), 3), gpus))
            continue
        elif draw < 0.62:
            kind = rng.choice(LOSS_KINDS)
        else:
            kind = rng.choice(OTHER_KINDS)
        if kind == "fallback" and any(f["kind"] == "fallback" for f in out):
            kind = "hang"
        loss = rng.uniform(0.15, 0.25) if rng.random() < 0.5 else rng.uniform(0.25, 0.6)
        out.append(fault_of(kind, a, b, round(1 - loss, 3), gpus, rng))
    return out


def scenario_set(seed: int, n: int = FLEETS) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return [fleet(rng, i) for i in range(n)]


# ---- scoring ----------------------------------------------------------------------------


def loss_of(fault: dict[str, Any]) -> float | None:
    return 1.0 - fault["factor"] if "factor" in fault and fault["kind"] != "fallback" else None


def place_nodes(fault: dict[str, Any]) -> set[str]:
    return set(fault["nodes"]) if fault["kind"] == "net_path" else {fault["node"]}


def faulty_nodes(sc: dict[str, Any]) -> set[str]:
    """The nodes a verdict may exclude: every fault's but a path's two ends."""
    return {f["node"] for f in sc["faults"] if f["kind"] != "net_path"}


def finding_nodes(f: dict[str, Any]) -> set[str]:
    return set(f.get("nodes") or ([f["node"]] if f.get("node") else []))


def colocated_cause(fault: dict[str, Any], sc: dict[str, Any]) -> dict[str, Any] | None:
    """The cause read on a NIC slowdown's node, where the set put one beside it."""
    if fault["kind"] != "nic":
        return None
    return next((c for c in sc["faults"] if c["kind"] in CAUSE_KINDS
                 and c.get("node") == fault["node"] and not c.get("gpus")), None)


def cause_carries(cause: dict[str, Any], findings: list[dict[str, Any]]) -> bool:
    """The cause's own finding on the node, carrying the slow figure it explains."""
    return any(matches(cause, f) and f.get("measured_gbs") is not None
               and f.get("expected_gbs") and f["measured_gbs"] < f["expected_gbs"]
               for f in findings)


def exact(fault: dict[str, Any], sc: dict[str, Any], verdict: dict[str, Any]) -> bool:
    """Right kind at the right place (``bench.detection.matches``; a fallback by its job
    phase). A NIC slowdown beside a cause read on its node: the cause's finding with the
    slow figure beside it, or its own finding."""
    findings = verdict["findings"]
    if fault["kind"] == "fallback":
        return found(fault, verdict)
    cause = colocated_cause(fault, sc)
    if cause is not None and cause_carries(cause, findings):
        return True
    return any(matches(fault, f) for f in findings)


def seen(fault: dict[str, Any], sc: dict[str, Any], verdict: dict[str, Any]) -> bool:
    """Found: exactly, or by a finding at its place (a node's, or a path's two ends)."""
    if exact(fault, sc, verdict):
        return True
    where = place_nodes(fault)
    return any(where <= finding_nodes(f) if fault["kind"] == "net_path"
               else where & finding_nodes(f) for f in verdict["findings"])


def stray(f: dict[str, Any], sc: dict[str, Any]) -> bool:
    """A finding at no fault's place: not the shortfall of a short fleet, not on a fault's
    node, nor a path between a fault's nodes."""
    if f["kind"] == "fabric_below_rated":
        return not ("net_gbs" in sc or "nvlink_gbs" in sc)
    nodes = finding_nodes(f)
    if not nodes:
        return True
    touched = set().union(*(place_nodes(x) for x in sc["faults"])) if sc["faults"] else set()
    if f["kind"] == "net_path_degraded":
        return not any(nodes == place_nodes(x) for x in sc["faults"]) and not nodes & faulty_nodes(sc)
    return not nodes & touched


@dataclass
class Result:
    """One fleet's check, scored."""

    index: int
    nodes: int
    noise: float
    n_faults: int
    rounds: int
    fabric_s: float
    cpu_s: float
    wall_s: float
    peak_mb: float
    complete: bool
    undecided: int
    stopped_by: str | None
    # Per fault: kind, loss (None: a kind without one), seen, exact, place.
    faults: list[tuple[str, float | None, bool, bool, str]] = field(default_factory=list)
    # Colocated cause and slowdown: how many, and how many carried both.
    both: int = 0
    both_ok: int = 0
    false_excluded: list[str] = field(default_factory=list)
    strays: list[str] = field(default_factory=list)
    clean: bool = False
    shortfall: bool = False
    healthy_nodes: int = 0
    workload_repeats: int = 0


def describe(fault: dict[str, Any]) -> str:
    place = ",".join(sorted(place_nodes(fault)))
    extra = fault.get("gpus") or fault.get("gpu")
    return f"{place}" + (f" gpus {extra}" if extra is not None else "")


def one(args: tuple[int, dict[str, Any]]) -> Result:
    """One fleet's preflight (run in a worker process: CPU seconds are the check's own)."""
    import resource

    i, sc = args
    profile = FALLBACK_PROFILE if fallback_nodes(sc) else None
    cpu0, wall0 = time.process_time(), time.perf_counter()
    v = run_check(SimBackend(sc), None, profile=profile).verdict()
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    r = Result(i, sc["nodes"], sc["noise"], len(sc["faults"]), v["rounds"], v["duration_s"],
               cpu, wall, peak, bool(v.get("complete")), int(v.get("undecided", 0)),
               v.get("stopped_by"), clean=not sc["faults"] and "net_gbs" not in sc
               and "nvlink_gbs" not in sc, shortfall="net_gbs" in sc or "nvlink_gbs" in sc)
    for fault in sc["faults"]:
        ok = exact(fault, sc, v)
        r.faults.append((fault["kind"], loss_of(fault), ok or seen(fault, sc, v), ok,
                         describe(fault)))
        cause = colocated_cause(fault, sc)
        if cause is not None:
            r.both += 1
            r.both_ok += cause_carries(cause, v["findings"]) and any(
                matches(cause, f) for f in v["findings"])
    r.healthy_nodes = sc["nodes"] - len(faulty_nodes(sc))
    r.false_excluded = sorted(set(v["exclude"]) - faulty_nodes(sc))
    slowed = fallback_nodes(sc)
    r.strays = [f"{f['kind']} {','.join(sorted(finding_nodes(f)))}"
                + (f" gpus {f['gpus']}" if f.get("gpus") else "")
                for f in v["findings"] if stray(f, sc) and not finding_nodes(f) & slowed]
    r.workload_repeats = _repeats(v)
    return r


def _repeats(v: dict[str, Any]) -> int:
    """Findings a verdict lists more than once: the same kind and place, and for a workload
    finding the same communicator, op, size and algorithm (``workload.NAMED_BY``)."""
    seen_: set[tuple[Any, ...]] = set()
    repeats = 0
    for f in v["findings"] + list((v.get("workload") or {}).get("findings", [])):
        key = (f["kind"], f.get("node"), tuple(f.get("nodes") or ()), tuple(f.get("gpus") or ()),
               f.get("gpu"), *(str(f.get(k)) for k in NAMED_BY))
        repeats += key in seen_
        seen_.add(key)
    return repeats


# ---- the report -------------------------------------------------------------------------


def share(a: int, b: int) -> str:
    return f"{a / b:.3f} ({a}/{b})" if b else "n/a"


def report(name: str, results: list[Result]) -> dict[str, float]:
    eligible = [(k, loss, s, e) for r in results for k, loss, s, e, _ in r.faults
                if loss is None or loss >= TARGET_LOSS - 1e-9]
    weak_paths = [(s, e) for r in results for k, loss, s, e, _ in r.faults
                  if k == "net_path" and loss is not None
                  and WEAK_PATH[0] - 1e-9 <= loss <= WEAK_PATH[1] + 1e-9]
    everything = [(s, e) for r in results for _, _, s, e, _ in r.faults]
    recall = sum(s for _, _, s, _ in eligible)
    exact_n = sum(e for _, e in everything)
    clean = [r for r in results if r.clean]
    complete = sum(r.complete for r in results)
    fabric = [r.fabric_s for r in results]
    upto = [r.fabric_s for r in results if r.nodes <= FABRIC_TIME_NODES]
    slowest = max(results, key=lambda r: r.cpu_s)
    healthy = sum(r.healthy_nodes for r in results)
    print(f"\n{name}: {len(results)} fleets, {sum(r.n_faults for r in results)} faults, "
          f"{len(clean)} fault-free at 6-8 % noise, {sum(r.shortfall for r in results)} short "
          "of the model")
    print(f"  recall, loss >= 15 % (and kinds without a loss): "
          f"{share(recall, len(eligible))}")
    print(f"  recall, node-pair paths losing 15-20 %:          "
          f"{share(sum(s for s, _ in weak_paths), len(weak_paths))}")
    print(f"  exact kind and place, every fault:                {share(exact_n, len(everything))}")
    print(f"  cause read beside a slowdown, both carried:       "
          f"{share(sum(r.both_ok for r in results), sum(r.both for r in results))}")
    print(f"  healthy nodes excluded:                           "
          f"{sum(len(r.false_excluded) for r in results)} of {healthy}")
    print(f"  findings matching no fault:                       "
          f"{sum(len(r.strays) for r in results)} (in fault-free fleets: "
          f"{sum(len(r.strays) for r in clean)})")
    print(f"  fault-free fleets left clean:                     "
          f"{sum(not r.strays for r in clean)} of {len(clean)}")
    print(f"  findings listed more than once:                   "
          f"{sum(r.workload_repeats for r in results)}")
    print(f"  checks complete: {share(complete, len(results))}; budget stops: "
          f"{sum(r.stopped_by is not None for r in results)}; undecided groups: median "
          f"{statistics.median(r.undecided for r in results):g}, max "
          f"{max(r.undecided for r in results)}")
    print(f"  rounds: median {statistics.median(r.rounds for r in results):g}, max "
          f"{max(r.rounds for r in results)}")
    print(f"  modeled fabric s: median {statistics.median(fabric):.1f}, max {max(fabric):.1f}; "
          f"at <= {FABRIC_TIME_NODES} x 8: max {max(upto, default=0.0):.1f}, over 30 s: "
          f"{sum(x > 30 for x in upto)}")
    print(f"  CPU s per check: median {statistics.median(r.cpu_s for r in results):.2f}; "
          f"slowest {slowest.cpu_s:.2f} (#{slowest.index}, {slowest.nodes} x 8, noise "
          f"{slowest.noise:.3f}, {slowest.n_faults} faults, {slowest.rounds} rounds)")
    return {"recall": recall / max(len(eligible), 1),
            "exact": exact_n / max(len(everything), 1),
            "false_excluded": sum(len(r.false_excluded) for r in results),
            "strays": sum(len(r.strays) for r in results),
            "complete": complete / len(results)}


def print_fleet(r: Result) -> None:
    flags = [] if r.complete else [f"incomplete ({r.undecided} undecided"
                                   + (f", {r.stopped_by}" if r.stopped_by else "") + ")"]
    print(f"  #{r.index:<2} {r.nodes:>4} x 8, noise {r.noise:.3f}, {r.n_faults} fault(s): "
          f"{r.rounds} rounds, fabric {r.fabric_s:.1f} s, {r.cpu_s:.1f} CPU-s "
          + " ".join(flags), flush=True)
    for kind, loss, s, e, where in r.faults:
        if not e:
            lost = f", loss {loss:.1%}" if loss is not None else ""
            print(f"      {'inexact' if s else 'missed'} {kind} {where}{lost}")
    for x in r.strays:
        print(f"      stray {x}")
    for n in r.false_excluded:
        print(f"      healthy node excluded {n}")


def run_set(seed: int, n: int, only: Sequence[int] | None, workers: int) -> list[Result]:
    fleets = scenario_set(seed, n)
    todo = [(i, sc) for i, sc in enumerate(fleets) if only is None or i in only]
    # Largest first: two workers finish together.
    todo.sort(key=lambda x: -x[1]["nodes"])
    results: list[Result] = []
    if workers <= 1:
        for item in todo:
            results.append(one(item))
            print_fleet(results[-1])
    else:
        ctx = multiprocessing.get_context("spawn")
        with ctx.Pool(workers, maxtasksperchild=1) as pool:
            for r in pool.imap_unordered(one, todo):
                results.append(r)
                print_fleet(r)
    return sorted(results, key=lambda r: r.index)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.scenario_sets", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="the first set only")
    p.add_argument("--set", type=int, action="append", help="a set's seed (repeatable)")
    p.add_argument("--only", type=int, action="append", help="one fleet of the set (repeatable)")
    p.add_argument("--fleets", type=int, default=FLEETS)
    p.add_argument("--max-nodes", type=int, help="only the set's fleets of at most this many nodes")
    p.add_argument("--workers", type=int, default=min(2, os.cpu_count() or 1))
    args = p.parse_args(argv)
    seeds = args.set or (SETS[:1] if args.quick else SETS)
    started = time.perf_counter()
    everything: list[Result] = []
    for seed in seeds:
        print(f"\nset {seed}, per fleet (missed or inexact: kind, place, loss; strays)")
        only = args.only
        if args.max_nodes:
            only = [i for i, sc in enumerate(scenario_set(seed, args.fleets))
                    if sc["nodes"] <= args.max_nodes and (only is None or i in only)]
        results = run_set(seed, args.fleets, only, args.workers)
        report(f"set {seed}", results)
        everything += results
    if len(seeds) > 1:
        report("all sets", everything)
    print(f"\nbenchmark wall time {time.perf_counter() - started:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
