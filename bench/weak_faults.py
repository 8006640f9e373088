"""Weak faults in noisy, uneven fleets: the regime where a fixed ratio fails.

Random sim scenarios of 16-1024 nodes x 8 GPUs with bandwidth faults of 12-25 % loss (up
to 8 per scenario, every fifth scenario fault-free), measurement noise of 5-8 % and
per-link variation of 5 %, each through one ``run_check`` at default settings, as
``ringwatch preflight --fabric`` runs it. (Monitoring over cycles, through the real
scheduler process, API and Postgres, is ``bench.monitoring``.)

``--only small`` runs 25 more at 16-40 nodes (their own draw), where up to 8 faults make
a dense fleet.

Printed: recall by loss band, healthy nodes excluded, fault-free scenarios called healthy,
the modeled preflight time at 1024 x 8, and a recall curve by loss (10-50 %) and noise
(2-10 %). Then monitoring in the same regime, as it runs (``--only monitoring``): the real
``ringwatch scheduler --once`` per cycle on the sim, feeding the real API and Postgres,
faults beginning after the links have learned their own normal; per fault band, how many
opened an incident and after how many cycles, false incidents, and the stored preflight's
answer at the end. Nothing is asserted (docs/analysis.md, "Weak faults").

    python -m bench.run weak_faults            # 30 scenarios, full curve
    python -m bench.run weak_faults --quick    # 12 scenarios, a coarse curve
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from bench.detection import GPUS, fault_of, faulty_nodes, matches, node_count
from ringwatch.agents.sim import SimBackend, node_name
from ringwatch.agents.spec import Measurement
from ringwatch.services.analyzer.assess import Assessment
from ringwatch.services.analyzer.drift import drift_observations, step_drift
from ringwatch.services.analyzer.evidence import CusumPolicy, Weighing, weigh
from ringwatch.services.check import run_check

LOSS_KINDS = ("nvlink", "nic", "net_path")


@dataclass
class Tally:
    found: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    total: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    healthy_nodes: int = 0
    false_excluded: int = 0
    false_findings: int = 0
    clean: int = 0
    clean_healthy: int = 0
    fabric_s: list[float] = field(default_factory=list)
    wall_s: list[float] = field(default_factory=list)
    worst: list[tuple[int, int, str]] = field(default_factory=list)

    def recall(self, band: str) -> str:
        f, t = self.found[band], self.total[band]
        return f"{f / t:.3f} ({f}/{t})" if t else "n/a"


def band_of(loss: float) -> str:
    return ">=15%" if loss >= 0.15 - 1e-9 else "12-15%"


def scenario(rng: random.Random, nodes: int, n_faults: int, *, noise: float, variation: float,
             loss: tuple[float, float]) -> dict[str, Any]:
    picked = rng.sample(range(nodes), min(nodes, 2 * n_faults))
    faults = []
    for k in range(min(n_faults, len(picked) // 2)):
        a, b = node_name(picked[2 * k]), node_name(picked[2 * k + 1])
        factor = round(1.0 - rng.uniform(*loss), 3)
        faults.append(fault_of(rng.choice(LOSS_KINDS), a, b, factor,
                               sorted(rng.sample(range(GPUS), 2))))
    return {"nodes": nodes, "gpus_per_node": GPUS, "gpu": "H100-SXM", "noise": round(noise, 3),
            "variation": variation, "seed": rng.randrange(1 << 30), "faults": faults}


def score(sc: dict[str, Any], findings: list[dict[str, Any]], exclude: list[str],
          t: Tally) -> None:
    bad_nodes = faulty_nodes(sc)
    t.healthy_nodes += sc["nodes"] - len(bad_nodes)
    false = sorted(set(exclude) - bad_nodes)
    t.false_excluded += len(false)
    t.false_findings += sum(not any(matches(x, f) for x in sc["faults"]) for f in findings)
    if not sc["faults"]:
        t.clean += 1
        t.clean_healthy += not findings
    for fault in sc["faults"]:
        band = band_of(1.0 - fault["factor"])
        t.total[band] += 1
        t.found[band] += any(matches(fault, f) for f in findings)
    if false:
        t.worst.append((len(false), sc["nodes"], ",".join(false[:4])))


def regime(rng: random.Random, n: int) -> list[dict[str, Any]]:
    """``n`` scenarios of the issue's regime; every fifth fault-free."""
    out = []
    for i in range(n):
        faults = 0 if i % 5 == 4 else rng.randint(1, 8)
        out.append(scenario(rng, node_count(rng), faults, noise=rng.uniform(0.05, 0.08),
                            variation=0.05, loss=(0.12, 0.25)))
    return out


def small_fleets(rng: random.Random, n: int) -> list[dict[str, Any]]:
    """``n`` scenarios of the regime at 16-40 nodes, where up to 8 faults make a dense
    fleet: a few slow NICs there slow half its node pairs."""
    out = []
    for i in range(n):
        nodes = rng.randint(16, 40)
        faults = 0 if i % 5 == 4 else rng.randint(1, 8)
        out.append(scenario(rng, nodes, faults, noise=rng.uniform(0.05, 0.08),
                            variation=0.05, loss=(0.12, 0.25)))
    return out


def preflight(scenarios: list[dict[str, Any]]) -> Tally:
    """One check per scenario; each printed as it ends, with the faults it missed and the
    findings that match no fault."""
    t = Tally()
    print("\npreflight, per scenario (missed: kind, place, loss; false: kind, place)")
    for i, sc in enumerate(scenarios):
        started = time.perf_counter()
        v = run_check(SimBackend(sc), None).verdict()
        wall = time.perf_counter() - started
        t.wall_s.append(wall)
        t.fabric_s.append(v["duration_s"])
        score(sc, v["findings"], v["exclude"], t)
        print(f"  #{i:<2} {sc['nodes']:>4} nodes, noise {sc['noise']:.3f}, "
              f"{len(sc['faults'])} fault(s): {v['rounds']} rounds, fabric "
              f"{v['duration_s']:.1f} s, wall {wall:.0f} s", flush=True)
        print_misses(sc, v["findings"])
    return t


def print_misses(sc: dict[str, Any], findings: list[dict[str, Any]]) -> None:
    """The scenario's faults no finding names, and the findings that name no fault."""
    for f in sc["faults"]:
        if not any(matches(f, x) for x in findings):
            place = f.get("node") or ",".join(f.get("nodes", []))
            gpus = f" gpus {f['gpus']}" if f.get("gpus") else ""
            print(f"      missed {f['kind']} {place}{gpus}, loss {1 - f['factor']:.1%}")
    for x in findings:
        if not any(matches(f, x) for f in sc["faults"]):
            print(f"      false {x['kind']} {x.get('node') or ','.join(x.get('nodes', []))}")


def report(name: str, t: Tally) -> None:
    print(f"\n{name}")
    print(f"  recall, loss >= 15 %:       {t.recall('>=15%')}")
    print(f"  recall, loss 12-15 %:       {t.recall('12-15%')}")
    share = 100.0 * t.false_excluded / t.healthy_nodes if t.healthy_nodes else 0.0
    print(f"  healthy nodes excluded:     {t.false_excluded} of {t.healthy_nodes} ({share:.3f} %)")
    print(f"  findings matching no fault: {t.false_findings}")
    print(f"  fault-free scenarios healthy: {t.clean_healthy} of {t.clean}")
    print(f"  fabric s per check: mean {statistics.mean(t.fabric_s):.2f}, "
          f"max {max(t.fabric_s):.2f}; wall s mean {statistics.mean(t.wall_s):.2f}, "
          f"max {max(t.wall_s):.2f}")
    for count, nodes, which in sorted(t.worst, reverse=True)[:3]:
        print(f"    {count} healthy node(s) excluded of {nodes}: {which}")


def ceiling(lo: float, hi: float, variation: float, w: Weighing, steps: int = 200,
            terminal: bool = False) -> float:
    """The recall of faults of ``lo``-``hi`` loss that a check with unlimited repeats and an
    exact peers' centre would reach: the only uncertainty left is each link's lasting
    offset (uniform within +-``variation``, as the sim draws it), which the judgement weighs
    as a nuisance of ``w.variation_prior``. What no number of repeats can pass in a fresh
    check, at these settings. ``terminal``: a GPU pair's, decided on its last look
    (``evidence.weigh``)."""
    hits = 0
    for i in range(steps):
        loss = lo + (hi - lo) * (i + 0.5) / steps
        for j in range(steps):
            offset = -variation + 2 * variation * (j + 0.5) / steps
            d = weigh([(1 - loss) * (1 + offset)] * w.max_repeats, noise=1e-6,
                      variation=w.variation_prior, centre_se=0.0, w=w, futility=False,
                      terminal=terminal)
            hits += d.degraded
    return hits / steps ** 2


def bound(variation: float = 0.05) -> None:
    print(f"\nceiling of a fresh check (unlimited repeats, exact centre; a link's lasting offset "
          f"uniform within +-{variation:.0%}, weighed as a nuisance of sigma "
          f"{Weighing().variation_prior:.0%})")
    print(f"  {'false alarm':>11} {'link':>20} {'12-15 %':>8} {'>=15 %':>8}")
    for false_alarm in (Weighing().false_alarm, 1e-3):
        w = Weighing(false_alarm=false_alarm)
        for link, terminal in (("node pair, path", False), ("GPU pair, last look", True)):
            print(f"  {false_alarm:>11g} {link:>20} "
                  f"{ceiling(0.12, 0.15, variation, w, terminal=terminal):>8.3f} "
                  f"{ceiling(0.15, 0.25, variation, w, terminal=terminal):>8.3f}")


def at_scale(rng: random.Random, draws: int) -> None:
    """A fault-free fleet, then ``draws`` draws of 8 faults: the time a check takes
    depends on where its faults fall."""
    print(f"\npreflight at 1024 x 8 (noise 8 %, variation 5 %; a fault-free fleet, then {draws} "
          "draws of 8 faults)")
    print(f"  {'faults':>6} {'rounds':>6} {'fabric_s':>9} {'wall_s':>7} {'found':>7} "
          f"{'false':>6} {'healthy excluded':>17}")
    for faults in (0,) + (8,) * draws:
        sc = scenario(rng, 1024, faults, noise=0.08, variation=0.05, loss=(0.12, 0.25))
        started = time.perf_counter()
        v = run_check(SimBackend(sc), None).verdict()
        wall = time.perf_counter() - started
        found = sum(any(matches(x, f) for f in v["findings"]) for x in sc["faults"])
        false = sum(not any(matches(x, f) for x in sc["faults"]) for f in v["findings"])
        excluded = len(set(v["exclude"]) - faulty_nodes(sc))
        print(f"  {faults:>6} {v['rounds']:>6} {v['duration_s']:>9.2f} {wall:>7.1f} "
              f"{found:>3}/{faults:<3} {false:>6} {excluded:>17}", flush=True)
        print_misses(sc, v["findings"])


def curve(rng: random.Random, losses: Sequence[float], noises: Sequence[float],
          per_cell: int, nodes: int) -> None:
    print(f"\nrecall by loss (rows) and noise (columns): preflight, {nodes} x 8, variation 5 %, "
          f"{per_cell} scenarios of 4 faults per cell")
    print("  loss  " + "".join(f"{f'{n:.0%}':>8}" for n in noises))
    for loss in losses:
        row = []
        for noise in noises:
            t = Tally()
            for _ in range(per_cell):
                sc = scenario(rng, nodes, 4, noise=noise, variation=0.05,
                              loss=(loss, loss))
                v = run_check(SimBackend(sc), None).verdict()
                score(sc, v["findings"], v["exclude"], t)
            found = sum(t.found.values())
            total = sum(t.total.values())
            row.append(f"{found / total:8.2f}" if total else "     n/a")
        print(f"  {loss:4.0%}  " + "".join(row))


def _intra_cycle(nodes: int, losses: Sequence[float], sigma: float,
                 rng: random.Random) -> list[Assessment]:
    """One cycle's judged intra-node assessments (two ops per node), each ratio drawn about
    1 - the node's loss with ``sigma``: what the drift detector is fed per place."""
    out = []
    for n in range(nodes):
        members = [f"node-{n:05d}/{g}" for g in range(GPUS)]
        for op in ("allreduce", "alltoall"):
            ratio = (1 - losses[n]) + rng.gauss(0, sigma)
            m = Measurement(op=op, scope="intra_node", members=members, size_bytes=1 << 28,
                            dtype="float32", warmup=5, iters=20, time_us=1.0,
                            algbw_gbs=100 * ratio, busbw_gbs=100 * ratio, wrong=0)
            out.append(Assessment(measurement=m, expected_gbs=100.0, ratio=ratio, bad=False,
                                  source="history", spread=sigma))
    return out


def _alarms(losses: Sequence[float], cycles: int, policy: CusumPolicy,
            rng: random.Random) -> list[int | None]:
    """Each place's first cycle in alarm (None: never), its loss lasting from cycle 0."""
    states: dict[str, dict[str, Any]] = {}
    first: list[int | None] = [None] * len(losses)
    t0 = datetime(2026, 1, 1, tzinfo=UTC)
    for c in range(cycles):
        obs = drift_observations(_intra_cycle(len(losses), losses, 0.05, rng))
        states, findings = step_drift(states, obs, t0 + timedelta(minutes=5 * c), policy)
        for f in findings:
            i = int((f.node or "node-0")[5:])
            if first[i] is None:
                first[i] = c
    return first


def drift(rng: random.Random, quick: bool) -> None:
    """The drift detector (services.analyzer.drift) as monitoring feeds it, per place: mean
    cycles from the onset of a lasting loss to the alarm, and alarms of healthy places."""
    places = 100 if quick else 400
    healthy_cycles = 100 if quick else 250
    print(f"\nslow drift: cycles from the onset of a lasting loss to the alarm "
          f"({places} places each, noise 5 %, two ops per place)")
    sigmas = (0.75, 1.0, 1.5, 2.0, 3.0)
    print("  threshold " + "".join(f"{f'{x:g} sigma':>10}" for x in sigmas)
          + f"{'false alarms':>26}")
    for h in (8.0, 12.0):
        policy = CusumPolicy(threshold=h)
        row = []
        for x in sigmas:
            found = [c for c in _alarms([x * 0.05] * places, 200, policy, rng) if c is not None]
            row.append(f"{statistics.mean(found) + 1:10.1f}" if found else "         -")
        healthy = _alarms([0.0] * places, healthy_cycles, policy, rng)
        alarmed = sum(c is not None for c in healthy)
        print(f"  h = {h:<5g} " + "".join(row)
              + f"{alarmed:>6} in {places * healthy_cycles} place-cycles")


def monitoring(rng: random.Random, quick: bool) -> None:
    """The weak regime through monitoring: ``BASELINE`` fault-free cycles (each link's own
    normal), then the faults, and ``AFTER`` more cycles."""
    from bench.monitoring import Fleet

    baseline, after = 6, 6
    sizes = (64,) if quick else (64, 256)
    state = Path(".ringwatch") / f"bench-weak-monitoring-{os.getpid()}"
    state.mkdir(parents=True, exist_ok=True)
    print(f"\nmonitoring (real scheduler --once per cycle, API, Postgres; noise 6.5 %, variation "
          f"5 %, 8 faults of 12-25 % loss from cycle {baseline + 1} of {baseline + after})")
    print(f"  {'nodes':>5} {'band':>7} {'opened':>7} {'cycles to open':>24} {'s/cycle':>8} "
          f"{'rounds/cycle':>14}")
    for nodes in sizes:
        sc = scenario(rng, nodes, 8, noise=0.065, variation=0.05, loss=(0.12, 0.25))
        for f in sc["faults"]:
            f["start"] = baseline
        path = state / f"weak-{nodes}.json"
        path.write_text(json.dumps(sc))
        fleet = Fleet(path, state / f"weak-{nodes}")
        opened: dict[int, int] = {}
        walls, early = [], 0
        try:
            for c in range(baseline + after):
                walls.append(fleet.cycle())
                incidents = fleet.incidents()
                if c < baseline:
                    early = len(incidents)
                    continue
                for i, fault in enumerate(sc["faults"]):
                    if i not in opened and any(matches(fault, x["detail"]) for x in incidents
                                               if x["status"] == "open"):
                        opened[i] = c - baseline + 1
            incidents = fleet.incidents()
            verdict = fleet.api.post("/v1/preflight", json={
                "nodes": [node_name(i) for i in range(nodes)]}).json()
        finally:
            fleet.close()
        for band in (">=15%", "12-15%"):
            idx = [i for i, f in enumerate(sc["faults"]) if band_of(1 - f["factor"]) == band]
            got = [opened[i] for i in idx if i in opened]
            cyc = ", ".join(str(opened.get(i, "-")) for i in idx)
            print(f"  {nodes:>5} {band:>7} {f'{len(got)}/{len(idx)}':>7} {cyc:>24} "
                  f"{statistics.mean(walls):>8.1f} "
                  f"{f'{min(fleet.rounds)}-{max(fleet.rounds)}':>14}")
        false = sum(not any(matches(f, x["detail"]) for f in sc["faults"]) for x in incidents)
        bad = faulty_nodes(sc)
        found = sum(any(matches(f, x) for x in verdict["findings"]) for f in sc["faults"])
        wrong = sorted(set(verdict["exclude"]) - bad)
        print(f"        incidents before the faults began: {early}; after: {len(incidents)}, "
              f"{false} matching no fault")
        print(f"        stored preflight at the end: healthy {verdict['healthy']}, "
              f"{found}/{len(sc['faults'])} faults named, {len(wrong)} healthy node(s) "
              f"excluded, suspects {len(verdict.get('suspects', []))}")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.weak_faults", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--seed", type=int, default=13)
    p.add_argument("--only", choices=("preflight", "small", "scale", "curve", "drift",
                                      "monitoring"))
    args = p.parse_args(argv)
    rng = random.Random(args.seed)
    started = time.perf_counter()
    scenarios = regime(rng, 12 if args.quick else 30)
    if args.only in (None, "preflight"):
        report("preflight (one check per scenario)", preflight(scenarios))
        bound()
    if args.only in (None, "small"):
        # Its own draw, so the scenarios after it are the same with or without it.
        small = small_fleets(random.Random(args.seed + 1), 10 if args.quick else 25)
        report("preflight, fleets of 16-40 nodes", preflight(small))
    if args.only in (None, "scale"):
        at_scale(rng, 1 if args.quick else 3)
    if args.only in (None, "drift"):
        drift(rng, args.quick)
    if args.only in (None, "monitoring"):
        monitoring(rng, args.quick)
    if args.only in (None, "curve"):
        losses = (0.1, 0.2, 0.3, 0.5) if args.quick else (0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5)
        noises = (0.02, 0.06, 0.1) if args.quick else (0.02, 0.04, 0.06, 0.08, 0.1)
        curve(rng, losses, noises, 1 if args.quick else 3, 64)
    print(f"\nbenchmark wall time {time.perf_counter() - started:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
