"""The scheduler's loop: monitoring cycles (the check of a preflight, services.check, on the
whole fleet, with the node-pair matching advanced each cycle) and the preflights it serves
between them; their results shipped as one batch each.

A cycle's results are shipped as one batch, so the analyzer compares every group with its
peers of the same cycle and localizes exactly as the cycle did.
"""

from __future__ import annotations

import logging
import random
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ringwatch.agents.groups import node_of, node_order
from ringwatch.agents.hostlist import compress_hostlist
from ringwatch.agents.spec import (
    Finding,
    Measurement,
    Occupant,
    ProbeBackend,
    ProbeSetupError,
    RankInfo,
    utcnow,
)
from ringwatch.agents.workloads import JobLayout, LayoutError
from ringwatch.services.analyzer.assess import LinkKey, Thresholds
from ringwatch.services.check import CheckBudget, ProbeSpec, run_check
from ringwatch.services.check.planner import layout_of
from ringwatch.services.config import TOKEN_EXPIRY_WARN_S
from ringwatch.services.scheduler.leader import (
    RENEW_SHARE,
    FleetLease,
    LeaseLost,
    LeaseRefused,
    NotLeader,
)
from ringwatch.services.scheduler.occupancy import OccupancySource, backend_view, read_occupancy

if TYPE_CHECKING:  # httpx under both: `ringwatch probe --fabric` sends nothing
    from ringwatch.services.scheduler.api_client import SchedulerApi
    from ringwatch.services.scheduler.shipper import Shipper
    from ringwatch.services.scheduler.watch import SchedulerWatch

Progress = Callable[[str], None]
log = logging.getLogger(__name__)
# After an error the loop waits this long, doubling per error in a row, up to the cap.
ERROR_BACKOFF_S = 5.0
ERROR_BACKOFF_MAX_S = 300.0
# The longest period between batches a batch may say it plans (the API's schema bound).
MAX_PLANNED_S = 30 * 86400.0


@dataclass(frozen=True)
class ProbeOptions(ProbeSpec):
    """What a scheduler's groups run (its preflights' too) and the profile it monitors as.
    ``sizes`` None: the backend's probe sizes, the same a preflight uses, so the two judge
    alike."""

    # A workload profile (agents.workloads): after the fabric check, each cycle also runs
    # the job's own communicators under ``job`` (None: the default layout), so their
    # series (ring and tree apart) are kept like any link's. ``ops`` already holds its ops.
    profile: str | None = None
    job: JobLayout | None = None
    # NVLink domains split into partitions on purpose (RINGWATCH_NVLINK_PARTITIONED): the
    # fabric check then compares no cliques, judging registration and health alone.
    nvlink_partitioned: bool = False


@dataclass
class CycleResult:
    backend: str
    ranks: list[RankInfo]
    measurements: list[Measurement] = field(default_factory=list)
    # What the probes reported themselves (hangs, errors, wrong data): shipped.
    findings: list[Finding] = field(default_factory=list)
    # The cycle's own judgement (localized faults): shown, not shipped; the API judges the
    # batch the same way.
    judged: list[Finding] = field(default_factory=list)
    rounds: int = 0
    fabric_time_s: float = 0.0
    wall_time_s: float = 0.0
    rotation: int = 0
    injected: list[dict[str, Any]] = field(default_factory=list)
    # Nodes left out because other work held them, with the reason.
    skipped: dict[str, str] = field(default_factory=dict)
    # Seconds each rank spent inside probe groups in this cycle.
    busy_s: dict[str, float] = field(default_factory=dict)
    duty_cycle: dict[str, float] = field(default_factory=dict)
    # NVML and NIC readings before and after the check of the GPUs whose counters rose
    # (or whose fabric state is a finding), and the nodes whose facts were read both times
    # (services.check.facts): only these may clear a counter incident on ingest.
    counters: list[dict[str, Any]] = field(default_factory=list)
    facts: list[str] = field(default_factory=list)
    # With a profile: how the job's communicators ran (the verdict's ``workload``
    # section); shown, not shipped (their measurements are).
    workload: dict[str, Any] | None = None
    # How the occupancy source answered (Occupancy.to_dict); a scheduled cycle's only.
    occupancy: dict[str, Any] | None = None
    # Seconds the backend took to set up for the cycle and to tear down after it (agents,
    # CUDA contexts): counted in every probed rank's busy time.
    setup_s: float = 0.0

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
            "counters": self.counters,
            # Absent and empty say the same (no node's facts read); absent, a batch of a
            # backend that reads none is taken by an API that predates the field.
            **({"facts": self.facts} if self.facts else {}),
            **({"occupancy": self.occupancy} if self.occupancy is not None else {}),
        }


@dataclass(frozen=True)
class Sharing:
    """How a scheduled cycle shares the fleet with its jobs (docs/operations.md, "Occupancy
    and contention"): where occupancy comes from (None: the backend's own view, Ray's other
    work or the sim's jobs), how long reading it may take, and whether busy nodes are
    probed anyway (RINGWATCH_PROBE_BUSY_NODES; their measurements then meet the job's
    traffic and are contended, never judged)."""

    source: OccupancySource | None = None
    timeout_s: float = 10.0
    probe_busy: bool = False


def run_cycle(backend: ProbeBackend, options: ProbeOptions, *, only: list[str] | None = None,
              progress: Progress | None = None, skip_busy: bool = False,
              rotation: int = 0,
              history: Mapping[LinkKey, Sequence[float]] | None = None,
              thresholds: Thresholds | None = None,
              budget: CheckBudget = CheckBudget(),
              sharing: Sharing = Sharing(),
              slots: Sequence[str | None] | None = None) -> CycleResult:
    """Every node's intra-node group, GPU pairs of suspect nodes, the ``rotation``-th
    node-pair matching, re-pairs of suspects with proven nodes, the world group and, where
    it is slow, the search for the slow path: the check of a preflight (services.check),
    judged against each link's own normal where ``history`` holds one, the facts of its
    nodes (NVML and NIC counters, NVLink fabric state) read and judged inside it. With
    ``skip_busy`` (a scheduled cycle) it reads occupancy first and probes idle nodes only;
    the backend holds its GPUs only from ``acquire`` to ``release`` around the probing.
    ``slots``: the fleet's tournament seats
    (the API keeps them), so the ``rotation``-th matching is the fleet's whoever runs it."""
    backend.begin_cycle(rotation)
    ranks = backend.ranks()
    layout = layout_of(ranks, only)
    fleet = list(layout)
    occupancy = None
    skipped: dict[str, str] = {}
    if skip_busy:
        occupancy = read_occupancy(sharing.source or backend_view(backend), fleet,
                                   timeout_s=sharing.timeout_s)
        skipped = {n: o.reason for n, o in occupancy.busy.items() if n in layout}
        if occupancy.error and progress:
            progress(f"occupancy: {occupancy.error}; {len(skipped)} node(s) counted busy")
        if progress:
            verb = "probing anyway" if sharing.probe_busy else "skipping"
            for line in busy_lines({n: occupancy.busy[n] for n in skipped}):
                progress(f"{verb} {line}")
        if not sharing.probe_busy:
            for node in skipped:
                del layout[node]
    setup_s = 0.0
    try:
        if layout:
            setup_s = backend.acquire(list(layout))
        for node, why in backend.not_acquired.items():
            if node in layout:
                if progress:
                    progress(f"skipping {node}: {why}")
                skipped[node] = why
                del layout[node]
        backend.refresh_ranks()
        ranks = backend.ranks()
        run = run_check(backend, list(layout), ranks=ranks, spec=options,
                        thresholds=thresholds, history=history, rotation=rotation,
                        fleet=(slots if slots is not None else fleet) if skip_busy else None,
                        budget=budget,
                        profile=options.profile, job=options.job, progress=progress,
                        label="round")
    finally:
        setup_s += backend.release()
    return CycleResult(
        backend=backend.name, ranks=ranks, measurements=run.measurements,
        findings=run.probe_findings, judged=run.judgement.findings,
        rounds=run.rounds, counters=run.counters, facts=run.facts,
        fabric_time_s=run.fabric_s, wall_time_s=run.wall_s, rotation=rotation,
        injected=[f.to_dict() for f in backend.injected], skipped=skipped,
        busy_s=with_setup(run.busy_s, ranks, layout, setup_s), workload=run.workload,
        occupancy=occupancy.to_dict() if occupancy is not None else None, setup_s=setup_s)


def busy_lines(busy: Mapping[str, Occupant]) -> list[str]:
    """The busy nodes for a log, one line per job (a thousand nodes in a few jobs are a few
    lines): its nodes as a Slurm host list and what holds them."""
    by_job: dict[tuple[str, str | None, bool], list[str]] = {}
    for node, o in busy.items():
        by_job.setdefault((o.source, o.job, o.unknown), []).append(node)
    lines = []
    for (source, job, unknown), nodes in sorted(by_job.items(), key=lambda kv: kv[1][0]):
        reasons = {busy[n].reason for n in nodes}
        why = reasons.pop() if len(reasons) == 1 else (
            f"occupancy unknown ({source})" if unknown
            else f"{'job ' + job if job else 'other work'}, per {source}")
        lines.append(f"{len(nodes)} node(s) {compress_hostlist(nodes)}: {why}")
    return lines


def with_setup(busy_s: dict[str, float], ranks: Sequence[RankInfo],
               layout: Mapping[str, Sequence[int]], setup_s: float) -> dict[str, float]:
    """Each probed rank's seconds in groups plus the set-up and tear-down of the cycle: its
    GPU was taken for those too, so the duty cycle counts them."""
    if setup_s <= 0:
        return busy_s
    out = dict(busy_s)
    for r in ranks:
        if r.node in layout:
            out[r.member] = out.get(r.member, 0.0) + setup_s
    return out


class Rotation:
    """Where the node-pair tournament stands for a scheduler with no API to keep it (a
    check run in-process, a benchmark): in memory. A scheduler with an API keeps it with
    the fleet (``SchedulerApi.start_cycle``), so a restart, another host or a changed node
    set goes on from the same place."""

    def __init__(self, position: int = 0) -> None:
        self.position = position

    def advance(self) -> int:
        """The position for this cycle; the next cycle gets the one after it."""
        current = self.position
        self.position += 1
        return current


def _kinds(findings: list[Finding]) -> str:
    if not findings:
        return ""
    counts: dict[str, int] = {}
    for f in findings:
        counts[f.kind] = counts.get(f.kind, 0) + 1
    return "(" + ", ".join(f"{k} {n}" for k, n in sorted(counts.items())) + ")"


class DutyCycle:
    """The fraction of each GPU's time spent probing since the scheduler started, per node
    (its busiest rank), monitoring cycles and preflights alike. Read at the start of a cycle,
    it covers whole cycles and the waits between them, so the first cycle has none to report.
    """

    def __init__(self, max_duty: float = 0.005) -> None:
        self.started = time.monotonic()
        self.max_duty = max_duty
        self.busy_s: dict[str, float] = {}
        # Seconds the next monitoring cycle must wait on account of preflights served since
        # the last one (a preflight is answered at once; monitoring gives way after it).
        self.owed_s = 0.0

    def add(self, cycle: CycleResult) -> None:
        self._hold(cycle.busy_s)

    def _hold(self, busy_s: dict[str, float]) -> None:
        for member, seconds in busy_s.items():
            self.busy_s[member] = self.busy_s.get(member, 0.0) + seconds

    def rest_after(self, held_s: float) -> float:
        """The pause after holding a rank ``held_s`` that keeps its share under max_duty."""
        return held_s / self.max_duty - held_s if self.max_duty > 0 else 0.0

    def charge_preflight(self, busy_s: dict[str, float]) -> None:
        self._hold(busy_s)
        self.owed_s += self.rest_after(max(busy_s.values(), default=0.0))

    def take_owed(self) -> float:
        owed, self.owed_s = self.owed_s, 0.0
        return owed

    def fractions(self) -> dict[str, float]:
        return shares(self.busy_s, time.monotonic() - self.started)


class Lease:
    """A claim on a preflight request, renewed once half of it has passed (checked every
    round): a check of a large, noisy fleet may outlast any lease fixed in advance, and an
    expired claim could not complete."""

    def __init__(self, api: SchedulerApi, request_id: str, lease_s: float) -> None:
        self.api, self.request_id, self.lease_s = api, request_id, lease_s
        self.renewed = time.monotonic()

    def keep(self) -> None:
        due = time.monotonic() - self.renewed >= self.lease_s / 2
        if due and self.api.renew_preflight(self.request_id, self.lease_s):
            self.renewed = time.monotonic()


def serve_preflight(backend: ProbeBackend, shipper: Shipper, api: SchedulerApi,
                    options: ProbeOptions, *, lease_s: float = 300.0,
                    progress: Progress | None = None, duty: DutyCycle | None = None,
                    thresholds: Thresholds | None = None,
                    budget: CheckBudget = CheckBudget()) -> bool:
    """Claim one waiting preflight request, run the adaptive check on its nodes (suspects
    are re-tested and localized before anyone is blamed), ship what it measured, complete
    the request with its verdict; False if nothing waits. The GPU time it took is charged
    to ``duty``: the next monitoring cycle waits the longer for it."""
    req = api.claim_preflight(lease_s)
    if req is None:
        return False
    ranks = backend.ranks()
    if set(req["nodes"]) - {r.node for r in ranks}:
        # A node whose worker joined since the last cycle (a new GPU node) is looked for now.
        backend.refresh_ranks()
        ranks = backend.ranks()
    missing = sorted(set(req["nodes"]) - {r.node for r in ranks}, key=node_order)
    if missing:
        api.complete_preflight(req["id"], error=f"nodes not in this cluster: {', '.join(missing)}")
        return True
    profile = req.get("profile")
    job = JobLayout.from_dict(req["job"]) if req.get("job") else None
    if progress:
        progress(f"preflight {req['id'][:8]}: probing {len(req['nodes'])} node(s)"
                 + (f" as a {profile} job" if profile else ""))
    lease = Lease(api, req["id"], lease_s)

    def each_round(line: str) -> None:
        lease.keep()
        if progress:
            progress(line)

    # A preflight probes the nodes it names whatever holds them: its asker (a job's prolog,
    # a launcher) speaks for them at the job's edge, before the job's traffic starts.
    setup_s = 0.0
    try:
        setup_s = backend.acquire(list(req["nodes"]))
        if backend.not_acquired:
            lost = ", ".join(f"{n} ({why})" for n, why in sorted(backend.not_acquired.items()))
            api.complete_preflight(req["id"], error=f"cannot probe {lost}")
            return True
        checked = run_check(backend, list(req["nodes"]), ranks=ranks, spec=options,
                            thresholds=thresholds, history=api.baselines(options.dtype),
                            budget=budget, profile=profile, job=job, progress=each_round,
                            label=f"preflight {req['id'][:8]} round")
    except LayoutError as exc:
        api.complete_preflight(req["id"], error=str(exc))
        return True
    finally:
        setup_s += backend.release()
    if duty is not None:
        duty.charge_preflight(with_setup(checked.busy_s, ranks,
                                         layout_of(ranks, req["nodes"]), setup_s))
    verdict = checked.verdict()
    asked = set(req["nodes"])
    batch = CycleResult(backend=backend.name, ranks=[r for r in ranks if r.node in asked],
                        measurements=checked.measurements, findings=checked.probe_findings,
                        counters=checked.counters, facts=checked.facts,
                        injected=[f.to_dict() for f in backend.injected])
    if shipper.ship(batch.to_batch()):
        # Results still spooled: leave the request to be claimed again once the API takes them.
        return True
    done = api.complete_preflight(req["id"], verdict=verdict)
    if progress:
        progress(f"preflight {req['id'][:8]}: {'healthy' if done.get('healthy') else 'UNHEALTHY'}")
    return True


def shares(busy_s: dict[str, float], period_s: float) -> dict[str, float]:
    """Each node's busiest rank's seconds in groups, as a share of ``period_s``."""
    per_node: dict[str, float] = {}
    for member_name, seconds in busy_s.items():
        node = node_of(member_name)
        per_node[node] = max(per_node.get(node, 0.0), seconds / max(period_s, 1e-9))
    return {n: round(v, 6) for n, v in sorted(per_node.items())}


def _api_note(answer: dict[str, Any] | None) -> str:
    """What the API made of the cycle's batch: its own findings (the hysteresis opens an
    incident on a fault seen in enough cycles) and the incidents it opened, slowdowns and
    what the probes reported (hangs, errors, wrong data) alike, and resolved."""
    if answer is None:
        return "API: not sent yet"
    found = [Finding.from_dict(f) for f in answer.get("findings") or []]
    opened = len(answer.get("degraded") or []) + len(answer.get("probe_findings") or [])
    return (f"API: {len(found)} finding(s){(' ' + _kinds(found)) if found else ''}, "
            f"{opened} incident(s) opened, "
            f"{len(answer.get('recovered') or [])} resolved")


def _occupancy_note(cycle: CycleResult, sharing: Sharing) -> str:
    """The cycle line's word on the nodes jobs held: how many, by which source, and when
    the source failed, that its nodes were counted busy."""
    o = cycle.occupancy or {}
    busy = o.get("busy") or {}
    unknown = sum(1 for x in busy.values() if x.get("unknown"))
    verb = "probed anyway (contended)" if sharing.probe_busy else "skipped"
    note = f"{len(cycle.skipped)} busy node(s) {verb} (occupancy: {o.get('source', 'none')}"
    if o.get("error"):
        note += f", FAILED: {o['error']}; {unknown} counted busy"
    contended = sum(1 for m in cycle.measurements if m.contended)
    return note + ")" + (f", {contended} contended measurement(s) not judged" if contended else "")


def _workload_note(summary: dict[str, Any] | None) -> str:
    """The cycle line's word on the job's communicators, with a profile."""
    if summary is None:
        return ""
    found = summary["findings"]
    return (f", {summary['profile']} job groups: "
            + (f"{len(found)} workload finding(s) ({', '.join(sorted({f['kind'] for f in found}))})"
               if found else "ok"))


def run_scheduler(backend: ProbeBackend, shipper: Shipper, options: ProbeOptions, *,
                  interval_s: float, once: bool, api: SchedulerApi | None = None,
                  stop: threading.Event | None = None, progress: Progress | None = None,
                  jitter: float = 0.1, poll_s: float = 1.0, max_duty: float = 0.005,
                  rotation: Rotation | None = None, thresholds: Thresholds | None = None,
                  budget: CheckBudget = CheckBudget(), sharing: Sharing = Sharing(),
                  fleet: str | None = None, lease_s: float = 60.0,
                  watch: SchedulerWatch | None = None) -> int:
    """Probe every ``interval_s`` (with jitter, so schedulers of many clusters do not align)
    and, between cycles, answer waiting preflight requests.

    With an ``api`` and a ``fleet``, only the scheduler holding the fleet's lease
    (services.scheduler.leader) probes; another stands by, releases what it holds on the
    GPUs, and takes over once the lease is free. The cycle number and the tournament's
    seats are the fleet's, kept by the API, so a restart, a new host or a changed node set
    goes on from the same place; without an API, ``rotation`` (in memory) keeps them.
    ``watch`` is told what the loop did (services.scheduler.watch: /healthz, /metrics).

    ``max_duty`` caps the fraction of any GPU's time spent probing: a cycle that held a
    rank for B seconds is followed by a wait of at least B / max_duty - B, whatever the
    interval says, so a slow fabric or a large fleet cannot turn monitoring into load.
    ``thresholds`` and ``budget`` (the process's settings) go to every check it runs;
    ``sharing`` says how cycles learn which nodes jobs hold and leave them alone."""
    stop = stop or threading.Event()
    rotation = rotation or Rotation()
    lease = FleetLease(api, fleet, lease_s, progress) if api is not None and fleet else None
    cycles = 0
    duty = DutyCycle(max_duty)
    next_cycle = time.monotonic()
    failures = 0
    standby_since: float | None = None
    observed = Observer(watch, shipper, api)
    try:
        while not stop.is_set():
            try:
                leading = lease is None or _leading(lease, backend)
                observed.role(lease)
            except LeaseRefused as exc:  # loud every time, and on: a new token mends it
                observed.refused()
                log.error("%s; no cycle runs until it is accepted", exc)
                if progress:
                    progress(f"ERROR: {exc}; no cycle runs until it is accepted")
                if once:
                    raise
                stop.wait(min(interval_s, 60.0))
                continue
            if not leading:
                standby_since = standby_since or time.monotonic()
                if once and time.monotonic() - standby_since > 2 * lease_s:
                    break  # --once from cron while another leads: nothing to do here
                stop.wait(min(poll_s * 5, lease_s * RENEW_SHARE))
                continue
            if standby_since is not None:  # taken over: the first cycle now
                standby_since, next_cycle = None, time.monotonic()
            cycles, next_cycle, failures, done = _turn(
                backend, shipper, options, api=api, lease=lease, rotation=rotation,
                duty=duty, cycles=cycles, next_cycle=next_cycle, failures=failures,
                interval_s=interval_s, once=once, stop=stop, progress=progress,
                jitter=jitter, poll_s=poll_s, max_duty=max_duty, thresholds=thresholds,
                budget=budget, sharing=sharing, observed=observed)
            observed.shipped(next_cycle)
            if done:
                break
    finally:
        if lease is not None:
            lease.release()
    return cycles


class Observer:
    """What the loop tells its ``SchedulerWatch`` (none: nothing), in one place: its role,
    each cycle, the spool and the API's last answer, and its token's expiry (asked of the
    API once an hour, a WARNING while it is under 14 days)."""

    TOKEN_CHECK_S = 3600.0

    def __init__(self, watch: SchedulerWatch | None, shipper: Shipper,
                 api: SchedulerApi | None) -> None:
        self.watch, self.shipper, self.api = watch, shipper, api
        self.token_checked = float("-inf")

    def role(self, lease: FleetLease | None) -> None:
        if self.watch is not None:
            if lease is None:
                self.watch.role(True, None)
            else:
                self.watch.role(lease.leader, lease.holder, lease.term)

    def refused(self) -> None:
        if self.watch is not None:
            self.watch.token(refused=True, prefix=self.shipper.token_prefix)

    def cycle(self, cycle: CycleResult, number: int) -> None:
        if self.watch is not None:
            self.watch.cycle(ended_at=time.time(), duration_s=cycle.wall_time_s,
                             number=number, probed=len({n for m in cycle.measurements
                                                         for n in m.nodes}),
                             busy=len(cycle.skipped))

    def shipped(self, next_cycle: float) -> None:
        """After each turn: the spool, the API's last answer, the planned wait, the token."""
        if self.watch is None:
            return
        s = self.shipper
        self.watch.spool(*s.spool_state(), s.dropped)
        self.watch.ingest(s.last_status)
        self.watch.next_cycle_in(max(0.0, next_cycle - time.monotonic()))
        expires = None
        if self.api is not None and time.monotonic() - self.token_checked >= self.TOKEN_CHECK_S:
            self.token_checked = time.monotonic()
            expires = self.api.token_expires_at()
            left = (expires - utcnow()).total_seconds() if expires is not None else None
            if expires is not None and left is not None and left < TOKEN_EXPIRY_WARN_S:
                log.warning("this scheduler's token %s expires in %.1f days (%s): create a new "
                            "agent token (ringwatch token create --role agent)",
                            s.token_prefix, left / 86400, expires.isoformat())
        self.watch.token(refused=s.refused, prefix=s.token_prefix, expires_at=expires)


def _leading(lease: FleetLease, backend: ProbeBackend) -> bool:
    """Whether this scheduler leads its fleet now; a standby holds nothing on the GPUs."""
    if lease.hold():
        return True
    backend.release()
    return False


def _turn(backend: ProbeBackend, shipper: Shipper, options: ProbeOptions, *,
          api: SchedulerApi | None, lease: FleetLease | None, rotation: Rotation,
          duty: DutyCycle, cycles: int, next_cycle: float, failures: int, interval_s: float,
          once: bool, stop: threading.Event, progress: Progress | None, jitter: float,
          poll_s: float, max_duty: float, thresholds: Thresholds | None,
          budget: CheckBudget, sharing: Sharing,
          observed: Observer | None = None) -> tuple[int, float, int, bool]:
    """One turn of the leader's loop: a cycle when one is due, else a spool flush; then a
    waiting preflight. Returns the cycle count, when the next cycle is due, the errors in a
    row, and whether the loop is done."""
    served = False
    try:
        if time.monotonic() >= next_cycle:
            so_far = duty.fractions()
            history = api.baselines(options.dtype) if api is not None else None
            index, slots = _next_cycle(backend, api, lease, rotation)
            cycle = run_cycle(backend, options, progress=_keeping(lease, progress),
                              skip_busy=True, rotation=index, history=history,
                              thresholds=thresholds, budget=budget, sharing=sharing,
                              slots=slots)
            duty.add(cycle)
            wait = interval_s * (1 + random.uniform(-jitter, jitter))
            held = max(cycle.busy_s.values(), default=0.0)
            floor = duty.rest_after(held)
            # This cycle's share of its busiest GPU's time, the wait after it counted:
            # what the duty cycle settles at if every cycle is like it. The first cycle
            # reports it per node (nothing has elapsed to measure yet); later ones what
            # each node spent since the scheduler started.
            period = cycle.wall_time_s + max(wait, floor)
            share = held / max(period, 1e-9)
            cycle.duty_cycle = so_far or shares(cycle.busy_s, period)
            # The period it plans is what the API's ingest-stall alert waits three of.
            batch = {**cycle.to_batch(),
                     "shipper": {"interval_s": round(min(period, MAX_PLANNED_S), 3)}}
            left = shipper.ship(batch)
            cycles += 1
            failures = 0
            if observed is not None:
                observed.cycle(cycle, index + 1)
            if progress:
                progress(f"cycle {index + 1}: {cycle.rounds} rounds, {len(cycle.measurements)} "
                         f"measurements, {len(cycle.judged)} finding(s) in this cycle"
                         f"{' ' + _kinds(cycle.judged) if cycle.judged else ''}, "
                         f"{_api_note(shipper.answers.pop(batch['batch_id'], None))}, "
                         f"{_occupancy_note(cycle, sharing)}, busiest GPU held "
                         f"{held:.1f} s: duty cycle {share:.3%} (max {max_duty:.2%}), "
                         f"{left} batch(es) still spooled"
                         + _workload_note(cycle.workload)
                         + (f", {shipper.moved_aside} moved aside" if shipper.moved_aside else ""))
            if once:
                return cycles, next_cycle, failures, True
            if floor > wait and progress:
                progress(f"waiting {floor:.0f} s, not {wait:.0f} s: the cycle held a rank "
                         f"{held:.1f} s and the duty cycle stays under {max_duty:.2%}")
            next_cycle = time.monotonic() + max(wait, floor)
        else:
            shipper.flush()
        served = api is not None and serve_preflight(
            backend, shipper, api, options, progress=_keeping(lease, progress), duty=duty,
            thresholds=thresholds, budget=budget)
        if served and (owed := duty.take_owed()) > 0:
            next_cycle = max(next_cycle, time.monotonic()) + owed
            if progress:
                progress(f"next cycle {owed:.0f} s later: the preflight's probing counts "
                         f"in the duty cycle ({max_duty:.2%})")
    except ProbeSetupError:
        raise  # the backend cannot probe at all: an operator must act
    except (LeaseLost, NotLeader) as exc:  # another scheduler leads now: stand by
        if progress:
            progress(f"fleet: {exc}; standing by")
        if lease is not None:
            lease.leader = False
        return cycles, next_cycle, failures, False
    except Exception as exc:  # an API, Ray or disk error: monitoring goes on
        if once:
            raise
        failures += 1
        backoff = min(ERROR_BACKOFF_MAX_S, ERROR_BACKOFF_S * 2 ** (failures - 1))
        log.exception("scheduler loop failed (%d in a row)", failures)
        if progress:
            progress(f"error: {type(exc).__name__}: {exc}; retrying in {backoff:.0f} s "
                     f"({failures} in a row)")
        next_cycle = max(next_cycle, time.monotonic() + backoff)
        stop.wait(backoff)
        return cycles, next_cycle, failures, False
    if not served:
        stop.wait(max(0.0, min(poll_s, next_cycle - time.monotonic())))
    return cycles, next_cycle, failures, False


def _next_cycle(backend: ProbeBackend, api: SchedulerApi | None, lease: FleetLease | None,
                rotation: Rotation) -> tuple[int, list[str | None] | None]:
    """This cycle's index (its number less one) and the tournament's seats: the fleet's,
    from the API, where a lease is held; else the local file's position over the nodes."""
    if api is not None and lease is not None:
        nodes = sorted({r.node for r in backend.ranks()}, key=node_order)
        number, slots = api.start_cycle(lease.fleet, nodes)
        return number - 1, slots
    # The persisted position numbers the cycles: a scheduler restarted, or run with --once
    # from cron, goes on counting instead of saying "cycle 1".
    return rotation.advance(), None


def _keeping(lease: FleetLease | None, progress: Progress | None) -> Progress | None:
    """``progress`` that also renews the fleet's lease between rounds (LeaseLost once another
    scheduler leads: the cycle stops there)."""
    if lease is None:
        return progress

    def each(line: str) -> None:
        lease.keep()
        if progress:
            progress(line)

    return each
