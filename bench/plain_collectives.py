"""An independent reference: plain torch.distributed on gloo, no Ray, no ringwatch code.

Times each op the nccl-tests way (warm-ups, barrier, timed loop, barrier; the slowest
rank's mean time) so ringwatch's busbw can be checked against it.
"""

from __future__ import annotations

import datetime
import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# nccl-tests doc/PERFORMANCE.md
FACTORS = {
    "allreduce": lambda n: 2 * (n - 1) / n,
    "allgather": lambda n: (n - 1) / n,
    "reducescatter": lambda n: (n - 1) / n,
    "alltoall": lambda n: (n - 1) / n,
}


def _run(op: str, n: int, size: int):
    """Returns (send buffer, recv buffer, callable) with ``size`` in nccl-tests' convention."""
    count = size // 4 // n * n
    if op == "allreduce":
        x = torch.ones(count)
        return lambda: dist.all_reduce(x)
    if op == "alltoall":
        x, y = torch.ones(count), torch.empty(count)
        return lambda: dist.all_to_all_single(y, x)
    if op == "allgather":  # size counts the output
        x, y = torch.ones(count // n), torch.empty(count)
        return lambda: dist.all_gather_into_tensor(y, x)
    x, y = torch.ones(count), torch.empty(count // n)  # reducescatter: size counts the input
    return lambda: dist.reduce_scatter_tensor(y, x)


def _worker(rank: int, n: int, port: int, cases, warmup: int, iters: int, out) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=n, timeout=datetime.timedelta(seconds=120))
    results = {}
    for op, size in cases:
        fn = _run(op, n, size)
        for _ in range(warmup):
            fn()
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        dist.barrier()
        t = torch.tensor([(time.perf_counter() - t0) / iters], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        results[(op, size)] = t.item()
    if rank == 0:
        out.put(results)
    dist.destroy_process_group()


def measure(cases: list[tuple[str, int]], n: int, warmup: int, iters: int) -> dict[tuple[str, int], float]:
    """busbw in GB/s for each (op, size) on ``n`` local gloo ranks."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, n, port, cases, warmup, iters, out)) for r in range(n)]
    for p in procs:
        p.start()
    times = out.get(timeout=600)
    for p in procs:
        p.join()
    return {k: size / t / 1e9 * FACTORS[k[0]](n) for k, t in times.items() for size in [k[1]]}
