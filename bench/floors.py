"""The absolute floor, as it runs: fleets slower than their hardware profile is rated,
slow everywhere alike, through the real `ringwatch scheduler --once` process, the real API
and Postgres at the default settings. Per case: the fleet-wide finding found or not, in
how many cycles its incident opened, and what it says; a healthy fleet for contrast.

    python -m bench.run floors
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from bench.monitoring import Fleet

CASES = (
    ("network at 12.5 GB/s per GPU (a quarter of 400G)", 64, {"net_gbs": 12.5}),
    ("network at 30 GB/s per GPU (GPUDirect RDMA off)", 64, {"net_gbs": 30.0}),
    ("NVLink at 25 GB/s per GPU", 16, {"nvlink_gbs": 25.0}),
    ("NVLink at 150 GB/s per GPU (a third)", 16, {"nvlink_gbs": 150.0}),
    ("healthy H100 fleet", 64, {}),
)
MAX_CYCLES = 4


def case(name: str, nodes: int, rates: dict[str, float], state: Path, i: int) -> None:
    path = state / f"floor-{i}.json"
    path.write_text(json.dumps({"nodes": nodes, "gpus_per_node": 8, "gpu": "H100-SXM",
                                "noise": 0.03, "seed": 100 + i, "faults": [], **rates}))
    fleet = Fleet(path, state / f"floor-{i}")
    opened, seen = None, []
    try:
        for c in range(1, MAX_CYCLES + 1):
            fleet.cycle()
            seen = fleet.incidents()
            if any(x["kind"] == "fabric_below_rated" for x in seen):
                opened = c
                break
    finally:
        fleet.close()
    found = [x for x in seen if x["kind"] == "fabric_below_rated"]
    other = sorted({x["kind"] for x in seen} - {"fabric_below_rated"})
    if found:
        d = found[0]["detail"]
        print(f"  {name} ({nodes} x 8): found in cycle {opened}: {d.get('scope')}, "
              f"{d.get('nodes_below')} of {d.get('nodes_judged')} nodes, median "
              f"{d.get('measured_gbs')} vs {d.get('expected_gbs')} GB/s rated; other incidents: "
              f"{', '.join(other) or 'none'}")
    else:
        print(f"  {name} ({nodes} x 8): not found in {MAX_CYCLES} cycles; incidents: "
              f"{', '.join(other) or 'none'}")


def main(flags: list[str]) -> None:
    state = Path(".ringwatch") / f"bench-floors-{os.getpid()}"
    state.mkdir(parents=True, exist_ok=True)
    print("fleets slower than their profile, default settings (floor 0.5 of rated, "
          "hysteresis 2 of 3):")
    for i, (name, nodes, rates) in enumerate(CASES):
        case(name, nodes, rates, state, i)
