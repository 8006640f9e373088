"""Node-pair coverage over a modeled week at 1024 nodes, driving the real rotation code: the
fleet's seats (agents.matchings.reconcile_slots, what the API keeps per fleet) and the
matching a cycle probes (services.check.planner.rotation_matching).

Each cycle probes one matching of the round-robin tournament: every pair of N nodes meets
once in N - 1 cycles (about 3.5 days at 1024 nodes and the default 300 s interval). Printed:
the share of node pairs met at least once in 7 days of 288 cycles,
- continuous running, the place kept by the fleet;
- a restart every 24 h with 2 % of the nodes leaving and as many joining each day, the
  place kept by the fleet (the scheduler's now);
- the same restarts with the place kept in a local file named by the node set (before:
  a changed node set started again at position 0), for comparison.
The share counts pairs of nodes present all week (a node that joins on day 6 cannot meet
everyone); the rotation's matching only, not the re-pairs a check adds.

    python -m bench.run rotation_coverage
"""

from __future__ import annotations

import random
import time

from ringwatch.agents.matchings import circle_matching, reconcile_slots
from ringwatch.services.check.planner import rotation_matching

NODES = 1024
DAYS = 7
CYCLES_PER_DAY = 288  # the default 300 s interval
CHURN = 0.02


def fleet_days(rng: random.Random, churn: float) -> list[list[str]]:
    """The node set of each day: ``churn`` of the nodes leave and as many new ones join."""
    nodes = [f"node-{i:04d}" for i in range(NODES)]
    days, fresh = [], NODES
    for _ in range(DAYS):
        days.append(list(nodes))
        gone = set(rng.sample(nodes, round(len(nodes) * churn)))
        nodes = [n for n in nodes if n not in gone]
        nodes += [f"node-{fresh + i:04d}" for i in range(len(gone))]
        fresh += len(gone)
    return days


def kept_by_fleet(days: list[list[str]]) -> set[frozenset[str]]:
    """The scheduler's way: the cycle number and the seats live with the fleet, so a restart
    or a changed node set goes on from the same place."""
    met: set[frozenset[str]] = set()
    slots: list[str | None] = []
    cycle = 0
    for nodes in days:
        for _ in range(CYCLES_PER_DAY):
            slots, _ = reconcile_slots(slots, nodes)
            met.update(frozenset(p) for p in rotation_matching(nodes, cycle, slots))
            cycle += 1
    return met


def kept_in_a_file(days: list[list[str]]) -> set[frozenset[str]]:
    """Before: the place in a file named by the node set, so a restart on a changed node set
    starts again at position 0 over the sorted nodes."""
    met: set[frozenset[str]] = set()
    for nodes in days:
        ordered = sorted(nodes)
        for k in range(CYCLES_PER_DAY):
            met.update(frozenset(p) for p in circle_matching(ordered, k))
    return met


def coverage(met: set[frozenset[str]], days: list[list[str]]) -> tuple[float, int]:
    always = set(days[0]).intersection(*days[1:])
    ordered = sorted(always)
    total = len(ordered) * (len(ordered) - 1) // 2
    hit = sum(1 for p in met if p <= always)
    return hit / total, total


def main(flags: list[str]) -> None:
    rng = random.Random(7)
    steady = fleet_days(rng, 0.0)
    churned = fleet_days(rng, CHURN)
    print(f"{NODES} nodes, {DAYS} days of {CYCLES_PER_DAY} cycles (a tournament is "
          f"{NODES - 1} cycles): node pairs met at least once")
    for label, days, run in (
            ("continuous, place kept by the fleet", steady, kept_by_fleet),
            (f"restart every 24 h, {CHURN:.0%} churn a day, place kept by the fleet", churned,
             kept_by_fleet),
            (f"restart every 24 h, {CHURN:.0%} churn a day, place in a local file (before)",
             churned, kept_in_a_file)):
        t0 = time.perf_counter()
        share, total = coverage(run(days), days)
        print(f"  {label:<72} {share:7.2%} of {total:,} pairs  ({time.perf_counter() - t0:.1f} s)")
