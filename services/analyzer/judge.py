"""The one judgement: measurements and the probes' own findings in, localized findings out.

Monitoring (each ingested cycle), ``ringwatch probe``, preflight from fresh runs (after
every round) and the scheduler's cycles all call ``judge``; preflight from stored results
reads the incidents it produced. So all of them name the same fault the same way.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from agents.spec import Finding, Measurement, RankInfo
from services.analyzer.assess import (
    AssessCache,
    Assessment,
    Expected,
    LinkKey,
    Thresholds,
    assess,
)
from services.analyzer.faults import Coverage
from services.analyzer.inventory import inventory_findings
from services.analyzer.localize import (
    GroupKey,
    GroupVerdict,
    VerdictCache,
    group_verdicts,
    localize,
)
from services.analyzer.shortfall import Explained, fleet_shortfall


def preset_of(m: Measurement) -> float | None:
    """The sender's hardware-model figure carried on the measurement (None where it had none)."""
    return m.preset_gbs


@dataclass
class JudgeCache:
    """What ``judge`` keeps between calls on a list of measurements that only grows (a
    check judging everything again after every round): each measurement's assessment
    (``AssessCache``), the copies a fleet-wide shortfall explains (``Explained``) and each
    group's verdict (``VerdictCache``). Only what the new measurements change is worked
    out again; the judgement is the same as without it."""

    assess: AssessCache = field(default_factory=AssessCache)
    verdicts: VerdictCache = field(default_factory=VerdictCache)
    explained: Explained = field(default_factory=dict)
    # The inventory's findings of the ranks last judged (a check's ranks do not change
    # between rounds), under the identities of those rank objects.
    inventory: tuple[tuple[int, ...], list[Finding]] | None = None

    def inventory_of(self, ranks: list[RankInfo]) -> list[Finding]:
        key = tuple(id(r) for r in ranks)
        if self.inventory is None or self.inventory[0] != key:
            self.inventory = (key, inventory_findings(ranks))
        return self.inventory[1]


@dataclass
class Judgement:
    assessments: list[Assessment]
    verdicts: dict[GroupKey, GroupVerdict]
    findings: list[Finding]
    # Nodes whose ranks reported their identity (their inventory was looked at).
    inventoried: set[str] = field(default_factory=set)

    @property
    def blamed(self) -> set[str]:
        return {n for f in self.findings for n in f.blamed_nodes}

    def coverage(self) -> Coverage:
        return Coverage(self.assessments, self.inventoried)


def judge(
    measurements: Iterable[Measurement],
    probe_findings: Iterable[Finding],
    nodes: Sequence[str] = (),
    ranks: Iterable[RankInfo] | None = None,
    *,
    thresholds: Thresholds,
    expected: Expected | None = None,
    history: Mapping[LinkKey, Sequence[float]] | None = None,
    cache: JudgeCache | None = None,
) -> Judgement:
    """Assess every measurement (peers first, the link's own history next, the hardware
    model as a floor), fold them per group and localize: GPU pair, GPU, node, NIC, path.

    ``nodes``: limit the findings to these nodes (all when empty). ``expected``: a hardware
    model; by default the figure each measurement carries (``preset_gbs``). ``cache``: one
    ``JudgeCache`` kept across calls whose measurements only grow (a check judging again
    after every round); the judgement is the same without it.
    """
    rank_list = list(ranks or [])
    assessed = assess(list(measurements), thresholds, expected or preset_of, history,
                      cache.assess if cache is not None else None)
    # A shortfall shared by most of the fleet is one finding, not a fault per node.
    assessments, fleet = fleet_shortfall(assessed, thresholds.degraded_ratio,
                                         cache.explained if cache is not None else None)
    verdicts = group_verdicts(assessments, thresholds.weighing,
                              cache.verdicts if cache is not None else None)
    findings = localize(assessments, list(probe_findings), list(nodes), rank_list, verdicts)
    wanted = set(nodes)
    inventory = (cache.inventory_of(rank_list) if cache is not None
                 else inventory_findings(rank_list))
    findings += [f for f in inventory if not wanted or f.node in wanted]
    for f in fleet:
        if wanted:
            f.nodes = [n for n in f.nodes or () if n in wanted]
        if f.nodes:
            findings.append(f)
    return Judgement(assessed, verdicts, findings, {r.node for r in rank_list})
