"""The adaptive check, round by round: what a preflight runs on a job's nodes and what each
monitoring cycle runs on the fleet.

Backend-agnostic: it sees only ``ProbeBackend`` (nccl, gloo, sim). Each round is planned
from what the rounds before it showed (``services.analyzer.judge``), so suspects are
re-tested and localized before anyone is blamed.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

from agents import profiles
from agents.collectives import default_sizes
from agents.spec import Finding, GroupSpec, Measurement, ProbeBackend, RankInfo, RoundResult
from agents.workloads import JobLayout, Workload, fabric_ops, workload
from services.analyzer.assess import Expected, LinkKey, Thresholds
from services.analyzer.judge import JudgeCache, Judgement, judge
from services.analyzer.verdict import build_verdict
from services.config import (
    CHECK_MAX_FABRIC_S,
    CHECK_MAX_ROUNDS,
    CHECK_MAX_WALL_S,
    Settings,
    get_settings,
)
from services.scheduler.deadlines import group_deadline_s
from services.scheduler.planner import (
    DEFAULT_OPS,
    AdaptivePlanner,
    ProbeShape,
    layout_of,
    node_members,
)
from services.scheduler.workload import algos_for, identity, job_groups, judge_job, kinds

Progress = Callable[[str], None]


def probe_sizes(backend: ProbeBackend) -> tuple[int, ...]:
    """The sizes a cycle or preflight probes unless told: the backend's own choice where it
    has one, else one latency and one bandwidth-bound size for its kind of fabric."""
    return tuple(getattr(backend, "preflight_sizes", None) or default_sizes(backend.name))


def probe_shape(backend: ProbeBackend, ops: Sequence[str] = DEFAULT_OPS,
                sizes: Sequence[int] | None = None, *, dtype: str = "float32", warmup: int = 5,
                iters: int = 20, redop: str = "sum", deadline_s: float | None = None) -> ProbeShape:
    shape = ProbeShape(ops=tuple(ops), sizes=tuple(sizes or probe_sizes(backend)), dtype=dtype,
                       warmup=warmup, iters=iters, redop=redop)
    deadline = deadline_s or getattr(backend, "preflight_deadline_s", None) or group_deadline_s(
        backend.name, shape.ops, shape.sizes, warmup=shape.warmup, iters=shape.iters,
        repeats=getattr(backend, "repeats", 1))
    return replace(shape, deadline_s=deadline)


@dataclass
class Rounds:
    """What rounds of groups measured and reported, added up as they ran."""

    measurements: list[Measurement] = field(default_factory=list)
    probe_findings: list[Finding] = field(default_factory=list)
    rounds: int = 0
    fabric_s: float = 0.0
    wall_s: float = 0.0
    # Seconds each rank spent inside probe groups.
    busy_s: dict[str, float] = field(default_factory=dict)

    def take(self, groups: Sequence[GroupSpec], result: RoundResult,
             node_profiles: dict[str, str | None]) -> None:
        """Add one round's result (its measurements annotated with their nodes' rated
        busbw, agents.profiles)."""
        self.rounds += 1
        self.fabric_s += result.fabric_time_s
        for g in groups:
            for m in g.members:
                self.busy_s[m] = self.busy_s.get(m, 0.0) + result.busy_s.get(m, result.wall_time_s)
        profiles.annotate(result.measurements, node_profiles)
        self.measurements += result.measurements
        self.probe_findings += result.findings

    def absorb(self, other: Rounds) -> None:
        """Count ``other``'s rounds (another phase of the same check) as this one's."""
        self.rounds += other.rounds
        self.fabric_s += other.fabric_s
        self.measurements += other.measurements
        self.probe_findings += other.probe_findings
        for m, seconds in other.busy_s.items():
            self.busy_s[m] = self.busy_s.get(m, 0.0) + seconds


@dataclass(frozen=True)
class CheckBudget:
    """What one check may spend (RINGWATCH_CHECK_MAX_ROUNDS, _MAX_FABRIC_S, _MAX_WALL_S):
    rounds, modeled fabric seconds (the probing itself) and wall seconds. A check that
    reaches any of them stops planning, and its verdict says ``complete: false`` with the
    groups it left undecided; no fleet, however slow or noisy, keeps a check or a
    scheduler's monitoring cycle going."""

    max_rounds: int = CHECK_MAX_ROUNDS
    max_fabric_s: float = CHECK_MAX_FABRIC_S
    max_wall_s: float = CHECK_MAX_WALL_S

    @classmethod
    def from_settings(cls, settings: Settings) -> CheckBudget:
        return cls(settings.check_max_rounds, settings.check_max_fabric_s,
                   settings.check_max_wall_s)

    def spent(self, run: Rounds, wall_s: float) -> str | None:
        """Which part of the budget ``run`` has used up, if any."""
        if run.rounds >= self.max_rounds:
            return f"rounds ({self.max_rounds})"
        if run.fabric_s >= self.max_fabric_s:
            return f"fabric time ({self.max_fabric_s:g} s)"
        if wall_s >= self.max_wall_s:
            return f"wall time ({self.max_wall_s:g} s)"
        return None


# The undecided groups a verdict lists by name; more are counted.
UNDECIDED_LISTED = 100


@dataclass
class AdaptiveRun(Rounds):
    """What an adaptive check measured, and the judgement of all of it."""

    judgement: Judgement = field(kw_only=True)
    # What of the budget stopped the plan before it had nothing left to ask (None: none).
    stopped_by: str | None = None

    @property
    def undecided_groups(self) -> list[dict[str, Any]]:
        """Groups the check measured but could not decide either way (never exclusions)."""
        return [{"scope": v.scope, "nodes": list(v.nodes)}
                for v in self.judgement.verdicts.values() if not v.bad and not v.cleared]

    @property
    def undecided(self) -> int:
        return len(self.undecided_groups)

    @property
    def complete(self) -> bool:
        """Exactly when nothing is undecided and no budget cut the plan short."""
        return self.stopped_by is None and self.undecided == 0


def run_adaptive(
    backend: ProbeBackend,
    layout: dict[str, list[int]],
    ranks: Sequence[RankInfo],
    shape: ProbeShape,
    *,
    thresholds: Thresholds | None = None,
    expected: Expected | None = None,
    rotation: int = 0,
    budget: CheckBudget | None = None,
    progress: Progress | None = None,
    label: str = "round",
    history: Mapping[LinkKey, Sequence[float]] | None = None,
) -> AdaptiveRun:
    """Plan a round from the judgement so far, run it, judge everything again; until the
    planner has nothing left to ask. ``rotation`` picks the node-pair matching;
    ``history``, each link's past busbw as the API holds it (``GET /v1/baselines``), gives
    a link its own normal in the check as on ingest, so the plan follows up what the API
    will find."""
    started = time.perf_counter()
    nodes = list(layout)
    mine = [r for r in ranks if r.node in layout]
    # The settings' thresholds, as the API judges ingested batches: one judgement.
    t = thresholds or get_settings().thresholds(backend.name)
    model = expected or getattr(backend, "expected_busbw", None)
    node_profiles = {r.node: r.profile for r in mine}

    # The measurements only grow from round to round: what was worked out for them is kept.
    cache = JudgeCache()

    def judged(run: AdaptiveRun) -> Judgement:
        return judge(run.measurements, run.probe_findings, nodes, mine, thresholds=t,
                     expected=model, history=history, cache=cache)

    run = AdaptiveRun(judgement=judge([], [], nodes, mine, thresholds=t))
    limits = budget or CheckBudget.from_settings(get_settings())
    planner = AdaptivePlanner(layout, shape, max_rounds=limits.max_rounds, rotation=rotation)
    while not (spent := limits.spent(run, time.perf_counter() - started)) and (
            groups := planner.next_round(run.judgement.verdicts, run.judgement.blamed)):
        _say(progress, label, run.rounds + 1, groups)
        run.take(groups, backend.run_round(groups), node_profiles)
        run.judgement = judged(run)
    if planner.phase != "done":
        run.stopped_by = spent or f"rounds ({limits.max_rounds})"
    run.wall_s = time.perf_counter() - started
    return run


@dataclass
class Checked:
    """A preflight's verdict and what it measured to reach it: the fabric check's and the
    job's groups' measurements (a scheduler ships them), their probe findings, and the
    seconds each rank spent in groups (its duty cycle)."""

    verdict: dict[str, Any]
    measurements: list[Measurement]
    probe_findings: list[Finding]
    busy_s: dict[str, float]


def run_preflight(backend: ProbeBackend, nodes: list[str] | None = None,
                  **kwargs: Any) -> dict[str, Any]:
    """The verdict (docs/formats.md) of ``check``."""
    return check(backend, nodes, **kwargs).verdict


def check(
    backend: ProbeBackend,
    nodes: list[str] | None = None,
    *,
    ops: Sequence[str] = DEFAULT_OPS,
    sizes: Sequence[int] | None = None,
    dtype: str = "float32",
    warmup: int = 5,
    iters: int = 20,
    redop: str = "sum",
    progress: Progress | None = None,
    label: str = "preflight round",
    thresholds: Thresholds | None = None,
    expected: Expected | None = None,
    deadline_s: float | None = None,
    max_rounds: int | None = None,
    budget: CheckBudget | None = None,
    history: Mapping[LinkKey, Sequence[float]] | None = None,
    profile: str | None = None,
    job: JobLayout | None = None,
) -> Checked:
    """Probe ``nodes`` (all the backend's nodes when None) and reach a verdict (docs/formats.md).

    ``duration_s`` is fabric time (the slowest group of each round, summed); the wall
    time of the whole check is ``wall_s``. A hang is a finding, never an exception.
    Defaults come from the backend where it offers them (``preflight_sizes``,
    ``preflight_deadline_s``, ``expected_busbw``).

    ``profile`` (agents.workloads: ddp, fsdp, moe, pipeline) adds its ops to the fabric
    check (monitoring's judgement), then runs the job's own communicators at its sizes
    under ``job`` (its tp/pp/dp layout; default: tensor parallel over each node's GPUs,
    data parallel across nodes) and reports them in the verdict's ``workload``; a
    workload finding makes the verdict unhealthy without excluding a node. A layout that
    does not fit the ranks raises LayoutError before anything runs.
    """
    ranks = backend.ranks()
    layout = layout_of(ranks, nodes)
    work = workload(profile) if profile is not None else None
    if work is not None:  # a layout that does not fit is refused before anything runs
        job = resolve_job(job, layout)
    shaped = partial(probe_shape, backend, dtype=dtype, warmup=warmup, iters=iters, redop=redop,
                     deadline_s=deadline_s)
    shape = shaped(fabric_ops(work, ops) if work else ops, sizes)
    if max_rounds is not None:
        budget = replace(budget or CheckBudget.from_settings(get_settings()), max_rounds=max_rounds)
    run = run_adaptive(backend, layout, ranks, shape, thresholds=thresholds, expected=expected,
                       budget=budget, progress=progress, label=label, history=history)
    if work is None or job is None:
        return Checked(verdict_of(run, backend.name, list(layout)), run.measurements,
                       run.probe_findings, run.busy_s)
    job_run, summary = run_job(backend, work, job, layout, ranks,
                               shaped(work.ops, work.sizes), progress)
    # The identity on the fabric check's own groups too (fsdp runs all three ops there):
    # a node's AllReduce off its halves is named by its intra-node group. Taken before the
    # job's measurements join the run (their identity is judge_job's).
    if work.identity_sizes:
        table, off = identity(run.measurements, {m.group: m.scope for m in run.measurements},
                              shape.sizes)
        summary["identity"] = table + summary["identity"]
        summary["findings"] = [f.to_dict() for f in off] + summary["findings"]
    run.absorb(job_run)
    # What the job's groups showed of the ranks themselves (a hang, wrong data, an error)
    # is a finding like any other; their speed is the workload section's.
    run.judgement = replace(run.judgement,
                            findings=run.judgement.findings + job_run.probe_findings)
    verdict = verdict_of(run, backend.name, list(layout))
    # The job asked whether its traffic runs well here: a communicator slower than its
    # peers, or an AllReduce off its halves, says no even where no link is to blame.
    summary["ok"] = not summary["findings"]
    verdict["healthy"] = verdict["healthy"] and summary["ok"]
    verdict["workload"] = summary
    return Checked(verdict, run.measurements, run.probe_findings, run.busy_s)


def resolve_job(job: JobLayout | None, layout: Mapping[str, Sequence[int]]) -> JobLayout:
    """The job's layout over these nodes' ranks (default: tensor parallel over one node's
    GPUs); LayoutError when it does not fit them."""
    per_node = max((len(ix) for ix in layout.values()), default=1)
    return (job or JobLayout()).resolve(sum(len(ix) for ix in layout.values()), per_node)


def run_job(backend: ProbeBackend, work: Workload, job: JobLayout,
            layout: dict[str, list[int]], ranks: Sequence[RankInfo], shape: ProbeShape,
            progress: Progress | None = None) -> tuple[Rounds, dict[str, Any]]:
    """The job's own communicators under ``job`` (resolved) over ``layout``'s ranks, run
    at the profile's sizes and judged (the verdict's ``workload`` section, without ``ok``)."""
    comms = job.communicators(node_members(layout, list(layout)))
    job_run = _job_phase(backend, work, comms, shape, {r.node: r.profile for r in ranks},
                         progress)
    summary = judge_job(work, job, comms, job_run.measurements)
    summary.update(rounds=job_run.rounds, fabric_s=round(job_run.fabric_s, 3))
    no_algos = algos_for(backend.name, work)[1]
    if no_algos:
        summary["algos"] = no_algos
    return job_run, summary


def _job_phase(backend: ProbeBackend, work: Workload, comms: Mapping[str, Any],
               shape: ProbeShape, node_profiles: dict[str, str | None],
               progress: Progress | None) -> Rounds:
    """Run the job's own groups, round by round (services.scheduler.workload.job_groups)."""
    out = Rounds()
    kind_of = kinds(comms)
    for groups in job_groups(work, comms, shape, algos_for(backend.name, work)[0]):
        if progress is not None:
            first = groups[0]
            progress(f"job round {out.rounds + 1}: {len(groups)} {kind_of[first.group_key]} "
                     f"group(s), {', '.join(first.ops)}"
                     f"{f' ({first.algo})' if first.algo else ''}")
        out.take(groups, backend.run_round(groups), node_profiles)
    return out


def verdict_of(run: AdaptiveRun, backend: str, nodes: list[str]) -> dict[str, Any]:
    """The verdict (docs/formats.md) of an adaptive check, as the CLI prints it and a scheduler
    completes an API preflight with: fabric and wall time, and whether the round cap cut
    the plan short (``complete``, with the groups it left ``undecided``)."""
    return build_verdict(
        backend=backend, nodes=nodes, findings=run.judgement.findings, rounds=run.rounds,
        duration_s=run.fabric_s,
        extra={"wall_s": round(run.wall_s, 3), "complete": run.complete,
               "undecided": run.undecided,
               "undecided_groups": run.undecided_groups[:UNDECIDED_LISTED],
               "stopped_by": run.stopped_by},
    )


def _say(progress: Progress | None, label: str, i: int, groups: list[GroupSpec]) -> None:
    if progress is not None:
        scopes = ", ".join(sorted({g.scope for g in groups}))
        progress(f"{label} {i}: {len(groups)} group(s) ({scopes})")
