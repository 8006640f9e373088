"""Probe this machine alone: every op at every world size from 1 to its GPUs, one process
per rank (each a ``ProbeAgent`` calling ``run_group``, as under Ray, but with no Ray), a
TCPStore hosted here, NVML read before and after, and the same reduction of the ranks'
reports to measurements and findings that the Ray driver uses (``agents.outcome``).
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import re
import socket
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ringwatch.agents import outcome, telemetry
from ringwatch.agents.device import check_cuda
from ringwatch.agents.probe import store_server
from ringwatch.agents.spec import Finding, GroupSpec, InjectedFault, Measurement

Progress = Callable[[str], None]


@dataclass(frozen=True)
class SelftestOptions:
    backend: str = "nccl"
    world_sizes: tuple[int, ...] = (1,)
    ops: tuple[str, ...] = ("allreduce", "alltoall", "allgather", "reducescatter", "sendrecv")
    sizes: tuple[int, ...] = (8, 1 << 20)
    dtype: str = "float32"
    redop: str = "sum"
    warmup: int = 5
    iters: int = 20
    repeats: int = 1
    cuda_graph: bool = True
    deadline_s: float = 300.0
    # Faults injected into this machine's ranks, to see that the selftest catches them.
    faults: tuple[InjectedFault, ...] = ()


@dataclass
class WorldResult:
    world_size: int
    measurements: list[Measurement] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)
    wall_s: float = 0.0


@dataclass
class SelftestResult:
    node: str
    backend: str
    gpus: list[dict[str, Any]] = field(default_factory=list)
    worlds: list[WorldResult] = field(default_factory=list)
    telemetry_findings: list[Finding] = field(default_factory=list)

    @property
    def findings(self) -> list[Finding]:
        return [f for w in self.worlds for f in w.findings] + self.telemetry_findings

    @property
    def measurements(self) -> list[Measurement]:
        return [m for w in self.worlds for m in w.measurements]


def node_name() -> str:
    """This host's name as a node name (no slashes, commas or spaces)."""
    return re.sub(r"[/,\s]", "-", socket.gethostname()) or "localhost"


def gpu_count(backend: str) -> int:
    """GPUs this machine can probe; ProbeSetupError (one line) when it has none for nccl."""
    if backend != "nccl":
        return 0
    from ringwatch.agents import device

    check_cuda(0)
    return device.cuda.device_count()


def _rank_main(backend: str, node: str, index: int, spec: dict[str, Any], rank: int, port: int,
               group_id: str, replies: Any, faults: list[dict[str, Any]]) -> None:
    """One rank's process: an agent on GPU ``index`` (or a CPU slot) runs the group."""
    from ringwatch.agents.probe import ProbeAgent

    agent = ProbeAgent(node, index, backend, host="127.0.0.1")
    agent.set_injected(faults)
    replies.put((rank, agent.run_group(spec, rank, "127.0.0.1", port, group_id)))


def run_world(options: SelftestOptions, world_size: int, node: str,
              progress: Progress = lambda _m: None) -> WorldResult:
    """Every op and size on ranks 0..world_size-1 of this machine, in one group."""
    started = time.monotonic()
    members = tuple(f"{node}/{i}" for i in range(world_size))
    spec = GroupSpec("intra_node", members, ops=options.ops, sizes=options.sizes,
                     dtype=options.dtype, warmup=options.warmup, iters=options.iters,
                     deadline_s=options.deadline_s, redop=options.redop)
    faults = [f for f in options.faults if f.member in members]
    payload = {**spec.to_dict(), "repeats": options.repeats, "cuda_graph": options.cuda_graph,
               "calibrate": any(f.kind == "slow" for f in faults)}
    # Its ranks are this machine's processes: the store listens on loopback alone.
    store = store_server("127.0.0.1", options.deadline_s, listen_there_only=True)
    ctx = mp.get_context("spawn")  # CUDA cannot be forked into
    replies_q = ctx.Queue()
    group_id = uuid.uuid4().hex[:8]
    procs = [ctx.Process(target=_rank_main, daemon=True,
                         args=(options.backend, node, rank, payload, rank, store.port, group_id,
                               replies_q, [f.to_dict() for f in faults
                                           if f.member == members[rank]]))
             for rank in range(world_size)]
    for p in procs:
        p.start()
    replies: dict[int, dict[str, Any]] = {}
    deadline = started + options.deadline_s
    while len(replies) < world_size and time.monotonic() < deadline:
        try:
            rank, reply = replies_q.get(timeout=0.5)
            replies[rank] = reply
        except queue.Empty:
            if not any(p.is_alive() for p in procs) and replies_q.empty():
                break  # every rank process has gone without a word: they died
    died = {r: f"rank process exited with code {procs[r].exitcode}" for r in range(world_size)
            if r not in replies and procs[r].exitcode not in (None, 0)}
    result = WorldResult(world_size)
    injected = [(f.kind, f.member) for f in faults]
    result.findings += outcome.error_findings(spec, replies, died, injected)
    missing = [r for r in range(world_size) if r not in replies and r not in died]
    if missing:
        ranks, stage = outcome.hang_suspects(store, spec, missing)
        result.findings += [Finding(kind="hang", node=node, gpu=r, detail={
            "members": list(members), "scope": spec.scope, "rank": r, "stage": stage,
            "deadline_s": options.deadline_s}) for r in ranks]
        progress(f"world size {world_size}: hung at {stage}: ranks {ranks}")
    result.findings += outcome.corruption_findings(spec, replies, injected)
    result.measurements = outcome.measurements(spec, replies)
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
    result.wall_s = time.monotonic() - started
    return result


def read_gpus(count: int) -> list[dict[str, Any]]:
    return [telemetry.read_gpu_telemetry(i) for i in range(count)]


def run_selftest(options: SelftestOptions, progress: Progress = lambda _m: None) -> SelftestResult:
    node = node_name()
    gpus = gpu_count(options.backend)
    result = SelftestResult(node=node, backend=options.backend, gpus=read_gpus(gpus))
    for n in options.world_sizes:
        progress(f"world size {n}: {len(options.ops)} op(s) x {len(options.sizes)} size(s)")
        result.worlds.append(run_world(options, n, node, progress))
    after = read_gpus(gpus)
    for i, (before_i, after_i) in enumerate(zip(result.gpus, after, strict=True)):
        result.telemetry_findings += telemetry.telemetry_findings(before_i, after_i, node, i)
    result.gpus = after
    return result
