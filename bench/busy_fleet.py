"""A busy fleet: most nodes in training jobs, faults on idle and on busy nodes, through the
real `ringwatch scheduler` (sim backend, its scenario's jobs as the occupancy source), the
real API and Postgres, at default settings (docs/operations.md, "Occupancy and contention").

60 % of the nodes run jobs over cycles 1-4 with 40-70 % of their links' bandwidth; six
faults: an NVLink pair at 0.5, a NIC at 0.5 and a node pair at 0.4 on idle nodes, the same
three kinds on busy nodes. Printed per cycle: busy nodes skipped, incidents open, healthy
nodes whose ringwatch_node_healthy read 0, incidents naming a healthy busy node, and the
cycle's wall time; then when each fault opened against its bound (idle: by cycle 2; busy:
within 2 cycles after its job ends), and whether a busy node's last-probe time moved while
its job ran.

    python -m bench.run busy_fleet            # 1024 x 8
    python -m bench.run busy_fleet --quick    # 256 x 8
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

GPUS = 8
JOB_CYCLES = (1, 4)
CYCLES = 7
# Cycles after its job ends by which a fault on a busy node must have opened, and the cycle
# by which a fault on an idle node must (the hysteresis opens on the second bad cycle).
AFTER_JOB = 2
IDLE_BY = 2
# The jobs' share of the fleet and the traffic each puts on its nodes' links.
BUSY_SHARE = 0.6
TRAFFIC = ((0.4, 0.5), (0.5, 0.6), (0.7, 0.4), (0.6, 0.7))


def name(i: int) -> str:
    return f"node-{i:03d}"


def scenario(nodes: int, seed: int = 11) -> dict[str, Any]:
    """The fleet: four jobs over the first 60 % of the nodes (as Slurm host lists), three
    faults inside them and three among the idle rest."""
    busy = int(nodes * BUSY_SHARE)
    bounds = [round(busy * k / len(TRAFFIC)) for k in range(len(TRAFFIC) + 1)]
    jobs = [{"id": f"train-{k}", "nodes": f"node-[{bounds[k]:03d}-{bounds[k + 1] - 1:03d}]",
             "cycles": list(JOB_CYCLES), "traffic": {"nvlink": nv, "network": net}}
            for k, (nv, net) in enumerate(TRAFFIC)]
    idle = list(range(busy, nodes))
    faults = [
        # On idle nodes.
        {"kind": "nvlink", "node": name(idle[len(idle) // 4]), "gpus": [2, 5], "factor": 0.5},
        {"kind": "nic", "node": name(idle[len(idle) // 2]), "factor": 0.5},
        {"kind": "net_path", "nodes": [name(idle[len(idle) * 3 // 4]), name(idle[-2])],
         "factor": 0.4},
        # On busy nodes: the first, second and (a pair across) the third and fourth jobs.
        {"kind": "nvlink", "node": name(bounds[0] + 3), "gpus": [1, 6], "factor": 0.5},
        {"kind": "nic", "node": name(bounds[1] + 5), "factor": 0.5},
        {"kind": "net_path", "nodes": [name(bounds[2] + 2), name(bounds[3] + 4)], "factor": 0.4},
    ]
    return {"nodes": nodes, "gpus_per_node": GPUS, "gpu": "H100-SXM", "noise": 0.03,
            "seed": seed, "jobs": jobs, "faults": faults}


def busy_nodes(sc: dict[str, Any]) -> set[str]:
    return {name(i) for i in range(int(sc["nodes"] * BUSY_SHARE))}


def excluded_by(sc: dict[str, Any]) -> set[str]:
    """Nodes a fault rightly excludes (a path excludes neither end)."""
    return {f["node"] for f in sc["faults"] if f["kind"] != "net_path"}


def matches(fault: dict[str, Any], incident: dict[str, Any]) -> bool:
    """An incident is this fault: its kind, at its place."""
    want = {"nvlink": "nvlink_degraded", "nic": "nic_degraded",
            "net_path": "net_path_degraded"}[fault["kind"]]
    if incident["kind"] != want:
        return False
    if fault["kind"] == "net_path":
        return sorted(incident["nodes"]) == sorted(fault["nodes"])
    if incident["nodes"] != [fault["node"]]:
        return False
    return fault["kind"] != "nvlink" or incident["detail"].get("gpus") == fault["gpus"]


SAMPLE = re.compile(r'^(\w+)\{([^}]*)\} (\S+)$')


def samples(text: str, family: str) -> dict[str, float]:
    """``family``'s value per ``node`` label in a /metrics scrape."""
    out = {}
    for line in text.splitlines():
        m = SAMPLE.match(line)
        if m and m.group(1) == family:
            labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2)))
            out[labels.get("node", "")] = float(m.group(3))
    return out


@dataclass
class Look:
    """What the API showed after one cycle."""

    cycle: int
    wall_s: float
    skipped: int
    incidents: list[dict[str, Any]]
    healthy: dict[str, float]
    last_probe: dict[str, float]
    occupied: dict[str, dict[str, Any]] = field(default_factory=dict)
    # /metrics as a scrape found it: its series, its size, and what its caps left out
    # (ringwatch_metrics_series_dropped, docs/security.md): a real fleet's must be none.
    series: int = 0
    scrape_bytes: int = 0
    dropped: float = 0.0


def scheduler_once(env: dict[str, str], fabric: Path) -> tuple[float, str]:
    """One `ringwatch scheduler --fabric FILE --once` at default settings: its wall time
    and its cycle line."""
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "ringwatch.services.cli.main", "scheduler", "--fabric",
                          str(fabric), "--once"], env=env, capture_output=True, text=True,
                         timeout=1800)
    if out.returncode != 0:
        raise RuntimeError(f"scheduler exited {out.returncode}: {out.stderr[-800:]}")
    line = next((x for x in out.stderr.splitlines() if re.search(r"cycle \d+:", x)), "")
    return time.monotonic() - t0, line


def look(api: httpx.Client, cycle: int, wall_s: float, line: str) -> Look:
    scrape = api.get("/metrics").text
    nodes: list[dict[str, Any]] = []
    after = None
    while True:
        resp = api.get("/v1/nodes", params={"limit": 5000, **({"after": after} if after else {})})
        resp.raise_for_status()
        nodes += resp.json()
        after = resp.headers.get("X-Next-Cursor")
        if not after:
            break
    found = re.search(r"(\d+) busy node\(s\) skipped", line)
    return Look(cycle, wall_s, int(found.group(1)) if found else -1,
                api.get("/v1/findings", params={"limit": 1000}).json(),
                samples(scrape, "ringwatch_node_healthy"),
                samples(scrape, "ringwatch_node_last_probe_timestamp_seconds"),
                {n["name"]: n["occupied"] for n in nodes if n.get("occupied")},
                sum(1 for x in scrape.splitlines() if x and not x.startswith("#")),
                len(scrape.encode()),
                sum(float(v) for v in re.findall(
                    r"^ringwatch_metrics_series_dropped\{[^}]*\} (\S+)$", scrape, re.M)))


def run_fleet(env: dict[str, str], api: httpx.Client, fabric: Path,
              cycles: int = CYCLES) -> list[Look]:
    looks = []
    for c in range(1, cycles + 1):
        wall, line = scheduler_once(env, fabric)
        looks.append(look(api, c, wall, line))
    return looks


@dataclass
class Outcome:
    """The issue's four conditions, read off the looks."""

    opened: dict[int, int | None]
    false_busy: list[tuple[int, str]]
    healthy_zero: list[tuple[int, str]]
    moved: list[str]


def judge(sc: dict[str, Any], looks: list[Look]) -> Outcome:
    busy, bad = busy_nodes(sc), excluded_by(sc)
    faulted = {n for f in sc["faults"] for n in ([f["node"]] if "node" in f else f["nodes"])}
    opened: dict[int, int | None] = {}
    for i, fault in enumerate(sc["faults"]):
        opened[i] = next((x.cycle for x in looks
                          if any(matches(fault, inc) for inc in x.incidents)), None)
    false_busy = sorted({(x.cycle, n) for x in looks for inc in x.incidents
                         for n in inc["nodes"] if n in busy and n not in faulted})
    healthy_zero = sorted({(x.cycle, n) for x in looks for n, v in x.healthy.items()
                           if v == 0 and n not in bad})
    during = [x for x in looks if JOB_CYCLES[0] <= x.cycle <= JOB_CYCLES[1]]
    moved = sorted(n for n in busy if len({x.last_probe.get(n) for x in during}) > 1)
    return Outcome(opened, false_busy, healthy_zero, moved)


def bound(fault: dict[str, Any], sc: dict[str, Any]) -> int:
    nodes = [fault["node"]] if "node" in fault else fault["nodes"]
    return JOB_CYCLES[1] + AFTER_JOB if set(nodes) & busy_nodes(sc) else IDLE_BY


def report(sc: dict[str, Any], looks: list[Look]) -> None:
    o = judge(sc, looks)
    busy = busy_nodes(sc)
    print(f"\n{sc['nodes']} x {GPUS}: {len(busy)} nodes in {len(sc['jobs'])} jobs over cycles "
          f"{JOB_CYCLES[0]}-{JOB_CYCLES[1]}, {len(sc['faults'])} faults, default settings")
    print(f"  {'cycle':>5}{'wall s':>8}{'skipped':>9}{'busy shown':>12}{'incidents':>11}"
          f"{'healthy=0':>11}{'/metrics series':>17}{'kB':>7}{'dropped':>9}")
    for x in looks:
        zero = sum(1 for n, v in x.healthy.items() if v == 0)
        print(f"  {x.cycle:>5}{x.wall_s:>8.1f}{x.skipped:>9}{len(x.occupied):>12}"
              f"{len(x.incidents):>11}{zero:>11}{x.series:>17}{x.scrape_bytes // 1000:>7}"
              f"{x.dropped:>9.0f}")
    print(f"  {'fault':<32}{'where':>7}{'opened':>8}{'bound':>7}")
    for i, f in enumerate(sc["faults"]):
        where = "busy" if bound(f, sc) > IDLE_BY else "idle"
        place = f.get("node") or "-".join(f["nodes"])
        got = o.opened[i]
        print(f"  {f['kind'] + ' ' + place:<32}{where:>7}{'-' if got is None else got:>8}"
              f"{'<= ' + str(bound(f, sc)):>7}")
    print(f"  incidents naming a healthy busy node: {len(o.false_busy)}; healthy nodes read "
          f"unhealthy: {len(o.healthy_zero)}; busy nodes whose last-probe time moved while "
          f"their job ran: {len(o.moved)}")


def main(flags: list[str]) -> None:
    import os

    from bench.monitoring import Fleet

    # Every scrape reads the database (the API's own default caches it 10 s): each look must
    # see its own cycle, which here is seconds after the last.
    os.environ["RINGWATCH_METRICS_CACHE_S"] = "0"
    nodes = 256 if "--quick" in flags else 1024
    sc = scenario(nodes)
    with tempfile.TemporaryDirectory(prefix="rw-busy-") as tmp:
        state = Path(tmp)
        path = state / f"busy-{nodes}.json"
        path.write_text(json.dumps(sc))
        fleet = Fleet(path, state / "fleet")
        try:
            looks = run_fleet(fleet.env, fleet.api, path)
        finally:
            fleet.close()
    report(sc, looks)
