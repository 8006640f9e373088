"""The one judgement: measurements and the probes' own findings in, localized findings out.

Monitoring (each ingested cycle), ``ringwatch probe``, preflight from fresh runs (after
every round) and the scheduler's cycles all call ``judge``; preflight from stored results
reads the incidents it produced. So all of them name the same fault the same way.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from ringwatch.agents.groups import split_member
from ringwatch.agents.spec import Finding, Measurement, RankInfo
from ringwatch.services.analyzer.assess import (
    AssessCache,
    Assessment,
    Expected,
    LinkKey,
    Thresholds,
    assess,
    same_items,
)
from ringwatch.services.analyzer.faults import Coverage
from ringwatch.services.analyzer.headline import deciding_result, headline_of
from ringwatch.services.analyzer.inventory import inventory_findings
from ringwatch.services.analyzer.localize import (
    GroupKey,
    GroupVerdict,
    LocalizeMemo,
    VerdictCache,
    group_verdicts,
    localize,
)
from ringwatch.services.analyzer.shortfall import Explained, Tally, fleet_shortfall


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
    shortfall: Tally = field(default_factory=Tally)
    localize: LocalizeMemo = field(default_factory=LocalizeMemo)
    # The inventory's findings of the ranks last judged (a check's ranks do not change
    # between rounds), while they are the very same rank objects.
    inventory: tuple[list[RankInfo], list[Finding]] | None = None
    # Their nodes (``Judgement.inventoried``).
    inventoried: set[str] = field(default_factory=set)

    def inventory_of(self, ranks: list[RankInfo]) -> list[Finding]:
        if self.inventory is None or not same_items(ranks, self.inventory[0]):
            self.inventory = (list(ranks), inventory_findings(ranks))
            self.inventoried = {r.node for r in ranks}
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

    def coverage(self, facts: Iterable[str] = ()) -> Coverage:
        """What the judged results looked at; ``facts``: the nodes whose counters were read
        before and after (a batch's ``facts``)."""
        return Coverage(self.assessments, self.inventoried, facts)


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
                                         cache.explained if cache is not None else None,
                                         below_ratio=1.0 - thresholds.weighing.min_loss,
                                         tally=cache.shortfall if cache is not None else None)
    verdicts = group_verdicts(assessments, thresholds.weighing,
                              cache.verdicts if cache is not None else None)
    findings = localize(assessments, list(probe_findings), list(nodes), rank_list, verdicts,
                        cache.localize if cache is not None else None)
    wanted = set(nodes)
    inventory = (cache.inventory_of(rank_list) if cache is not None
                 else inventory_findings(rank_list))
    findings += [f for f in inventory if not wanted or f.node in wanted]
    for f in fleet:
        if wanted:
            f.nodes = [n for n in f.nodes or () if n in wanted]
        if f.nodes:
            findings.append(f)
    explain(findings, assessments)
    return Judgement(assessed, verdicts, findings,
                     set(cache.inventoried) if cache is not None else {r.node for r in rank_list})



# Findings that say why (docs/transport.md): a fact read on a node, which excludes it, so
# no bandwidth finding is made there; the slow results it explains become its headline.
CAUSES = ("transport_fallback", "nic_errors", "nvlink_fabric")


# Where a cause finding's slow results are: a node's network (groups across nodes), its
# NVLink (groups inside it) or one GPU pair of it.
Place = tuple[str, str, frozenset[int]]
NO_GPUS: frozenset[int] = frozenset()


def explain(findings: list[Finding], assessments: Sequence[Assessment]) -> None:
    """Give each cause finding the bandwidth figure it explains, where its node measured
    slow: among the bad results of groups through its place (a GPU pair's transport, that
    pair; a node's network, groups across nodes; a GPU's fabric state, groups in its node),
    the one at the middle by ratio, as every finding's headline is chosen."""
    causes = [f for f in findings
              if f.kind in CAUSES and f.node is not None and "headline" not in f.detail]
    if not causes:
        return
    # The bad results by place, once, and each place's deciding result once: a batch may
    # carry thousands of cause findings, and scanning every result for each was quadratic.
    bad_at: dict[Place, list[Assessment]] = defaultdict(list)
    for bad in assessments:
        if bad.bad:
            for place in _places(bad.measurement.members):
                bad_at[place].append(bad)
    deciding: dict[Place, Assessment | None] = {}
    for f in causes:
        place = _place(f)
        if place not in deciding:
            deciding[place] = deciding_result(bad_at.get(place, ()))
        a = deciding[place]
        if a is not None:
            f.detail["headline"] = headline_of(a)
            f.measured_gbs, f.expected_gbs = a.measurement.busbw_gbs, a.expected_gbs


def _place(f: Finding) -> Place:
    assert f.node is not None
    if f.gpus:  # a GPU pair: results of that pair's own group
        return ("gpus", f.node, frozenset(f.gpus))
    if f.kind == "nvlink_fabric":
        return ("nvlink", f.node, NO_GPUS)
    return ("net", f.node, NO_GPUS)


def _places(members: Sequence[str]) -> list[Place]:
    """Every place a group's results are through, as ``_place`` names a finding's: a node
    pair's through both its ends' networks, a group inside a node through its NVLink and
    its GPU pair; a group of more than two nodes through no one node's."""
    places = [split_member(m) for m in members]
    nodes = {n for n, _ in places}
    if len(nodes) > 2:
        # The world group and the search's unions run at their slowest path, anyone's: a
        # shortfall of theirs is no figure of one node's network.
        return []
    if len(nodes) > 1:
        return [("net", n, NO_GPUS) for n in nodes]
    node = next(iter(nodes), None)
    if node is None:
        return []
    return [("nvlink", node, NO_GPUS), ("gpus", node, frozenset(g for _, g in places))]
