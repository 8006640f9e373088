"""The scheduler's loop: monitoring cycles (the check of a preflight, services.check, on the
whole fleet, with the node-pair matching advanced each cycle) and the preflights it serves
between them; their results shipped as one batch each.

A cycle's results are shipped as one batch, so the analyzer compares every group with its
peers of the same cycle and localizes exactly as the cycle did.
"""

from __future__ import annotations

import json
import logging
import random
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agents.groups import member as member_key
from agents.groups import node_of, node_order, split_member
from agents.hostlist import compress_hostlist
from agents.nvlink_fabric import domain_findings, fabric_by_node
from agents.spec import (
    Finding,
    Measurement,
    Occupant,
    ProbeBackend,
    ProbeSetupError,
    RankInfo,
)
from agents.telemetry import counter_findings
from agents.transport import node_nic_findings
from agents.workloads import JobLayout, LayoutError
from services.analyzer.assess import LinkKey, Thresholds
from services.check import CheckBudget, ProbeSpec, run_check
from services.check.planner import layout_of
from services.scheduler.occupancy import (
    BackendOccupancy,
    OccupancySource,
    read_occupancy,
)

if TYPE_CHECKING:  # httpx under both: `ringwatch probe --fabric` sends nothing
    from services.scheduler.api_client import SchedulerApi
    from services.scheduler.shipper import Shipper

Progress = Callable[[str], None]
log = logging.getLogger(__name__)
# After an error the loop waits this long, doubling per error in a row, up to the cap.
ERROR_BACKOFF_S = 5.0
ERROR_BACKOFF_MAX_S = 300.0


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
    # NVML readings before and after the cycle of the GPUs whose counters rose.
    counters: list[dict[str, Any]] = field(default_factory=list)
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
              sharing: Sharing = Sharing()) -> CycleResult:
    """Every node's intra-node group, GPU pairs of suspect nodes, the ``rotation``-th
    node-pair matching, re-pairs of suspects with proven nodes, the world group and, where
    it is slow, the search for the slow path: the check of a preflight (services.check),
    judged against each link's own normal where ``history`` holds one; around it, the NVML
    counters read before and after. With ``skip_busy`` (a scheduled cycle) it reads
    occupancy first and probes idle nodes only; the backend holds its GPUs only from
    ``acquire`` to ``release`` around the probing."""
    backend.begin_cycle(rotation)
    ranks = backend.ranks()
    layout = layout_of(ranks, only)
    fleet = list(layout)
    occupancy = None
    skipped: dict[str, str] = {}
    if skip_busy:
        occupancy = read_occupancy(sharing.source or BackendOccupancy(backend, own_source(backend)), fleet,
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
        before = backend.counters()
        run = run_check(backend, list(layout), ranks=ranks, spec=options,
                        thresholds=thresholds, history=history, rotation=rotation,
                        fleet=fleet if skip_busy else None, budget=budget,
                        profile=options.profile, job=options.job, progress=progress,
                        label="round")
        after = backend.counters()
    finally:
        setup_s += backend.release()
    nvml, snapshots = _counter_findings(before, after, partitioned=options.nvlink_partitioned)
    return CycleResult(
        backend=backend.name, ranks=ranks, measurements=run.measurements,
        findings=run.probe_findings + nvml, judged=run.judgement.findings + nvml,
        rounds=run.rounds, counters=snapshots,
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


def own_source(backend: ProbeBackend) -> str:
    """The occupancy source a backend's own view is: the sim's scenario jobs, else Ray's
    other work."""
    return "sim" if backend.name == "sim" else "ray"


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
    """Where the node-pair tournament stands, kept in a file so a restarted scheduler goes
    on with the next matching instead of starting over (and never reaching the rest)."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.position = 0
        if path is not None and path.exists():
            try:
                self.position = int(json.loads(path.read_text()).get("position", 0))
            except (ValueError, OSError, AttributeError):
                self.position = 0  # an unreadable file: start over, never refuse to probe

    def advance(self) -> int:
        """The position for this cycle; the next cycle gets the one after it."""
        current = self.position
        self.position += 1
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps({"position": self.position}))
            tmp.replace(self.path)  # atomic: a crash leaves the old or the new, never half
        return current


def _counter_findings(before: dict[str, dict[str, Any]], after: dict[str, dict[str, Any]],
                      partitioned: bool = False) -> tuple[list[Finding], list[dict[str, Any]]]:
    """Each GPU's NVML verdict over the cycle (counters that rose, links that went down,
    XID errors) and, for the GPUs where something changed, the two readings to store."""
    findings: list[Finding] = []
    snapshots: list[dict[str, Any]] = []
    for member_name, b in sorted(before.items()):
        a = after.get(member_name)
        if not a:
            continue
        node, gpu = split_member(member_name)
        # A node's NICs are read under one of its ranks: their counters' verdict is the node's.
        nic = node_nic_findings(b, a, node) if "nic" in b else []
        findings += nic
        xids = list(b.get("xid") or []) + list(a.get("xid") or [])
        found = counter_findings(b, a, node, gpu, xids)
        findings += found
        found += nic
        if found:
            snapshots.append({"node": node, "local_index": gpu, "before": b.get("nvlinks", []),
                              "after": a.get("nvlinks", []), "xid": xids,
                              "findings": [f.kind for f in found]})
    # The NVLink fabric's state (registration, health, clique) is a state, not a counter:
    # judged on the readings after the cycle, across the nodes of each NVLink domain.
    fabric = domain_findings(fabric_by_node(after), partitioned=partitioned)
    findings += fabric
    for f in fabric:
        reading = after.get(member_key(f.node, f.gpu)) if f.node and f.gpu is not None else None
        snapshots.append({"node": f.node, "local_index": f.gpu, "before": [], "after": [],
                          "xid": [], "fabric": (reading or {}).get("fabric"),
                          "findings": [f.kind]})
    return findings, snapshots


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
    incident on a fault seen in enough cycles) and the incidents it opened and resolved."""
    if answer is None:
        return "API: not sent yet"
    found = [Finding.from_dict(f) for f in answer.get("findings") or []]
    return (f"API: {len(found)} finding(s){(' ' + _kinds(found)) if found else ''}, "
            f"{len(answer.get('degraded') or [])} incident(s) opened, "
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
                  budget: CheckBudget = CheckBudget(), sharing: Sharing = Sharing()) -> int:
    """Probe every ``interval_s`` (with jitter, so schedulers of many clusters do not align)
    and, between cycles, answer waiting preflight requests.

    ``max_duty`` caps the fraction of any GPU's time spent probing: a cycle that held a
    rank for B seconds is followed by a wait of at least B / max_duty - B, whatever the
    interval says, so a slow fabric or a large fleet cannot turn monitoring into load.
    ``thresholds`` and ``budget`` (the process's settings) go to every check it runs;
    ``sharing`` says how cycles learn which nodes jobs hold and leave them alone."""
    stop = stop or threading.Event()
    rotation = rotation or Rotation(None)
    cycles = 0
    duty = DutyCycle(max_duty)
    next_cycle = time.monotonic()
    failures = 0
    while not stop.is_set():
        try:
            if time.monotonic() >= next_cycle:
                so_far = duty.fractions()
                history = api.baselines(options.dtype) if api is not None else None
                # The persisted position numbers the cycles: a scheduler restarted, or run
                # with --once from cron, goes on counting instead of saying "cycle 1".
                index = rotation.advance()
                cycle = run_cycle(backend, options, progress=progress, skip_busy=True,
                                  rotation=index, history=history,
                                  thresholds=thresholds, budget=budget, sharing=sharing)
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
                batch = cycle.to_batch()
                left = shipper.ship(batch)
                cycles += 1
                failures = 0
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
                    break
                if floor > wait and progress:
                    progress(f"waiting {floor:.0f} s, not {wait:.0f} s: the cycle held a rank "
                             f"{held:.1f} s and the duty cycle stays under {max_duty:.2%}")
                next_cycle = time.monotonic() + max(wait, floor)
            else:
                shipper.flush()
            served = api is not None and serve_preflight(
                backend, shipper, api, options, progress=progress, duty=duty,
                thresholds=thresholds, budget=budget)
            if served and (owed := duty.take_owed()) > 0:
                next_cycle = max(next_cycle, time.monotonic()) + owed
                if progress:
                    progress(f"next cycle {owed:.0f} s later: the preflight's probing counts "
                             f"in the duty cycle ({max_duty:.2%})")
        except ProbeSetupError:
            raise  # the backend cannot probe at all: an operator must act
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
            continue
        if not served:
            stop.wait(max(0.0, min(poll_s, next_cycle - time.monotonic())))
    return cycles
