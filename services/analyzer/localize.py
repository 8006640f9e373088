"""Turn judged groups into findings that name a GPU pair, a node's NIC or a node-to-node path.

Each conclusion is drawn from the narrowest evidence first (a GPU pair before its node,
a node before the paths through it), and whatever a blamed node already explains is not
blamed again. The reasoning is laid out in docs/analysis.md.
"""

from __future__ import annotations

import bisect
import math
import statistics
from collections import defaultdict
from collections.abc import Iterable, Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field, replace
from functools import cached_property, lru_cache
from statistics import NormalDist
from typing import NamedTuple, TypeVar

from ringwatch.agents.groups import Group, group_nodes, node_order, split_member
from ringwatch.agents.spec import EXCLUDING_KINDS, Finding, RankInfo
from ringwatch.services.analyzer.assess import (
    Assessment,
    PeerKey,
    identity_changes,
    peer_key,
    same_items,
    spans_paths,
)
from ringwatch.services.analyzer.evidence import (
    MAD_TO_SIGMA,
    UNDECIDED,
    Decision,
    Weighing,
    by_majority,
    can_hide,
    cleared_now,
    followed_up,
    held_open,
    noise_terms,
    out_of_reach,
    slowest_path_share,
    slowest_spread_share,
    stands_apart,
    stepped,
    unconfirmed,
    weigh_log_mean,
    weigh_mean,
)
from ringwatch.services.analyzer.headline import deciding_result, headline_of

# Best PCIe Gen5 x16 P2P copy rates sit near 55 GB/s; NVLink pairs do several times that.
PCIE_CEILING_GBS = 64.0
# A NIC is blamed when at least this share of its decided node-pair groups are slow;
# then again, at the lower share, among the pairs no NIC blamed so far explains (a weak
# NIC one partner cleared, its other two pairs slow).
NIC_BAD_SHARE = 0.75
NIC_BAD_SHARE_SECOND = 0.6

GroupKey = tuple[str, Group]
K = TypeVar("K")
# A kind's between-group variation is measured from at least this many groups' first
# measurements; the variance of a MAD-based estimate is 1 / 0.37 of a plain one's.
MIN_VARIATION_GROUPS = 30
MAD_VARIANCE_EFFICIENCY = 0.37


@dataclass(frozen=True)
class OpSummary:
    """What one op of one group's assessments say whatever the run's noise, worked out
    once for the assessments it was made from (``items``): a check judges every group
    again after every round, and most groups' assessments have not changed."""

    items: tuple[Assessment, ...]
    # The assessments not explained by a fleet-wide shortfall, and their figures: the mean
    # log ratio and the medians of what their expectations carry.
    live: tuple[Assessment, ...]
    log_mean: float
    spread: float
    centre_se: float
    variation: float
    all_peers: bool
    rated: bool
    # Every live assessment has a ratio above 0.
    positive: bool
    # This group's part of the run's noise (``measured_noise``): the squared deviations of
    # its log busbw from their mean and their degrees of freedom (0: not counted).
    noise_ss: float
    noise_dof: int

    def fits(self, items: list[Assessment]) -> bool:
        return len(items) == len(self.items) and all(
            a is b for a, b in zip(items, self.items, strict=True))


def summarize(items: list[Assessment]) -> OpSummary:
    """The figures of one op of one group that do not depend on the run's noise."""
    live = tuple(a for a in items if not a.explained)
    n = len(live)
    ss, dof = 0.0, 0
    if len(items) >= 2:
        kept = items[1:] if len(items) >= 3 else items
        ss, dof = noise_terms([a.measurement.busbw_gbs for a in kept])
    return OpSummary(
        items=tuple(items), live=live,
        log_mean=sum(math.log(max(a.ratio or 0.0, 1e-9)) for a in live) / n if n else 0.0,
        spread=_median([a.spread for a in live]) if n else 0.0,
        centre_se=_median([a.centre_se for a in live]) if n else 0.0,
        variation=_median([a.variation for a in live]) if n else 0.0,
        all_peers=all(a.source == "peers" for a in live),
        rated=any(a.source == "rated" for a in live),
        positive=all(a.ratio for a in live), noise_ss=ss, noise_dof=dof)


# Per group and op, its summary: kept by a caller that judges a growing list of
# measurements again and again (``group_verdicts``' ``cache``).
SummaryCache = dict[tuple[str, Group, str], OpSummary]
# NIC decisions pooled over a set of node-pair verdicts, under those verdicts.
Pooled = dict[tuple["GroupVerdict", ...], Decision | None]


@dataclass(eq=False)
class GroupVerdict:
    """Every judged measurement of one group of ranks (possibly over several rounds), and
    the weighing of them: per op a sequential test (``evidence.weigh``) decides degraded,
    healthy, or not yet. Compared and hashed by identity: a judgement's verdicts key the
    NIC decisions pooled over them."""

    scope: str
    members: tuple[str, ...]
    nodes: tuple[str, ...]
    by_op: dict[str, list[Assessment]] = field(default_factory=dict)
    weighing: Weighing = field(default_factory=Weighing)
    # Per-measurement noise by op, and the between-group variation by kind of group where
    # the run measured it, over the whole run (``group_verdicts``).
    noise: Mapping[str, float] = field(default_factory=dict)
    variation: Mapping[PeerKey, float] = field(default_factory=dict)
    # How many places the judgement judged (``places_of``): a slow decision of one link
    # stands at the check's false-exclusion rate shared among them (``stands_apart``).
    places: int = 1
    # Where this run's healthy unions read, by op (``union_levels``): a union is judged
    # against the healthiest of its peers where they read above the model.
    levels: Mapping[str, UnionLevels] = field(default_factory=dict)
    _decisions: dict[str, Decision] | None = field(default=None, repr=False)
    # ``_pair_mean`` by op: a node pair's evidence is asked for by both its ends' NICs, in
    # every pass of the NIC and path rules.
    _pair_means: dict[str, PairEvidence | None] = field(default_factory=dict, repr=False)
    _summaries: SummaryCache = field(default_factory=dict, repr=False)
    _checked: dict[str, OpSummary] = field(default_factory=dict, repr=False)
    # Shared by the verdicts of one judgement: NIC decisions pooled over a set of them
    # (``_pooled``), asked for again by each pass of the NIC and path rules.
    _pooled: Pooled = field(default_factory=dict, repr=False)

    @property
    def decisions(self) -> dict[str, Decision]:
        if self._decisions is None:
            self._decisions = {op: self._weigh(op) for op, items in self.by_op.items()
                               if any(not a.explained for a in items)}
        return self._decisions

    def summary(self, op: str) -> OpSummary:
        """``summarize`` of the op's assessments, from the cache where they are unchanged."""
        items = self.by_op[op]
        s = self._checked.get(op)
        if s is not None and len(s.items) == len(items) and s.items[-1] is items[-1]:
            return s  # checked in full when this verdict first asked (its lists only grow)
        s = self._checked[op] = _summary(self._summaries, self.key, op, items)
        return s

    def _weigh(self, op: str) -> Decision:
        s = self.summary(op)
        live = s.live
        if not self.weighing.sequential or s.rated:
            # Below the hardware's rated floor there is nothing subtle left to weigh.
            return by_majority([a.bad for a in live], self.weighing)
        spread = max(s.spread, self.weighing.min_noise)
        noise = self.noise.get(op)
        measured = noise is not None
        if noise is None:
            # Nothing repeated yet to tell noise from lasting offsets. One measurement's
            # ratio scatters by the peers' spread, whatever its parts; the mean of several
            # is given no credit for averaging until the noise is measured, and no group
            # stops for futility on this stand-in (tried: a fault-free 2-node fleet took
            # fewer rounds, but a 12-node fleet at 8 % noise with its NVLink 40 % below
            # rated then named a healthy node's NIC).
            noise, variation = spread, (spread if len(live) > 1 else 0.0)
        else:
            variation = self.lasting_variation(s)
        w = self.weighing
        log_mean = s.log_mean
        if self.prunes:
            # A union runs at its slowest path: weighed against what one path of the
            # smallest loss would take off it, not against that loss itself, and with the
            # lasting offset of the slowest of its paths, not of one path. Where the run
            # measured how its node pairs spread, it is expected at the slowest of paths
            # spread so, not under the prior (assess models it so).
            k = len(self.nodes)
            pairs_spread = self._pairs_spread(op)
            log_mean -= _spread_shift(k, pairs_spread, w)
            # Where unions of this run read above the model (a fleet whose paths spread
            # less in the tail than a normal spread does), the healthiest of the others of
            # its size or smaller, as far down as their noise could have lifted them, is
            # what this one is held to (``union_levels``).
            lift = 0.0
            if measured:
                levels = self.levels.get(op)
                if levels is not None:
                    lift = max(levels.reference(k, self.key), 0.0)
            log_mean -= lift
            w = _union_weighing(w, min(w.min_loss, w.union_min_loss(k, pairs_spread, lift)))
            if measured:
                variation *= slowest_spread_share(k)
        noise = max(noise, self.weighing.min_noise)
        d = weigh_log_mean(log_mean, len(live), noise=noise,
                           variation=variation, centre_se=s.centre_se, w=w,
                           futility=measured,
                           early_clear=self.is_one_link and len(live) >= EARLY_CLEAR_REPEATS,
                           terminal=self.is_one_link)
        if d.degraded and measured and self.is_one_link and not stands_apart(
                s.log_mean, noise ** 2 / len(live) + s.centre_se ** 2, variation, self.places,
                w):
            # Slow by the test, but not yet by the noise measured at the check's
            # false-exclusion rate: a healthy link low in its band and two unlucky readings
            # look so. Measured again; at its last repeat still so, it stays a suspect.
            d = held_open(d)
        if (measured and self.is_one_link and not d.degraded and not d.cleared
                and len(live) >= w.confirm_clear
                and not can_hide(s.log_mean, variation ** 2 + s.centre_se ** 2
                                 + noise ** 2 / len(live), w)):
            # One link that cannot hide a loss of the smallest size the check is built to
            # find: decided, and not measured again. (A ring or a union runs at its
            # slowest edge, a few percent under its peers with one edge that slow: only
            # its own test clears it.)
            d = cleared_now(d)
        if d.degraded and not measured:
            # Slow on a stand-in: it must stand at the noisiest fabric planned for too, or
            # wait (measured again) until the run has measured its noise.
            cautious = max(noise, self.weighing.unmeasured_noise)
            if not weigh_log_mean(s.log_mean, len(live), noise=cautious,
                                  variation=cautious if len(live) > 1 else 0.0,
                                  centre_se=s.centre_se, w=self.weighing).degraded:
                d = held_open(d)
        if (self.prunes and self.scope != "world" and measured and d.decision == UNDECIDED
                and not d.exhausted and len(live) >= UNION_FUTILE_REPEATS
                and out_of_reach(log_mean, variation ** 2 + s.centre_se ** 2, w)):
            # A union its readings could not clear at the mean they have settled on: more
            # of them only sharpen the noise, and the lasting offset of its slowest path
            # stays. Its smaller unions, on which a slow path takes a larger share, are
            # measured instead (the search keeps what is not cleared).
            d = followed_up(d)
        # The world group is the search's only gate (cleared, no path is looked for at
        # all): one more reading than a union, whose regions three unions cover.
        if self.prunes and len(live) < self.weighing.confirm_clear + (self.scope == "world"):
            return unconfirmed(d)
        return d

    def _pairs_spread(self, op: str) -> float | None:
        """How far this run's node pairs sit from each other for good on ``op``, where it
        measured it (``measured_variation``; the kind of the fewest ranks across nodes)."""
        return pairs_spread_of(self.variation, op)

    @cached_property
    def key(self) -> GroupKey:
        """What its verdict is found under: its scope and its group."""
        return self.scope, Group(self.members)

    @property
    def prunes(self) -> bool:
        """A group that spans many paths (``assess.spans_paths``): cleared, it takes every
        path between its nodes out of the search."""
        return spans_paths(self.scope, len(self.nodes))

    @property
    def is_one_link(self) -> bool:
        """A GPU pair or a node pair: a fault on it shows in full. A node's intra-node ring
        and a union of many paths run at their slowest edge, so a fault on one of those
        takes only part of its loss off the group."""
        return len(self.members) == 2 or (self.scope == "inter_node" and len(self.nodes) == 2)

    def lasting_variation(self, s: OpSummary) -> float:
        """How far a healthy group like this one sits from its expectation for good: the
        run's measured figure for its kind where it is judged by its peers and the run
        measured one, else what its assessments carry (``s``: a summary of them)."""
        return lasting_of(s, self.variation)

    # What is read of the decisions is kept once read: the NIC, path and plan rules ask it
    # of every group again and again. A verdict's assessments do not change under it: a
    # judgement makes a new verdict for a group whose assessments changed.
    @cached_property
    def bad(self) -> bool:
        """Decided slow for some op."""
        return any(d.degraded for d in self.decisions.values())

    @cached_property
    def cleared(self) -> bool:
        """Decided healthy for every op it ran, or explained whole by a fleet-wide
        shortfall (decided by that finding: nothing of it is left to localize)."""
        if not self.decisions:
            return self.explained
        return all(d.cleared for d in self.decisions.values())

    @cached_property
    def explained(self) -> bool:
        """Every measurement of it is explained by a fleet-wide shortfall."""
        return bool(self.by_op) and all(a.explained for items in self.by_op.values()
                                        for a in items)

    @property
    def suspect(self) -> bool:
        """Not cleared: slow, or not yet decided (a search never prunes what it has not
        cleared)."""
        return not self.cleared

    @cached_property
    def provisional(self) -> bool:
        """Slow on one measurement only: decided, but to be measured again."""
        ds = self.decisions.values()
        return any(d.degraded for d in ds) and all(d.provisional for d in ds if d.degraded)

    @cached_property
    def pending_ops(self) -> tuple[str, ...]:
        """Ops still undecided with repeats left: what a repeat of this group measures."""
        ds = self.decisions
        if any(d.degraded and not d.provisional for d in ds.values()):
            return ()
        return tuple(op for op, d in sorted(ds.items()) if d.pending)

    @property
    def confidence(self) -> float:
        """How sure the group's decision is: of the slow ops' tests where it is slow, else of
        the least sure op."""
        ds = list(self.decisions.values())
        slow = [d.confidence for d in ds if d.degraded]
        if slow:
            return max(slow)
        return min((d.confidence for d in ds), default=0.0)

    @property
    def worst(self) -> Assessment | None:
        rated = [a for items in self.by_op.values() for a in items if a.ratio is not None]
        return min(rated, key=lambda a: a.ratio or 0.0) if rated else None


@lru_cache(maxsize=256)
def _union_weighing(w: Weighing, loss: float) -> Weighing:
    """How a union is weighed: against ``loss``, at the union's miss rate."""
    return replace(w, min_loss=loss, miss=w.union_miss)


def pairs_spread_of(variation: Mapping[PeerKey, float], op: str) -> float | None:
    """How far a run's node pairs sit from each other for good on ``op``, where it measured
    it (``measured_variation``; the kind of the fewest ranks across nodes)."""
    pairs = [(key[4], x) for key, x in variation.items()
             if key[0] == op and key[1] == "inter_node"]
    return min(pairs)[1] if pairs else None


def lasting_of(s: OpSummary, variation: Mapping[PeerKey, float]) -> float:
    """How far a healthy group sits from its expectation for good (``GroupVerdict.
    lasting_variation``): the run's measured figure for its kind where it is judged by its
    peers and the run measured one, else what its assessments carry."""
    if s.all_peers:
        return variation.get(peer_key(s.live[0].measurement), s.variation)
    return s.variation


def _spread_shift(k: int, pairs_spread: float | None, w: Weighing) -> float:
    """How much lower (in log) a union of ``k`` nodes is expected where the run measured
    how its node pairs spread, than under the prior the assessment modeled it with."""
    if pairs_spread is None:
        return 0.0
    return math.log(slowest_path_share(k, pairs_spread)
                    / slowest_path_share(k, w.variation_prior))


# A union sets where its peers are held only once its mean is known to within this (log)
# standard error: a third of the shortfall one weak path leaves on a large union. Under
# more noise than its readings have averaged out, a union is held to the model alone, which
# expects less of it: held to an uncertain peer, a fault-free fleet at 8 % noise searched
# on and on for a path that was not there.
UNION_LEVEL_SE = 0.025
# A union still undecided on this many readings, where no number of readings at its mean
# could clear it, is followed up by its smaller unions instead of measured on
# (``evidence.out_of_reach``): under 7 % noise a 3-node union sitting about 3 % under its
# model took all 20 of its readings and ended undecided, one round of the check each.
UNION_FUTILE_REPEATS = 6
# A union's peers are unions of at most this share more nodes than it: a healthy union
# reads higher against its model the more nodes it has, so a smaller one never holds a
# larger one to more than it should read.
UNION_PEER_SLACK = 1.1


@dataclass(frozen=True)
class UnionLevels:
    """Where the healthy unions of one op of a run read against their model: for each union
    measured to within ``UNION_LEVEL_SE``, its mean log ratio less ``z`` standard errors (its
    noise over its readings, the lasting offset of its slowest path, its centre's error),
    ``z`` about where the best of that many healthy means sits (``union_levels``). A fault
    only ever slows a union, so the best of these bounds is about where a healthy union
    reads, and lower where some unions are slow: a union is held to the best bound among
    its peers (the others of its size or smaller), where that is above the model. Sorted
    by node count, with the best and second best bound up to each."""

    sizes: tuple[int, ...]
    best: tuple[tuple[float, GroupKey | None], ...]
    second: tuple[float, ...]

    @classmethod
    def of(cls, bounds: list[tuple[int, float, GroupKey]]) -> UnionLevels:
        bounds = sorted(bounds, key=lambda x: x[0])
        sizes, best, second = [], [], []
        top: tuple[float, GroupKey | None] = (-math.inf, None)
        runner = -math.inf
        for k, lcb, key in bounds:
            if lcb > top[0]:
                top, runner = (lcb, key), top[0]
            elif lcb > runner:
                runner = lcb
            sizes.append(k)
            best.append(top)
            second.append(runner)
        return cls(tuple(sizes), tuple(best), tuple(second))

    def reference(self, k: int, own: GroupKey) -> float:
        """The highest bound among the unions of at most ``UNION_PEER_SLACK`` times ``k``
        nodes, other than ``own``; -inf where there is none."""
        i = bisect.bisect_right(self.sizes, UNION_PEER_SLACK * k) - 1
        if i < 0:
            return -math.inf
        lcb, key = self.best[i]
        return self.second[i] if key == own else lcb


def union_levels(c: VerdictCache, noise: Mapping[str, float],
                 variation: Mapping[PeerKey, float], w: Weighing) -> dict[str, UnionLevels]:
    """``UnionLevels`` of every op the run's unions measured where it measured that op's
    noise, from what ``c`` folded of them."""
    out: dict[str, list[tuple[int, float, float, GroupKey]]] = {}
    spreads = {op: pairs_spread_of(variation, op) for op in noise}
    for key, k in c.union_sizes.items():
        for op in c.by_group.get(key, ()):
            sigma = noise.get(op)
            s = c.summaries.get((key[0], key[1], op))
            if sigma is None or s is None or not s.live or not s.positive or s.rated:
                continue
            lasting = lasting_of(s, variation) * slowest_spread_share(k)
            se = math.sqrt(max(sigma, w.min_noise) ** 2 / len(s.live) + lasting ** 2
                           + s.centre_se ** 2)
            if se <= UNION_LEVEL_SE:
                out.setdefault(op, []).append(
                    (k, s.log_mean - _spread_shift(k, spreads[op], w), se, key))
    levels = {}
    for op, rows in out.items():
        # Where the highest of M healthy unions' means sits, in their standard errors (the
        # median of the most of M normal draws, about): the bound is then no higher than a
        # healthy union reads as often as not where all its peers are healthy, and lower
        # where some are slow.
        z = NormalDist().inv_cdf(len(rows) / (len(rows) + 1.0))
        levels[op] = UnionLevels.of([(k, m - z * se, key) for k, m, se, key in rows])
    return levels


def _median(values: list[float]) -> float:
    """``statistics.median`` with the one- and two-value cases (most groups' repeats) done
    directly: the judgement takes millions of these in a large check."""
    n = len(values)
    if n == 1:
        return values[0]
    if n == 2:
        return (values[0] + values[1]) / 2
    return statistics.median(values)


# One op of one group's part of the run's noise: its op, squared deviations, degrees of
# freedom (``OpSummary.noise_ss``); and its first reading against its peers: its kind,
# log ratio and the centre's error (``measured_variation``).
NoiseTerm = tuple[str, float, int]
FirstReading = tuple[PeerKey, float, float]


@dataclass
class VerdictCache:
    """What ``group_verdicts`` keeps between calls on a list of assessments that only grows
    (a check's, judged again after every round; ``assess`` hands back the same object for
    a measurement whose assessment did not change). Only the groups with a new or changed
    assessment are folded again; a group whose assessments and estimates (noise,
    variation) are the ones it was last weighed under keeps its verdict, and with it its
    decisions and the NIC decisions pooled over it. The verdicts are the same as without
    it."""

    weighing: Weighing | None = None
    summaries: SummaryCache = field(default_factory=dict)
    # The assessments last folded; per index its group and op, and whether it is judged.
    last: list[Assessment] = field(default_factory=list)
    slots: list[tuple[GroupKey, str]] = field(default_factory=list)
    placed: list[bool] = field(default_factory=list)
    # Per group and op, the indices of its assessments, ascending.
    indices: dict[GroupKey, dict[str, list[int]]] = field(default_factory=dict)
    # Per group its judged assessments by op, and the index of its first.
    by_group: dict[GroupKey, dict[str, list[Assessment]]] = field(default_factory=dict)
    first: dict[GroupKey, int] = field(default_factory=dict)
    terms: dict[tuple[GroupKey, str], NoiseTerm] = field(default_factory=dict)
    firsts: dict[tuple[GroupKey, str], FirstReading] = field(default_factory=dict)
    noise: dict[str, float] = field(default_factory=dict)
    variation: dict[PeerKey, float] = field(default_factory=dict)
    verdicts: dict[GroupKey, GroupVerdict] = field(default_factory=dict)
    pooled: Pooled = field(default_factory=dict)
    # What ``places_of`` counted so far: the groups, the links among them and their nodes.
    counted: set[GroupKey] = field(default_factory=set)
    links: int = 0
    local_nodes: set[str] = field(default_factory=set)
    places: int = 1
    # How many entries ``pooled`` kept when it was last pruned of dropped verdicts.
    pooled_kept: int = 0
    # The noise terms by op and the first readings by kind, and those whose terms or
    # readings moved since the noise and variation were last worked out: only theirs are
    # worked out again (``measured_noise``, ``measured_variation``).
    op_terms: dict[str, dict[tuple[GroupKey, str], NoiseTerm]] = field(default_factory=dict)
    kind_firsts: dict[PeerKey, dict[tuple[GroupKey, str], FirstReading]] = field(
        default_factory=dict)
    moved_ops: set[str] = field(default_factory=set)
    moved_kinds: set[PeerKey] = field(default_factory=set)
    # Whether a group already judged had its first judged assessment move in the last
    # fold, and the first of the last group ``verdicts`` holds: with neither, the groups
    # keep their order and new ones come after them (``group_verdicts``' short way).
    reordered: bool = False
    last_first: int = -1
    # Per group, the kinds (``peer_key``) of its judged assessments: the groups a moved
    # variation weighs again.
    kinds_of: dict[GroupKey, set[PeerKey]] = field(default_factory=dict)
    # The node count of each union (``spans_paths``) folded so far, and where the run's
    # healthy unions read (``union_levels``) when the verdicts were last weighed.
    union_sizes: dict[GroupKey, int] = field(default_factory=dict)
    # The node pairs folded so far (inter-node groups that are not unions).
    not_unions: set[GroupKey] = field(default_factory=set)
    levels: dict[str, UnionLevels] = field(default_factory=dict)

    def changes(self, items: list[Assessment]) -> list[int] | None:
        """The indices of ``items`` not folded yet, where it is the last list grown or with
        some assessments made again; None where it is another list."""
        n = len(self.last)
        if len(items) < n:
            return None
        changed = identity_changes(items, self.last)
        if any(items[i].measurement is not self.last[i].measurement for i in changed):
            return None
        return changed + list(range(n, len(items)))

    def fold(self, items: list[Assessment], changed: list[int]) -> set[GroupKey]:
        """Take in ``items`` at the ``changed`` indices: the groups whose judged
        assessments changed."""
        n = len(self.last)
        touched: set[GroupKey] = set()
        self.reordered = False
        for i in changed:
            a = items[i]
            if i >= n:
                m = a.measurement
                key, op = (m.scope, m.group), m.series
                self.slots.append((key, op))
                self.placed.append(False)
                self.indices.setdefault(key, {}).setdefault(op, []).append(i)
            now = a.judged and a.ratio is not None
            if now or self.placed[i]:
                touched.add(self.slots[i][0])
            self.placed[i] = now
        self.last = items
        for key in touched:
            self._regroup(key, items)
        return touched

    def _regroup(self, key: GroupKey, items: list[Assessment]) -> None:
        ops = []
        for op, ix in self.indices[key].items():
            kept = [i for i in ix if self.placed[i]]
            term = self.terms.pop((key, op), None)
            first = self.firsts.pop((key, op), None)
            if kept:
                listed = [items[i] for i in kept]
                ops.append((kept[0], op, listed))
                s = _summary(self.summaries, key, op, listed)
                self.terms[(key, op)] = (op, s.noise_ss, s.noise_dof)
                if (reading := _first_reading(s)) is not None:
                    self.firsts[(key, op)] = reading
            self._index((key, op), term, first)
        if ops:
            ops.sort(key=lambda x: x[0])
            self.by_group[key] = {op: listed for _, op, listed in ops}
            if self.first.get(key, ops[0][0]) != ops[0][0]:
                self.reordered = True
            self.first[key] = ops[0][0]
            self.kinds_of[key] = {peer_key(a.measurement) for _, _, listed in ops for a in listed}
            if (key[0] in ("inter_node", "world") and key not in self.union_sizes
                    and key not in self.not_unions):
                # Its node count worked out once (a node pair's too: most groups are those).
                k = len(group_nodes(key[1].members))
                if spans_paths(key[0], k):
                    self.union_sizes[key] = k
                else:
                    self.not_unions.add(key)
        else:
            self.by_group.pop(key, None)
            self.first.pop(key, None)
            self.kinds_of.pop(key, None)

    def _index(self, slot: tuple[GroupKey, str], term: NoiseTerm | None,
               first: FirstReading | None) -> None:
        """Keep ``op_terms`` and ``kind_firsts`` with ``slot``'s term and first reading,
        which were ``term`` and ``first``."""
        now, reading = self.terms.get(slot), self.firsts.get(slot)
        if _counted(now) != _counted(term):
            self.op_terms.setdefault(slot[1], {}).pop(slot, None)
            if now is not None:
                self.op_terms[slot[1]][slot] = now
            self.moved_ops.add(slot[1])
        if reading != first:
            for x in (first, reading):
                if x is not None:
                    self.kind_firsts.setdefault(x[0], {}).pop(slot, None)
                    self.moved_kinds.add(x[0])
            if reading is not None:
                self.kind_firsts[reading[0]][slot] = reading

    def measured_noise(self) -> dict[str, float]:
        """``noise_of`` all the terms, worked out again only for the ops whose terms moved
        (each op's figure is its terms' alone)."""
        out = {op: x for op, x in self.noise.items() if op not in self.moved_ops}
        for op in self.moved_ops:
            out.update(noise_of(self.op_terms.get(op, {}).values()))
        self.moved_ops = set()
        return dict(sorted(out.items()))

    def measured_variation(self, noise: Mapping[str, float], w: Weighing) -> dict[PeerKey, float]:
        """``variation_of`` all the first readings under ``noise``, worked out again only for
        the kinds whose readings or op's noise moved (each kind's figure is its own)."""
        redo = self.moved_kinds | {k for k in self.kind_firsts
                                   if noise.get(k[0]) != self.noise.get(k[0])}
        out = {k: x for k, x in self.variation.items() if k not in redo}
        out.update(variation_of((x for k in redo for x in self.kind_firsts.get(k, {}).values()),
                                noise, w))
        self.moved_kinds = set()
        return dict(sorted(out.items()))


def _counted(term: NoiseTerm | None) -> tuple[float, int] | None:
    """What of a noise term ``noise_of`` counts: none of a group measured once."""
    return (term[1], term[2]) if term is not None and term[2] else None


def group_verdicts(assessments: Iterable[Assessment], weighing: Weighing | None = None,
                   cache: VerdictCache | None = None) -> dict[GroupKey, GroupVerdict]:
    """Judged assessments folded per group (scope and member set), each weighed with the
    run's own measured noise. ``cache``: one ``VerdictCache`` kept across calls on a
    growing list of assessments (a check's); the verdicts are the same without it."""
    w = weighing or Weighing()
    items = list(assessments)
    c = cache if cache is not None else VerdictCache()
    changed = c.changes(items) if c.weighing is w else None
    if changed is None:
        vars(c).update(vars(VerdictCache(w)))
        changed = list(range(len(items)))
    touched = c.fold(items, changed)
    noise = c.measured_noise()
    variation = c.measured_variation(noise, w)
    ops = _changed(c.noise, noise)
    kinds = _changed(c.variation, variation)
    places = places_of(c, touched)
    moved = places != c.places
    levels = union_levels(c, noise, variation, w) if c.union_sizes else {}
    lifted = levels != c.levels
    # A one-link group's slow decision depends on the places judged, a union's on how the
    # node pairs spread (``GroupVerdict._pairs_spread``): each is weighed again when those
    # move.
    new = sorted((k for k in touched if k in c.by_group and k not in c.verdicts),
                 key=c.first.__getitem__)
    out: dict[GroupKey, GroupVerdict] = {}
    if c.verdicts and not ops and not kinds and not moved and not c.reordered and (
            not new or c.first[new[0]] > c.last_first):
        # Only the touched groups are weighed again, under the same noise, variation and
        # places: the others keep their verdicts and order, and new groups come after them.
        # The same verdicts, in the same order, as the long way below; a large check's
        # rounds of a few groups each no longer pass over all of them.
        out = dict(c.verdicts)
        for key in touched:
            if key in out and key not in c.by_group:
                del out[key]
        again = [k for k in touched if k in out]
        if lifted:
            # The unions are held to where the run's healthy unions read: each is weighed
            # again when that moves (in place: the order stays).
            again += [k for k in c.union_sizes if k in out and k not in touched]
        for key in [*again, *new]:
            made = out[key] = _verdict(c, key, w)
            made.noise, made.variation, made.places = noise, variation, places
            made.levels = levels
    else:
        # In the order of each group's first judged assessment, as a fresh fold finds them.
        for key in sorted(c.by_group, key=c.first.__getitem__):
            by_op = c.by_group[key]
            v = c.verdicts.get(key)
            if v is None or key in touched or not ops.isdisjoint(by_op) or (
                    kinds and not kinds.isdisjoint(c.kinds_of[key])) or (
                    moved and v.is_one_link) or ((kinds or lifted) and v.prunes):
                v = _verdict(c, key, w)
            v.noise, v.variation, v.places, v.levels = noise, variation, places, levels
            out[key] = v
    c.last_first = c.first[next(reversed(out))] if out else -1
    if len(c.pooled) > 2 * c.pooled_kept + 64:
        # Decisions pooled over verdicts no longer current are never asked for again: they
        # are dropped now and then (in place: every verdict holds this memo), not after
        # every round, which cost a pass over them all.
        alive = {id(v) for v in out.values()}
        for k in [k for k in c.pooled if not all(id(v) in alive for v in k)]:
            del c.pooled[k]
        c.pooled_kept = len(c.pooled)
    c.noise, c.variation, c.verdicts, c.places, c.levels = noise, variation, out, places, levels
    return out


def _verdict(c: VerdictCache, key: GroupKey, w: Weighing) -> GroupVerdict:
    """A new verdict of ``key``'s group from what ``c`` folded of it."""
    by_op = c.by_group[key]
    return GroupVerdict(key[0], key[1].members, tuple(sorted(group_nodes(key[1].members))),
                        by_op=by_op, weighing=w, _pooled=c.pooled, _summaries=c.summaries,
                        _checked={op: c.summaries[(key[0], key[1], op)] for op in by_op})


def places_of(c: VerdictCache, new: Iterable[GroupKey]) -> int:
    """How many places the judgement of ``c``'s groups judges (``new``: those folded since
    it last counted), for the false-exclusion rate (``Weighing.family_z``): each GPU pair
    and node pair measured, each node's NVLink and its NIC; rounded up to a power of two,
    so that a check's rounds seldom move it (each move weighs every link again)."""
    for key in new:
        if key in c.counted:
            continue
        c.counted.add(key)
        scope, members = key[0], key[1].members
        if len(members) == 2 or scope == "intra_node":
            c.links += 1
        if scope in ("intra_node", "gpu_pair"):
            c.local_nodes.add(split_member(members[0])[0])
    count = max(c.links + 2 * len(c.local_nodes), 1)
    return 1 << (count - 1).bit_length()


def _summary(cache: SummaryCache, key: GroupKey, op: str, items: list[Assessment]) -> OpSummary:
    """``summarize(items)``, from ``cache`` where they are the ones it was made from."""
    s = cache.get((key[0], key[1], op))
    if s is None or not s.fits(items):
        s = cache[(key[0], key[1], op)] = summarize(items)
    return s


def _changed(old: Mapping[K, float], new: Mapping[K, float]) -> set[K]:
    return {k for k in old.keys() | new.keys() if old.get(k) != new.get(k)}


def measured_variation(verdicts: Iterable[GroupVerdict], noise: Mapping[str, float],
                       w: Weighing) -> dict[PeerKey, float]:
    """Per kind of group judged against its peers (``peer_key``: the groups that did the
    same work), how far healthy groups sit from each other for good, where this run shows
    it differs from ``Weighing.variation_prior``.

    Each group's first measurement (every group has one, whatever came of it, so no
    repeat bends the figure) scatters about the peers' centre by variation, noise and the
    centre's error together; the noise is measured from repeats, so the variation is what
    is left. The scatter is taken robustly (MAD: faults are outliers). Where the run shows
    the variation smaller than the prior beyond doubt (two standard errors), the upper end
    of its estimate is used; where larger beyond doubt, the estimate; else the prior
    stands (under noise of several percent, one run cannot tell). The standard error is
    the scatter's under the prior where that is the larger, so a scatter that came out low
    by chance does not vouch for its own precision: under noise of several percent it
    would otherwise take its kind's variation to the floor, and every pooled NIC decision
    would then trust its pairs' means far past what they know.

    Larger than the prior needs the readings above the centre (log ratio 0, what the
    groups were judged against) to show it too, and takes the lesser figure: which groups
    a check measures is not a fair draw. The search's two-node unions are picked because
    they may hold a slow path; where most of such a kind was slow, the MAD read several
    times the lasting offset there is, and a 30 % path in a 64-node fleet was never named
    (its pair's AllToAll never decided; looked into by hand). A slow group only ever reads
    low, so the upper side is not bent by them. It is not used to go below the prior: a
    group that runs at its slowest link (an intra-node ring) spreads further below its
    centre than above it."""
    return variation_of((x for v in verdicts for op in v.by_op
                         if (x := _first_reading(v.summary(op))) is not None), noise, w)


def _first_reading(s: OpSummary) -> FirstReading | None:
    """A group's first live reading judged against its peers (every group has one, whatever
    came of it, so no repeat bends the figure)."""
    live = s.live
    if not live or live[0].source != "peers" or not live[0].ratio:
        return None
    return peer_key(live[0].measurement), math.log(live[0].ratio), live[0].centre_se


def variation_of(firsts: Iterable[FirstReading], noise: Mapping[str, float],
                 w: Weighing) -> dict[PeerKey, float]:
    """``measured_variation`` from the groups' first readings."""
    logs_of: dict[PeerKey, list[float]] = defaultdict(list)
    centre_se: dict[PeerKey, list[float]] = defaultdict(list)
    for key, log_ratio, se in firsts:
        logs_of[key].append(log_ratio)
        centre_se[key].append(se)
    prior = w.variation_prior ** 2
    out: dict[PeerKey, float] = {}
    for key in sorted(logs_of):
        logs = logs_of[key]
        sigma = noise.get(key[0])
        if sigma is None or len(logs) < MIN_VARIATION_GROUPS:
            continue
        known = sigma ** 2 + statistics.median(centre_se[key]) ** 2
        centre = statistics.median(logs)
        var, se = _variation_estimate([abs(x - centre) for x in logs], known, prior)
        if var + 2 * se < prior:
            out[key] = max(stepped(math.sqrt(max(var + 2 * se, w.min_variation ** 2))),
                           w.min_variation)
        elif var - 2 * se > prior:
            upper, upper_se = _variation_estimate([x for x in logs if x > 0.0], known, prior)
            if upper - 2 * upper_se > prior:
                out[key] = stepped(math.sqrt(min(var, upper)))
    return out


def _variation_estimate(deviations: list[float], known: float, prior: float
                        ) -> tuple[float, float]:
    """The lasting variance these absolute deviations show beyond ``known`` (noise and the
    centre's error), and its standard error: their median is ``Φ⁻¹(3/4)`` of the scatter's
    sigma, whether over both sides of the centre (the MAD) or over one side alone. The
    standard error is the scatter's under the prior where that is the larger."""
    if len(deviations) < MIN_VARIATION_GROUPS // 2:
        return 0.0, math.inf
    total = (MAD_TO_SIGMA * statistics.median(deviations)) ** 2
    se = max(total, known + prior) * math.sqrt(2.0 / (MAD_VARIANCE_EFFICIENCY * len(deviations)))
    return total - known, se


def measured_noise(verdicts: Iterable[GroupVerdict], min_dof: int = 8) -> dict[str, float]:
    """Per op, the noise of one measurement, pooled over the groups measured more than once
    (``evidence.noise_terms``); none for an op with fewer than ``min_dof`` degrees of
    freedom.

    A group's first reading is what decided whether it was measured again (one far from
    its expectation is repeated, one near it may be cleared at once), so it is left out
    where the group has two more: their scatter is not selected on."""
    return noise_of(((op, x.noise_ss, x.noise_dof) for v in verdicts for op, items in v.by_op.items()
                     if len(items) >= 2 and (x := v.summary(op)).noise_dof), min_dof)


def noise_of(terms: Iterable[NoiseTerm], min_dof: int = 8) -> dict[str, float]:
    """``measured_noise`` from the groups' noise terms (summed exactly: the same figure
    whatever order the groups come in)."""
    ss: dict[str, list[float]] = defaultdict(list)
    dof: dict[str, int] = defaultdict(int)
    for op, s, d in terms:
        if d:
            ss[op].append(s)
            dof[op] += d
    return {op: stepped(math.sqrt(math.fsum(ss[op]) / d))
            for op, d in sorted(dof.items()) if d >= min_dof}


def p2p_link_types(ranks: Iterable[RankInfo] | None,
                   only: set[str] | None = None) -> dict[tuple[str, int, int], str]:
    """(node, gpu, peer) -> nvidia-smi topo word ("NV18", "PHB", ...) from rank telemetry,
    for the nodes in ``only`` (all when None).

    Telemetry's ``p2p`` row maps a peer index to either a word or ``{"nvlink": bool, ...}``.
    """
    out: dict[tuple[str, int, int], str] = {}
    for r in ranks or []:
        if only is not None and r.node not in only:
            continue
        for peer, value in (r.telemetry.get("p2p") or {}).items():
            if isinstance(value, dict):
                word = value.get("link") or ("NV" if value.get("nvlink") else "PCIe")
            else:
                word = str(value)
            out[(r.node, r.local_index, int(peer))] = word
    return out


# A finding lists at most this many of the slow results behind it.
MAX_EVIDENCE = 8


def evidence_of(assessments: Iterable[Assessment]) -> list[dict[str, object]]:
    """The slow results behind a finding, worst first: scope, op, size, nodes, figures."""
    out = []
    for a in sorted(assessments, key=lambda a: a.ratio or 0.0)[:MAX_EVIDENCE]:
        m = a.measurement
        nodes = sorted(group_nodes(m.group.members))
        item: dict[str, object] = {"scope": m.scope, "op": m.series, "size_bytes": m.size_bytes,
                                   "ranks": len(m.members), "measured_gbs": round(m.busbw_gbs, 3)}
        if a.expected_gbs is not None:
            item["expected_gbs"] = round(a.expected_gbs, 3)
        item["nodes"] = list(nodes[:4]) + ([f"+{len(nodes) - 4} more"] if len(nodes) > 4 else [])
        if len(m.members) <= 2:
            item["members"] = sorted(m.members)
        out.append(item)
    return out


def deciding(verdicts: Iterable[GroupVerdict]) -> list[Assessment]:
    """The results a finding rests on: its groups' measurements of each op they were
    decided slow on; where none was decided alone (a NIC convicted over its partners
    together), all of its groups' measurements. A fleet-wide shortfall's are not its own."""
    verdicts = list(verdicts)
    decided = [a for x in verdicts for op, d in x.decisions.items() if d.degraded
               for a in x.by_op[op] if not a.explained]
    return decided or [a for x in verdicts for items in x.by_op.values() for a in items
                       if not a.explained]


def _finding(kind: str, v: GroupVerdict | list[GroupVerdict], decision: Decision | None = None,
             **where: object) -> Finding:
    """A degradation finding: its headline (``deciding_result`` of the results it rests
    on, ``deciding``), whose figures are its measured and expected busbw; the slow results
    behind it as its evidence; its confidence that of ``decision`` where the groups were
    weighed together (a NIC over its partners), else of the surest slow group."""
    verdicts = v if isinstance(v, list) else [v]
    worst = [w for w in (x.worst for x in verdicts) if w is not None]
    severity = "critical" if any(a.severity == "critical" for a in worst) else "warning"
    slow = [a for x in verdicts for items in x.by_op.values() for a in items if a.bad]
    detail: dict[str, object] = {"evidence": evidence_of(slow or worst)}
    top = deciding_result(deciding(verdicts))
    if top is not None:
        detail["headline"] = headline_of(top)
    decided = [d for x in verdicts for d in x.decisions.values() if d.degraded]
    if decision is not None:
        decided = [decision]
        detail["partners"] = len(verdicts)
    if decided:
        best = max(decided, key=lambda d: d.confidence)
        detail["confidence"] = round(best.confidence, 4)
        detail["repeats"] = best.repeats
    return Finding(kind=kind, severity=severity,
                   measured_gbs=top.measurement.busbw_gbs if top is not None else None,
                   expected_gbs=top.expected_gbs if top is not None else None,
                   detail=detail, **where)  # type: ignore[arg-type]


def _gpus(v: GroupVerdict) -> list[int]:
    return sorted(split_member(x)[1] for x in v.members)


def _is_pcie(node: str, gpus: list[int], v: GroupVerdict,
             links: dict[tuple[str, int, int], str]) -> bool:
    """Expected NVLink, got PCIe: telemetry says so, or (without it) the rate can't be NVLink."""
    a, b = gpus
    words = [links.get((node, a, b)), links.get((node, b, a))]
    if any(w is not None for w in words):
        return any(w is not None and not w.startswith("NV") for w in words)
    w = v.worst
    return (w is not None and w.expected_gbs is not None
            and w.measurement.busbw_gbs <= PCIE_CEILING_GBS < w.expected_gbs / 2)


def _faulty_gpus(bad_pairs: list[list[int]], tested: list[list[int]]) -> set[int]:
    """GPUs slow with most of their partners: the GPU, not one link, is at fault."""
    bad_count: dict[int, int] = defaultdict(int)
    tested_count: dict[int, int] = defaultdict(int)
    for pair in bad_pairs:
        for g in pair:
            bad_count[g] += 1
    for pair in tested:
        for g in pair:
            tested_count[g] += 1
    return {g for g, n in bad_count.items() if n >= 2 and 2 * n >= tested_count[g]}


def _pcie_pairs_of(node: str, links: dict[tuple[str, int, int], str]) -> list[list[int]]:
    return sorted({tuple(sorted((a, b))) for (n, a, b), w in links.items()  # type: ignore[misc]
                   if n == node and not w.startswith("NV")})


def _node_findings(node: str, intra: list[GroupVerdict], pairs: list[GroupVerdict],
                   links: dict[tuple[str, int, int], str]) -> list[Finding]:
    """NVLink and topology findings of one node from its intra-node and GPU-pair groups."""
    bad_pairs = [v for v in pairs if v.bad]
    if bad_pairs:
        return _pair_findings(node, bad_pairs, pairs, links)
    bad_intra = [v for v in intra if v.bad]
    if not bad_intra or pairs:
        # Pairs tested and all fine: the slow intra-node result was not confirmed.
        return []
    pcie = _pcie_pairs_of(node, links)
    if pcie:
        return [_finding("topology_mismatch", bad_intra, node=node, gpus=list(p)) for p in pcie]
    gpus = _gpus(bad_intra[0]) if len(bad_intra[0].members) == 2 else None
    return [_finding("nvlink_degraded", bad_intra, node=node, gpus=gpus)]


def _pair_findings(node: str, bad_pairs: list[GroupVerdict], pairs: list[GroupVerdict],
                   links: dict[tuple[str, int, int], str]) -> list[Finding]:
    out: list[Finding] = []
    rest = []
    for v in bad_pairs:
        gpus = _gpus(v)
        if _is_pcie(node, gpus, v, links):
            out.append(_finding("topology_mismatch", v, node=node, gpus=gpus))
        else:
            rest.append(v)
    faulty = _faulty_gpus([_gpus(v) for v in rest], [_gpus(v) for v in pairs])
    for g in sorted(faulty):
        mine = [v for v in rest if g in _gpus(v)]
        out.append(_finding("nvlink_degraded", mine, node=node, gpu=g, gpus=[g]))
    out += [_finding("nvlink_degraded", v, node=node, gpus=_gpus(v))
            for v in rest if not faulty.intersection(_gpus(v))]
    return out


# A node pair's lasting offset from its peers is partly each end's own (its NIC) and partly
# the rest (the partner's NIC, the path): the share of its variance taken as the rest.
OWN_SHARE_OTHER = 0.5
# A link is cleared before its healthy bound (once a loss is out of reach,
# ``evidence.weigh``'s ``early_clear``) only on this many readings. A node pair cleared
# proves both its NICs, and one lucky reading must not prove a slow NIC; and the run's
# noise is measured from the groups it repeats: were those only the ones whose first
# reading was far off, the noise would read high, the between-link variation low, and
# healthy links at the low end of the spread would be decided slow.
EARLY_CLEAR_REPEATS = 3


@dataclass(frozen=True)
class NicCase:
    """A node's NIC weighed over all its node-pair groups at once (``weigh_nics``): the
    pooled decision, and the groups it rests on."""

    decision: Decision
    groups: tuple[GroupVerdict, ...]


class PairEvidence(NamedTuple):
    """What one node pair says of its ends' NICs on one op (``_pair_mean``)."""

    # The mean log ratio of its measurements.
    mean: float
    # The variance of ``mean`` that is the pair's alone: the part of its lasting offset that
    # is not this node's own, and the noise left in the mean.
    own_variance: float
    # The error of the centre every pair of its kind is judged against.
    centre_se: float
    # The between-pair variation (one standard deviation).
    variation: float


def _pair_mean(v: GroupVerdict, op: str) -> PairEvidence | None:
    """One node pair's evidence on ``op``; None before the run has measured its noise (the
    mean of repeats can't be credited before then)."""
    if op not in v._pair_means:
        v._pair_means[op] = _pair_evidence(v, op)
    return v._pair_means[op]


def _pair_evidence(v: GroupVerdict, op: str) -> PairEvidence | None:
    noise = v.noise.get(op)
    if noise is None or op not in v.by_op:
        return None
    s = v.summary(op)
    if not s.positive:  # a reading of no busbw says nothing of its link's rate
        s = summarize([a for a in s.live if a.ratio])
    if not s.live:
        return None
    variation = v.lasting_variation(s)
    noise = max(noise, v.weighing.min_noise)
    return PairEvidence(mean=s.log_mean,
                        own_variance=OWN_SHARE_OTHER * variation ** 2 + noise ** 2 / len(s.live),
                        centre_se=s.centre_se, variation=variation)


def _pooled(groups: list[GroupVerdict], w: Weighing) -> Decision | None:
    """``_pool_nic``, once per set of groups (a check's verdicts keep it across rounds)."""
    if not groups:
        return None
    memo = groups[0]._pooled
    key = tuple(groups)
    if key not in memo:
        memo[key] = _pool_nic(groups, w)
    return memo[key]


def _pool_nic(groups: list[GroupVerdict], w: Weighing) -> Decision | None:
    """The NIC's decision from these groups together, per op: a NIC loss slows every pair
    through it alike, while each pair's lasting offset (its partner's NIC, its path) and
    noise are its own and average down over partners. What does not average down: the
    centre all pairs are judged against, and this node's own lasting offset, shared by
    every pair through it. Degraded needs the pairs without the slowest one to say so too
    (one slow path must not pass for a NIC); one op degraded is enough, healthy needs all."""
    decisions = []
    for op in sorted({op for v in groups for op in v.by_op}):
        means = sorted((x for v in groups if (x := _pair_mean(v, op)) is not None),
                       key=lambda x: x.mean)
        if not means:
            continue
        repeats = sum(len(v.by_op.get(op, ())) for v in groups)
        d = _pool(means, repeats, w)
        if d.degraded and (len(means) < 2 or not _pool(means[1:], repeats, w).degraded
                           or not _nic_stands(means, groups[0].places, w)):
            d = replace(d, decision=UNDECIDED)
        decisions.append(d)
    if not decisions:
        return None
    slow = [d for d in decisions if d.degraded]
    if slow:
        return max(slow, key=lambda d: d.llr)
    if all(d.cleared for d in decisions):
        return min(decisions, key=lambda d: d.confidence)
    return max(decisions, key=lambda d: d.llr)


def _pool(means: list[PairEvidence], repeats: int, w: Weighing) -> Decision:
    """Pairs' evidence weighed together: their inverse-variance mean, with the shared
    centre's error and the node's own lasting offset added to its variance."""
    weight = sum(1.0 / x.own_variance for x in means)
    m = sum(x.mean / x.own_variance for x in means) / weight
    centre_se = _median([x.centre_se for x in means])
    own = (1.0 - OWN_SHARE_OTHER) * _median([x.variation for x in means]) ** 2
    return weigh_mean(m, 1.0 / weight + centre_se ** 2 + own, repeats, w)


def _nic_stands(means: list[PairEvidence], places: int, w: Weighing) -> bool:
    """A NIC's slow decision stands at the check's false-exclusion rate
    (``evidence.stands_apart``): the pairs' mean below the healthy band by the noise left
    in it, weighed over its partners as ``_pool`` weighs them."""
    noise = [max(x.own_variance - OWN_SHARE_OTHER * x.variation ** 2, 1e-12) for x in means]
    weight = sum(1.0 / x.own_variance for x in means)
    m = sum(x.mean / x.own_variance for x in means) / weight
    noise_var = sum(n / x.own_variance ** 2 for n, x in zip(noise, means, strict=True)) / weight ** 2
    centre_se = _median([x.centre_se for x in means])
    return stands_apart(m, noise_var + centre_se ** 2, _median([x.variation for x in means]),
                        places, w)


def weigh_nics(of_node: Mapping[str, list[GroupVerdict]]) -> dict[str, NicCase]:
    """Each node's NIC, weighed over its node-pair groups together (``_pooled``): twice,
    the second time leaving out partners the first found slow themselves (a pair of two
    slow NICs says little of either one)."""
    first = {n: d for n, vs in of_node.items() if (d := _first_pass(vs))}
    slow = {n for n, d in first.items() if d.degraded}
    out: dict[str, NicCase] = {}
    for node, vs in of_node.items():
        if (case := _nic_case(node, vs, slow)) is not None:
            out[node] = case
    return out


def _first_pass(vs: list[GroupVerdict]) -> Decision | None:
    return _pooled(vs, vs[0].weighing) if vs else None


def _nic_case(node: str, vs: list[GroupVerdict], slow: set[str]) -> NicCase | None:
    """``weigh_nics``' second pass for one node: its groups without partners in ``slow``."""
    kept = [v for v in vs if not (set(v.nodes) - {node}) & slow] if slow else vs
    d = _pooled(kept, kept[0].weighing) if kept else None
    return NicCase(d, tuple(kept)) if d is not None else None


def nic_needs_more_partners(node: str, groups: list[GroupVerdict], proven: set[str],
                            nic: NicCase | None = None) -> bool:
    """True while ``node``'s node-pair results can't yet decide its NIC either way: no
    partner cleared it, its pooled evidence (``nic``) has not decided, and fewer than two
    ``proven`` partners (each cleared with someone else) found it slow. A pair with a
    partner that is itself slow with everyone says nothing of this node's NIC, and an
    undecided one is no evidence."""
    if any(v.cleared for v in groups):
        return False
    if nic is not None and (nic.decision.degraded or nic.decision.cleared):
        return False
    return len(_slow_with_proven(node, groups, proven)) < 2


def _slow_with_proven(node: str, groups: list[GroupVerdict], proven: set[str]
                      ) -> list[GroupVerdict]:
    return [v for v in groups if v.bad and set(v.nodes) - {node} <= proven]


def by_node(pairs: Iterable[GroupVerdict]) -> dict[str, list[GroupVerdict]]:
    """Each node's node-pair groups."""
    of_node: dict[str, list[GroupVerdict]] = defaultdict(list)
    for v in pairs:
        for n in v.nodes:
            of_node[n].append(v)
    return of_node


@dataclass(frozen=True)
class NicEvidence:
    """Node-pair groups by node, each NIC weighed over its partners (``weigh_nics``) and
    the nodes proven fine by them: what the NIC rule reads, once per set of pairs."""

    of_node: dict[str, list[GroupVerdict]]
    nics: dict[str, NicCase]
    proven: set[str]
    # The nodes the NIC rule may name (``_may_name``); no other node can be.
    candidates: set[str]

    @classmethod
    def of(cls, of_node: dict[str, list[GroupVerdict]], memo: NicMemo | None = None,
           hint: set[str] | None = None) -> NicEvidence:
        """From node-pair groups by node (``by_node``). ``memo``: one ``NicMemo`` kept across
        calls on pairs that change little (a check's, after every round), ``hint`` as
        ``NicMemo.update`` takes it; the evidence is the same without them."""
        if memo is not None:
            memo.update(of_node, hint)
            return cls(of_node, dict(memo.nics), set(memo.proven), set(memo.candidates))
        nics = weigh_nics(of_node)
        proven = proven_nodes(of_node, nics)
        return cls(of_node, nics, proven, {n for n, vs in of_node.items()
                                           if _may_name(n, vs, proven, nics.get(n))})


def _may_name(node: str, vs: list[GroupVerdict], proven: set[str], nic: NicCase | None) -> bool:
    """Whether ``_nic_findings`` may name ``node`` at some share."""
    return (len(_slow_with_proven(node, vs, proven)) >= 2
            or (nic is not None and nic.decision.degraded))


@dataclass
class NicMemo:
    """``weigh_nics``, ``proven_nodes`` and the nodes the NIC rule may name, kept across
    calls on node pairs that change little from one to the next (a check judging again
    after every round, its newly blamed nodes' pairs left out): only the nodes whose pairs
    changed are weighed again, with the partners of a node whose first-pass decision went
    in or out of slow; only those and the partners of a node proven or no longer proven
    are looked at again for the rule. A pass over every node of a large fleet, several
    times a round, was most of a check's cost. The results are ``weigh_nics``' and
    ``proven_nodes``' own (``NicEvidence.of`` without a memo)."""

    of_node: dict[str, list[GroupVerdict]] = field(default_factory=dict)
    first: dict[str, Decision] = field(default_factory=dict)
    slow: set[str] = field(default_factory=set)
    nics: dict[str, NicCase] = field(default_factory=dict)
    proven: set[str] = field(default_factory=set)
    candidates: set[str] = field(default_factory=set)
    # Where its last pairs came from (``VerdictIndex.nic_hint``): the index, how far into
    # its updates, and without which nodes.
    source: VerdictIndex | None = None
    seen: int = 0
    blamed: frozenset[str] = frozenset()

    def update(self, of_node: Mapping[str, list[GroupVerdict]],
               hint: set[str] | None = None) -> None:
        """Take in ``of_node``; ``hint``: the only nodes whose lists may differ from the last
        ones (None: any may)."""
        old = self.of_node
        # A list of verdicts compares by identity, element by element: cheap.
        if hint is None:
            changed = {n for n, vs in of_node.items() if old.get(n) != vs}
            changed.update(n for n in old if n not in of_node)
        else:
            changed = {n for n in hint if old.get(n) != of_node.get(n)}
        self.of_node = dict(of_node)
        moved = set()
        for n in changed:
            d = _first_pass(of_node.get(n, []))
            if d is None:
                self.first.pop(n, None)
            else:
                self.first[n] = d
            if (d is not None and d.degraded) != (n in self.slow):
                moved.add(n)
                self.slow ^= {n}
        dirty = changed | _partners(moved, of_node)
        turned = set()
        for n in dirty:
            vs = of_node.get(n)
            case = _nic_case(n, vs, self.slow) if vs is not None else None
            if case is None:
                self.nics.pop(n, None)
            else:
                self.nics[n] = case
            fine = vs is not None and _nic_fine(vs, case.decision if case is not None else None)
            if fine != (n in self.proven):
                turned.add(n)
                self.proven ^= {n}
        for n in dirty | _partners(turned, of_node):
            vs = of_node.get(n)
            if vs is not None and _may_name(n, vs, self.proven, self.nics.get(n)):
                self.candidates.add(n)
            else:
                self.candidates.discard(n)


def _partners(nodes: set[str], of_node: Mapping[str, list[GroupVerdict]]) -> set[str]:
    return {p for n in nodes for v in of_node.get(n, ()) for p in v.nodes}


def _nic_findings(e: NicEvidence, share: float = NIC_BAD_SHARE) -> list[Finding]:
    """A node slow with (nearly) every partner, while a partner is fine elsewhere; or whose
    partners together show it slow (``weigh_nics``): its NIC."""
    out = []
    for node in sorted(e.candidates):
        vs = e.of_node[node]
        bad = [v for v in vs if v.bad]
        decided = [v for v in vs if v.bad or v.cleared]
        nic = e.nics.get(node)
        if (len(_slow_with_proven(node, vs, e.proven)) >= 2
                and len(bad) >= share * len(decided)):
            out.append(_finding("nic_degraded", bad, node=node))
        elif nic is not None and nic.decision.degraded:
            out.append(_finding("nic_degraded", list(nic.groups), nic.decision, node=node))
    return out


def proven_nodes(of_node: Mapping[str, list[GroupVerdict]],
                 nics: Mapping[str, NicCase]) -> set[str]:
    """Nodes whose NIC is fine: a node-pair group of theirs decided healthy, or their
    partners together clear it (``nics``: ``weigh_nics(of_node)``)."""
    return {n for n, vs in of_node.items()
            if _nic_fine(vs, nics[n].decision if n in nics else None)}


def _nic_fine(groups: list[GroupVerdict], pooled: Decision | None) -> bool:
    """A NIC is fine when one of its node-pair groups was decided healthy, or all of them
    together (``pooled``) clear it."""
    return any(v.cleared for v in groups) or (pooled is not None and pooled.cleared)


def _path_suspects(pairs: list[GroupVerdict],
                   of_node: Mapping[str, list[GroupVerdict]] | None = None) -> list[GroupVerdict]:
    """The paths to name: ``path_candidates`` slow on every op they ran (``_on_every_op``)."""
    return [v for v in path_candidates(pairs, of_node) if _on_every_op(v)]


def path_candidates(pairs: list[GroupVerdict],
                    of_node: Mapping[str, list[GroupVerdict]] | None = None) -> list[GroupVerdict]:
    """Slow node pairs whose two ends are each proven elsewhere (a pair of theirs cleared,
    or their other pairs together clear their NIC) and slow with no other partner: only
    then is the path, not an end's NIC, to blame. A node slow with two partners but not
    enough for its NIC stays a suspect, unnamed. ``of_node``: ``by_node(pairs)`` where the
    caller has it."""
    of_node = of_node if of_node is not None else by_node(pairs)
    slow = [v for v in pairs if v.bad]
    # Counted over the slow pairs alone: a node's slow pairs are all among them.
    counts: dict[str, int] = defaultdict(int)
    for v in slow:
        for n in v.nodes:
            counts[n] += 1
    doubtful = {n for n, k in counts.items() if k >= 2}
    return [v for v in slow if not doubtful.intersection(v.nodes)
            and all(_proven_without(n, v, of_node[n]) for n in v.nodes)]


def _on_every_op(slow: GroupVerdict) -> bool:
    """Slow on every op it ran, weighed together: a slow path carries all of a pair's
    traffic, so it slows each op the pair ran, not one. In a large check the pairs are many
    and each op of each is weighed on its own, so now and then one op of one pair reads
    slow enough to pass the bound by chance; the path is named only if the ops' mean
    shortfall passes it too (the pair's lasting offset counted once, each op's noise its
    own)."""
    if not slow.weighing.sequential:
        return True
    means, noise_terms, floors = [], [], []
    for op in sorted(slow.decisions):
        x = _pair_mean(slow, op)
        if x is None:
            continue
        means.append(x.mean)
        noise_terms.append(x.own_variance - OWN_SHARE_OTHER * x.variation ** 2)
        floors.append(x.variation ** 2 + x.centre_se ** 2)
    if len(means) < 2:
        return True
    k = len(means)
    s2 = max(floors) + sum(noise_terms) / k ** 2
    repeats = sum(d.repeats for d in slow.decisions.values())
    mean = sum(means) / k
    if weigh_mean(mean, s2, repeats, slow.weighing).degraded:
        return True
    # Its repeats ran out on every op, each decided on its last look (``weigh``'s
    # ``terminal``): the ops together are held to the same fixed-sample bound.
    return (all(d.exhausted and d.degraded for d in slow.decisions.values())
            and mean <= -slow.weighing.terminal_z * math.sqrt(s2))


def _proven_without(node: str, slow: GroupVerdict, groups: list[GroupVerdict]) -> bool:
    others = [v for v in groups if v is not slow]
    if any(v.cleared for v in others):
        return True  # before weighing them all together
    return _nic_fine(others, _pooled(others, slow.weighing) if others else None)


def dedupe(findings: Iterable[Finding]) -> list[Finding]:
    seen: set[tuple[object, ...]] = set()
    out = []
    for f in findings:
        key = (f.kind, f.node, f.gpu, tuple(f.gpus or ()), tuple(f.nodes or ()))
        if key not in seen:
            seen.add(key)
            out.append(f)
    return out


def localize(
    assessments: Iterable[Assessment],
    probe_findings: Iterable[Finding],
    nodes: list[str],
    ranks: Iterable[RankInfo] | None = None,
    verdicts: dict[GroupKey, GroupVerdict] | None = None,
    memo: LocalizeMemo | None = None,
) -> list[Finding]:
    """Findings of the verdict's kinds (docs/formats.md) for these nodes (all nodes seen when ``nodes`` is empty).

    ``ranks`` (optional) carries telemetry: a P2P row tells a PCIe pair from a slow NVLink.
    ``verdicts``: ``group_verdicts(assessments)`` where the caller has it already.
    ``memo``: a ``LocalizeMemo`` kept across calls on verdicts that change little (a
    check's, after every round); the findings are the same without it.
    """
    if verdicts is None:
        verdicts = group_verdicts(assessments)
    index = memo.index if memo is not None else VerdictIndex()
    index.update(verdicts)
    slow_local = index.slow_local()
    links = p2p_link_types(memo.ranks_of(ranks, slow_local) if memo is not None else ranks,
                           slow_local)
    findings = dedupe(probe_findings)
    blamed = {f.node for f in findings if f.kind in EXCLUDING_KINDS and f.node}
    # Only a node with a slow group of its own can have an NVLink or topology finding.
    for node in sorted(slow_local - blamed):
        findings += _node_findings(node, index.local_of(node, "intra_node"),
                                   index.local_of(node, "gpu_pair"), links)
    blamed |= {f.node for f in findings if f.kind in EXCLUDING_KINDS and f.node}
    weighed = memo.nics if memo is not None else None
    evidence = NicEvidence.of(index.by_node(blamed), weighed, index.nic_hint(weighed, blamed))
    for share in (NIC_BAD_SHARE, NIC_BAD_SHARE_SECOND):
        nic = _nic_findings(evidence, share)
        findings += nic
        if new := {f.node for f in nic if f.node} - blamed:
            blamed |= new
            evidence = NicEvidence.of(index.by_node(blamed), weighed,
                                      index.nic_hint(weighed, blamed))
    # The rules below look at slow node pairs alone.
    slow = index.slow_pairs(blamed)
    findings += [_finding("net_path_degraded", v, nodes=sorted(v.nodes, key=node_order))
                 for v in _path_suspects(slow, evidence.of_node)]
    findings += _lone_pairs(slow, findings, evidence.of_node)
    return _only(dedupe(findings), set(nodes))


@dataclass
class VerdictIndex:
    """What the NIC, path and NVLink rules and the plan read of a judgement's verdicts,
    kept from one judgement to the next: each node's node pairs and its own groups, the
    slow ones, and the groups with ops pending, by their place in the verdicts' order.
    ``update`` takes in only the verdicts that are new (a pass in C finds them, where the
    verdicts kept their order and new groups came after them; else it starts afresh): a
    check judges again after every round, and most rounds of a large fleet change a few of
    its tens of thousands of groups. Read, it gives what a pass over the verdicts would,
    in the same order."""

    keys: list[GroupKey] = field(default_factory=list)
    values: list[GroupVerdict] = field(default_factory=list)
    # Per node, its node-pair groups and its own groups (GPU pairs, intra-node ring), by
    # place; each node's node pairs as a list too, made again only where they changed.
    pairs: dict[str, dict[int, GroupVerdict]] = field(default_factory=dict)
    pair_lists: dict[str, list[GroupVerdict]] = field(default_factory=dict)
    local: dict[str, dict[int, GroupVerdict]] = field(default_factory=dict)
    # The places of the slow node pairs, of the nodes' own slow groups, and of the groups
    # with ops pending (``GroupVerdict.pending_ops``).
    bad_pairs: set[int] = field(default_factory=set)
    bad_local: set[int] = field(default_factory=set)
    pending: set[int] = field(default_factory=set)
    stale: set[str] = field(default_factory=set)
    # Whether ``pending`` is kept (the plan's index; the rules do not read it).
    track_pending: bool = False
    # How many updates it took, the last one that started afresh, and after which update
    # which nodes' node pairs changed (``nic_hint``).
    updates: int = 0
    fresh_at: int = 0
    log: list[tuple[int, frozenset[str]]] = field(default_factory=list)

    def update(self, verdicts: Mapping[GroupKey, GroupVerdict]) -> None:
        keys, values = list(verdicts), list(verdicts.values())
        n = len(self.keys)
        self.updates += 1
        if len(keys) < n or keys[:n] != self.keys:
            updates = self.updates
            vars(self).update(vars(VerdictIndex(track_pending=self.track_pending)))
            self.updates = self.fresh_at = updates
            n = 0
        for i in identity_changes(values, self.values):
            self._take(i, values[i])
        for i in range(n, len(values)):
            self._take(i, values[i])
        self.keys, self.values = keys, values
        for node in self.stale:
            if node in self.pairs:
                self.pair_lists[node] = list(self.pairs[node].values())
            else:
                self.pair_lists.pop(node, None)
        if self.stale:
            self.log.append((self.updates, frozenset(self.stale)))
        self.stale.clear()

    def nic_hint(self, memo: NicMemo | None, blamed: AbstractSet[str]) -> set[str] | None:
        """The nodes whose node pairs without ``blamed`` (``by_node``) may differ from the
        ones ``memo`` last took from this index: those whose pairs changed since, and the
        partners of nodes blamed then and not now or the other way round. None: any may
        (another index, or this one started afresh since). Noted in ``memo`` as taken."""
        if memo is None:
            return None
        hint: set[str] | None = None
        if memo.source is self and memo.seen >= self.fresh_at:
            hint = set()
            for at, nodes in reversed(self.log):
                if at <= memo.seen:
                    break
                hint |= nodes
            flipped = memo.blamed.symmetric_difference(blamed)
            hint |= flipped
            hint.update(p for n in flipped for v in self.pair_lists.get(n, ()) for p in v.nodes)
        memo.source, memo.seen, memo.blamed = self, self.updates, frozenset(blamed)
        return hint

    def _take(self, i: int, v: GroupVerdict) -> None:
        """``v`` at place ``i`` (a new group, or a new verdict of the group there: the same
        scope and nodes), in place, so each node's groups stay in the verdicts' order."""
        nodes = v.nodes
        if len(nodes) == 1:
            self.local.setdefault(nodes[0], {})[i] = v
            _mark(self.bad_local, i, v.bad)
        elif v.scope == "inter_node" and len(nodes) == 2:
            for node in nodes:
                self.pairs.setdefault(node, {})[i] = v
            self.stale.update(nodes)
            _mark(self.bad_pairs, i, v.bad)
        if self.track_pending:
            _mark(self.pending, i, bool(v.pending_ops))

    def slow_local(self) -> set[str]:
        """Nodes with a slow group of their own."""
        return {self.values[i].nodes[0] for i in self.bad_local}

    def local_of(self, node: str, scope: str) -> list[GroupVerdict]:
        """``node``'s own groups of ``scope``, in order."""
        return [v for v in self.local.get(node, {}).values() if v.scope == scope]

    def by_node(self, blamed: AbstractSet[str] = frozenset()) -> dict[str, list[GroupVerdict]]:
        """``by_node`` of the node pairs without ``blamed`` nodes."""
        out = dict(self.pair_lists)
        for node in blamed:
            for v in self.pair_lists.get(node, ()):
                for other in v.nodes:
                    if other in out and other not in blamed:
                        kept = [x for x in out[other] if blamed.isdisjoint(x.nodes)]
                        if kept:
                            out[other] = kept
                        else:
                            del out[other]
            out.pop(node, None)
        return out

    def slow_pairs(self, blamed: AbstractSet[str] = frozenset()) -> list[GroupVerdict]:
        """The slow node pairs without ``blamed`` nodes, in order."""
        return [v for i in sorted(self.bad_pairs)
                if blamed.isdisjoint((v := self.values[i]).nodes)]

    def with_pending(self) -> list[tuple[GroupKey, GroupVerdict]]:
        """The groups with ops pending."""
        return [(self.keys[i], self.values[i]) for i in sorted(self.pending)]


def _mark(places: set[int], i: int, on: bool) -> None:
    if on:
        places.add(i)
    else:
        places.discard(i)


@dataclass
class LocalizeMemo:
    """What ``localize`` keeps across calls on a check's verdicts (``judge``'s cache): the
    verdicts' index, the NICs' weighing, and the ranks by node."""

    # The plan of the same check reads them too (``AdaptivePlanner``'s ``memo``): the
    # index keeps the groups with ops pending for it.
    index: VerdictIndex = field(default_factory=lambda: VerdictIndex(track_pending=True))
    nics: NicMemo = field(default_factory=NicMemo)
    ranks: tuple[list[RankInfo], dict[str, list[RankInfo]]] | None = None

    def ranks_of(self, ranks: Iterable[RankInfo] | None, nodes: set[str]) -> list[RankInfo]:
        """``ranks`` on ``nodes`` (the ranks are indexed by node once per list of them)."""
        listed = list(ranks or [])
        if self.ranks is None or not same_items(listed, self.ranks[0]):
            of_node: dict[str, list[RankInfo]] = defaultdict(list)
            for r in listed:
                of_node[r.node].append(r)
            self.ranks = (listed, dict(of_node))
        return [r for n in sorted(nodes) for r in self.ranks[1].get(n, ())]


def _lone_pairs(pairs: list[GroupVerdict], named: list[Finding],
                of_node: Mapping[str, list[GroupVerdict]]) -> list[Finding]:
    """A slow node pair neither of whose ends was measured with any other node: nothing can
    tell its NICs from the path between them, and the evidence is still a degraded link.
    It is named at the granularity it has, as the path, saying so; never silent
    (``of_node``: ``by_node(pairs)``)."""
    covered = {n for f in named for n in (f.node, *(f.nodes or ())) if n}
    out = []
    for v in pairs:
        if v.bad and not covered.intersection(v.nodes) and all(
                len(of_node[n]) == 1 for n in v.nodes):
            f = _finding("net_path_degraded", v, nodes=sorted(v.nodes, key=node_order))
            f.detail.update({"localized": "node_pair", "reason": (
                "neither end was measured with another node: its NICs and the path between "
                "them are not told apart")})
            out.append(f)
    return out


def _only(findings: list[Finding], wanted: set[str]) -> list[Finding]:
    if not wanted:
        return findings
    return [f for f in findings
            if (f.node is None or f.node in wanted) and set(f.nodes or ()) <= wanted]
