"""What one check costs as a user runs it: the whole ``ringwatch preflight --fabric`` process.

    python -m bench.check_cost            # 1024 x 8 and 4096 x 8
    python -m bench.check_cost --quick    # 1024 x 8 only

Each case is a fresh process, as a Slurm prolog or a terminal starts it; printed: its CPU
seconds (user + system, the CLI's start included), peak resident memory, wall seconds, and
the check's modeled fabric seconds and rounds. Then the top costs of the first case from a
profile of the check alone (in this process). Nothing is asserted; the targets are in
docs/scale.md ("The check's cost").
"""

from __future__ import annotations

import cProfile
import io
import json
import os
import pstats
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

THREE_FAULTS = [{"kind": "nic", "node": "node-011", "factor": 0.6},
                {"kind": "nvlink", "node": "node-003", "gpus": [2, 5], "factor": 0.5},
                {"kind": "hang", "node": "node-404", "gpu": 1}]


def cases(quick: bool) -> list[tuple[str, dict]]:
    base = {"gpus_per_node": 8, "gpu": "H100-SXM", "seed": 2026}
    out = [("1024 x 8, three faults", {**base, "nodes": 1024, "faults": THREE_FAULTS}),
           ("1024 x 8, fault-free, 3 % noise", {**base, "nodes": 1024, "noise": 0.03}),
           ("1024 x 8, fault-free, 8 % noise", {**base, "nodes": 1024, "noise": 0.08,
                                               "variation": 0.05})]
    if not quick:
        out.append(("4096 x 8, three faults", {**base, "nodes": 4096, "faults": THREE_FAULTS}))
    return out


def run_cli(scenario: dict) -> dict[str, float]:
    """One ``ringwatch preflight --fabric`` process: its CPU, peak memory and verdict."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(scenario, f)
    try:
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        started = time.monotonic()
        proc = subprocess.run([sys.executable, "-m", "services.cli.main", "preflight",
                               "--fabric", f.name, "--json"], capture_output=True, text=True,
                              env={**os.environ})
        wall = time.monotonic() - started
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
    finally:
        Path(f.name).unlink()
    verdict = json.loads(proc.stdout) if proc.stdout.strip() else {}
    return {"cpu": (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime),
            # ru_maxrss of children is the largest child so far: each case runs alone here.
            "rss_mb": after.ru_maxrss / 1024, "wall": wall, "rc": proc.returncode,
            "fabric": verdict.get("duration_s", float("nan")),
            "rounds": verdict.get("rounds", 0), "exclude": len(verdict.get("exclude", []))}


def profile(scenario: dict, top: int = 15) -> str:
    from agents.sim import SimBackend
    from services.check import run_check

    prof = cProfile.Profile()
    prof.enable()
    run_check(SimBackend(scenario))
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(top)
    return out.getvalue()


def main(flags: list[str]) -> None:
    chosen = cases("--quick" in flags)
    print(f"{'case':<34} {'cpu s':>7} {'peak MB':>8} {'wall s':>7} {'fabric s':>9} "
          f"{'rounds':>6} {'excluded':>8}")
    for name, scenario in chosen:
        r = run_cli(scenario)
        print(f"{name:<34} {r['cpu']:>7.2f} {r['rss_mb']:>8.0f} {r['wall']:>7.2f} "
              f"{r['fabric']:>9.2f} {r['rounds']:>6} {r['exclude']:>8}", flush=True)
    print(f"\ntop costs of '{chosen[0][0]}' (the check alone, cumulative):")
    lines = profile(chosen[0][1]).splitlines()
    start = next((i for i, line in enumerate(lines) if "ncalls" in line), 0)
    print("\n".join(lines[start:]))


if __name__ == "__main__":
    main(sys.argv[1:])
