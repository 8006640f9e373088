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
from typing import Any

from agents import profiles
from agents.collectives import default_sizes
from agents.spec import Finding, GroupSpec, Measurement, ProbeBackend, RankInfo
from agents.workloads import JobLayout, workload
from services.analyzer.assess import Expected, LinkKey, Thresholds
from services.analyzer.judge import Judgement, judge
from services.analyzer.verdict import build_verdict
from services.config import get_settings
from services.scheduler.deadlines import group_deadline_s
from services.scheduler.planner import (
    DEFAULT_OPS,
    MAX_ROUNDS,
    AdaptivePlanner,
    ProbeShape,
    layout_of,
    node_members,
)
from services.scheduler.workload import identity_findings, identity_table, run_job

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
class AdaptiveRun:
    """What an adaptive check measured, and the judgement of all of it."""

    judgement: Judgement
    measurements: list[Measurement] = field(default_factory=list)
    probe_findings: list[Finding] = field(default_factory=list)
    rounds: int = 0
    fabric_s: float = 0.0
    wall_s: float = 0.0
    # Seconds each rank spent inside probe groups.
    busy_s: dict[str, float] = field(default_factory=dict)
    # False when the round cap stopped the plan before it had nothing left to ask.
    complete: bool = True

    @property
    def undecided(self) -> int:
        """Groups the check measured but could not decide either way (never exclusions)."""
        return sum(1 for v in self.judgement.verdicts.values() if not v.bad and not v.cleared)


def run_adaptive(
    backend: ProbeBackend,
    layout: dict[str, list[int]],
    ranks: Sequence[RankInfo],
    shape: ProbeShape,
    *,
    thresholds: Thresholds | None = None,
    expected: Expected | None = None,
    rotation: int = 0,
    max_rounds: int = MAX_ROUNDS,
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

    def judged(run: AdaptiveRun) -> Judgement:
        return judge(run.measurements, run.probe_findings, nodes, mine, thresholds=t,
                     expected=model, history=history)

    run = AdaptiveRun(judgement=judge([], [], nodes, mine, thresholds=t))
    planner = AdaptivePlanner(layout, shape, max_rounds=max_rounds, rotation=rotation)
    while groups := planner.next_round(run.judgement.verdicts, run.judgement.blamed):
        run.rounds += 1
        _say(progress, label, run.rounds, groups)
        result = backend.run_round(groups)
        run.fabric_s += result.fabric_time_s
        for g in groups:
            for m in g.members:
                run.busy_s[m] = run.busy_s.get(m, 0.0) + result.busy_s.get(m, result.wall_time_s)
        profiles.annotate(result.measurements, node_profiles)
        run.measurements += result.measurements
        run.probe_findings += result.findings
        run.judgement = judged(run)
    run.complete = planner.phase == "done"
    run.wall_s = time.perf_counter() - started
    return run


def run_preflight(
    backend: ProbeBackend,
    nodes: list[str] | None = None,
    *,
    ops: Sequence[str] = DEFAULT_OPS,
    sizes: Sequence[int] | None = None,
    progress: Progress | None = None,
    thresholds: Thresholds | None = None,
    expected: Expected | None = None,
    deadline_s: float | None = None,
    max_rounds: int = MAX_ROUNDS,
    history: Mapping[LinkKey, Sequence[float]] | None = None,
    profile: str | None = None,
    job: JobLayout | None = None,
) -> dict[str, Any]:
    """Probe ``nodes`` (all the backend's nodes when None) and return DESIGN.md's verdict.

    ``duration_s`` is fabric time (the slowest group of each round, summed); the wall
    time of the whole check is ``wall_s``. A hang is a finding, never an exception.
    Defaults come from the backend where it offers them (``preflight_sizes``,
    ``preflight_deadline_s``, ``expected_busbw``).

    ``profile`` (agents.workloads: ddp, fsdp, moe, pipeline) sets the ops and sizes of the
    fabric check to the job's, then runs the job's own communicators under ``job`` (its
    tp/pp/dp layout; default: tensor parallel over each node's GPUs, data parallel across
    nodes) and reports them in the verdict's ``workload``; the fabric verdict is the same
    judgement monitoring reaches.
    """
    ranks = backend.ranks()
    layout = layout_of(ranks, nodes)
    work = workload(profile) if profile is not None else None
    members = node_members(layout, list(layout))
    if work is not None:
        # The fabric check is the one monitoring runs (the same judgement), with the
        # profile's ops added; the profile's own sizes are its job groups'.
        ops = tuple(dict.fromkeys((*ops, *work.ops)))
        per_node = max((len(ix) for ix in layout.values()), default=1)
        job = job or JobLayout(tp=per_node)
        # A layout that does not fit the ranks is refused before anything runs.
        job = replace(job, tp=per_node if job.tp is None else job.tp).resolve(len(members))
    shape = probe_shape(backend, ops, sizes, deadline_s=deadline_s)
    run = run_adaptive(backend, layout, ranks, shape, thresholds=thresholds, expected=expected,
                       max_rounds=max_rounds, progress=progress, label="preflight round",
                       history=history)
    if work is None:
        return verdict_of(run, backend.name, list(layout))
    assert job is not None
    job_run, summary = run_job(backend, work, job, members,
                               probe_shape(backend, work.ops, work.sizes, deadline_s=deadline_s),
                               progress=progress)
    # What the job's groups showed of the ranks themselves (a hang, wrong data, an
    # error) is a finding like any other; their speed is the workload section's.
    run.judgement = replace(run.judgement, findings=run.judgement.findings + [
        f for f in job_run.findings if f.kind in ("hang", "data_corruption", "probe_error")])
    run.rounds += job_run.rounds
    run.fabric_s += job_run.fabric_s
    # The identity on the fabric check's own groups too (fsdp runs all three ops there):
    # a node's AllReduce off its halves is named by its intra-node group.
    scopes = {m.group: m.scope for m in run.measurements}
    on_fabric = replace(work, identity_sizes=shape.sizes) if work.identity_sizes else work
    fabric_identity = identity_findings(run.measurements, scopes, on_fabric)
    summary["identity"] = identity_table(run.measurements, scopes, on_fabric) + summary["identity"]
    summary["findings"] = [f.to_dict() for f in fabric_identity] + summary["findings"]
    verdict = verdict_of(run, backend.name, list(layout))
    # The job asked whether its traffic runs well here: a communicator slower than its
    # peers, or an AllReduce off its halves, says no even where no link is to blame.
    summary["ok"] = not summary["findings"]
    verdict["healthy"] = verdict["healthy"] and summary["ok"]
    verdict["workload"] = summary
    return verdict


def verdict_of(run: AdaptiveRun, backend: str, nodes: list[str]) -> dict[str, Any]:
    """DESIGN.md's verdict of an adaptive check, as the CLI prints it and a scheduler
    completes an API preflight with: fabric and wall time, and whether the round cap cut
    the plan short (``complete``, with the groups it left ``undecided``)."""
    return build_verdict(
        backend=backend, nodes=nodes, findings=run.judgement.findings, rounds=run.rounds,
        duration_s=run.fabric_s,
        extra={"wall_s": round(run.wall_s, 3), "complete": run.complete,
               "undecided": run.undecided},
    )


def _say(progress: Progress | None, label: str, i: int, groups: list[GroupSpec]) -> None:
    if progress is not None:
        scopes = ", ".join(sorted({g.scope for g in groups}))
        progress(f"{label} {i}: {len(groups)} group(s) ({scopes})")
