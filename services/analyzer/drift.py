"""Slow drift: a slight loss that persists, accumulated per place across monitoring cycles.

One cycle's judgement weighs one cycle's measurements, so a link that lost a few percent
and stays there never looks slow in any of them. Here each place (a node's NVLink, one GPU
pair, a node's NIC) gets one observation per cycle, its ratio to its expectation and the
sigma of that ratio, and a one-sided CUSUM (``evidence.Cusum``) accumulates the shortfall
across cycles: a place whose score passes the threshold is a finding that says since when
the loss has lasted (docs/analysis.md, "Slow drift").

Pure: assessments and the places' states in, new states and findings out.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from statistics import NormalDist
from typing import Any

from ringwatch.agents.groups import Group, nodes_of, split_member
from ringwatch.agents.spec import Finding
from ringwatch.services.analyzer.assess import Assessment
from ringwatch.services.analyzer.evidence import Cusum, CusumPolicy
from ringwatch.services.analyzer.faults import fault_key
from ringwatch.services.analyzer.headline import deciding_result, headline_of
from ringwatch.services.analyzer.localize import evidence_of

# A ratio's sigma is never taken below this: links are never that steady, and a flat
# series of identical values would otherwise make every tenth of a percent count.
MIN_SIGMA = 0.01
# One cycle adds at most threshold / STEPS to a score: whatever the loss, a place needs
# three cycles in a row to alarm (drift is what accumulates; one wild cycle is not drift).
STEPS = 2.5
# A score is kept at most CEILING times the threshold: a loss that lasted days must not
# take days to clear once the link is repaired. From the ceiling, clean cycles take the
# score down by about one slack each: the alarm ends h / 2k cycles after the loss (eight
# with the defaults), about as long as a loss of 1.5 sigma takes to be found.
CEILING = 1.5
NVLINK, NIC = "nvlink_degraded", "nic_degraded"


@dataclass
class Observation:
    """One place's evidence in one cycle: the ratio the CUSUM weighs (the worst op's, less
    its being the worst: ``_worst_of``) and its sigma, and what a finding on the place names
    and shows (its headline, from the op the ratio is of; the results behind it)."""

    kind: str
    node: str
    ratio: float
    sigma: float
    gpus: list[int] | None = None
    measured_gbs: float | None = None
    expected_gbs: float | None = None
    evidence: list[dict[str, object]] = field(default_factory=list)
    headline: dict[str, Any] | None = None


@dataclass
class _Reading:
    """One op of one group this cycle: its shortfall in sigmas (repeats averaged)."""

    z: float
    sigma: float
    worst: Assessment
    items: list[Assessment]
    # The measurements of the op whose shortfall ``z`` is (``items`` may hold other ops'
    # too, once readings are folded by ``_worst_of``).
    weighed: list[Assessment]


def _sigma(a: Assessment) -> float:
    # The centre's own uncertainty counts as well as the measurement's noise: a centre
    # learned from few values is off by the same amount every cycle, which a CUSUM would
    # otherwise accumulate as a loss.
    return max(math.hypot(a.spread, a.centre_se), MIN_SIGMA)


def _reading(items: list[Assessment]) -> _Reading:
    sigma = statistics.median(_sigma(a) for a in items)
    ratio = statistics.fmean(a.ratio or 0.0 for a in items)
    worst = min(items, key=lambda a: a.ratio or 0.0)
    return _Reading((1.0 - ratio) / sigma, sigma, worst, items, items)


def expected_worst(n: int) -> float:
    """How many sigmas above 0 the largest of ``n`` standard normal draws lies on average
    (Blom's approximation; a little above the exact value, so on the safe side)."""
    if n <= 1:
        return 0.0
    return NormalDist().inv_cdf((n - 0.375) / (n + 0.25))


def _worst_of(readings: list[_Reading]) -> _Reading:
    """The worst of several readings, less what the worst of as many healthy ones would
    show: the worst of two healthy ops sits 0.56 sigma low, past the CUSUM's slack, and
    left as it is every healthy place would drift into alarm within a few hundred cycles."""
    worst = max(readings, key=lambda r: r.z)
    z = worst.z - expected_worst(len(readings))
    return _Reading(z, worst.sigma, worst.worst, [a for r in readings for a in r.items],
                    worst.weighed)


def _observation(kind: str, node: str, r: _Reading, gpus: list[int] | None = None,
                 items: list[Assessment] | None = None) -> Observation:
    # Every reading has a ratio, so its op's results have a headline measurement.
    top = deciding_result(r.weighed) or r.worst
    return Observation(kind=kind, node=node, ratio=1.0 - r.z * r.sigma, sigma=r.sigma, gpus=gpus,
                       measured_gbs=top.measurement.busbw_gbs, expected_gbs=top.expected_gbs,
                       evidence=evidence_of(items if items is not None else r.items),
                       headline=headline_of(top) if top.expected_gbs else None)


def drift_observations(assessments: Iterable[Assessment]) -> dict[str, Observation]:
    """One observation per place from one cycle's assessments, keyed by place:

    - ``nvlink:NODE``: the node's intra-node group(s), the worst op;
    - ``nvlink:NODE:gpus=A,B``: a GPU-pair group, the worst op;
    - ``nic:NODE``: each node of a two-node group gets that pair's ratio (its worst op); a
      node in several pairs this cycle gets its best one, since a slow NIC is slow with
      every partner while a healthy node is slow only with a slow one. The partner rotates
      every cycle, so only a node whose own NIC is slow accumulates.

    Repeats of one op in the cycle are averaged; the worst of several ops is corrected for
    being the worst (``_worst_of``). Left out: assessments without a ratio, at latency-bound
    sizes, explained by a fleet-wide shortfall, or already slow by the cycle's thresholds
    (a loss that size is the judgement's to find, each cycle on its own).
    """
    groups: dict[tuple[str, Group], dict[str, list[Assessment]]] = defaultdict(
        lambda: defaultdict(list))
    for a in assessments:
        m = a.measurement
        if a.ratio is None or not a.judged or a.explained or a.bad:
            continue
        groups[(m.scope, m.group)][m.series].append(a)
    intra: dict[str, list[tuple[Group, _Reading]]] = defaultdict(list)
    pairs: dict[str, list[_Reading]] = defaultdict(list)
    out: dict[str, Observation] = {}
    for (scope, members), by_op in sorted(groups.items()):
        nodes = sorted(nodes_of(members))
        readings = [_reading(items) for _, items in sorted(by_op.items())]
        if scope == "intra_node" and len(nodes) == 1:
            intra[nodes[0]] += [(members, r) for r in readings]
        elif scope == "gpu_pair" and len(nodes) == 1:
            gpus = sorted(split_member(x)[1] for x in members)
            key = f"nvlink:{nodes[0]}:gpus=" + ",".join(map(str, gpus))
            out[key] = _observation(NVLINK, nodes[0], _worst_of(readings), gpus)
        elif scope == "inter_node" and len(nodes) == 2:
            r = _worst_of(readings)
            for n in nodes:
                pairs[n].append(r)
    for node, of_node in intra.items():
        member_sets = {members for members, _ in of_node}
        only = next(iter(member_sets))
        # A two-GPU node's intra-node group is one GPU pair: named as localize names it.
        pair = (sorted(split_member(x)[1] for x in only)
                if len(member_sets) == 1 and len(only) == 2 else None)
        out[f"nvlink:{node}"] = _observation(NVLINK, node, _worst_of([r for _, r in of_node]),
                                             pair)
    for node, partners in pairs.items():
        best = min(partners, key=lambda r: r.z)
        out[f"nic:{node}"] = _observation(NIC, node, best,
                                          items=[a for r in partners for a in r.items])
    return dict(sorted(out.items()))


def confidence(score: float, policy: CusumPolicy) -> float:
    """How sure a drift alarm is: ``1 / (1 + exp(-2kh (score/h - 1)))`` for slack k and
    threshold h, kept below 1.

    With the slack half the shift to be found (2k sigmas), a CUSUM score S is the log
    likelihood ratio of "lower by 2k sigma" against "healthy" over the excursion, divided
    by 2k; taking the prior odds a threshold h stands for, exp(-2kh), the posterior is
    this logistic: even odds (0.5) exactly at the threshold, rising with score/threshold
    (with the defaults 0.88 at S = h + 2, 0.98 at h + 4, the most a score is kept at). So
    it lies in (0.5, 1) for every place in alarm, and grows with the evidence as
    ``evidence.weigh``'s confidence does."""
    k, h = policy.slack, policy.threshold
    x = score / h if h > 0 else math.inf
    c = 1.0 / (1.0 + math.exp(-max(min(2 * k * h * (x - 1.0), 50.0), -50.0)))
    return min(round(c, 4), 0.9999)


def _finding(obs: Observation, c: Cusum, policy: CusumPolicy) -> Finding:
    detail: dict[str, Any] = {
        "drift": {"since": c.since.isoformat() if c.since else None, "cycles": c.cycles,
                  "score": round(c.score, 3)},
        "confidence": confidence(c.score, policy),
        "evidence": obs.evidence,
    }
    if obs.headline is not None:
        detail["headline"] = obs.headline
    return Finding(kind=obs.kind, node=obs.node, gpus=list(obs.gpus) if obs.gpus else None,
                   severity="warning", measured_gbs=obs.measured_gbs,
                   expected_gbs=obs.expected_gbs, detail=detail)


def step_drift(states: Mapping[str, Mapping[str, Any]], observations: Mapping[str, Observation],
               at: datetime, policy: CusumPolicy) -> tuple[dict[str, dict[str, Any]], list[Finding]]:
    """Fold one cycle's observations into the places' CUSUMs (``Cusum.to_dict`` states by
    place key): the new states and a finding for every place in alarm.

    One cycle adds at most ``threshold / STEPS`` to a score, and a score is kept no higher
    than ``CEILING * threshold`` (so a repaired link clears in a few cycles, however long its
    loss lasted). A place not observed this cycle keeps its state, and makes no
    finding: a cycle that did not look at a place is no evidence either way
    (services.monitor.health folds findings so). A place whose score is back at 0 has no
    state.
    """
    out = {key: dict(state) for key, state in states.items() if key not in observations}
    findings = []
    most = policy.slack + policy.threshold / STEPS
    ceiling = CEILING * policy.threshold
    for key, obs in sorted(observations.items()):
        c = Cusum.from_dict(dict(states.get(key) or {}), policy)
        c.add(max(obs.ratio, 1.0 - most * obs.sigma), obs.sigma, at)
        c.score = min(c.score, ceiling)
        if c.alarm:
            findings.append(_finding(obs, c, policy))
        out[key] = c.to_dict()
    return {k: s for k, s in out.items() if float(s.get("score", 0.0)) > 0.0}, findings


def unexplained(drift: Iterable[Finding], judged: Iterable[Finding]) -> list[Finding]:
    """The drift findings that name something the cycle's judgement has not: none whose
    fault key the judgement found, none on a node the judgement already blames (its loss is
    explained there, as localize never blames a blamed node twice), a GPU pair's drift
    before its node's, and a node's NVLink drift before its NIC's (the node's NVLink carries
    its network traffic too)."""
    judged = list(judged)
    keys = {fault_key(f) for f in judged}
    blamed = {n for f in judged for n in f.blamed_nodes}
    drift = [f for f in drift if fault_key(f) not in keys and f.node not in blamed]
    pair_drift = {f.node for f in drift if f.kind == NVLINK and f.gpus and len(f.gpus) == 2}
    nvlink_drift = {f.node for f in drift if f.kind == NVLINK}
    out = []
    for f in drift:
        if f.kind == NIC and f.node in nvlink_drift:
            continue
        if f.kind == NVLINK and not f.gpus and f.node in pair_drift:
            continue
        out.append(f)
    return out
