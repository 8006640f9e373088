"""Judge each measurement against what its link should do: peers, the link's history, presets.

Pure functions over ``agents.spec.Measurement``: no database, no backend. The rules
(which expectation wins, which sizes are judged) are explained in docs/analysis.md.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from itertools import compress
from operator import is_not
from typing import TypeVar

import numpy as np

from ringwatch.agents.groups import Group, group_nodes
from ringwatch.agents.spec import Measurement
from ringwatch.services.analyzer.evidence import (
    MAD_TO_SIGMA,
    MEDIAN_SE,
    Weighing,
    noise_terms,
    slowest_path_share,
    stepped,
)
from ringwatch.services.config import RATED_FLOOR

T = TypeVar("T")
# A hardware-preset figure for one measurement, or None where the preset has none.
Expected = Callable[[Measurement], "float | None"]
# The key under which peers are compared: they must have done the same work.
PeerKey = tuple[str, str, int, str, int]
# A link's identity across rounds: the same ranks doing the same op at the same size.
LinkKey = tuple[str, str, int, str, Group]


# How many of a link's past readings make its own normal: the store keeps this many per
# link, and a link with half of them is established.
HISTORY_WINDOW = 50

@dataclass(frozen=True)
class Thresholds:
    """When a ratio measured/expected counts as degraded, and how badly."""

    degraded_ratio: float = 0.7
    critical_ratio: float = 0.5
    # Fewer peers than this and the peer source is not used: one peer is one noisy reading,
    # not a centre (a two-node fleet's intra-node groups are judged by the hardware model).
    min_peers: int = 2
    # A high quantile: in a small fleet the median of the peers can itself be faulty.
    peer_quantile: float = 0.75
    # From this many peers on, their median: one faulty peer in eight can no longer move
    # it, and a median is what a healthy link's ratio is centred on.
    median_peers: int = 8
    # History needs this many past values before it becomes an expectation.
    min_history: int = 5
    history_window: int = HISTORY_WINDOW
    # A value more than this many MADs below the history median is an outlier too.
    history_mad_k: float = 6.0
    # Where a preset exists, the expectation is never below this share of it: peers that
    # are all slow together (one bad node in every group of a search) can't vouch for
    # each other. Below 1 because real links reach a little less than their datasheet.
    preset_floor: float = 0.9
    # Below this share of its hardware profile's rated busbw a measurement is degraded
    # whatever its peers and history say (agents.profiles; RINGWATCH_RATED_FLOOR).
    rated_floor: float = RATED_FLOOR
    # How repeated measurements of a group are weighed into a decision (evidence.Weighing).
    weighing: Weighing = Weighing()

    def severity(self, ratio: float) -> str:
        return "critical" if ratio < self.critical_ratio else "warning"


# Modeled and NCCL fabrics: every suspect is re-tested before anyone is blamed (in a
# preflight and in each monitoring cycle alike), so 0.85 is affordable and catches a
# 0.75-factor fault under 3 % noise.
PREFLIGHT_THRESHOLDS = Thresholds(degraded_ratio=0.85)
# gloo times CPU processes that share cores: tens of percent of jitter, and each repeat
# costs real seconds: a group is slow when both of two measurements are (Weighing.sequential
# off), which finds the gross faults gloo can show.
GLOO_THRESHOLDS = Thresholds(weighing=Weighing(sequential=False, max_repeats=2))


def thresholds_for(backend: str, rated_floor: float = RATED_FLOOR) -> Thresholds:
    """The one judgement's thresholds for a backend's results: monitoring, probe and
    preflight (fresh or stored) all use these, under the process's rated floor
    (RINGWATCH_RATED_FLOOR)."""
    t = GLOO_THRESHOLDS if backend == "gloo" else PREFLIGHT_THRESHOLDS
    return t if rated_floor == t.rated_floor else replace(t, rated_floor=rated_floor)


@dataclass
class Assessment:
    """One measurement and the verdict on it."""

    measurement: Measurement
    expected_gbs: float | None
    ratio: float | None
    bad: bool
    # "peers", "history", "preset", "rated" (below the profile's floor), "latency" (small
    # size, not judged) or "none".
    source: str
    severity: str | None = None
    # False for latency-bound sizes: their ratio is informative, never a verdict.
    judged: bool = True
    # How far healthy links of this kind sit from the expectation: the relative spread of
    # the source (peers: noise and between-link variation together; history: the link's
    # own scatter), the relative standard error of the expectation itself, and how far a
    # healthy link may sit from it for good (none from its own normal; the between-link
    # variation from its peers' or a hardware figure).
    spread: float = 0.0
    centre_se: float = 0.0
    variation: float = 0.0
    # Explained by a fleet-wide shortfall (analyzer.shortfall): not weighed against its link.
    explained: bool = False


@dataclass(frozen=True)
class Baseline:
    """Robust summary of a link's past busbw values."""

    median: float
    mad: float
    count: int


def peer_key(m: Measurement) -> PeerKey:
    return (m.series, m.scope, m.size_bytes, m.dtype, len(m.members))


def link_key(m: Measurement) -> LinkKey:
    return (m.series, m.scope, m.size_bytes, m.dtype, m.group)


def history_baseline(values: Sequence[float], window: int = HISTORY_WINDOW) -> Baseline | None:
    """Median and MAD of the last ``window`` values; None for an empty history."""
    recent = np.asarray(list(values)[-window:], dtype=float)
    recent = recent[np.isfinite(recent) & (recent > 0)]
    if recent.size == 0:
        return None
    median = float(np.median(recent))
    return Baseline(median, float(np.median(np.abs(recent - median))), int(recent.size))


def own_normal(values: Sequence[float], t: Thresholds = Thresholds()) -> Baseline | None:
    """The link's own history as its normal (median and MAD of the last values), or None:
    too little of it, or so noisy that even a critical loss would pass as its usual jitter
    (``history_mad_k`` sigmas below the median reach the critical ratio). Saying so beats
    an expectation that no measurement could ever miss."""
    b = history_baseline(values, t.history_window)
    if b is None or b.count < t.min_history:
        return None
    if b.median - t.history_mad_k * MAD_TO_SIGMA * b.mad < t.critical_ratio * b.median:
        return None
    return b


def leave_one_out_quantile(values: np.ndarray, q: float) -> np.ndarray:
    """For each value, the q-quantile (linear interpolation) of all the others."""
    k = values.size
    if k < 2:
        return np.full(k, np.nan)
    order = np.argsort(values, kind="stable")
    s = values[order]
    h = q * (k - 2)
    lo = int(np.floor(h))
    hi = min(lo + 1, k - 2)
    frac = h - lo
    rank = np.empty(k, dtype=int)
    rank[order] = np.arange(k)
    # Index j of the array without element r is j (j < r) or j + 1 (j >= r).
    v_lo = s[lo + (lo >= rank)]
    v_hi = s[hi + (hi >= rank)]
    return v_lo + frac * (v_hi - v_lo)


def weighted_leave_one_out_quantile(values: np.ndarray, weights: np.ndarray,
                                    q: float) -> np.ndarray:
    """For each value, the weighted q-quantile of all the others: the smallest value whose
    share of the others' weight, counted from below, reaches q."""
    k = values.size
    if k < 2:
        return np.full(k, np.nan)
    order = np.argsort(values, kind="stable")
    s, w = values[order], weights[order]
    cum = np.cumsum(w)
    rank = np.arange(k)
    target = q * (cum[-1] - w)
    j = np.searchsorted(cum, target, side="left")
    # At or past the one left out, the others' running weight is short of ``cum`` by its
    # weight: look again for the target plus that weight, beyond it.
    past = np.maximum(np.searchsorted(cum, target + w, side="left"), rank + 1)
    j = np.where(j >= rank, past, j)
    j = np.where(j < k, j, rank - 1)
    out = np.empty(k)
    out[order] = s[j]
    return out


# The healthy centre's mixture (``healthy_centres``): the span of log ratio below the
# centre over which it spreads the slow groups, and how many rounds of it at most.
SLOW_SPAN = 1.0
MIXTURE_ITERATIONS = 100
# Up to this share of a kind's groups taken as slow, its centre is the plain (weighted)
# median of them all.
MEDIAN_SLOW_SHARE = 0.1


def healthy_centres(values: np.ndarray, weights: np.ndarray, sd: np.ndarray,
                    gap: float) -> tuple[np.ndarray, float, int]:
    """For each group, the centre of the healthy ones among the others; with the healthy
    ones' spread and how many there are.

    The peers are a mixture: healthy groups, normal about the centre (each with its own
    standard deviation ``sd``: its lasting offset and the noise of its mean), and slow
    ones, anywhere from ``gap`` (the loss a fault is sought from) below it, evenly. Each
    group's chance of being healthy weights it in the centre, a weighted median, worked
    out again until it settles (expectation-maximization, started from the 75th
    percentile, where the healthy groups are). A median of all the groups sits inside
    the slow ones once they are many: a node pair is slow when either end's NIC is, and a
    small fleet with a few slow NICs, whose pairs a check re-measures and re-pairs, can
    have half its node pairs slow, and its slow NICs then read only part of their loss
    against the median. A healthy group is never taken for a
    slow one for sitting less than ``gap`` under the centre, so links a little slow for
    good keep their weight; with no slow groups the centre is the weighted median of them
    all. (``_centres`` keeps the median of all where few are slow.)"""
    x = np.log(np.maximum(values, 1e-12))
    c = _weighted_quantile(x, weights, 0.75)
    healthy_share = 0.8
    edge = math.log(1.0 - gap)
    norm = sd * math.sqrt(2.0 * math.pi)
    r = np.ones_like(x)
    for _ in range(MIXTURE_ITERATIONS):
        z = (x - c) / sd
        h = healthy_share * np.exp(-0.5 * z * z) / norm
        g = np.where(x <= c + edge, (1.0 - healthy_share) / SLOW_SPAN, 0.0)
        r = h / np.maximum(h + g, 1e-300)
        wr = weights * r
        if wr.sum() <= 0:
            break
        healthy_share = min(max(float(wr.sum() / weights.sum()), 0.05), 0.999)
        moved = _weighted_quantile(x, wr, 0.5)
        if moved == c:
            break
        c = moved
    wr = np.maximum(weights * r, 1e-12)
    spread = math.sqrt(float((wr * (x - c) ** 2).sum() / wr.sum()))
    # A median in logs is the median of the values: taken of them, it is one of them exactly.
    return weighted_leave_one_out_quantile(values, wr, 0.5), spread, int((r > 0.5).sum())


def _weighted_quantile(x: np.ndarray, w: np.ndarray, q: float) -> float:
    order = np.argsort(x, kind="stable")
    cum = np.cumsum(w[order])
    return float(x[order][min(int(np.searchsorted(cum, q * cum[-1], side="left")), x.size - 1)])


def node_weights(groups: Sequence[Group]) -> np.ndarray:
    """Each group's weight among its peers: one over the number of peer groups its busiest
    node is in. A check re-pairs a suspect node with partner after partner, and in a small
    fleet those pairs can be a third of all the node pairs; weighted so, each node counts
    about once, and a slow NIC's many pairs do not drag the centre its pairs are judged
    against down to them."""
    degree: dict[str, int] = defaultdict(int)
    nodes = [group_nodes(g.members) for g in groups]
    for ns in nodes:
        for n in ns:
            degree[n] += 1
    return np.array([1.0 / max((degree[n] for n in ns), default=1) for ns in nodes])


@dataclass(frozen=True)
class PeerCentre:
    """What a measurement's peers say: their centre, their relative spread, and the
    centre's own relative standard error (the spread over the root of how many peers,
    ``evidence.stepped``: a kind that gained a few groups keeps the same centre)."""

    value: float
    spread: float
    se: float


@dataclass
class KindGroups:
    """The groups of one peer key as ``_centres`` reads them, kept while they grow: each
    group's value over its repeats and its noise terms (worked out again only for a group
    that got a measurement), and the node weights (again only when a group joined)."""

    sizes: list[int] = field(default_factory=list)
    values: list[float] = field(default_factory=list)
    noise_ss: list[float] = field(default_factory=list)
    noise_dof: list[int] = field(default_factory=list)
    weights: np.ndarray = field(default_factory=lambda: np.empty(0))
    # ``node_weights`` kept as groups join: each group's nodes, how many of the kind's
    # groups each node is in and which; only the groups on a node whose count moved are
    # weighed again (a kind of thousands of node pairs gains a few a round).
    nodes: list[frozenset[str]] = field(default_factory=list)
    degree: dict[str, int] = field(default_factory=dict)
    on_node: dict[str, list[int]] = field(default_factory=dict)
    weight_list: list[float] = field(default_factory=list)

    def update(self, measurements: Sequence[Measurement],
               groups: Mapping[Group, list[int]]) -> None:
        """Take in ``groups`` (each group's measurement indices, in the order they joined)."""
        joined = len(groups) != len(self.sizes)
        for j, ix in enumerate(groups.values()):
            if j < len(self.sizes) and self.sizes[j] == len(ix):
                continue
            busbw = [measurements[i].busbw_gbs for i in ix]
            ss, dof = noise_terms(busbw)
            if j < len(self.sizes):
                self.sizes[j], self.values[j] = len(ix), _group_value(busbw)
                self.noise_ss[j], self.noise_dof[j] = ss, dof
            else:
                self.sizes.append(len(ix))
                self.values.append(_group_value(busbw))
                self.noise_ss.append(ss)
                self.noise_dof.append(dof)
        if joined:
            self._join(list(groups))

    def _join(self, groups: list[Group]) -> None:
        """``weights`` = ``node_weights(groups)``, from the groups that joined."""
        start = len(self.nodes)
        moved: set[str] = set()
        for j in range(start, len(groups)):
            ns = group_nodes(groups[j].members)
            self.nodes.append(ns)
            self.weight_list.append(1.0)
            for n in ns:
                self.degree[n] = self.degree.get(n, 0) + 1
                self.on_node.setdefault(n, []).append(j)
            moved |= ns
        again = {j for n in moved for j in self.on_node[n]}
        again.update(range(start, len(groups)))
        for j in again:
            self.weight_list[j] = 1.0 / max((self.degree[n] for n in self.nodes[j]), default=1)
        self.weights = np.array(self.weight_list)

    def noise(self, min_pairs: int = 8) -> float | None:
        """The per-measurement relative noise, pooled over the groups measured more than once
        (``evidence.noise_terms``); None with fewer than ``min_pairs`` degrees of freedom."""
        dof = sum(self.noise_dof)
        return math.sqrt(sum(self.noise_ss) / dof) if dof >= min_pairs else None


def _centres(kind: KindGroups, t: Thresholds) -> list[PeerCentre | None]:
    """The peer centre of each group of one peer key, in the order the groups joined."""
    if len(kind.sizes) - 1 < max(t.min_peers, 1):
        return [None] * len(kind.sizes)
    idx = kind.sizes
    values = np.array(kind.values)
    spread = _relative_spread(values)
    weights = kind.weights
    if len(idx) - 1 < t.median_peers:
        q = t.peer_quantile
        noise = kind.noise()
        if noise is not None:  # a few lucky readings must not lift the quantile
            values = _shrunk(values, np.array(idx, dtype=float), noise,
                             t.weighing.variation_prior)
        centres = (leave_one_out_quantile(values, q) if np.all(weights == weights[0])
                   else weighted_leave_one_out_quantile(values, weights, q))
        return _peer_centres(centres, spread, len(idx) - 1)
    # Each group's mean is off its centre by its lasting offset and the noise of its
    # repeats; the noise is measured where groups were repeated, else the peers' spread
    # stands in for it (wider: a group is then taken as healthy more readily).
    noise = kind.noise()
    noise = max(stepped(noise) if noise is not None else spread, t.weighing.min_noise)
    n = np.array(idx, dtype=float)
    sd = np.sqrt(t.weighing.variation_prior ** 2 + noise ** 2 / n)
    centres, healthy_spread, healthy = healthy_centres(values, weights, sd, t.weighing.min_loss)
    if healthy < (1.0 - MEDIAN_SLOW_SHARE) * len(idx):
        return _peer_centres(centres, stepped(healthy_spread), max(healthy - 1, 1))
    # Few slow groups: the median of them all is robust to them, and it is what a large
    # fleet's thousands of decisions were tuned against (the mixture, which leaves out the
    # far tail of the noise too, sat a few tenths of a percent higher there).
    centres = weighted_leave_one_out_quantile(values, weights, 0.5)
    return _peer_centres(centres, spread, len(idx) - 1)


def _shrunk(values: np.ndarray, repeats: np.ndarray, noise: float,
            prior: float) -> np.ndarray:
    """Each group's value drawn toward the median of them all as far as its repeats leave
    it uncertain: a group's lasting offset has about ``prior`` of relative spread, its mean
    ``noise`` over the root of its repeats, so a single reading keeps the share prior^2 /
    (prior^2 + noise^2) of its distance (empirical Bayes, in logs). Among few peers the
    centre is a high quantile, which a couple of lucky single readings would otherwise lift
    well above what the groups measured many times run at."""
    logs = np.log(np.maximum(values, 1e-12))
    middle = float(np.median(logs))
    keep = prior ** 2 / (prior ** 2 + noise ** 2 / repeats)
    return np.exp(middle + keep * (logs - middle))


def _peer_centres(centres: np.ndarray, spread: float, count: int) -> list[PeerCentre | None]:
    se = stepped(MEDIAN_SE * spread / math.sqrt(max(count, 1)))
    return [PeerCentre(e, spread, se) if math.isfinite(e) and e > 0 else None
            for e in centres.tolist()]


def _group_value(busbw: list[float]) -> float:
    """A group's busbw over its repeats: their geometric mean (ratios average in logs)."""
    if len(busbw) == 1:
        return busbw[0]
    return math.exp(float(np.mean(np.log([max(x, 1e-12) for x in busbw]))))


def _relative_spread(values: np.ndarray) -> float:
    """MAD of the log values, scaled to a standard deviation: robust to a few slow peers
    (``evidence.stepped``)."""
    logs = np.log(values[values > 0])
    if logs.size < 2:
        return 0.0
    return stepped(float(MAD_TO_SIGMA * np.median(np.abs(logs - np.median(logs)))))


# A hardware figure is reached by healthy links to within about this (relative, one sigma):
# the band a preset-judged group gets.
PRESET_VARIATION = 0.03


@dataclass(frozen=True)
class Chosen:
    """An expectation and how uncertain it is (``Assessment``'s fields of the same names)."""

    value: float | None
    source: str
    spread: float = 0.0
    centre_se: float = 0.0
    variation: float = 0.0


def _choose(peer: PeerCentre | None, own: Baseline | None, preset: float | None,
            t: Thresholds, paths: float | None = None) -> Chosen:
    """The link's own normal first, where it has one and it lies within its peers' healthy
    band (a link always a little slower than its peers is normal for itself; one always far
    slower has been faulty from the start). Then its peers, measured under the same
    conditions. Then the hardware model, which also floors whatever was chosen; for a group
    of many nodes, ``paths``: the model at the share this run's node pairs reach of it."""
    w = t.weighing
    if paths is not None:
        # A union with a path model is judged by it, not by its peers: the search's unions
        # of one size are picked because they may hold a slow path, and healthy ones would
        # sit below a high quantile of so few peers.
        peer = None
    floor = preset * t.preset_floor if preset is not None and preset > 0 else None
    if paths is not None:
        # A union runs at its slowest path, below the node pairs' model: its floor is its
        # own model's.
        floor = paths * t.preset_floor
    chosen: Chosen | None = None
    if own is not None and own.median > 0:
        # A few past values can agree by chance (five within 1 % under 6.5 % noise): their
        # spread is never taken as smaller than what its peers show this run, or the normal
        # would be trusted far past what it knows.
        spread = max(MAD_TO_SIGMA * own.mad / own.median, peer.spread if peer is not None else 0.0)
        centre_se = MEDIAN_SE * max(spread, w.min_noise) / math.sqrt(own.count)
        if peer is None or own.median >= peer.value * (1 - w.band_z * w.variation_prior):
            chosen = Chosen(own.median, "history", spread, centre_se)
    if chosen is None and peer is not None:
        se = peer.se
        if preset is not None and preset > 0 and abs(math.log(peer.value / preset)) <= (
                w.band_z * PRESET_VARIATION):
            # The hardware model agrees with the peers: the centre is known at least as well
            # as the model is. Few peers, half of them slow (one bad NIC among four nodes),
            # spread widely, and would otherwise leave no loss decidable.
            se = min(se, PRESET_VARIATION)
        chosen = Chosen(peer.value, "peers", peer.spread, se, w.variation_prior)
    if chosen is not None and chosen.value is not None and (floor is None or chosen.value >= floor):
        return chosen
    if paths is not None:
        return Chosen(paths, "paths", w.variation_prior, 0.0, w.variation_prior)
    if chosen is not None and floor is not None:
        return Chosen(floor, "preset", PRESET_VARIATION, 0.0, PRESET_VARIATION)
    if preset is not None and preset > 0:
        return Chosen(preset, "preset", PRESET_VARIATION, 0.0, PRESET_VARIATION)
    return Chosen(None, "none")


def spans_paths(scope: str, nodes: int) -> bool:
    """A group of more than two nodes across the network (the world group, a path search's
    union): it loads every path between its nodes and runs at the slowest."""
    return scope in ("inter_node", "world") and nodes > 2


def _is_union(m: Measurement) -> bool:
    return spans_paths(m.scope, len(m.nodes))


def identity_changes(items: Sequence[object], last: Sequence[object]) -> list[int]:
    """The indices below ``len(last)`` where ``items`` holds another object than ``last``:
    one pass in C, for the caches that compare a large check's every assessment with the
    last round's."""
    return list(compress(range(len(last)), map(is_not, items, last)))


def same_items(items: list[T], last: list[T]) -> bool:
    """Whether ``items`` equals ``last`` item by item: a pass in C, which takes the very same
    object as equal at once (a check hands the judgement the same ranks every round)."""
    return len(items) == len(last) and items == last


@dataclass
class AssessCache:
    """What ``assess`` worked out for a list of measurements that only grows: a check's,
    judged again after every round. Handed back in, the next call works out only what the
    new measurements can change (the peer centres of the kinds they joined, the largest
    size of their groups, the node pairs' share of the model) and returns the very same
    ``Assessment`` for every measurement whose inputs are unchanged. The result is the
    same as without it; a list that did not grow from the last one, or other thresholds,
    model or history, start it afresh."""

    thresholds: Thresholds | None = None
    expected: Expected | None = None
    history: Mapping[LinkKey, Sequence[float]] | None = None
    measurements: list[Measurement] = field(default_factory=list)
    # Per measurement: its peer key, the key its judged size is taken under, its model
    # figure and its own normal.
    peer_keys: list[PeerKey] = field(default_factory=list)
    size_keys: list[tuple[str, str, Group]] = field(default_factory=list)
    presets: list[float | None] = field(default_factory=list)
    normals: list[Baseline | None] = field(default_factory=list)
    groups: dict[PeerKey, dict[Group, list[int]]] = field(
        default_factory=lambda: defaultdict(dict))
    # Peer keys that got a measurement since their centres were worked out.
    stale: set[PeerKey] = field(default_factory=set)
    centres: dict[PeerKey, dict[Group, PeerCentre | None]] = field(default_factory=dict)
    kinds: dict[PeerKey, KindGroups] = field(default_factory=dict)
    largest: dict[tuple[str, str, Group], int] = field(default_factory=dict)
    shares: dict[tuple[str, int, str], list[float]] = field(
        default_factory=lambda: defaultdict(list))
    share_seen: set[tuple[str, int, str, Group]] = field(default_factory=set)
    # Each size key's measurements (their judged flag follows its largest size), and the
    # measurements of groups of more than two nodes (judged by the node pairs' share).
    by_size: dict[tuple[str, str, Group], list[int]] = field(
        default_factory=lambda: defaultdict(list))
    unions: list[int] = field(default_factory=list)
    # The measurements whose inputs may have changed since the last call.
    dirty: set[int] = field(default_factory=set)
    made: list[tuple[tuple[object, ...], Assessment]] = field(default_factory=list)
    # ``made``'s assessments alone, kept beside it: what ``assess`` hands back.
    assessed: list[Assessment] = field(default_factory=list)

    def fits(self, ms: Sequence[Measurement], t: Thresholds, expected: Expected | None,
             history: Mapping[LinkKey, Sequence[float]] | None) -> bool:
        """``ms`` extends the list last judged, under the same settings."""
        n = len(self.measurements)
        return (self.thresholds is t and self.expected is expected and self.history is history
                and len(ms) >= n and (n == 0 or ms[n - 1] is self.measurements[-1]))

    def restart(self, t: Thresholds, expected: Expected | None,
                history: Mapping[LinkKey, Sequence[float]] | None) -> None:
        vars(self).update(vars(AssessCache(t, expected, history)))

    def extend(self, new: Sequence[Measurement], t: Thresholds) -> None:
        """Take in measurements added to the list: each one's keys, model figure and own
        normal; the largest size its group ran; a node pair's first measurement of each
        op and size as its share of the model (the repeats a check takes are of pairs that
        looked slow, and counted in they pull the median down, which hid a path 15 % slow
        from the world group)."""
        start = len(self.measurements)
        self.measurements.extend(new)
        expected, history = self.expected, self.history
        for i, m in enumerate(new, start):
            key = peer_key(m)
            self.peer_keys.append(key)
            self.groups[key].setdefault(m.group, []).append(i)
            self.stale.add(key)
            size_key = (key[0], m.scope, m.group)
            self.size_keys.append(size_key)
            self.by_size[size_key].append(i)
            if m.size_bytes > self.largest.get(size_key, 0):
                self.largest[size_key] = m.size_bytes
                self.dirty.update(self.by_size[size_key])
            self.dirty.add(i)
            if _is_union(m):
                self.unions.append(i)
            preset = expected(m) if expected is not None else None
            self.presets.append(preset)
            past = history.get(link_key(m)) if history else None
            self.normals.append(own_normal(past, t) if past else None)
            if m.scope == "inter_node" and preset and m.busbw_gbs > 0 and len(m.nodes) == 2:
                seen = (key[0], m.size_bytes, m.dtype, m.group)
                if seen not in self.share_seen:
                    self.share_seen.add(seen)
                    self.shares[seen[:3]].append(m.busbw_gbs / preset)

    def refresh_centres(self, t: Thresholds) -> None:
        """The peer centres (``_centres``) of the kinds that got a measurement since they
        were worked out; the measurements of groups whose centre moved are to be assessed
        again."""
        ms = self.measurements
        for key in self.stale:
            groups = self.groups[key]
            kind = self.kinds.setdefault(key, KindGroups())
            kind.update(ms, groups)
            old = self.centres.get(key, {})
            new = self.centres[key] = dict(zip(groups, _centres(kind, t), strict=True))
            for group, ix in groups.items():
                # A group whose centre did not move keeps its assessments (its new
                # measurements are dirty already).
                if group not in old or old[group] != new[group]:
                    self.dirty.update(ix)
        self.stale.clear()

    def path_efficiency(self) -> dict[tuple[str, int, str], float]:
        """The share of its hardware model a healthy node pair reaches in this run: the
        node pairs' median per (op, size, dtype), each pair by its first measurement; none
        where fewer than three pairs ran."""
        return {key: float(np.median(v)) for key, v in self.shares.items() if len(v) >= 3}


def assess(
    measurements: Iterable[Measurement],
    thresholds: Thresholds = Thresholds(),
    expected: Expected | None = None,
    history: Mapping[LinkKey, Sequence[float]] | None = None,
    cache: AssessCache | None = None,
) -> list[Assessment]:
    """One Assessment per measurement, in order.

    ``expected`` is a hardware preset (busbw in GB/s or None); ``history`` maps a
    ``link_key`` to that link's past busbw values, oldest first. ``cache``: the same
    object on every call for a list that only grows (``AssessCache``).
    """
    ms = list(measurements)
    t = thresholds
    c = cache if cache is not None else AssessCache()
    if not c.fits(ms, t, expected, history):
        c.restart(t, expected, history)
    c.extend(ms[len(c.measurements):], t)
    c.refresh_centres(t)
    paths = c.path_efficiency()
    c.dirty.update(c.unions)
    for i in sorted(c.dirty):
        m, preset = ms[i], c.presets[i]
        peer = c.centres[c.peer_keys[i]][m.group]
        is_judged = m.size_bytes == c.largest[c.size_keys[i]]
        share = paths.get((c.peer_keys[i][0], m.size_bytes, m.dtype)) if preset and _is_union(m) else None
        union = (preset * share * slowest_path_share(len(m.nodes), t.weighing.variation_prior)
                 if preset and share is not None else None)
        inputs = (peer, is_judged, union)
        if i < len(c.made) and c.made[i][0] == inputs:
            continue
        a = _assessment(m, t, _choose(peer, c.normals[i], preset, t, union), is_judged)
        if i < len(c.made):
            # New inputs, the same assessment (a peer count that grew, a centre that did not
            # move): the same object, so that its group is not folded and weighed again.
            if c.made[i][1] == a:
                a = c.made[i][1]
            c.made[i] = (inputs, a)
            c.assessed[i] = a
        else:
            c.made.append((inputs, a))
            c.assessed.append(a)
    c.dirty.clear()
    return list(c.assessed)


def _assessment(m: Measurement, t: Thresholds, c: Chosen, is_judged: bool) -> Assessment:
    value, source = c.value, c.source
    ratio = m.busbw_gbs / value if value else None
    bad = is_judged and ratio is not None and ratio < t.degraded_ratio
    rated = m.rated_gbs
    if is_judged and not bad and rated and m.busbw_gbs < t.rated_floor * rated:
        # Peers and history may all be slow alike: the hardware's rating is not.
        value, source, ratio, bad = rated, "rated", m.busbw_gbs / rated, True
    return Assessment(
        measurement=m, expected_gbs=value, ratio=ratio, bad=bad,
        source=source if is_judged else "latency",
        severity=t.severity(ratio) if bad and ratio is not None else None,
        judged=is_judged, spread=c.spread, centre_se=c.centre_se, variation=c.variation,
    )
