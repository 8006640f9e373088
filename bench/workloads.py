"""Each workload profile's preflight against the collectives chart's budgets.

On the sim at 64, 256 and 1024 nodes x 8 GPUs, with faults of >= 25 % loss (a GPU pair, a
NIC, a node-to-node path) and one AllReduce fallback, each profile's ``run_check`` at
default settings and its default layout (tensor parallel in each node, data parallel
across; the pipeline profile with pp 4): modeled fabric time, wall time on this machine,
which faults the fabric check localized, and the workload section's findings. The chart
budgets 10-20 minutes for a plain model's AllReduce test and 40-60 for a Mixture-of-Experts
model's; the target is every profile under 60 s of modeled fabric time at 1024 x 8 while
localizing every fault of >= 25 % loss (docs/workloads.md). Nothing is asserted.

    python -m bench.run workloads            # 64, 256, 1024 nodes
    python -m bench.run workloads --quick    # 64, 256
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections.abc import Sequence
from typing import Any

from bench.detection import fault_of, matches
from ringwatch.agents.sim import SimBackend, node_name
from ringwatch.agents.workloads import WORKLOADS, JobLayout
from ringwatch.services.check import run_check

CHART_MIN = {"ddp": "10-20 min", "fsdp": "10-20 min", "moe": "40-60 min", "pipeline": "-"}


def scenario(rng: random.Random, nodes: int) -> dict[str, Any]:
    picked = rng.sample(range(nodes), 7)
    faults = [fault_of(kind, node_name(picked[2 * i]), node_name(picked[2 * i + 1]),
                       round(rng.uniform(0.4, 0.75), 3), sorted(rng.sample(range(8), 2)))
              for i, kind in enumerate(("nvlink", "nic", "net_path"))]
    faults.append({"kind": "fallback", "node": node_name(picked[6]), "op": "allreduce",
                   "factor": 0.5})
    return {"nodes": nodes, "gpus_per_node": 8, "noise": 0.03, "variation": 0.02,
            "seed": rng.randrange(1 << 30), "faults": faults}


def run(nodes_list: Sequence[int], seed: int) -> None:
    rng = random.Random(seed)
    print("\nworkload profiles (sim, noise 3 %, faults: a GPU pair, a NIC and a path of "
          ">= 25 % loss, one AllReduce fallback)")
    print(f"  {'nodes':>5} {'profile':>8} {'rounds':>6} {'fabric_s':>9} {'job_s':>6} "
          f"{'wall_s':>7} {'chart':>10} {'localized':>10} {'false':>5} {'fallback':>8} "
          "workload findings")
    for nodes in nodes_list:
        sc = scenario(rng, nodes)
        rate = [f for f in sc["faults"] if f["kind"] != "fallback"]
        for name in WORKLOADS:
            job = JobLayout(tp=8, pp=4) if name == "pipeline" else None
            started = time.perf_counter()
            v = run_check(SimBackend(sc), profile=name, job=job).verdict()
            wall = time.perf_counter() - started
            found = sum(any(matches(f, x) for x in v["findings"]) for f in rate)
            fb = sc["faults"][-1]["node"]
            # The fallback slows its node's AllReduce alone; the fabric check, which sees
            # only busbw, may blame that node's links for it: not counted as false.
            false = sum(not any(matches(f, x) for f in rate) and x.get("node") != fb
                        for x in v["findings"])
            w = v["workload"]
            named = any(fb in (x.get("nodes") or [x.get("node")]) for x in w["findings"])
            kinds: dict[str, int] = {}
            for f in w["findings"]:
                kinds[f["kind"]] = kinds.get(f["kind"], 0) + 1
            print(f"  {nodes:>5} {name:>8} {v['rounds']:>6} {v['duration_s']:>9.2f} "
                  f"{w['fabric_s']:>6.2f} {wall:>7.1f} {CHART_MIN[name]:>10} "
                  f"{f'{found}/{len(rate)}':>10} {false:>5} {'named' if named else '-':>8} "
                  f"{', '.join(f'{k} {n}' for k, n in sorted(kinds.items())) or '-'}",
                  flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.workloads", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--seed", type=int, default=14)
    args = p.parse_args(argv)
    started = time.perf_counter()
    run((64, 256) if args.quick else (64, 256, 1024), args.seed)
    print(f"\nbenchmark wall time {time.perf_counter() - started:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
