"""A fleet slow everywhere alike: one finding naming the scope, not one per node.

Peers cannot see a shortfall they all share (NCCL fell back to sockets on every node,
GPUDirect RDMA is off, a driver caps NVLink). The hardware figures can: a measurement
below its profile's floor (``rated``) or the sender's model (``preset``) while its peers
did not call it slow. When at least half the nodes judged in a scope (NVLink inside
nodes, or the network between them) are below in *every* such measurement of theirs, the
shortfall is the fleet's: one ``fabric_below_rated`` finding with the measured and rated
figures and the nodes affected, and those measurements are not localized node by node
(the nodes are not at fault one by one; excluding them would exclude the fleet).

No group vetoes a shortfall its members share: a group judged against what this run's own
node pairs reach (the world group, a path search's union) cannot see it and is left out of
the count. A measurement far below the fleet's own level (a node at 30 % in a fleet at
60 %) is not explained by the shortfall and is localized as any other. A group all of
whose measurements the shortfall explains is decided (``GroupVerdict.cleared``): a check
does not measure it again.
"""

from __future__ import annotations

import statistics
from collections import Counter, defaultdict
from dataclasses import dataclass, field, replace
from typing import Any

from ringwatch.agents.groups import node_order
from ringwatch.agents.profiles import scope_class
from ringwatch.agents.spec import Finding
from ringwatch.services.analyzer.assess import Assessment, identity_changes
from ringwatch.services.analyzer.headline import deciding_result, headline_of

KIND = "fabric_below_rated"
HARDWARE_SOURCES = frozenset({"rated", "preset"})
# Expectations taken from this run's own node pairs (a union, the world group included, is
# judged at the share the pairs reach): blind to a shortfall the pairs share, so such a
# group neither vouches for its nodes nor vetoes the fleet's finding.
BLIND_SOURCES = frozenset({"paths"})
# The share of a scope's judged nodes that must be below for the shortfall to be the fleet's.
FLEET_SHARE = 0.5


# An assessment's explained copy under the original's identity (with the original, which
# keeps that identity from being reused): a check judging again after every round gets the
# same copy back, and the groups it belongs to are not folded and weighed again.
Explained = dict[int, tuple[Assessment, Assessment]]


@dataclass
class Tally:
    """Per scope and node, how many of its readings count towards a shortfall and how many
    of them are below the hardware (under ``cut``), kept across calls on a list that only
    grows (a check's, where ``assess`` hands back the same object for a reading whose
    assessment did not change): whether any scope may be short fleet-wide is then known
    from the readings that changed, not from a pass over all of them after every round."""

    cut: float | None = None
    last: list[Assessment] = field(default_factory=list)
    # Per index: the scope and nodes it counts under and whether it is below (None: it
    # does not count).
    slots: list[tuple[str, list[str], bool] | None] = field(default_factory=list)
    counted: dict[str, Counter[str]] = field(
        default_factory=lambda: {"nvlink": Counter(), "network": Counter()})
    below: dict[str, Counter[str]] = field(
        default_factory=lambda: {"nvlink": Counter(), "network": Counter()})
    # Per scope, how many nodes are below in every reading that counts.
    short: dict[str, int] = field(default_factory=lambda: {"nvlink": 0, "network": 0})

    def update(self, assessments: list[Assessment], cut: float) -> None:
        n = len(self.last)
        if cut != self.cut or len(assessments) < n or (
                n and assessments[n - 1].measurement is not self.last[n - 1].measurement):
            vars(self).update(vars(Tally(cut)))
            n = 0
        for i in identity_changes(assessments, self.last):
            self._count(i, -1)
            self.slots[i] = _slot(assessments[i], cut)
            self._count(i, 1)
        for i in range(n, len(assessments)):
            self.slots.append(_slot(assessments[i], cut))
            self._count(i, 1)
        self.last = list(assessments)

    def _count(self, i: int, step: int) -> None:
        slot = self.slots[i]
        if slot is None:
            return
        cls, nodes, below = slot
        counted, under = self.counted[cls], self.below[cls]
        for node in nodes:
            was = node in counted and under[node] == counted[node]
            counted[node] += step
            if not counted[node]:
                del counted[node]
            if below:
                under[node] += step
                if not under[node]:
                    del under[node]
            self.short[cls] += (node in counted and under[node] == counted[node]) - was

    def may_be_short(self) -> bool:
        """Whether a scope has enough nodes below in every reading that counts (the
        condition ``fleet_shortfall`` names a scope on)."""
        return any(short >= 2 and short >= FLEET_SHARE * len(self.counted[cls])
                   for cls, short in self.short.items())


def _slot(a: Assessment, cut: float) -> tuple[str, list[str], bool] | None:
    m = a.measurement
    if (not a.judged or a.ratio is None or not (m.rated_gbs or m.preset_gbs)
            or a.source in BLIND_SOURCES):
        return None
    return scope_class(m.nodes), m.nodes, _under(a, cut)


def _under(a: Assessment, cut: float) -> bool:
    """Below the hardware's figure by as much as the judgement decides slow on
    (``fleet_shortfall``'s ``cut``)."""
    return a.source in HARDWARE_SOURCES and not a.explained and (
        a.bad or (a.judged and a.ratio is not None and a.ratio < cut))


def fleet_shortfall(assessments: list[Assessment], degraded_ratio: float,
                    memo: Explained | None = None, below_ratio: float | None = None,
                    tally: Tally | None = None) -> tuple[list[Assessment], list[Finding]]:
    """The assessments with a fleet-wide shortfall's measurements no longer ``bad`` (they
    are explained by it), and its findings (at most one per scope). ``memo``: kept across
    calls on a growing list (``Explained``), as is ``tally`` (``Tally``); the result is
    the same without them.

    NVLink first: a collective across nodes also runs over each node's NVLink, so where
    NVLink is short fleet-wide the slowness of those nodes' network groups is explained
    by it and does not count against the network."""
    copies: Explained = {}

    def explain(a: Assessment) -> Assessment:
        hit = memo.get(id(a)) if memo is not None else None
        copy = hit[1] if hit is not None and hit[0] is a else replace(
            a, bad=False, explained=True)
        copies[id(a)] = (a, copy)
        return copy

    # Only a node whose every judged measurement is below can be short; fewer than two such
    # nodes are no fleet (and a check asks this after every round of thousands of groups).
    # Below: a measurement under the hardware's figure by as much as the judgement decides
    # slow on (``below_ratio``: the weighing's ``1 - min_loss``), not only by the one
    # measurement's ``degraded_ratio``. A network at 78 % of its model sits at 0.87 of the
    # preset floor, above 0.85 in most readings, and no node was below in all of them; the
    # weighing then decided every node pair slow and named 344 paths of a 700-node fleet.
    cut = max(degraded_ratio, below_ratio or 0.0)

    def _below(a: Assessment) -> bool:
        return _under(a, cut)

    if tally is not None:
        tally.update(assessments, cut)
    if (not tally.may_be_short() if tally is not None else
            len({n for a in assessments if _below(a) for n in a.measurement.nodes}) < 2):
        if memo is not None:
            memo.clear()
        return list(assessments), []
    judged: dict[str, dict[str, list[int]]] = {"nvlink": defaultdict(list),
                                              "network": defaultdict(list)}
    for i, a in enumerate(assessments):
        m = a.measurement
        if not a.judged or a.ratio is None or not (m.rated_gbs or m.preset_gbs):
            continue
        if a.source in BLIND_SOURCES:
            continue
        cls = scope_class(m.nodes)
        for node in m.nodes:
            judged[cls][node].append(i)
    out = list(assessments)
    findings = []
    short_nvlink: set[str] = set()
    for cls in ("nvlink", "network"):
        by_node = judged[cls]
        if cls == "network" and short_nvlink:
            for idx in by_node.values():
                for i in idx:
                    nodes = set(out[i].measurement.nodes)
                    if nodes <= short_nvlink and _below(out[i]):
                        out[i] = explain(out[i])
        below = sorted((n for n, idx in by_node.items() if all(_below(out[i]) for i in idx)),
                       key=node_order)
        if len(below) < 2 or len(below) < FLEET_SHARE * len(by_node):
            continue
        # The fleet's shortfall, once it is one, explains every node's readings at the
        # fleet's level, not only those of the nodes below in all of them: under noise a
        # node at the fleet's level reads above its floor now and then, and its other
        # readings were localized as a slow NIC (five healthy nodes of a 74-node fleet at
        # 72 % of its network's model excluded); explaining only its readings below the
        # floor left its pairs half explained, measured again and again (411 rounds).
        shared = sorted({i for n in below for i in by_node[n]})
        every = sorted({i for idx in by_node.values() for i in idx})
        explained = _within_fleet_level(out, shared, every, dict(by_node), degraded_ratio)
        findings.append(_finding(cls, below, len(by_node), [out[i] for i in explained]))
        for i in explained:
            out[i] = explain(out[i])
        if cls == "nvlink":
            short_nvlink = set(below)
    if memo is not None:
        memo.clear()
        memo.update(copies)
    return out, findings


def _hardware_ratio(a: Assessment) -> float:
    m = a.measurement
    return m.busbw_gbs / (m.rated_gbs or m.preset_gbs or 1.0)


def _within_fleet_level(out: list[Assessment], shared: list[int], every: list[int],
                        of_node: dict[str, list[int]], degraded_ratio: float) -> list[int]:
    """Of ``every`` measurement in the scope, those that run at the fleet's level (the
    median of ``shared``, the nodes below in all of theirs) or above it. A node whose own
    median sits far below it (a node at 30 % in a fleet at 60 %) has a fault of its own on
    top: its measurements stay to be localized; so does one reading far below the level (a
    slow path between two nodes at the level). A node is judged on its median, not one
    measurement, so that the noise of one reading does not single a node out."""
    level = statistics.median(_hardware_ratio(out[i]) for i in shared)
    own_fault = {n for n, idx in of_node.items()
                 if statistics.median(_hardware_ratio(out[i]) for i in idx)
                 < level * degraded_ratio}
    floor = level * degraded_ratio
    return [i for i in every if not own_fault.intersection(out[i].measurement.nodes)
            and (i in shared or _hardware_ratio(out[i]) >= floor)]


def _finding(cls: str, below: list[str], judged: int, explained: list[Assessment]) -> Finding:
    measured = statistics.median(a.measurement.busbw_gbs for a in explained)
    rated = statistics.median(a.measurement.rated_gbs or a.measurement.preset_gbs or 0.0
                              for a in explained)
    ratio = measured / rated if rated else 0.0
    detail: dict[str, Any] = {
        "scope": cls, "ops": sorted({a.measurement.op for a in explained}),
        "nodes_judged": judged, "nodes_below": len(below), "ratio": round(ratio, 3),
        "reason": f"{len(below)} of {judged} nodes reach a median {measured:.1f} GB/s "
                  f"busbw over {cls}, {ratio:.0%} of the {rated:.0f} GB/s the "
                  "hardware is rated for"}
    # Its figures are its headline's (one of the results below rated, against its rating);
    # the reason keeps the fleet-wide medians.
    top = deciding_result(explained)
    if top is not None:
        detail["headline"] = headline_of(top)
    return Finding(
        kind=KIND, nodes=below, severity="critical",
        measured_gbs=top.measurement.busbw_gbs if top is not None else round(measured, 3),
        expected_gbs=top.expected_gbs if top is not None else round(rated, 3), detail=detail)

