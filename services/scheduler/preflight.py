"""The preflight driver: probe a set of nodes round by round and answer "may a job run here?".

Backend-agnostic: it sees only ``ProbeBackend`` (nccl, gloo, sim). Each round is planned
from what the rounds before it showed, so suspects are re-tested before anyone is blamed.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from agents.spec import Finding, GroupSpec, Measurement, ProbeBackend, RankInfo
from services.analyzer.assess import PREFLIGHT_THRESHOLDS, Expected, Thresholds, assess
from services.analyzer.localize import group_verdicts, localize
from services.analyzer.verdict import build_verdict
from services.scheduler.deadlines import group_deadline_s
from services.scheduler.planner import (
    DEFAULT_OPS,
    DEFAULT_SIZES,
    AdaptivePlanner,
    ProbeShape,
    layout_of,
)

Progress = Callable[[str], None]


def default_thresholds(backend_name: str) -> Thresholds:
    """gloo times CPU processes that share cores: tens of percent of jitter, so it keeps the
    looser monitoring threshold; modeled and NCCL fabrics get preflight's tighter one."""
    return Thresholds() if backend_name == "gloo" else PREFLIGHT_THRESHOLDS


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
    max_rounds: int = 96,
) -> dict[str, Any]:
    """Probe ``nodes`` (all the backend's nodes when None) and return DESIGN.md's verdict.

    ``duration_s`` is fabric time (the slowest group of each round, summed); the wall
    time of the whole check is ``wall_s``. A hang is a finding, never an exception.
    Defaults come from the backend where it offers them (``preflight_sizes``,
    ``preflight_deadline_s``, ``expected_busbw``).
    """
    started = time.perf_counter()
    ranks = backend.ranks()
    layout = layout_of(ranks, nodes)
    backend_sizes: Sequence[int] = getattr(backend, "preflight_sizes", DEFAULT_SIZES)
    shape = ProbeShape(ops=tuple(ops), sizes=tuple(sizes or backend_sizes))
    backend_deadline: float = getattr(backend, "preflight_deadline_s", None) or group_deadline_s(
        backend.name, shape.ops, shape.sizes, warmup=shape.warmup, iters=shape.iters,
        repeats=getattr(backend, "repeats", 1))
    shape = replace(shape, deadline_s=deadline_s or backend_deadline)
    evidence = _Evidence(layout, ranks, thresholds or default_thresholds(backend.name),
                         expected or getattr(backend, "expected_busbw", None))
    planner = AdaptivePlanner(layout, shape, max_rounds=max_rounds)
    fabric_s = 0.0
    rounds = 0
    while groups := planner.next_round(evidence.verdicts, evidence.blamed):
        rounds += 1
        _say(progress, rounds, groups)
        result = backend.run_round(groups)
        fabric_s += result.fabric_time_s
        evidence.add(result.measurements, result.findings)
    return build_verdict(
        backend=backend.name, nodes=list(layout), findings=evidence.findings, rounds=rounds,
        duration_s=fabric_s, extra={"wall_s": round(time.perf_counter() - started, 3)},
    )


class _Evidence:
    """Everything measured so far, re-judged after each round (peers span all rounds)."""

    def __init__(self, layout: dict[str, list[int]], ranks: Sequence[RankInfo],
                 thresholds: Thresholds, expected: Expected | None) -> None:
        self.nodes = list(layout)
        self.ranks = [r for r in ranks if r.node in layout]
        self.thresholds = thresholds
        self.expected = expected
        self.measurements: list[Measurement] = []
        self.probe_findings: list[Finding] = []
        self.add([], [])

    def add(self, measurements: list[Measurement], findings: list[Finding]) -> None:
        self.measurements += measurements
        self.probe_findings += findings
        assessments = assess(self.measurements, self.thresholds, self.expected)
        self.verdicts = group_verdicts(assessments)
        self.findings = localize(assessments, self.probe_findings, self.nodes, self.ranks)
        self.blamed = {n for f in self.findings for n in f.blamed_nodes}


def _say(progress: Progress | None, i: int, groups: list[GroupSpec]) -> None:
    if progress is not None:
        scopes = ", ".join(sorted({g.scope for g in groups}))
        progress(f"preflight round {i}: {len(groups)} group(s) ({scopes})")
