"""A profiled check's second phase: the job's own communicators, planned, run and judged.

The fabric phase (services.check.loop) judges every link and names faults; this phase plans
each kind of the job's groups (tensor-, data-parallel, pipeline neighbours) with the
profile's ops and sizes (``job_groups``), runs them (``run_job_phase``) and says how the
job's traffic would run here (``judge_job``): each kind's busbw, its slowest group against
its peers, and the identity ReduceScatter + AllGather against AllReduce per group and size
(docs/workloads.md). It never changes the fabric judgement: monitoring and preflight judge
the fabric alike, and this is what the job sees of that fabric.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections import defaultdict
from collections.abc import Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Any

from ringwatch.agents.groups import Group, nodes_of
from ringwatch.agents.spec import Finding, GroupSpec, Measurement, ProbeBackend, RankInfo
from ringwatch.agents.workloads import COMM_KINDS, JobLayout, Workload, disjoint_rounds
from ringwatch.services.analyzer.evidence import MAD_TO_SIGMA
from ringwatch.services.check.planner import node_members, pack
from ringwatch.services.check.rounds import Progress, Rounds
from ringwatch.services.check.shape import ProbeShape

Comms = Mapping[str, Sequence[tuple[str, ...]]]
# The identity's time ratio (RS + AG) / AR of a healthy group sits near 1 (a ring
# AllReduce is a ReduceScatter then an AllGather); a group is off when it is further than
# this many of its peers' spreads from their centre, and never for less than
# IDENTITY_MIN_TOLERANCE (one ratio of three timings carries their noise).
IDENTITY_Z = 4.0
IDENTITY_MIN_TOLERANCE = 0.25
# A communicator this far below its row's median busbw (same kind, op, size, algorithm: a
# loss of the check's smallest size, 15 %) is
# slow. Every slow one of a row is named, not only the slowest: two faulty nodes must not
# hide each other.
SLOW_SHARE = 0.85
# ...and only when it also lies further below than this many robust spreads of its kind's
# groups, so that at high noise the tail of a thousand healthy groups is not named. The
# spread is read from at least SLOW_MIN_PAIRS pairs of the kind's groups; fewer have
# SLOW_SHARE alone.
SLOW_Z = 4.0
SLOW_MIN_PAIRS = 8
# A communicator under SLOW_SHARE of its row's median but not under the row's bar (the
# noise could explain it) is run again, up to this many more times, and judged on the mean
# of its readings: the bar a group of n readings must pass closes in on SLOW_SHARE as
# 1/sqrt(n) (a node's AllReduce fallen back to 80 % sat just over a bar of 0.79 at 6 %
# noise, where 4 readings put the bar at 0.89).
JOB_REPEATS = 3
# What a workload finding names beside its kind and place: two alike in all of it are one.
NAMED_BY = ("communicator", "op", "size_bytes", "algo")


def resolve_job(job: JobLayout | None, layout: Mapping[str, Sequence[int]]) -> JobLayout:
    """The job's layout over these nodes' ranks (default: tensor parallel over one node's
    GPUs); LayoutError when it does not fit them."""
    per_node = max((len(ix) for ix in layout.values()), default=1)
    return (job or JobLayout()).resolve(sum(len(ix) for ix in layout.values()), per_node)


def run_job_phase(backend: ProbeBackend, work: Workload, job: JobLayout,
                  layout: dict[str, list[int]], ranks: Sequence[RankInfo], shape: ProbeShape,
                  fabric: Sequence[Measurement], fabric_sizes: Sequence[int],
                  progress: Progress | None = None,
                  hung: AbstractSet[str] = frozenset()) -> tuple[Rounds, dict[str, Any]]:
    """The job's own communicators under ``job`` (resolved) over ``layout``'s ranks, run at
    the profile's sizes, and the verdict's ``workload`` section on them. ``fabric``, what the
    fabric phase measured at ``fabric_sizes``, adds the identity on its own groups (fsdp runs
    all three ops there): a node's AllReduce off its halves is named by its intra-node group.
    ``ok`` is False when the job's traffic runs badly here (a communicator slower than its
    peers, an AllReduce off its halves), even where no link is to blame.

    The groups the noise could explain (``doubtful``) are run again, up to ``JOB_REPEATS``
    more times each, before the section is judged.

    ``hung``: ranks the fabric phase found hung. A communicator holding one is not run (it
    would wait out its deadline again, each round of it) and is listed in ``left_out``."""
    comms, left_out = without_hung(job.communicators(node_members(layout, list(layout))), hung)
    algos, no_algos = algos_for(backend.name, work)
    node_profiles = {r.node: r.profile for r in ranks}
    kind_of = kinds(comms)
    job_run = Rounds()
    planned = job_groups(work, comms, shape, algos)
    spec_of = {(g.group, g.algo): g for groups in planned for g in groups}
    for groups in planned:
        _job_round(backend, job_run, groups, kind_of, node_profiles, progress)
    for _ in range(JOB_REPEATS):
        again = [spec_of[key] for key in doubtful(kind_of, job_run.measurements)]
        if not again:
            break
        while again:
            now, again = pack(again)
            _job_round(backend, job_run, now, kind_of, node_profiles, progress, "again")
    summary = judge_job(work, job, comms, job_run.measurements)
    summary.update(rounds=job_run.rounds, fabric_s=round(job_run.fabric_s, 3))
    if no_algos:
        summary["algos"] = no_algos
    if work.identity_sizes:
        table, off = identity(fabric, {m.group: m.scope for m in fabric}, fabric_sizes)
        summary["identity"] = table + summary["identity"]
        summary["findings"] = [f.to_dict() for f in once(off)] + summary["findings"]
    if left_out:
        summary["left_out"] = left_out
    summary["ok"] = not summary["findings"]
    return job_run, summary


def _job_round(backend: ProbeBackend, run: Rounds, groups: list[GroupSpec],
               kind_of: Mapping[Group, str], node_profiles: dict[str, str | None],
               progress: Progress | None, note: str = "") -> None:
    if progress is not None:
        first = groups[0]
        progress(f"job round {run.rounds + 1}: {len(groups)} {kind_of[first.group]} "
                 f"group(s), {', '.join(first.ops)}"
                 f"{f' ({first.algo})' if first.algo else ''}{f', {note}' if note else ''}")
    run.take(groups, backend.run_round(groups), node_profiles)


def without_hung(comms: Comms, hung: AbstractSet[str]
                 ) -> tuple[dict[str, list[tuple[str, ...]]], list[dict[str, Any]]]:
    """The job's communicators that hold no rank of ``hung``, and the others as the
    workload section lists them (kind, how many ranks, the hung ones, why: a data-parallel
    group's thousand nodes are not listed)."""
    kept: dict[str, list[tuple[str, ...]]] = {}
    left_out: list[dict[str, Any]] = []
    for kind, groups in comms.items():
        kept[kind] = []
        for g in groups:
            stuck = sorted(r for r in g if r in hung)
            if not stuck:
                kept[kind].append(g)
                continue
            left_out.append({"communicator": kind, "ranks": len(g), "hung": stuck,
                             "reason": "a rank of it hung in the fabric check"})
    return kept, left_out


def job_groups(workload: Workload, comms: Comms, shape: ProbeShape,
               algos: Sequence[str] = ()) -> list[list[GroupSpec]]:
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


def kinds(comms: Comms) -> dict[Group, str]:
    """Each of the job's groups (``Measurement.group``) to its kind."""
    return {Group(g): kind for kind, groups in comms.items() for g in groups}


def judge_job(workload: Workload, layout: JobLayout, comms: Comms,
              ms: Sequence[Measurement]) -> dict[str, Any]:
    """The verdict's ``workload`` section for what the job's groups measured: per kind, op,
    size and algorithm, how many groups, their median busbw, the slowest group, and every
    group below the row's bar (``slow_below``: ``SLOW_SHARE`` of the median, lower where
    the noise of the kind's groups reaches further; a group read more than once, on the
    mean of its readings against ``GroupReadings.bar``), each a ``communicator_slow`` finding;
    the identity ratios of the job's groups and their ``collective_identity`` findings.
    Each finding is listed once (``once``)."""
    kind_of = kinds(comms)
    rows, findings = [], []
    for (kind, op, size, algo), row_ in job_rows(kind_of, ms):
        median, bar, groups = row_.median, row_.bar, row_.groups
        by_speed = sorted(groups, key=lambda g: g.busbw)
        slowest = by_speed[0]
        share = slowest.busbw / median if median > 0 else 1.0
        row: dict[str, Any] = {
            "kind": kind, "op": op, "size_bytes": size, "groups": len(groups),
            "busbw_gbs": round(median, 3),
            "time_us": round(statistics.median(g.readings[0].time_us for g in groups), 3),
            "slowest_busbw_gbs": round(slowest.busbw, 3), "slowest_share": round(share, 3),
            "slow_below": round(bar, 3),
        }
        if algo is not None:
            row["algo"] = algo
        slow = [g for g in by_speed if median > 0 and g.busbw < g.bar(bar) * median]
        again = [g for g in groups if len(g.readings) > 1]
        if again:
            row["measured_again"] = len(again)
        if slow:
            row["slowest_nodes"] = slowest.nodes
            row["slow_nodes"] = [g.nodes for g in slow]
        findings += [Finding(
            kind="communicator_slow", nodes=g.nodes, severity="warning",
            measured_gbs=round(g.busbw, 3), expected_gbs=median,
            detail={"communicator": kind, "share": round(g.busbw / median, 3), "op": op,
                    "size_bytes": size, "readings": len(g.readings),
                    **({"algo": algo} if algo else {})}) for g in slow]
        rows.append(row)
    table, off = identity(ms, kind_of, workload.identity_sizes)
    return {"profile": workload.name, "layout": layout.to_dict(),
            "groups": {k: len(v) for k, v in comms.items()}, "communicators": rows,
            "identity": table, "findings": [f.to_dict() for f in once(findings + off)]}


@dataclass
class GroupReadings:
    """One job group's readings in one row (kind, op, size, algorithm): judged on their
    geometric mean, against a bar that closes in on ``SLOW_SHARE`` as readings add up."""

    group: Group
    readings: list[Measurement]

    @property
    def nodes(self) -> list[str]:
        return self.readings[0].nodes

    @cached_property
    def busbw(self) -> float:
        logs = [math.log(m.busbw_gbs) for m in self.readings if m.busbw_gbs > 0]
        return math.exp(sum(logs) / len(logs)) if logs else 0.0

    def bar(self, row_bar: float) -> float:
        """The share of the row's median this group is slow under: the row's (one
        reading's) bar, its noise term shrunk by the square root of its readings, never
        above ``SLOW_SHARE``."""
        return min(SLOW_SHARE, row_bar ** (1.0 / math.sqrt(len(self.readings))))


@dataclass
class JobRow:
    median: float
    bar: float
    groups: list[GroupReadings]


def job_rows(kind_of: Mapping[Group, str], ms: Sequence[Measurement]
             ) -> list[tuple[tuple[str, str, int, str | None], JobRow]]:
    """Per kind, op, size and algorithm (in the order the section lists them), each group's
    readings, the row's median (of the groups' means) and its bar (``slow_bars``, from each
    group's first reading: the readings taken again were picked for being low). A reading
    that met other traffic (``contended``) says nothing of the communicator: it is neither
    judged nor a reason to run the group again."""
    by_group: dict[tuple[str, str, int, str | None], dict[Group, list[Measurement]]] = (
        defaultdict(dict))
    for m in ms:
        kind = kind_of.get(m.group)
        if kind is not None and not m.wrong and not m.contended:
            by_group[(kind, m.op, m.size_bytes, m.algo)].setdefault(m.group, []).append(m)
    bars = slow_bars({key: [r[0] for r in groups.values()] for key, groups in by_group.items()})
    out = []
    for key, groups in sorted(by_group.items(), key=lambda kv: (
            COMM_KINDS.index(kv[0][0]), kv[0][1], kv[0][2], kv[0][3] or "")):
        readings = [GroupReadings(g, r) for g, r in groups.items()]
        out.append((key, JobRow(statistics.median(g.busbw for g in readings), bars[key[0]],
                                readings)))
    return out


def doubtful(kind_of: Mapping[Group, str], ms: Sequence[Measurement]
             ) -> list[tuple[Group, str | None]]:
    """The job groups to run again: under ``SLOW_SHARE`` of a row's median on their mean,
    not yet under their bar, read fewer than ``1 + JOB_REPEATS`` times; with the
    algorithm of the row (each is run again as it was planned, all its ops and sizes)."""
    out: dict[tuple[Group, str | None], None] = {}
    for (_, _, _, algo), row in job_rows(kind_of, ms):
        for g in row.groups:
            if (row.median > 0 and len(g.readings) <= JOB_REPEATS
                    and g.bar(row.bar) * row.median <= g.busbw < SLOW_SHARE * row.median):
                out[(g.group, algo)] = None
    return list(out)


def slow_bars(series: Mapping[tuple[str, str, int, str | None], Sequence[Measurement]]
              ) -> dict[str, float]:
    """Per kind of group, the share of a row's median under which a group is slow:
    ``SLOW_SHARE``, or lower where ``SLOW_Z`` robust spreads of the kind's groups reach
    further. A row of many groups at high noise has healthy groups far under its median;
    a row of few (eight data-parallel rails) cannot say its own spread, so the spread is
    pooled over the kind's rows from the differences of groups measured one after the
    other in a row: free of the row's median (which a row of eight pulls toward itself,
    a spread from it a sixth short), a slow group in two of them at most, their median
    taken. Neighbours alike (one rack) make it smaller: the bar then nears SLOW_SHARE."""
    diffs: dict[str, list[float]] = defaultdict(list)
    for (kind, _, _, _), group in series.items():
        logs = [math.log(m.busbw_gbs) for m in group if m.busbw_gbs > 0]
        diffs[kind] += [abs(a - b) for a, b in itertools.pairwise(logs)]
    bars = {}
    for kind, ds in diffs.items():
        if len(ds) < SLOW_MIN_PAIRS:
            bars[kind] = SLOW_SHARE
            continue
        spread = statistics.median(ds) * MAD_TO_SIGMA / math.sqrt(2)
        bars[kind] = min(SLOW_SHARE, math.exp(-SLOW_Z * spread))
    return bars


def once(findings: Sequence[Finding]) -> list[Finding]:
    """Each finding once: two of one kind, at one place (node, GPU, GPUs, nodes), naming
    the same communicator, op, size and algorithm are one, the first kept (judge_job lists
    a row's groups slowest first, so the worse stays). Two groups of a row can share a
    place: two tensor-parallel groups of four GPUs on one node."""
    seen: set[tuple[Any, ...]] = set()
    out = []
    for f in findings:
        key = (f.kind, f.node, f.gpu, tuple(f.gpus or ()), tuple(f.nodes or ()),
               tuple(f.detail.get(k) for k in NAMED_BY))
        if key not in seen:
            seen.add(key)
            out.append(f)
    return out


# ---- ReduceScatter + AllGather = AllReduce -----------------------------------------------


def _times(ms: Sequence[Measurement], sizes: Sequence[int]
           ) -> dict[tuple[Group, int], dict[str, Measurement]]:
    """Per group and size, its AllReduce (as NCCL chooses it), ReduceScatter and AllGather."""
    out: dict[tuple[Group, int], dict[str, Measurement]] = defaultdict(dict)
    for m in ms:
        # One rank has no identity to check: its in-place AllReduce is a no-op (about 1 us
        # on an H200 where its ReduceScatter and AllGather copy).
        if (len(m.members) >= 2 and m.size_bytes in sizes and m.algo is None and not m.wrong
                and not m.contended and m.time_us > 0
                and m.op in ("allreduce", "reducescatter", "allgather")):
            out[(m.group, m.size_bytes)].setdefault(m.op, m)
    return {k: v for k, v in out.items() if len(v) == 3}


def _ratio(t: Mapping[str, float]) -> float:
    return (t["reducescatter"] + t["allgather"]) / t["allreduce"]


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


def identity(ms: Sequence[Measurement], kind_of: Mapping[Group, str],
             sizes: Sequence[int]) -> tuple[list[dict[str, Any]], list[Finding]]:
    """The identity at ``sizes``, per kind of group (``kind_of``, else "fabric") and size:
    the ratios' median and range, and a ``collective_identity`` finding for each group
    whose AllReduce runs off its two halves (an AllReduce on a slower algorithm or protocol
    than its halves, a fallback, or halves slower than the whole). The expected ratio is
    the hardware model's where the measurements carry one, else the median of the group's
    peers (same kind and size), else 1 (a ring AllReduce is a ReduceScatter then an
    AllGather); the tolerance is the peers' spread, never under IDENTITY_MIN_TOLERANCE."""
    peers: dict[tuple[str, int], list[tuple[Group, float, float | None]]] = (
        defaultdict(list))
    for (group, size), t in _times(ms, sizes).items():
        ratio = _ratio({op: m.time_us for op, m in t.items()})
        peers[(kind_of.get(group, "fabric"), size)].append((group, ratio, _model_ratio(t)))
    table, out = [], []
    for (kind, size), rows in sorted(peers.items()):
        ratios = [r for _, r, _ in rows]
        table.append({"kind": kind, "size_bytes": size, "groups": len(rows),
                      "ratio_median": round(statistics.median(ratios), 3),
                      "ratio_min": round(min(ratios), 3), "ratio_max": round(max(ratios), 3)})
        centre, tol = (_band(ratios) if len(rows) >= 3
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
    return table, out
