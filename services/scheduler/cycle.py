"""One probe cycle: plan the rounds for every rank, run them, package the results.

A cycle's results are shipped as one batch, so the analyzer compares every
group with its peers of the same cycle.
"""

from __future__ import annotations

import random
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from agents.spec import Finding, GroupSpec, Measurement, ProbeBackend, RankInfo
from services.scheduler.api_client import SchedulerApi
from services.scheduler.deadlines import group_deadline_s
from services.scheduler.planner import layout_of, plan_rounds
from services.scheduler.shipper import Shipper

Progress = Callable[[str], None]


@dataclass(frozen=True)
class ProbeOptions:
    ops: tuple[str, ...] = ("allreduce", "alltoall")
    sizes: tuple[int, ...] = (1 << 20,)
    dtype: str = "float32"
    warmup: int = 5
    iters: int = 20
    # nccl-tests' -o for AllReduce and ReduceScatter: sum, max, min, or avg (nccl only).
    redop: str = "sum"


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
    # Nodes left out because other work held them, with the reason.
    skipped: dict[str, str] = field(default_factory=dict)
    # Seconds each rank spent inside probe groups in this cycle.
    busy_s: dict[str, float] = field(default_factory=dict)
    duty_cycle: dict[str, float] = field(default_factory=dict)

    def to_batch(self, batch_id: str | None = None) -> dict[str, Any]:
        """The body of ``POST /v1/measurements``."""
        return {
            "batch_id": batch_id or f"{self.backend}-{uuid.uuid4()}",
            "backend": self.backend,
            "measurements": [m.to_dict() for m in self.measurements],
            "ranks": [r.to_dict() for r in self.ranks],
            "findings": [f.to_dict() for f in self.findings],
            "injected": self.injected,
            "skipped": self.skipped,
            "duty_cycle": self.duty_cycle,
        }


def run_cycle(backend: ProbeBackend, options: ProbeOptions, *, only: list[str] | None = None,
              progress: Progress | None = None, skip_busy: bool = False) -> CycleResult:
    started = time.monotonic()
    ranks = backend.ranks()
    layout = layout_of(ranks, only)
    skipped = _busy(backend, layout) if skip_busy else {}
    for node, reason in skipped.items():
        if progress:
            progress(f"skipping {node}: {reason}")
        del layout[node]
    deadline = group_deadline_s(backend.name, options.ops, options.sizes, warmup=options.warmup,
                                iters=options.iters, repeats=getattr(backend, "repeats", 1))
    rounds: list[list[GroupSpec]] = plan_rounds(
        layout, ops=options.ops, sizes=options.sizes, dtype=options.dtype,
        warmup=options.warmup, iters=options.iters, deadline_s=deadline, redop=options.redop,
    )
    result = CycleResult(backend=backend.name, ranks=ranks, skipped=skipped,
                         injected=[f.to_dict() for f in getattr(backend, "injected", [])])
    for i, groups in enumerate(rounds, 1):
        if progress:
            scopes = ", ".join(sorted({g.scope for g in groups}))
            progress(f"round {i}/{len(rounds)}: {len(groups)} group(s) ({scopes})")
        rr = backend.run_round(groups)
        for g in groups:
            for m in g.members:
                held = rr.busy_s.get(m, rr.wall_time_s)
                result.busy_s[m] = result.busy_s.get(m, 0.0) + held
        result.measurements += rr.measurements
        result.findings += rr.findings
        result.fabric_time_s += rr.fabric_time_s
    result.rounds = len(rounds)
    result.wall_time_s = time.monotonic() - started
    return result


def _busy(backend: ProbeBackend, layout: dict[str, list[int]]) -> dict[str, str]:
    busy_nodes = getattr(backend, "busy_nodes", None)
    if busy_nodes is None:
        return {}
    return {n: r for n, r in busy_nodes().items() if n in layout}


class DutyCycle:
    """The fraction of each GPU's time spent probing since the scheduler started, per node
    (its busiest rank). Read at the start of a cycle, it covers whole cycles and the waits
    between them, so the first cycle has none to report."""

    def __init__(self) -> None:
        self.started = time.monotonic()
        self.busy_s: dict[str, float] = {}

    def add(self, cycle: CycleResult) -> None:
        for member, seconds in cycle.busy_s.items():
            self.busy_s[member] = self.busy_s.get(member, 0.0) + seconds

    def fractions(self) -> dict[str, float]:
        elapsed = max(time.monotonic() - self.started, 1e-9)
        per_node: dict[str, float] = {}
        for member, seconds in self.busy_s.items():
            node = member.split("/")[0]
            per_node[node] = max(per_node.get(node, 0.0), seconds / elapsed)
        return {n: round(v, 6) for n, v in sorted(per_node.items())}


class Recording:
    """A backend seen through a recorder: every round's results are kept for shipping."""

    def __init__(self, backend: ProbeBackend) -> None:
        self.backend = backend
        self.name = backend.name
        self.measurements: list[Measurement] = []
        self.findings: list[Finding] = []

    def ranks(self) -> list[RankInfo]:
        return self.backend.ranks()

    def run_round(self, groups: list[GroupSpec]):  # -> RoundResult
        result = self.backend.run_round(groups)
        self.measurements += result.measurements
        self.findings += result.findings
        return result

    def close(self) -> None:
        """The recorder owns nothing; the backend is closed by whoever opened it."""

    def __getattr__(self, name: str) -> Any:  # preflight_sizes, expected_busbw, repeats ...
        return getattr(self.backend, name)


def serve_preflight(backend: ProbeBackend, shipper: Shipper, api: SchedulerApi,
                    options: ProbeOptions, *, lease_s: float = 300.0,
                    progress: Progress | None = None) -> bool:
    """Claim one waiting preflight request, run a preflight on its nodes (suspects are
    re-tested before anyone is blamed), ship what it measured, complete the request with
    its verdict; False if nothing waits."""
    from services.scheduler.preflight import run_preflight

    req = api.claim_preflight(lease_s)
    if req is None:
        return False
    ranks = backend.ranks()
    missing = sorted(set(req["nodes"]) - {r.node for r in ranks})
    if missing:
        api.complete_preflight(req["id"], error=f"nodes not in this cluster: {', '.join(missing)}")
        return True
    if progress:
        progress(f"preflight {req['id'][:8]}: probing {len(req['nodes'])} node(s)")
    recording = Recording(backend)
    verdict = run_preflight(recording, req["nodes"], progress=progress)
    batch = CycleResult(backend=backend.name, ranks=[r for r in ranks if r.node in req["nodes"]],
                        measurements=recording.measurements, findings=recording.findings,
                        injected=[f.to_dict() for f in getattr(backend, "injected", [])])
    if shipper.ship(batch.to_batch()):
        # Results still spooled: leave the request to be claimed again once the API takes them.
        return True
    done = api.complete_preflight(req["id"], verdict=verdict)
    if progress:
        progress(f"preflight {req['id'][:8]}: {'healthy' if done.get('healthy') else 'UNHEALTHY'}")
    return True


def run_scheduler(backend: ProbeBackend, shipper: Shipper, options: ProbeOptions, *,
                  interval_s: float, once: bool, api: SchedulerApi | None = None,
                  stop: threading.Event | None = None, progress: Progress | None = None,
                  jitter: float = 0.1, poll_s: float = 1.0, max_duty: float = 0.005) -> int:
    """Probe every ``interval_s`` (with jitter, so schedulers of many clusters do not align)
    and, between cycles, answer waiting preflight requests.

    ``max_duty`` caps the fraction of any GPU's time spent probing: a cycle that held a
    rank for B seconds is followed by a wait of at least B / max_duty - B, whatever the
    interval says, so a slow fabric or a large fleet cannot turn monitoring into load."""
    stop = stop or threading.Event()
    cycles = 0
    duty = DutyCycle()
    next_cycle = time.monotonic()
    while not stop.is_set():
        if time.monotonic() >= next_cycle:
            so_far = duty.fractions()
            cycle = run_cycle(backend, options, progress=progress, skip_busy=True)
            cycle.duty_cycle = so_far
            duty.add(cycle)
            worst = max(so_far.values(), default=0.0)
            left = shipper.ship(cycle.to_batch())
            cycles += 1
            if progress:
                progress(f"cycle {cycles}: {len(cycle.measurements)} measurements, "
                         f"{len(cycle.findings)} findings, {len(cycle.skipped)} node(s) skipped, "
                         f"duty cycle {worst:.3%}, {left} batch(es) still spooled")
            if once:
                break
            wait = interval_s * (1 + random.uniform(-jitter, jitter))
            held = max(cycle.busy_s.values(), default=0.0)
            floor = held / max_duty - held if max_duty > 0 else 0.0
            if floor > wait and progress:
                progress(f"waiting {floor:.0f} s, not {wait:.0f} s: the cycle held a rank "
                         f"{held:.1f} s and the duty cycle stays under {max_duty:.2%}")
            next_cycle = time.monotonic() + max(wait, floor)
        else:
            shipper.flush()
        served = api is not None and serve_preflight(backend, shipper, api, options, progress=progress)
        if not served:
            stop.wait(max(0.0, min(poll_s, next_cycle - time.monotonic())))
    return cycles
