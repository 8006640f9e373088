"""The probe's timing loop as a user checks it: does an injected slow factor slow a group by
what it says, what does a sync point cost, and (on a GPU) what does CUDA-graph replay buy
over an eager loop at every size from 8 B to 1 GiB.

The CPU part always runs (gloo ranks on threads, the host device). The GPU part runs where
torch sees CUDA: world size 1, as one GPU allows; compare its figures with
``ringwatch selftest --nccl-tests DIR`` or nccl-tests' own tables.
"""

from __future__ import annotations

import statistics
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ringwatch.agents.collectives import OPS, plan
from ringwatch.agents.device import CudaDevice, HostDevice, ProbeDevice
from ringwatch.agents.probe import _sync_point, leave_group, make_group, run_probe

TRIALS = 3


def on_group(n: int, backend: str, fn: Callable[[int, Any, ProbeDevice], Any]) -> list[Any]:
    """``fn(rank, pg, device)`` on ``n`` threads of one process, in one fresh group."""
    store = dist.PrefixStore(uuid.uuid4().hex, dist.HashStore())
    out: list[Any] = [None] * n
    errors: list[BaseException] = []

    def work(rank: int) -> None:
        try:
            device: ProbeDevice = CudaDevice(rank) if backend == "nccl" else HostDevice()
            pg = make_group(backend, store, rank, n, 120, device=device)
            try:
                out[rank] = fn(rank, pg, device)
            finally:
                # Shut down as agents do: a group left to the collector was seen to raise
                # an async "unhandled system error" from NCCL's watchdog on an H200.
                leave_group(pg, failed=False)
        except BaseException as exc:  # reported below, with the rank's traceback lost
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return out


def group_time_us(backend: str, n: int, op: str, size: int, *, slow: float | None = None,
                  graph: bool = True, iters: int = 20, warmup: int = 5) -> tuple[float, str]:
    """The group's time per iteration (slowest rank), median of TRIALS repeats."""
    buf = plan(op, size, n, "float32")

    def probe(rank: int, pg: Any, device: ProbeDevice) -> dict[str, Any]:
        return run_probe(pg, buf, rank, backend=backend, device=device, warmup=warmup,
                         iters=iters, repeats=TRIALS, cuda_graph=graph, calibrate=True,
                         slow_factor=slow if rank == n - 1 else None)

    res = on_group(n, backend, probe)
    per_repeat = [max(r["times_s"][i] for r in res) for i in range(TRIALS)]
    return statistics.median(per_repeat) * 1e6, res[0]["timing"]


def slow_accuracy_processes(sizes: list[int], factors: list[float], repeats: int = 5) -> None:
    """Through ``ringwatch selftest``'s runner: gloo ranks in processes of their own, as
    agents run, with the fault injected into rank 1."""
    from ringwatch.agents.spec import InjectedFault
    from ringwatch.services.selftest.runner import SelftestOptions, run_world

    def times(faults: tuple[InjectedFault, ...]) -> dict[int, float]:
        world = run_world(SelftestOptions(backend="gloo", ops=("allreduce",), sizes=tuple(sizes),
                                          repeats=repeats, faults=faults), 2, "bench")
        return {m.size_bytes: m.time_us for m in world.measurements}

    print(f"\ninjected slow factor, gloo, 2 rank processes, allreduce: measured slowdown "
          f"(target 1/factor), median of {repeats} repeats")
    print(f"  {'size':>10}{'base us':>11}" + "".join(f"{f'x{1 / f:.0f} at f={f}':>16}"
                                                   for f in factors))
    base = times(())
    slowed = {f: times((InjectedFault("slow", "bench", 1, f),)) for f in factors}
    for size in sizes:
        print(f"  {size:>10}{base[size]:>11.1f}"
              + "".join(f"{slowed[f][size] / base[size]:>16.2f}" for f in factors))


def slow_accuracy(backend: str, n: int, sizes: list[int], factors: list[float],
                  op: str = "allreduce") -> None:
    print(f"\ninjected slow factor on {backend}, {n} ranks, {op}: measured slowdown "
          f"(target 1/factor), median of {TRIALS} repeats")
    print(f"  {'size':>10}{'base us':>11}" + "".join(f"{f'x{1 / f:.0f} at f={f}':>16}"
                                                   for f in factors))
    for size in sizes:
        base, _ = group_time_us(backend, n, op, size)
        cells = []
        for f in factors:
            t, _ = group_time_us(backend, n, op, size, slow=f)
            cells.append(f"{t / base:>16.2f}")
        print(f"  {size:>10}{base:>11.1f}" + "".join(cells))


def sync_cost(backend: str, n: int, trials: int = 200) -> None:
    def sync(rank: int, pg: Any, device: ProbeDevice) -> float:
        for _ in range(10):
            _sync_point(pg, device)
        t0 = time.perf_counter()
        for _ in range(trials):
            _sync_point(pg, device)
        return (time.perf_counter() - t0) / trials * 1e6

    us = on_group(n, backend, sync)
    print(f"\nsync point (one-element MIN allreduce + wait + synchronize) on {backend}, "
          f"{n} ranks: {max(us):.1f} us each")


def gpu_sweep(sizes: list[int]) -> None:
    print("\nGPU, world size 1, float32, warmup 5, 20 iterations: time per op in us, "
          "CUDA graph replay vs eager loop timed by events")
    print(f"  {'op':<14}{'size':>12}{'graph us':>11}{'eager us':>11}{'eager/graph':>13}")
    for op in sorted(OPS):
        for size in sizes:
            g, timing = group_time_us("nccl", 1, op, size, graph=True)
            e, _ = group_time_us("nccl", 1, op, size, graph=False)
            mark = "" if timing == "cuda_graph" else f"  ({timing})"
            print(f"  {op:<14}{size:>12}{g:>11.2f}{e:>11.2f}{e / g:>13.2f}{mark}")


def main(flags: list[str]) -> None:
    quick = "--quick" in flags
    torch.set_num_threads(1)
    slow_accuracy_processes([1 << 16, 1 << 20] if quick else [1 << 16, 1 << 20, 4 << 20, 16 << 20],
                            [0.5, 0.25])
    if not torch.cuda.is_available():
        print("\nno CUDA here: the GPU part (graph vs eager per size, GPU-side slow delay) "
              "runs where torch sees a GPU")
        return
    print(f"\nGPU: {torch.cuda.get_device_name(0)}, torch {torch.__version__}, "
          f"NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}")
    sync_cost("nccl", 1)
    sizes = [8, 1 << 10, 1 << 16, 1 << 20, 16 << 20, 128 << 20]
    if not quick:
        sizes.append(1 << 30)
    gpu_sweep(sizes)
    # AllGather: on one rank an in-place AllReduce is no work (0.5 us), which a delay
    # kernel's own launch would swamp.
    slow_accuracy("nccl", 1, [1 << 20, 16 << 20, 128 << 20], [0.5, 0.25], op="allgather")
