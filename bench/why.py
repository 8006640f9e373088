"""Why, at fleet scale: NCCL falling back to sockets or SHM and NIC error counters rising,
through the real `ringwatch scheduler` (sim backend), the real API and Postgres, and the
stored preflight of the whole fleet (docs/transport.md).

Per fleet size: four faults of each cause on distinct nodes (inter-node sockets, half of
them also slow; a GPU pair over SHM; symbol errors at 500 a cycle; a link flap), plus two
NVLink pairs at 0.5 with no cause. Printed: cycles until each kind's incidents opened,
exact localization, whether a cause carries the slow figure it explains, false incidents,
the preflight's exclusions against the faulted nodes, and cycle and scrape times.

    python -m bench.run why            # 1024 x 8
    python -m bench.run why --quick    # 256 x 8
"""

from __future__ import annotations

import json
import random
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.monitoring import Fleet

GPUS = 8
CAUSES = ("socket", "shm", "symbol_error", "link_downed")


def scenario(nodes: int, rng: random.Random) -> tuple[dict[str, Any], dict[str, str]]:
    """The faults, and the kind each faulted node must be named for (and nothing else)."""
    picked = [f"node-{i:03d}" for i in rng.sample(range(nodes), 4 * len(CAUSES) + 2)]
    faults: list[dict[str, Any]] = []
    want: dict[str, str] = {}
    for i, cause in enumerate(CAUSES * 4):
        node = picked[i]
        if cause == "socket":
            faults.append({"kind": "transport", "node": node, "transport": "socket"})
            if i % 8 == 0:  # half of them slow as well: the cause carries the figure
                faults.append({"kind": "nic", "node": node, "factor": 0.4})
        elif cause == "shm":
            faults.append({"kind": "transport", "node": node,
                           "gpus": sorted(rng.sample(range(GPUS), 2)), "transport": "shm"})
        else:
            faults.append({"kind": "nic_errors", "node": node, "counter": cause,
                           "per_cycle": 500 if cause == "symbol_error" else 1})
        want[node] = "transport_fallback" if cause in ("socket", "shm") else "nic_errors"
    for node in picked[-2:]:
        faults.append({"kind": "nvlink", "node": node, "gpus": sorted(rng.sample(range(GPUS), 2)),
                       "factor": 0.5})
        want[node] = "nvlink_degraded"
    return ({"nodes": nodes, "gpus_per_node": GPUS, "gpu": "H100-SXM", "noise": 0.03,
             "seed": rng.randrange(1 << 30), "faults": faults}, want)


def run(nodes: int, rng: random.Random, state: Path) -> None:
    sc, want = scenario(nodes, rng)
    path = state / f"why-{nodes}.json"
    path.write_text(json.dumps(sc))
    fleet = Fleet(path, state / f"why-{nodes}")
    opened: dict[str, int] = {}
    walls = []
    try:
        for c in range(1, 4):
            walls.append(fleet.cycle())
            for x in fleet.incidents():
                opened.setdefault(f"{x['kind']}:{x['nodes'][0]}", c)
            if all(f"{k}:{n}" in opened for n, k in want.items()):
                break
        incidents = fleet.incidents()
        t0 = time.monotonic()
        verdict = fleet.api.post("/v1/preflight", json={
            "nodes": [f"node-{i:03d}" for i in range(nodes)]}).json()
        preflight_s = time.monotonic() - t0
        t0 = time.monotonic()
        scrape = fleet.api.get("/metrics").text
        scrape_s = time.monotonic() - t0
    finally:
        fleet.close()

    print(f"\n{nodes} x {GPUS}: {len(sc['faults'])} faults on {len(want)} nodes; "
          f"cycles {', '.join(f'{w:.1f}' for w in walls)} s")
    print(f"  {'kind':<20} {'faults':>6} {'opened':>7} {'cycle':>6} {'exact':>6} {'with figure':>12}")
    for kind in ("transport_fallback", "nic_errors", "nvlink_degraded"):
        nodes_of = [n for n, k in want.items() if k == kind]
        mine = [x for x in incidents if x["kind"] == kind and x["nodes"][0] in nodes_of]
        cycles = [opened[f"{kind}:{n}"] for n in nodes_of if f"{kind}:{n}" in opened]
        exact = sum(1 for x in mine if _exact(sc, x))
        figure = sum(1 for x in mine if x["detail"].get("headline"))
        print(f"  {kind:<20} {len(nodes_of):>6} {len(mine):>7} {max(cycles, default=0):>6} "
              f"{exact:>6} {figure:>12}")
    false = [x for x in incidents if want.get(x["nodes"][0]) != x["kind"]]
    print(f"  false incidents: {len(false)}"
          + (f" ({', '.join(x['kind'] + ' ' + x['nodes'][0] for x in false[:5])})" if false else ""))
    named: dict[str, set[str]] = {}
    for f in verdict.get("findings", []):
        named.setdefault(f.get("node") or "", set()).add(f["kind"])
    right = sum(1 for n, k in want.items() if named.get(n) == {k})
    print(f"  preflight of all {nodes} nodes: {preflight_s:.2f} s, excludes "
          f"{len(verdict.get('exclude', []))} (faulted {len(want)}), each faulted node named "
          f"for its own kind alone: {right}/{len(want)}, others excluded: "
          f"{len(set(verdict.get('exclude', [])) - set(want))}")
    causes = sum(1 for line in scrape.splitlines()
                 if line.startswith(("ringwatch_nic_error_rate_per_second{",
                                     "ringwatch_transport_fallback{")))
    print(f"  /metrics: {scrape_s:.2f} s, {causes} cause series")


def _exact(sc: dict[str, Any], incident: dict[str, Any]) -> bool:
    """The incident names the faulted place: the node, and for a pair its GPUs."""
    d, node = incident["detail"], incident["nodes"][0]
    for f in sc["faults"]:
        if f.get("node") != node:
            continue
        if incident["kind"] == "transport_fallback" and f["kind"] == "transport":
            return sorted(d.get("gpus") or []) == sorted(f.get("gpus") or [])
        if incident["kind"] == "nic_errors" and f["kind"] == "nic_errors":
            return d.get("counter") == f["counter"]
        if incident["kind"] == "nvlink_degraded" and f["kind"] == "nvlink":
            return sorted(d.get("gpus") or []) == sorted(f["gpus"])
    return False


def main(flags: list[str]) -> None:
    rng = random.Random(41)
    sizes = (256,) if "--quick" in flags else (1024,)
    with tempfile.TemporaryDirectory(prefix="rw-why-") as tmp:
        for nodes in sizes:
            run(nodes, rng, Path(tmp))
