"""A profiled check's second phase: the job's own communicators, as the job will form them.

The fabric check (``run_adaptive``) judges every link and names faults; this phase then
runs each kind of the job's groups (tensor-, data-parallel, pipeline neighbours) with the
profile's ops and sizes, and says how the job's traffic would run here: each kind's
busbw, its slowest group against its peers, and the identity ReduceScatter + AllGather
against AllReduce per group and size (docs/workloads.md). It never changes the fabric
verdict: monitoring and preflight judge the fabric alike, and this is what the job sees of
that fabric.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from agents.spec import Finding, GroupSpec, Measurement, ProbeBackend, nodes_of
from agents.workloads import COMM_KINDS, JobLayout, Workload, disjoint_rounds
from services.analyzer.evidence import MAD_TO_SIGMA
from services.scheduler.planner import ProbeShape

Progress = Callable[[str], None]
# The identity's time ratio (RS + AG) / AR of a healthy group sits near 1 (a ring
# AllReduce is a ReduceScatter then an AllGather); a group is off when it is further than
# this many of its peers' spreads from their centre, and never for less than
# IDENTITY_MIN_TOLERANCE (one ratio of three timings carries their noise).
IDENTITY_Z = 4.0
IDENTITY_MIN_TOLERANCE = 0.25
# A communicator this far below its kind's median busbw is named as the job's slowest.
SLOW_SHARE = 0.8


@dataclass
class JobRun:
    """What the job's communicators measured, and what it says."""

    measurements: list[Measurement] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)
    rounds: int = 0
    fabric_s: float = 0.0
    wall_s: float = 0.0


def job_groups(workload: Workload, comms: Mapping[str, Sequence[tuple[str, ...]]],
               shape: ProbeShape, algos: Sequence[str] = ()) -> list[list[GroupSpec]]:
    """Rounds of the job's groups: each kind's groups with that kind's ops and sizes, then,
    for each of ``algos``, its AllReduce on a communicator told to use that algorithm;
    packed so that no rank is in two groups of a round."""
    rounds: list[list[GroupSpec]] = []
    for kind in COMM_KINDS:
        probe = workload.comms.get(kind)
        if probe is None or not comms.get(kind):
            continue
        variants: list[tuple[tuple[str, ...], str | None]] = [(probe.ops, None)]
        if "allreduce" in probe.ops:
            variants += [(("allreduce",), a) for a in algos]
        for ops, algo in variants:
            for members in disjoint_rounds(comms[kind]):
                rounds.append([replace(shape.group(_scope(g), g, ops), sizes=probe.sizes,
                                       algo=algo) for g in members])
    return rounds


def _scope(members: tuple[str, ...]) -> str:
    """Where a job group's traffic runs: NVLink when its ranks share a node."""
    return "intra_node" if len(nodes_of(members)) == 1 else "world"


def algos_for(backend: str, workload: Workload) -> tuple[tuple[str, ...], str | None]:
    """The AllReduce algorithms a backend can be told to use, and why none where it cannot:
    NCCL takes NCCL_ALGO per communicator (the sim models it); gloo has no such choice."""
    if not workload.algos:
        return (), None
    if backend in ("nccl", "sim"):
        return workload.algos, None
    return (), (f"{backend} cannot be told an algorithm: AllReduce probed as {backend} runs it, "
                "ring and tree not apart")


def run_job(backend: ProbeBackend, workload: Workload, layout: JobLayout,
            ranks: Sequence[str], shape: ProbeShape, *,
            progress: Progress | None = None) -> tuple[JobRun, dict[str, Any]]:
    """Run the job's communicators and summarise them: per kind, op, size and algorithm,
    the busbw and the slowest group; the identity ratios; findings of the job's own."""
    lay = layout.resolve(len(ranks))
    comms = lay.communicators(ranks)
    algos, no_algos = algos_for(backend.name, workload)
    run = JobRun()
    kind_of = {tuple(sorted(g)): kind for kind, groups in comms.items() for g in groups}
    for i, groups in enumerate(job_groups(workload, comms, shape, algos), 1):
        if progress is not None:
            first = groups[0]
            progress(f"job round {i}: {len(groups)} {kind_of[first.group_key]} group(s), "
                     f"{', '.join(first.ops)}{f' ({first.algo})' if first.algo else ''}")
        result = backend.run_round(groups)
        run.rounds += 1
        run.fabric_s += result.fabric_time_s
        run.wall_s += result.wall_time_s
        run.measurements += result.measurements
        run.findings += result.findings
    out = summary(workload, lay, comms, run)
    slow = [Finding(kind="communicator_slow", nodes=row["slowest_nodes"], severity="warning",
                    measured_gbs=row["slowest_busbw_gbs"], expected_gbs=row["busbw_gbs"],
                    detail={"communicator": row["kind"], "share": row["slowest_share"],
                            **{k: row[k] for k in ("op", "size_bytes", "algo") if k in row}})
            for row in out["communicators"] if "slowest_nodes" in row]
    run.findings += slow + identity_findings(run.measurements, kind_of, workload)
    out["identity"] = identity_table(run.measurements, kind_of, workload)
    out["findings"] = [f.to_dict() for f in run.findings]
    if no_algos:
        out["algos"] = no_algos
    return run, out


def summary(workload: Workload, layout: JobLayout,
            comms: Mapping[str, Sequence[tuple[str, ...]]], run: JobRun) -> dict[str, Any]:
    """Per kind, op, size and algorithm: how many groups, their median busbw, and the
    slowest group (named when it falls below ``SLOW_SHARE`` of the median)."""
    kind_of = {tuple(sorted(g)): kind for kind, groups in comms.items() for g in groups}
    series: dict[tuple[str, str, int, str | None], list[Measurement]] = defaultdict(list)
    for m in run.measurements:
        kind = kind_of.get(m.group)
        if kind is not None and not m.wrong:
            series[(kind, m.op, m.size_bytes, m.algo)].append(m)
    rows = []
    for (kind, op, size, algo), ms in sorted(series.items(), key=lambda kv: (
            COMM_KINDS.index(kv[0][0]), kv[0][1], kv[0][2], kv[0][3] or "")):
        median = statistics.median(m.busbw_gbs for m in ms)
        slowest = min(ms, key=lambda m: m.busbw_gbs)
        share = slowest.busbw_gbs / median if median > 0 else 1.0
        row: dict[str, Any] = {
            "kind": kind, "op": op, "size_bytes": size, "groups": len(ms),
            "busbw_gbs": round(median, 3), "time_us": round(statistics.median(
                m.time_us for m in ms), 3),
            "slowest_busbw_gbs": round(slowest.busbw_gbs, 3), "slowest_share": round(share, 3),
        }
        if algo is not None:
            row["algo"] = algo
        if share < SLOW_SHARE:
            row["slowest_nodes"] = slowest.nodes
        rows.append(row)
    return {"profile": workload.name, "layout": layout.to_dict(),
            "groups": {k: len(v) for k, v in comms.items()}, "rounds": run.rounds,
            "fabric_s": round(run.fabric_s, 3), "communicators": rows}


# ---- ReduceScatter + AllGather = AllReduce -----------------------------------------------


def _times(ms: Sequence[Measurement], sizes: Sequence[int]
           ) -> dict[tuple[tuple[str, ...], int], dict[str, Measurement]]:
    """Per group and size, its AllReduce (as NCCL chooses it), ReduceScatter and AllGather."""
    out: dict[tuple[tuple[str, ...], int], dict[str, Measurement]] = defaultdict(dict)
    for m in ms:
        # One rank has no identity to check: its in-place AllReduce is a no-op (about 1 us
        # on an H200 where its ReduceScatter and AllGather copy).
        if (len(m.members) >= 2 and m.size_bytes in sizes and m.algo is None and not m.wrong and m.time_us > 0
                and m.op in ("allreduce", "reducescatter", "allgather")):
            out[(m.group, m.size_bytes)].setdefault(m.op, m)
    return {k: v for k, v in out.items() if len(v) == 3}


def _ratio(t: Mapping[str, float]) -> float:
    return (t["reducescatter"] + t["allgather"]) / t["allreduce"]


def identity_ratios(ms: Sequence[Measurement], sizes: Sequence[int]
                    ) -> dict[tuple[tuple[str, ...], int], float]:
    """Per group and size, time(ReduceScatter) + time(AllGather) over time(AllReduce),
    where the group ran all three at that size (AllReduce as NCCL chooses it)."""
    return {key: _ratio({op: m.time_us for op, m in t.items()})
            for key, t in _times(ms, sizes).items()}


def _model_ratio(t: Mapping[str, Measurement]) -> float | None:
    """The identity ratio the hardware model expects of this group (the sim's preset, or
    the node type's rated busbw), from the expected busbw of each op; None without one."""
    times = {}
    for op, m in t.items():
        expected = m.preset_gbs or m.rated_gbs
        if not expected:
            return None
        times[op] = m.time_us * m.busbw_gbs / expected
    return _ratio(times)


def _band(values: Sequence[float]) -> tuple[float, float]:
    """Centre and tolerance of healthy identity ratios: their median, and IDENTITY_Z robust
    spreads of the log ratios (never under IDENTITY_MIN_TOLERANCE)."""
    logs = [math.log(v) for v in values]
    centre = statistics.median(logs)
    mad = statistics.median(abs(x - centre) for x in logs) * MAD_TO_SIGMA
    return math.exp(centre), max(IDENTITY_Z * mad, math.log1p(IDENTITY_MIN_TOLERANCE))


def identity_findings(ms: Sequence[Measurement], kind_of: Mapping[tuple[str, ...], str],
                      workload: Workload) -> list[Finding]:
    """A group whose AllReduce runs off its two halves: an AllReduce on a slower algorithm
    or protocol than its halves (a fallback), or halves slower than the whole. The expected
    ratio is the hardware model's where the measurements carry one, else the median of the
    group's peers (same kind and size), else 1 (a ring AllReduce is a ReduceScatter then an
    AllGather); the tolerance is the peers' spread, never under IDENTITY_MIN_TOLERANCE."""
    out = []
    times = _times(ms, workload.identity_sizes)
    peers: dict[tuple[str, int], list[tuple[tuple[str, ...], float, float | None]]] = (
        defaultdict(list))
    for (group, size), t in times.items():
        ratio = _ratio({op: m.time_us for op, m in t.items()})
        peers[(kind_of.get(group, "fabric"), size)].append((group, ratio, _model_ratio(t)))
    for (kind, size), rows in sorted(peers.items()):
        centre, tol = (_band([r for _, r, _ in rows]) if len(rows) >= 3
                       else (1.0, math.log1p(IDENTITY_MIN_TOLERANCE)))
        for group, r, model in rows:
            expected = model or centre
            if abs(math.log(r / expected)) > tol:
                out.append(Finding(
                    kind="collective_identity", nodes=nodes_of(group), severity="warning",
                    detail={"communicator": kind, "size_bytes": size, "ratio": round(r, 3),
                            "expected_ratio": round(expected, 3),
                            "tolerance": round(math.expm1(tol), 3),
                            "reason": ("AllReduce slower than ReduceScatter + AllGather: an "
                                       "algorithm or protocol fallback" if r < expected else
                                       "ReduceScatter + AllGather slower than AllReduce")}))
    return out


def identity_table(ms: Sequence[Measurement], kind_of: Mapping[tuple[str, ...], str],
                   workload: Workload) -> list[dict[str, Any]]:
    """Per kind and size, the identity ratios' median and range (for the report)."""
    by: dict[tuple[str, int], list[float]] = defaultdict(list)
    for (group, size), r in identity_ratios(ms, workload.identity_sizes).items():
        by[(kind_of.get(group, "fabric"), size)].append(r)
    return [{"kind": k, "size_bytes": s, "groups": len(v),
             "ratio_median": round(statistics.median(v), 3),
             "ratio_min": round(min(v), 3), "ratio_max": round(max(v), 3)}
            for (k, s), v in sorted(by.items())]
