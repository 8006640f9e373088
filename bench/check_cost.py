"""What one check costs as a user runs it: the whole ``ringwatch preflight --fabric`` process.

    python -m bench.check_cost            # 1024 x 8, 4096 x 8 and 16384 x 8
    python -m bench.check_cost --quick    # 1024 x 8 only

Each run is a fresh process, as a Slurm prolog or a terminal starts it, three runs a case
(one with --quick, and one of 16384 x 8, which takes minutes); printed: the median CPU
seconds (user + system, the CLI's start included, that process's own), the largest peak
resident memory, the median wall seconds, the check's modeled fabric seconds and rounds,
whether the verdict is right (it names each fault, in its place, and nothing else) and
whether it is complete. Then the top costs of the largest three-fault case run three
times (4096 x 8; 1024 x 8 with --quick) from a profile of the check alone (in this
process). Nothing is asserted; the targets are in docs/scale.md ("The check's cost").
"""

from __future__ import annotations

import cProfile
import io
import json
import os
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# The figures swing by about 10 % from run to run on a 2-core machine: each case is run
# this many times and its median printed.
RUNS = 3
THREE_FAULTS = [{"kind": "nic", "node": "node-011", "factor": 0.6},
                {"kind": "nvlink", "node": "node-003", "gpus": [2, 5], "factor": 0.5},
                {"kind": "hang", "node": "node-404", "gpu": 1}]
# What a right verdict names for each fault (its kind, node and GPUs), and nothing else.
NAMED = {"nic": "nic_degraded", "nvlink": "nvlink_degraded", "hang": "hang"}
# A case this large runs once: it takes minutes.
ONCE_FROM_NODES = 16384


def cases(quick: bool) -> list[tuple[str, dict]]:
    base = {"gpus_per_node": 8, "gpu": "H100-SXM", "seed": 2026}
    out = [("1024 x 8, three faults", {**base, "nodes": 1024, "faults": THREE_FAULTS}),
           ("1024 x 8, fault-free, 3 % noise", {**base, "nodes": 1024, "noise": 0.03}),
           ("1024 x 8, fault-free, 8 % noise", {**base, "nodes": 1024, "noise": 0.08,
                                               "variation": 0.05})]
    if not quick:
        out.append(("4096 x 8, three faults", {**base, "nodes": 4096, "faults": THREE_FAULTS}))
        out.append(("16384 x 8, three faults", {**base, "nodes": 16384,
                                                "faults": THREE_FAULTS}))
    return out


def right(verdict: dict, scenario: dict) -> bool:
    """The verdict names each fault of ``scenario`` (kind, node, GPU pair) and nothing else,
    and excludes exactly the faults' nodes."""
    faults = scenario.get("faults", [])
    wanted = {(NAMED[f["kind"]], f["node"], tuple(f.get("gpus") or ())) for f in faults}
    named = {(f["kind"], f.get("node"), tuple(f.get("gpus") or ()))
             for f in verdict.get("findings", [])}
    return named == wanted and verdict.get("exclude") == sorted({f["node"] for f in faults})


def run_cli(scenario: dict) -> dict[str, float]:
    """One ``ringwatch preflight --fabric`` process: its own CPU and peak memory (read from
    that child's rusage alone) and its verdict."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(scenario, f)
    try:
        started = time.monotonic()
        proc = subprocess.Popen([sys.executable, "-m", "ringwatch.services.cli.main", "preflight",
                                 "--fabric", f.name, "--json"], stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, text=True, env={**os.environ})
        assert proc.stdout is not None
        out = proc.stdout.read()
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        wall = time.monotonic() - started
    finally:
        Path(f.name).unlink()
    verdict = json.loads(out) if out.strip() else {}
    return {"cpu": usage.ru_utime + usage.ru_stime, "rss_mb": usage.ru_maxrss / 1024,
            "wall": wall, "rc": proc.returncode,
            "fabric": verdict.get("duration_s", float("nan")),
            "rounds": verdict.get("rounds", 0), "exclude": len(verdict.get("exclude", [])),
            "right": "yes" if verdict and right(verdict, scenario) else "NO",
            "complete": "yes" if verdict.get("complete") else "no"}


def median_of(scenario: dict, runs: int) -> dict[str, float]:
    """``run_cli`` ``runs`` times: the median CPU and wall seconds, the largest peak."""
    rs = [run_cli(scenario) for _ in range(runs)]
    out = dict(rs[0])
    for k in ("cpu", "wall"):
        out[k] = statistics.median(r[k] for r in rs)
    out["rss_mb"] = max(r["rss_mb"] for r in rs)
    return out


def profile(scenario: dict, top: int = 15) -> str:
    from ringwatch.agents.sim import SimBackend
    from ringwatch.services.check import run_check

    prof = cProfile.Profile()
    prof.enable()
    run_check(SimBackend(scenario))
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(top)
    return out.getvalue()


def main(flags: list[str]) -> None:
    chosen = cases("--quick" in flags)
    runs = 1 if "--quick" in flags else RUNS
    print(f"each case {runs} fresh process(es) ({ONCE_FROM_NODES} nodes and more: one): "
          "median CPU and wall, largest peak")
    print(f"{'case':<34} {'cpu s':>7} {'peak MB':>8} {'wall s':>7} {'fabric s':>9} "
          f"{'rounds':>6} {'excluded':>8} {'right':>5} {'complete':>8}")
    for name, scenario in chosen:
        r = median_of(scenario, 1 if scenario["nodes"] >= ONCE_FROM_NODES else runs)
        print(f"{name:<34} {r['cpu']:>7.2f} {r['rss_mb']:>8.0f} {r['wall']:>7.2f} "
              f"{r['fabric']:>9.2f} {r['rounds']:>6} {r['exclude']:>8} {r['right']:>5} "
              f"{r['complete']:>8}", flush=True)
    name, scenario = [(n, s) for n, s in chosen
                      if s.get("faults") and s["nodes"] < ONCE_FROM_NODES][-1]
    print(f"\ntop costs of '{name}' (the check alone, cumulative):")
    lines = profile(scenario).splitlines()
    start = next((i for i, line in enumerate(lines) if "ncalls" in line), 0)
    print("\n".join(lines[start:]))


if __name__ == "__main__":
    main(sys.argv[1:])
