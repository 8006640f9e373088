"""The check, round by round: plan a round from the judgement so far, probe, judge all of it
again; until the plan has nothing left to ask or the budget is spent. What a preflight runs
on a job's nodes and what each monitoring cycle runs on the fleet. Beside the probes it
reads the facts of its nodes (NVML and NIC counters, NVLink fabric state) before the first
round and after the last, and judges them with the rest (``services.check.facts``).

Backend-agnostic: it sees only ``ProbeBackend`` (nccl, gloo, sim). Each round is planned
from what the rounds before it showed (``services.analyzer.judge``), so suspects are
re-tested and localized before anyone is blamed. Everything a process configures (the
thresholds, the budget) comes in as an argument: the check reads no settings.
"""

from __future__ import annotations

import contextlib
import gc
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from ringwatch.agents.groups import member, node_order
from ringwatch.agents.spec import (
    EXCLUDING_KINDS,
    Finding,
    GroupSpec,
    Measurement,
    ProbeBackend,
    RankInfo,
)
from ringwatch.agents.workloads import JobLayout, fabric_ops, workload
from ringwatch.services.analyzer.assess import Expected, LinkKey, Thresholds, thresholds_for
from ringwatch.services.analyzer.judge import JudgeCache, Judgement, explain, judge
from ringwatch.services.analyzer.localize import dedupe
from ringwatch.services.analyzer.verdict import build_verdict
from ringwatch.services.check import facts
from ringwatch.services.check.planner import AdaptivePlanner, layout_of
from ringwatch.services.check.rounds import Progress, Rounds
from ringwatch.services.check.shape import ProbeShape, ProbeSpec
from ringwatch.services.check.workload import resolve_job, run_job_phase
from ringwatch.services.config import CHECK_MAX_FABRIC_S, CHECK_MAX_ROUNDS, CHECK_MAX_WALL_S

if TYPE_CHECKING:
    from ringwatch.services.settings import Settings

# What the judgement names from busbw alone: on a node a fact excludes, the fact is its name.
BANDWIDTH_KINDS = frozenset({"nvlink_degraded", "nic_degraded", "net_path_degraded"})
# The undecided groups a verdict lists by name; more are counted.
UNDECIDED_LISTED = 100


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


@dataclass
class CheckResult(Rounds):
    """What a check measured (both phases), the judgement of it, and with a profile the
    job's ``workload`` section; ``verdict()`` is what the CLI prints and a scheduler
    completes an API preflight with."""

    backend: str = field(kw_only=True)
    nodes: list[str] = field(kw_only=True)
    judgement: Judgement = field(kw_only=True)
    # What of the budget stopped the plan before it had nothing left to ask (None: none).
    stopped_by: str | None = None
    # With a profile: how the job's communicators ran (services.check.workload).
    workload: dict[str, Any] | None = None
    # The counter readings before and after of the GPUs where something changed (a batch's
    # ``counters``), and the nodes whose facts were read both times (its ``facts``).
    counters: list[dict[str, Any]] = field(default_factory=list)
    facts: list[str] = field(default_factory=list)

    @property
    def undecided_groups(self) -> list[dict[str, Any]]:
        """Places the check measured but could not decide (never exclusions): GPU pairs,
        node pairs and two-GPU nodes neither named nor shown unable to hide a loss of the
        check's smallest size (``Weighing.smallest_loss``; ``evidence.can_hide``). A ring
        of a node's GPUs, the world group and the search's unions only steer the plan
        (their GPU pairs and node pairs are the places); a group on a node the verdict
        already excludes (a hang, wrong data, a slow NIC named it) needs no decision."""
        excluded = {f.node for f in self.judgement.findings
                    if f.kind in EXCLUDING_KINDS and f.node is not None}
        return [{"scope": v.scope, "nodes": list(v.nodes)}
                for v in self.judgement.verdicts.values()
                if v.is_one_link and not v.bad and not v.cleared
                and excluded.isdisjoint(v.nodes)]

    def verdict(self) -> dict[str, Any]:
        """The verdict (docs/formats.md): fabric and wall time, whether the budget cut the
        plan short (``complete``, with the groups it left ``undecided``); with a profile,
        unhealthy too where the job's traffic runs badly, without excluding a node."""
        undecided = self.undecided_groups
        # Complete exactly when nothing is undecided and no budget cut the plan short.
        verdict = build_verdict(
            backend=self.backend, nodes=self.nodes, findings=self.judgement.findings,
            rounds=self.rounds, duration_s=self.fabric_s,
            extra={"wall_s": round(self.wall_s, 3),
                   "complete": self.stopped_by is None and not undecided,
                   "undecided": len(undecided),
                   "undecided_groups": undecided[:UNDECIDED_LISTED],
                   "stopped_by": self.stopped_by},
        )
        if self.workload is not None:
            verdict["healthy"] = verdict["healthy"] and self.workload["ok"]
            verdict["workload"] = self.workload
        # Nodes whose own groups met other traffic: nothing was judged of them, so the check
        # cannot vouch for them (as for a node with no fresh results), nor blame them.
        contended = sorted(set_aside(self.measurements) & set(self.nodes), key=node_order)
        if contended:
            verdict["contended"] = contended
            verdict["healthy"] = False
        return verdict


def run_check(
    backend: ProbeBackend,
    nodes: Sequence[str] | None = None,
    *,
    ranks: Sequence[RankInfo] | None = None,
    spec: ProbeSpec = ProbeSpec(),
    thresholds: Thresholds | None = None,
    expected: Expected | None = None,
    history: Mapping[LinkKey, Sequence[float]] | None = None,
    rotation: int = 0,
    fleet: Sequence[str | None] | None = None,
    budget: CheckBudget = CheckBudget(),
    profile: str | None = None,
    job: JobLayout | None = None,
    progress: Progress | None = None,
    label: str = "round",
) -> CheckResult:
    """Probe ``nodes`` (all of ``ranks``' nodes when None; ``ranks``: the backend's when None)
    and judge them: the one check behind a preflight, a served preflight and a monitoring
    cycle.

    ``spec`` is what every group runs; ``thresholds`` judge the results (None: the
    analyzer's for the backend; a process passes its settings'); ``expected``, the busbw
    model (None: the backend's); ``history``, each link's past busbw as the API holds it
    (``GET /v1/baselines``), gives a link its own normal in the check as on ingest, so the
    plan follows up what the API will find; ``rotation`` picks the node-pair matching of
    the tournament over ``fleet`` (a monitoring cycle's whole fleet, busy nodes too; None:
    ``nodes``); a ``contended`` measurement (other traffic on its links) is kept and
    shipped but never judged;
    ``budget`` bounds the plan. ``fabric_s`` is fabric time (the slowest group of each
    round, summed); ``wall_s`` the wall time of the fabric phase. A hang is a finding,
    never an exception.

    The facts of the nodes (``backend.counters()``: NVML and NIC counters, NVLink fabric
    state) are read before the first round and after the last, and judged
    (services.check.facts; ``spec.nvlink_partitioned`` for the fabric's cliques): their
    findings join ``probe_findings`` and the judgement, their readings ``counters``, and
    ``facts`` names the nodes read both times.

    ``profile`` (agents.workloads: ddp, fsdp, moe, pipeline) adds its ops to the fabric
    check (monitoring's judgement), then runs the job's own communicators at its sizes
    under ``job`` (its tp/pp/dp layout; default: tensor parallel over each node's GPUs,
    data parallel across nodes) and reports them in ``workload``. A layout that does not
    fit the ranks raises LayoutError before anything runs.
    """
    ranks = list(ranks if ranks is not None else backend.ranks())
    layout = layout_of(ranks, nodes)
    work = workload(profile) if profile is not None else None
    if work is not None and layout:  # a layout that does not fit is refused before anything runs
        job = resolve_job(job, layout)
    shape = spec.shape(backend, fabric_ops(work, spec.ops) if work else spec.ops, spec.sizes)
    before = facts.read(backend, layout)
    result = _fabric_phase(backend, layout, ranks, shape, budget, progress, label,
                           thresholds=thresholds or thresholds_for(backend.name),
                           expected=expected or backend.expected_busbw,
                           history=history, rotation=rotation, fleet=fleet)
    if work is not None and job is not None and layout:
        job_run, result.workload = run_job_phase(
            backend, work, job, layout, ranks, spec.shape(backend, work.ops, work.sizes),
            result.measurements, shape.sizes, progress,
            hung=hung_ranks(result.judgement.findings, layout))
        result.absorb(job_run)
        # What the job's groups showed of the ranks themselves (a hang, wrong data, an
        # error) is a finding like any other; their speed is the workload section's. Each
        # round of them reports it again (a node's transport): the verdict lists it once.
        result.judgement = replace(result.judgement, findings=dedupe(
            [*result.judgement.findings, *job_run.probe_findings]))
    _take_facts(result, facts.judge_facts(before, facts.read(backend, layout),
                                          partitioned=spec.nvlink_partitioned))
    return result


def hung_ranks(findings: Sequence[Finding], layout: Mapping[str, Sequence[int]]) -> set[str]:
    """The ranks the fabric phase found hung: a hang's GPU, or every rank of its node where
    it names no GPU."""
    out: set[str] = set()
    for f in findings:
        node = f.node
        if f.kind == "hang" and node is not None and node in layout:
            gpus = [f.gpu] if f.gpu is not None else list(layout[node])
            out.update(member(node, g) for g in gpus)
    return out


def _take_facts(result: CheckResult, read: facts.Facts) -> None:
    """The facts' findings are what the probes reported (shipped with the batch, judged by
    the API as the check judged them) and part of the judgement (the verdict excludes
    their nodes); their readings are kept."""
    # A cause read on a node (its NIC counters, its NVLink fabric state) carries the slow
    # figure it explains where the node's own groups measured slow, and the node is named
    # for it alone: as the API judges the batch, where the facts come in with the probes'
    # findings and no bandwidth finding is made on a node they exclude.
    explain(read.findings, result.judgement.assessments)
    named = {f.node for f in read.findings if f.kind in EXCLUDING_KINDS and f.node}
    kept = [f for f in result.judgement.findings
            if f.kind not in BANDWIDTH_KINDS or named.isdisjoint({f.node, *(f.nodes or ())})]
    result.probe_findings += read.findings
    result.judgement = replace(result.judgement, findings=kept + read.findings)
    result.counters, result.facts = read.snapshots, read.nodes


def _fabric_phase(backend: ProbeBackend, layout: dict[str, list[int]],
                  ranks: Sequence[RankInfo], shape: ProbeShape, budget: CheckBudget,
                  progress: Progress | None, label: str, *, thresholds: Thresholds,
                  expected: Expected | None,
                  history: Mapping[LinkKey, Sequence[float]] | None,
                  rotation: int, fleet: Sequence[str | None] | None = None) -> CheckResult:
    """Plan a round from the judgement so far, run it, judge everything again; until the
    planner has nothing left to ask or ``budget`` is spent."""
    started = time.perf_counter()
    with _fewer_young_collections():
        return _rounds(backend, layout, ranks, shape, budget, progress, label, started,
                       thresholds=thresholds, expected=expected, history=history,
                       rotation=rotation, fleet=fleet)


def _rounds(backend: ProbeBackend, layout: dict[str, list[int]], ranks: Sequence[RankInfo],
            shape: ProbeShape, budget: CheckBudget, progress: Progress | None, label: str,
            started: float, *, thresholds: Thresholds, expected: Expected | None,
            history: Mapping[LinkKey, Sequence[float]] | None, rotation: int,
            fleet: Sequence[str | None] | None = None) -> CheckResult:
    """The rounds themselves (``_fabric_phase``'s loop)."""
    nodes = list(layout)
    mine = [r for r in ranks if r.node in layout]
    node_profiles = {r.node: r.profile for r in mine}
    # The measurements only grow from round to round: what was worked out for them is kept.
    cache = JudgeCache()
    run = CheckResult(backend=backend.name, nodes=nodes,
                      judgement=judge([], [], nodes, mine, thresholds=thresholds))
    planner = AdaptivePlanner(layout, shape, max_rounds=budget.max_rounds, rotation=rotation,
                              fleet=fleet, memo=cache.localize)
    # ``set_aside`` and whether any measurement was contended, taken from each round's new
    # measurements as they come rather than from all of them after every round.
    aside: set[str] = set()
    contended = False
    while not (spent := budget.spent(run, time.perf_counter() - started)) and (
            groups := planner.next_round(run.judgement.verdicts, run.judgement.blamed | aside)):
        _say(progress, label, run.rounds + 1, groups)
        seen = len(run.measurements)
        run.take(groups, backend.run_round(groups), node_profiles)
        new = run.measurements[seen:]
        aside |= set_aside(new)
        contended = contended or any(m.contended for m in new)
        run.judgement = judge(judged(run.measurements) if contended else run.measurements,
                              run.probe_findings, nodes, mine,
                              thresholds=thresholds, expected=expected, history=history,
                              cache=cache)
        _settle()
    if planner.phase != "done":
        run.stopped_by = spent or f"rounds ({budget.max_rounds})"
    run.wall_s = time.perf_counter() - started
    return run


# A check allocates hundreds of thousands of objects that live to its end (measurements,
# assessments, verdicts) and makes little cyclic garbage; at CPython's default threshold
# (700 allocations) the young generation is swept again and again, about 12 % of a fault-
# free 1024 x 8 check's CPU. Checks raise it while they run; the last to end puts it back.
# Each round's survivors are frozen besides (``_settle``), and the older generations are
# swept a tenth as often: a check leaves no cyclic garbage behind it (a full sweep after 14
# rounds of a 16384 x 8 check finds none), and at the default thresholds the sweeps of
# those rounds, each over all that the rounds before had made, took a third of their CPU.
YOUNG_THRESHOLD = 10_000
OLDER_THRESHOLD = 100
_gc_lock = threading.Lock()
_gc_users = 0
_gc_before: tuple[int, int, int] = (0, 0, 0)


@contextlib.contextmanager
def _fewer_young_collections() -> Iterator[None]:
    global _gc_users, _gc_before
    with _gc_lock:
        if _gc_users == 0:
            _gc_before = gc.get_threshold()
            gc.set_threshold(max(_gc_before[0], YOUNG_THRESHOLD),
                             *(max(t, OLDER_THRESHOLD) for t in _gc_before[1:]))
        _gc_users += 1
    try:
        yield
    finally:
        with _gc_lock:
            gc.unfreeze()
            _gc_users -= 1
            if _gc_users == 0:
                gc.set_threshold(*_gc_before)


def _settle() -> None:
    """What a round made and kept (its measurements, assessments and verdicts) is moved out
    of the collector's sweeps (``gc.freeze``) until the check ends: otherwise each full
    sweep walks everything the rounds before made again, and a 16384 x 8 check spent more
    than a tenth of its CPU there. Each check's end puts them back (``gc.unfreeze``), so that
    garbage frozen beside a check is not kept past it."""
    gc.freeze()


def judged(measurements: list[Measurement]) -> list[Measurement]:
    """What a judgement weighs: every measurement but the contended ones, which met a job's
    traffic and say nothing of the link (docs/operations.md, "Occupancy and contention")."""
    if not any(m.contended for m in measurements):
        return measurements
    return [m for m in measurements if not m.contended]


def set_aside(measurements: list[Measurement]) -> set[str]:
    """Nodes whose own NVLink groups met other traffic (a job the occupancy source did not
    name, or busy nodes probed on purpose): the plan leaves them out of further rounds as it
    does blamed nodes, rather than re-pair and re-test what cannot be judged."""
    return {m.nodes[0] for m in measurements
            if m.contended and m.scope in ("intra_node", "gpu_pair")}


def _say(progress: Progress | None, label: str, i: int, groups: list[GroupSpec]) -> None:
    if progress is not None:
        scopes = ", ".join(sorted({g.scope for g in groups}))
        progress(f"{label} {i}: {len(groups)} group(s) ({scopes})")
