"""One probe cycle: plan the rounds for every rank, run them, package the results.

A cycle's results are shipped as one batch, so the analyzer compares every
group with its peers of the same cycle.
"""

from __future__ import annotations

import logging
import random
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from agents.spec import Finding, GroupSpec, Measurement, ProbeBackend, RankInfo
from services.scheduler.api_client import SchedulerApi
from services.scheduler.planner import plan_rounds
from services.scheduler.shipper import Shipper

log = logging.getLogger(__name__)
Progress = Callable[[str], None]


@dataclass(frozen=True)
class ProbeOptions:
    ops: tuple[str, ...] = ("allreduce", "alltoall")
    sizes: tuple[int, ...] = (1 << 20,)
    dtype: str = "float32"
    warmup: int = 5
    iters: int = 20


@dataclass
class CycleResult:
    backend: str
    ranks: list[RankInfo]
    measurements: list[Measurement] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)
    rounds: int = 0
    fabric_time_s: float = 0.0
    wall_time_s: float = 0.0
    injected: list[dict[str, Any]] = field(default_factory=list)

    def to_batch(self, batch_id: str | None = None) -> dict[str, Any]:
        """The body of ``POST /v1/measurements``."""
        return {
            "batch_id": batch_id or f"{self.backend}-{uuid.uuid4()}",
            "backend": self.backend,
            "measurements": [m.to_dict() for m in self.measurements],
            "ranks": [r.to_dict() for r in self.ranks],
            "findings": [f.to_dict() for f in self.findings],
            "injected": self.injected,
        }


def nodes_of_ranks(ranks: list[RankInfo], only: list[str] | None = None) -> dict[str, list[int]]:
    nodes: dict[str, list[int]] = {}
    for r in ranks:
        if only is None or r.node in only:
            nodes.setdefault(r.node, []).append(r.local_index)
    return {n: sorted(ix) for n, ix in sorted(nodes.items())}


def run_cycle(backend: ProbeBackend, options: ProbeOptions, *, only: list[str] | None = None,
              progress: Progress | None = None) -> CycleResult:
    started = time.monotonic()
    ranks = backend.ranks()
    rounds: list[list[GroupSpec]] = plan_rounds(
        nodes_of_ranks(ranks, only), ops=options.ops, sizes=options.sizes, dtype=options.dtype,
        warmup=options.warmup, iters=options.iters,
    )
    result = CycleResult(backend=backend.name, ranks=ranks,
                         injected=[f.to_dict() for f in getattr(backend, "injected", [])])
    for i, groups in enumerate(rounds, 1):
        if progress:
            scopes = ", ".join(sorted({g.scope for g in groups}))
            progress(f"round {i}/{len(rounds)}: {len(groups)} group(s) ({scopes})")
        rr = backend.run_round(groups)
        result.measurements += rr.measurements
        result.findings += rr.findings
        result.fabric_time_s += rr.fabric_time_s
    result.rounds = len(rounds)
    result.wall_time_s = time.monotonic() - started
    return result


def serve_preflight(backend: ProbeBackend, shipper: Shipper, api: SchedulerApi,
                    options: ProbeOptions, *, lease_s: float = 300.0,
                    progress: Progress | None = None) -> bool:
    """Claim one waiting preflight request, probe its nodes, ship, complete; False if none."""
    req = api.claim_preflight(lease_s)
    if req is None:
        return False
    known = {r.node for r in backend.ranks()}
    missing = sorted(set(req["nodes"]) - known)
    if missing:
        api.complete_preflight(req["id"], error=f"nodes not in this cluster: {', '.join(missing)}")
        return True
    if progress:
        progress(f"preflight {req['id'][:8]}: probing {len(req['nodes'])} node(s)")
    cycle = run_cycle(backend, options, only=req["nodes"], progress=progress)
    if shipper.ship(cycle.to_batch()):
        # Results still spooled: leave the request to be claimed again once the API takes them.
        return True
    verdict = api.complete_preflight(req["id"])
    if progress:
        progress(f"preflight {req['id'][:8]}: {'healthy' if verdict.get('healthy') else 'UNHEALTHY'}")
    return True


def run_scheduler(backend: ProbeBackend, shipper: Shipper, options: ProbeOptions, *,
                  interval_s: float, once: bool, api: SchedulerApi | None = None,
                  stop: threading.Event | None = None, progress: Progress | None = None,
                  jitter: float = 0.1, poll_s: float = 1.0) -> int:
    """Probe every ``interval_s`` (with jitter, so schedulers of many clusters do not align)
    and, between cycles, answer waiting preflight requests."""
    stop = stop or threading.Event()
    cycles = 0
    next_cycle = time.monotonic()
    while not stop.is_set():
        if time.monotonic() >= next_cycle:
            cycle = run_cycle(backend, options, progress=progress)
            left = shipper.ship(cycle.to_batch())
            cycles += 1
            if progress:
                progress(f"cycle {cycles}: {len(cycle.measurements)} measurements, "
                         f"{len(cycle.findings)} findings, {left} batch(es) still spooled")
            if once:
                break
            next_cycle = time.monotonic() + interval_s * (1 + random.uniform(-jitter, jitter))
        else:
            shipper.flush()
        served = api is not None and serve_preflight(backend, shipper, api, options, progress=progress)
        if not served:
            stop.wait(max(0.0, min(poll_s, next_cycle - time.monotonic())))
    return cycles
