"""What an agent's lifecycle costs, on a local Ray cluster of 2 nodes x 2 gloo ranks run as
nccl agents are (they end at ``release`` and start again at ``acquire``): the set-up and
tear-down seconds per cycle, first cycle and steady state; and what an idle agent holds,
its resident host memory and the CPU it uses while it waits, with Ray's own processes per
node beside it. The figures size the GPU workers' requests (deploy/kubernetes)."""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path
from typing import Any

import psutil

from ringwatch.agents.spec import GroupSpec
from ringwatch.services.scheduler.ray_backend import RayBackend

NODES, RANKS = 2, 2
IDLE_S = 10.0
MIB = 1 << 20


def main(flags: list[str]) -> None:
    cycles = 3 if "--quick" in flags else 6
    started = time.perf_counter()
    with RayBackend("gloo", local_nodes=NODES, ranks_per_node=RANKS, hold_between_cycles=False,
                    temp_dir=Path(".ringwatch") / "ray") as backend:
        start_s = time.perf_counter() - started
        nodes = sorted({r.node for r in backend.ranks()})
        acquire_s, release_s = [], []
        idle_lines: list[str] = []
        for _ in range(cycles):
            acquire_s.append(backend.acquire(nodes))
            backend.run_round(groups(backend))
            if len(acquire_s) == cycles:
                idle_lines = idle(backend)
            release_s.append(backend.release())
        probe_lines = probes_and_monitor()
    steady_a, steady_r = acquire_s[1:], release_s[1:]
    print(f"local Ray cluster, {NODES} nodes x {RANKS} gloo ranks, agents ending between "
          f"cycles (the nccl lifecycle); {psutil.cpu_count()} cores here")
    print(f"  start (cluster, and every agent's first start, cold): {start_s:.2f} s")
    print(f"  cycle 1: acquire {acquire_s[0]:.3f} s (the agents from the start are still up), "
          f"release {release_s[0]:.3f} s")
    print(f"  cycles 2-{cycles} (steady state): acquire median {statistics.median(steady_a):.2f} s "
          f"(min {min(steady_a):.2f}, max {max(steady_a):.2f}); release median "
          f"{statistics.median(steady_r):.3f} s (max {max(steady_r):.3f})")
    print(f"  set-up and tear-down per cycle, counted in each probed rank's duty cycle: "
          f"{statistics.median(steady_a) + statistics.median(steady_r):.2f} s")
    for line in idle_lines + probe_lines:
        print(line)


def probes_and_monitor() -> list[str]:
    """What the worker pod holds besides: Ray's log monitor, and one `ray health-check`
    (the kubelet's probe of the GPU workers runs it three times every 30 s)."""
    import resource
    import shutil
    import subprocess

    import ray

    monitors = [p.memory_info().rss / MIB for p in psutil.Process().children(recursive=True)
                if "log_monitor" in " ".join(_cmdline(p))]
    ray_bin = shutil.which("ray") or str(Path(sys.executable).with_name("ray"))
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    check = subprocess.Popen([ray_bin, "health-check", "--address",
                              ray.get_runtime_context().gcs_address],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    peak = 0.0
    while check.poll() is None:  # its own peak resident memory, sampled
        try:
            peak = max(peak, psutil.Process(check.pid).memory_info().rss / MIB)
        except psutil.Error:
            break
        time.sleep(0.02)
    check.wait(120)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    return [f"  Ray's log monitor: resident {_range(monitors)} MiB; one `ray health-check`: "
            f"{cpu:.2f} CPU-s, about {peak:.0f} MiB resident at its peak"]


def _cmdline(p: psutil.Process) -> list[str]:
    try:
        return p.cmdline()
    except psutil.Error:
        return []


def groups(backend: RayBackend) -> list[GroupSpec]:
    """Each node's intra-node group: one small allreduce, so every agent has run a group."""
    by_node: dict[str, list[str]] = {}
    for r in backend.ranks():
        by_node.setdefault(r.node, []).append(r.member)
    return [GroupSpec("intra_node", tuple(m), ops=("allreduce",), sizes=(1 << 16,), warmup=1,
                      iters=3) for m in by_node.values()]


def idle(backend: RayBackend) -> list[str]:
    """Each agent's own footprint, read by the agent (as on a cluster), IDLE_S apart with
    nothing asked of it in between, with psutil's view of the same processes; and Ray's own
    processes of each node over the same seconds."""
    before, ray_before = backend.footprints(), _ray_per_node()
    time.sleep(IDLE_S)
    after, ray_after = backend.footprints(), _ray_per_node()
    members = sorted(after)
    rss = [after[m]["rss_bytes"] / MIB for m in members]
    cpu = [(after[m]["cpu_s"] - before[m]["cpu_s"]) * 1000 / IDLE_S for m in members]
    uss = [u for u in (_uss(after[m]["pid"]) for m in members) if u is not None]
    ray_cpu = [(ray_after[k][1] - ray_before[k][1]) * 1000 / IDLE_S
               for k in ray_after if k in ray_before]
    return [
        f"  an idle agent (after a group), over {IDLE_S:.0f} s: resident {_range(rss)} MiB "
        f"(unique to it, psutil's USS: {_range(uss)} MiB); CPU {_range(cpu, '.1f')} ms per s",
        f"  Ray's own processes on each node (raylet, its dashboard and runtime-env agents), "
        f"agents or not: resident {_range([v[0] for v in ray_after.values()])} MiB; CPU "
        f"{_range(ray_cpu, '.1f')} ms per s",
    ]


def _uss(pid: int) -> float | None:
    try:
        return psutil.Process(pid).memory_full_info().uss / MIB
    except (psutil.Error, AttributeError):
        return None


# The per-node processes each raylet starts beside the workers.
_RAY_NODE_PROCESSES = ("ray::DashboardAgent", "ray::RuntimeEnvAgent")


def _ray_per_node() -> dict[int, tuple[float, float]]:
    """Per raylet of this driver's cluster (by pid), with its per-node agents: resident MiB
    and CPU seconds used so far; what a node holds for Ray whether or not agents run there."""
    nodes = {}
    for proc in psutil.Process().children(recursive=True):
        try:
            if proc.name() != "raylet":
                continue
            own = [proc] + [c for c in proc.children() if c.name() in _RAY_NODE_PROCESSES]
            nodes[proc.pid] = (sum(p.memory_info().rss for p in own) / MIB,
                               sum(sum(p.cpu_times()[:2]) for p in own))
        except psutil.Error:
            continue
    return nodes


def _range(values: list[Any], spec: str = ".0f") -> str:
    if not values:
        return "n/a"
    lo, hi = min(values), max(values)
    return f"{lo:{spec}}" if f"{lo:{spec}}" == f"{hi:{spec}}" else f"{lo:{spec}}-{hi:{spec}}"


if __name__ == "__main__":
    main([])
