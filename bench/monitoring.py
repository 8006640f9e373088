"""Periodic monitoring at fleet scale, as it runs: the real `ringwatch scheduler` process
(one `--once` run per cycle, so every cycle is also a restart that must go on with the next
node-pair matching) on the sim backend, feeding the real API and Postgres.

Per fleet size: one scenario with faults of every kind, factors 0.5-0.75 (at least 25 %
loss), present from the first cycle; then fault-free cycles on a fresh database. Printed
per fault kind: cycles until its incident opened, exact localization, incidents per fault;
then false incidents over the fault-free cycles and each GPU's duty cycle at the default
interval.

    python -m bench.run monitoring            # 256 x 8 and 1024 x 8, 50 fault-free cycles
    python -m bench.run monitoring --quick    # 64 x 8 and 256 x 8, 10 fault-free cycles
"""

from __future__ import annotations

import json
import math
import os
import random
import re
import subprocess
import sys
import time
import uuid
from collections import defaultdict
from pathlib import Path
from typing import Any

import httpx

from bench import admin_url
from bench.detection import GPUS, fault_of, matches
from ringwatch.agents.sim import SimBackend
from ringwatch.services.scheduler.cycle import ProbeOptions, run_cycle
from ringwatch.services.settings import Settings
from ringwatch.services.store import db
from tests.procs import free_port, start_server, stop_server

TOKEN = "rw_bench_" + uuid.uuid4().hex
KINDS = ("nvlink", "nic", "net_path", "hang", "corrupt", "error", "pcie_only")


def scenario(nodes: int, rng: random.Random) -> dict[str, Any]:
    """Two faults of every kind on distinct nodes, each 25-50 % loss where it has a factor."""
    picked = rng.sample(range(nodes), 4 * len(KINDS))
    faults = []
    for i, kind in enumerate(KINDS * 2):
        a, b = f"node-{picked[2 * i]:03d}", f"node-{picked[2 * i + 1]:03d}"
        factor = round(rng.uniform(0.5, 0.75), 3)
        faults.append(fault_of(kind, a, b, factor, sorted(rng.sample(range(GPUS), 2))))
    return {"nodes": nodes, "gpus_per_node": GPUS, "gpu": "H100-SXM", "noise": 0.03,
            "seed": rng.randrange(1 << 30), "faults": faults}


class Fleet:
    """A fresh database, a real API process, and `ringwatch scheduler --once` runs."""

    def __init__(self, scenario_path: Path, state: Path) -> None:
        self.admin = admin_url()
        self.name = f"rw_bench_{uuid.uuid4().hex[:8]}"
        url = db.create_database(self.admin, self.name)
        db.upgrade(url)
        self.env = {**os.environ, "RINGWATCH_DATABASE_URL": url,
                    "RINGWATCH_BOOTSTRAP_ADMIN_TOKEN": TOKEN, "RINGWATCH_TOKEN": TOKEN,
                    "RINGWATCH_API_URL": f"http://127.0.0.1:{free_port()}",
                    "RINGWATCH_STATE_DIR": str(state)}
        self.scenario = scenario_path
        # Rounds of each cycle run so far.
        self.rounds: list[int] = []
        self.proc = start_server(self.env, notifier=False)
        self.api = httpx.Client(base_url=self.env["RINGWATCH_API_URL"], timeout=120,
                                headers={"Authorization": f"Bearer {TOKEN}"})

    def cycle(self) -> float:
        t0 = time.monotonic()
        out = subprocess.run([sys.executable, "-m", "ringwatch.services.cli.main", "scheduler", "--fabric",
                              str(self.scenario), "--once"], env=self.env, capture_output=True,
                             text=True, timeout=1200)
        if out.returncode != 0:
            raise RuntimeError(f"scheduler exited {out.returncode}: {out.stderr[-500:]}")
        # The scheduler's own summary line: "cycle 1: N rounds, ...".
        found = re.search(r"cycle \d+: (\d+) rounds", out.stderr)
        self.rounds.append(int(found.group(1)) if found else 0)
        return time.monotonic() - t0

    def incidents(self) -> list[dict[str, Any]]:
        return self.api.get("/v1/findings").json()

    def close(self) -> None:
        self.api.close()
        stop_server(self.proc)
        db.drop_database(self.admin, self.name)


def faulty(sc: dict[str, Any], nodes: int, cycles: int, state: Path) -> None:
    path = state / f"faults-{nodes}.json"
    path.write_text(json.dumps(sc))
    fleet = Fleet(path, state / f"faults-{nodes}")
    opened: dict[int, int] = {}
    walls = []
    extra = 2  # cycles after the last incident opened: repeats must open nothing new
    try:
        for c in range(1, cycles + 1):
            walls.append(fleet.cycle())
            for i, fault in enumerate(sc["faults"]):
                if i not in opened and any(matches(fault, x["detail"]) for x in fleet.incidents()):
                    opened[i] = c
            if len(opened) == len(sc["faults"]):
                extra -= 1
                if extra < 0:
                    break
        incidents = fleet.incidents()
    finally:
        fleet.close()
    per_kind: dict[str, list[int | None]] = defaultdict(list)
    counts: dict[str, list[int]] = defaultdict(list)
    for i, fault in enumerate(sc["faults"]):
        per_kind[fault["kind"]].append(opened.get(i))
        counts[fault["kind"]].append(sum(matches(fault, x["detail"]) for x in incidents))
    explained = sum(any(matches(f, x["detail"]) for f in sc["faults"]) for x in incidents)
    path_target = math.ceil(math.log2(nodes)) + 3
    print(f"\n{nodes} x {GPUS}: {len(sc['faults'])} faults (two of each kind, 25-50 % loss), "
          f"{len(walls)} cycles, {sum(walls) / len(walls):.1f} s per cycle end to end "
          f"(scheduler start, probing, shipping, ingest)")
    print(f"  {'fault':<10}{'cycles to open':>18}{'target':>8}{'localized':>11}{'incidents':>11}")
    for kind in KINDS:
        got = per_kind[kind]
        target = path_target if kind == "net_path" else 3
        cyc = ", ".join("-" if c is None else str(c) for c in got)
        loc = sum(c is not None for c in got)
        print(f"  {kind:<10}{cyc:>18}{'<= ' + str(target):>8}{f'{loc}/{len(got)}':>11}"
              f"{', '.join(map(str, counts[kind])):>11}")
    still = sum(x["status"] == "open" for x in incidents)
    print(f"  incidents: {len(incidents)} ({still} open), of which not one of the faults: "
          f"{len(incidents) - explained}")


def fault_free(nodes: int, cycles: int, state: Path, rng: random.Random) -> None:
    path = state / f"clean-{nodes}.json"
    path.write_text(json.dumps({"nodes": nodes, "gpus_per_node": GPUS, "gpu": "H100-SXM",
                                "noise": 0.03, "seed": rng.randrange(1 << 30), "faults": []}))
    fleet = Fleet(path, state / f"clean-{nodes}")
    try:
        walls = [fleet.cycle() for _ in range(cycles)]
        incidents = fleet.incidents()
    finally:
        fleet.close()
    print(f"  fault-free, {cycles} cycles ({sum(walls) / len(walls):.1f} s each): "
          f"{len(incidents)} false incident(s)")


def duty(nodes: int, state: Path) -> None:
    """Each GPU's busy time in one modeled cycle, over the default interval."""
    sc = scenario(nodes, random.Random(1))
    sc["faults"] = []
    backend = SimBackend(sc)
    cycle = run_cycle(backend, ProbeOptions())
    busy = sorted(cycle.busy_s.values())
    interval = Settings().probe_interval_s
    print(f"  duty cycle per GPU at the default {interval:.0f} s interval: median "
          f"{busy[len(busy) // 2] / interval:.4%}, max {busy[-1] / interval:.4%} "
          f"({cycle.rounds} rounds, {busy[-1]:.2f} s of modeled probing for the busiest GPU)")


def main(flags: list[str]) -> None:
    quick = "--quick" in flags
    sizes = (64, 256) if quick else (256, 1024)
    clean_cycles = 10 if quick else 50
    state = Path(".ringwatch") / f"bench-monitoring-{os.getpid()}"
    state.mkdir(parents=True, exist_ok=True)
    rng = random.Random(20261123)
    for n in sizes:
        faulty(scenario(n, rng), n, 10, state)
        fault_free(n, clean_cycles, state, rng)
        duty(n, state)
