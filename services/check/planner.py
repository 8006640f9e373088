"""Plan probe rounds: which ranks form which groups, so that every round's groups are disjoint.

One adaptive plan serves a preflight and each monitoring cycle: intra-node groups of every
node at once; GPU pairs of suspect nodes beside a node-pair matching of the others (all
matchings for a small fleet, the ``rotation``-th for a large one); re-pairs; a world group;
where that is slow, the search for the slow path.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import TypeVar

from ringwatch.agents.groups import Group, group_nodes, member, node_order
from ringwatch.agents.matchings import circle_matching, circle_matchings
from ringwatch.agents.spec import GroupSpec, RankInfo
from ringwatch.services.analyzer.assess import spans_paths
from ringwatch.services.analyzer.evidence import Decision
from ringwatch.services.analyzer.localize import (
    GroupKey,
    GroupVerdict,
    LocalizeMemo,
    NicCase,
    NicMemo,
    VerdictIndex,
    nic_needs_more_partners,
    path_candidates,
)
from ringwatch.services.check.shape import ProbeShape
from ringwatch.services.config import CHECK_MAX_ROUNDS

T = TypeVar("T")
Nodes = dict[str, list[int]]
Verdicts = Mapping[GroupKey, GroupVerdict]

# Up to this many nodes the static plan tests every node pair (n - 1 matchings).
ALL_PAIRS_MAX = 8


def node_members(nodes: Nodes, names: Sequence[str]) -> list[str]:
    """All ranks of these nodes, node by node: a ring then crosses each node boundary once."""
    return [member(n, i) for n in names for i in nodes[n]]


def intra_round(nodes: Nodes, shape: ProbeShape) -> list[GroupSpec]:
    """Every node's own ranks at once; a node with a single rank has no intra-node link."""
    return [shape.group("intra_node", node_members(nodes, [n]))
            for n in sorted(nodes) if len(nodes[n]) >= 2]


def pair_group(nodes: Nodes, a: str, b: str, shape: ProbeShape,
               ops: tuple[str, ...] | None = None) -> GroupSpec:
    first, second = sorted((a, b))
    return shape.group("inter_node", node_members(nodes, [first, second]), ops)


def world_group(nodes: Nodes, names: Sequence[str], shape: ProbeShape) -> GroupSpec:
    return shape.group("world", node_members(nodes, sorted(names)))


# --- the adaptive plan -------------------------------------------------------------------

# A region of node pairs the path search still suspects: every pair inside ``a``
# ("within"), or every pair with one node in ``a`` and one in ``b`` ("across").
Region = tuple[str, tuple[str, ...], tuple[str, ...]]
# How many times one node is re-paired in a phase (re-pair, then confirm).
MAX_REPAIRS_PER_NODE = 4
# Re-pairs go on beside other nodes' repeats once at most this share of the nodes has a
# group undecided: a tail of stragglers. While more are undecided (a small fleet dense
# with faults) they wait, so that partners are chosen on everything the round can tell.
STRAGGLER_SHARE = 0.1
# Readings of a node's ring after which an undecided ring is followed up by its GPU pairs
# rather than measured again (``_ring_done``).
RING_REPEATS = 4
# ...once it leans slow by this much (odds of about 3 to 1; a lead is ``follow_up_llr``).
RING_LEAN = 1.0
# A check's round cap (the budget's, RINGWATCH_CHECK_MAX_ROUNDS): with every group decided
# in at most ``Weighing.max_repeats`` measurements a plan ends well before it.
MAX_ROUNDS = CHECK_MAX_ROUNDS


def split(items: Sequence[T], parts: int) -> list[list[T]]:
    """Near-equal consecutive parts (no empty ones)."""
    k = min(parts, len(items))
    size, extra = divmod(len(items), k)
    out, start = [], 0
    for i in range(k):
        end = start + size + (1 if i < extra else 0)
        out.append(list(items[start:end]))
        start = end
    return out


@dataclass
class SearchStep:
    """Unions of node sets to test, and which unions cover each smaller region.

    A region stays a suspect while most of the unions covering it are (``kept``): a
    region across two parts has one, which decides; one within a part has three, and one
    of them cleared by an unlucky draw of the noise does not prune it. Those regions are
    the next steps. Two-node unions end the search at a node pair.
    """

    unions: list[tuple[str, ...]]
    covers: list[tuple[Region, list[int]]]


def separated_split(items: Sequence[str], parts: int,
                    known: set[frozenset[str]]) -> list[tuple[str, ...]]:
    """``split``, then swap nodes so that no known slow pair sits inside one part: a union
    holding both ends of a known pair would be slow for a reason already known."""
    out = split(list(items), parts)
    ends = {n for pair in known for n in pair}
    # In a fixed order: the same results must give the same plan in every process (a set's
    # order follows string hashing, which differs between processes).
    for pair in sorted(known, key=sorted):
        x, y = sorted(pair)
        home = next((p for p in out if x in p and y in p), None)
        if home is None:
            continue
        for other in out:
            if other is home or any(frozenset((y, z)) in known for z in other):
                continue
            spare = next((z for z in other if z not in ends), None)
            if spare is not None:
                home[home.index(y)], other[other.index(spare)] = spare, y
                break
    return [tuple(p) for p in out]


def kept(slow: Sequence[bool]) -> bool:
    """Whether a region stays a suspect, from the unions covering it: while more than half
    of them are not cleared. Each union holding a slow pair is cleared now and then by the
    noise (its test's miss rate); a region within a part, which three unions cover, is
    lost only when two of them are, where requiring all three lost it when any one was.
    A region across two parts has one union, which decides alone."""
    return 2 * sum(slow) > len(slow)


def search_step(region: Region, known: set[frozenset[str]] | None = None) -> SearchStep:
    """Split a region: within C into four parts and the six unions of two of them (every
    pair of C lies in one union); across C x D into halves and the four cross unions.
    ``known`` slow pairs are kept apart by the split where possible."""
    known = known or set()
    kind, a, b = region
    if kind == "within":
        if len(a) <= 3:
            pairs = [(x, y) for i, x in enumerate(a) for y in a[i + 1:]]
            return SearchStep([tuple(sorted(p)) for p in pairs], [])
        parts = separated_split(a, 4, known)
        unions: list[tuple[str, ...]] = []
        covers: list[tuple[Region, list[int]]] = []
        index: dict[tuple[int, int], int] = {}
        # Order unions so consecutive ones are disjoint and pack two to a round.
        for i, j in ((0, 1), (2, 3), (0, 2), (1, 3), (0, 3), (1, 2)):
            index[(i, j)] = len(unions)
            unions.append(tuple(sorted(parts[i] + parts[j])))
        for i, p in enumerate(parts):
            if len(p) >= 2:
                covers.append((("within", p, ()), [u for (x, y), u in index.items() if i in (x, y)]))
        for (i, j), u in index.items():
            covers.append((("across", parts[i], parts[j]), [u]))
        return SearchStep(unions, covers)
    if len(a) == 1 and len(b) == 1:
        return SearchStep([tuple(sorted(a + b))], [])
    ca = separated_split(a, 2, known)
    cb = separated_split(b, 2, known)
    cells = [(i, j) for i in range(len(ca)) for j in range(len(cb))]
    # (0,0) with (1,1), then (0,1) with (1,0): disjoint unions share a round.
    cells.sort(key=lambda c: (c[0] != c[1], c))
    cross = [tuple(sorted(ca[i] + cb[j])) for i, j in cells]
    return SearchStep(cross, [(("across", ca[i], cb[j]), [k]) for k, (i, j) in enumerate(cells)])


def pack(groups: Sequence[GroupSpec]) -> tuple[list[GroupSpec], list[GroupSpec]]:
    """Greedy first fit: the groups that can share one round (no rank twice), and the rest."""
    used: set[str] = set()
    now, later = [], []
    for g in groups:
        if used.isdisjoint(g.members):
            used.update(g.members)
            now.append(g)
        else:
            later.append(g)
    return now, later


def gpu_pair_rounds(nodes: Nodes, suspects: Sequence[str], shape: ProbeShape) -> list[list[GroupSpec]]:
    """Perfect matchings of each suspect node's GPUs, all suspect nodes side by side:
    g - 1 rounds (g even) test every GPU pair of every suspect node."""
    per_node = {n: circle_matchings(nodes[n]) for n in suspects if len(nodes[n]) >= 3}
    depth = max((len(r) for r in per_node.values()), default=0)
    rounds = []
    for k in range(depth):
        rounds.append([shape.group("gpu_pair", [member(n, a), member(n, b)])
                       for n, r in sorted(per_node.items()) if k < len(r) for a, b in r[k]])
    return rounds


@dataclass
class _Issued:
    """A suspect region; its step is split only once nothing it depends on is pending."""

    region: Region
    step: SearchStep | None = None
    issued: set[int] = field(default_factory=set)

    @property
    def done(self) -> bool:
        return self.step is not None and len(self.issued) == len(self.step.unions)


class AdaptivePlanner:
    """Preflight's plan, one round at a time, from the group verdicts so far.

    intra-node round -> GPU-pair matchings on suspect nodes (with one node-pair matching
    of the other nodes) -> re-pair rounds: suspects with proven-good nodes, slow pairs of
    two good nodes re-tested -> one world group -> if that is slow, the path search
    (``search_step``) -> re-tests of what the search found. docs/analysis.md gives the
    round count: O(g) + O(1) + O(log N) per slow path.
    """

    def __init__(self, nodes: Nodes, shape: ProbeShape, *, max_rounds: int = MAX_ROUNDS,
                 rotation: int = 0, fleet: Sequence[str | None] | None = None,
                 memo: LocalizeMemo | None = None) -> None:
        self.nodes = nodes
        # Which node-pair matching of the round-robin tournament a large fleet gets: a
        # monitor advances it every cycle, so every pair of nodes meets in turn.
        self.rotation = rotation
        # The seats the tournament is drawn over, in order: the whole fleet, busy nodes too
        # (None: a vacant seat), so a pair's turn does not move as jobs come and go, nor as
        # nodes join and leave (agents.matchings.reconcile_slots; None: the nodes probed).
        self.fleet = list(fleet) if fleet is not None else None
        self.shape = shape
        largest = (max(shape.sizes),)
        self.pair_shape = ProbeShape(("allreduce",), largest, shape.dtype, shape.warmup,
                                     shape.iters, shape.deadline_s)
        self.union_shape = ProbeShape(("alltoall",), largest, shape.dtype, shape.warmup,
                                      shape.iters, shape.deadline_s)
        self.repeat_sizes = largest
        self.max_rounds = max_rounds
        self.rounds = 0
        self.phase = "intra"
        self.pair_rounds: list[list[GroupSpec]] = []
        self.matching_rounds: list[list[GroupSpec]] = []
        # Re-pairs per node in the current phase.
        self.repaired: dict[str, int] = defaultdict(int)
        # Nodes paired by the fallback for fleets with no proven node (once each), and
        # every node pair issued so far (the fallback never repeats one).
        self.lonely_paired: set[str] = set()
        self.issued_pairs: set[frozenset[str]] = set()
        self.world: GroupSpec | None = None
        # The world group's two halves, measured in the round after each of its readings:
        # a union is held to where its healthy peers read (``localize.UnionLevels``), and
        # the world's are its halves. They are the first two unions the search would
        # measure (``search_step``), which does not measure them again.
        self.halves: list[tuple[str, ...]] = []
        self.halves_due = False
        self.halves_measured = False
        self.active: list[_Issued] = []
        self.search_started = False
        # The world group was slow (or undecided) and the path search ran.
        self.searched = False
        # What the plan reads of the verdicts, taken in as they change (``update``d where it
        # is read: a cheap pass in C when the judgement took them in already), and
        # each NIC weighed over its node pairs (``_node_pairs``): ``memo``'s, where the
        # judgement keeps them too (a check's), so that both bring them up to date once.
        self.index = memo.index if memo is not None else VerdictIndex(track_pending=True)
        self.nic_memo = memo.nics if memo is not None else NicMemo()
        # The search's unions as groups, made once each: a lead asks for its unions' groups
        # every round, and a large union's members run to tens of thousands; and each
        # node's member names, made once for all of them.
        self.union_groups: dict[tuple[str, ...], GroupSpec] = {}
        self.union_keys: dict[tuple[str, ...], GroupKey] = {}
        self.member_names: dict[str, list[str]] = {}

    def next_round(self, verdicts: Verdicts, blamed: set[str]) -> list[GroupSpec]:
        """The next round's groups; empty when preflight is done."""
        if self.rounds >= self.max_rounds:
            return []
        groups = self._plan(verdicts, blamed)
        if groups:
            self.rounds += 1
        return groups

    def _plan(self, v: Verdicts, blamed: set[str]) -> list[GroupSpec]:
        # Every decision is made before the plan moves on: a group its test has not yet
        # decided is measured again (only the undecided ops, at the judged size), so no
        # step prunes, pairs or blames on one unlucky measurement.
        repeats = self._repeats(v, blamed)
        if self.phase == "repair" and (self.pair_rounds or self.matching_rounds):
            # Rounds planned ahead (GPU-pair and node-pair matchings) wait on no decision
            # of the rounds before them: they go on, and repeats fill the ranks left free.
            planned = ((self.pair_rounds.pop(0) if self.pair_rounds else [])
                       + (self.matching_rounds.pop(0) if self.matching_rounds else []))
            return pack(planned + repeats)[0]
        if self.halves_due:
            # The halves go in the round after a reading of the world group (before its
            # repeats) while it is undecided: the first time always.
            self.halves_due = False
            world = v.get((self.world.scope, self.world.group)) if self.world else None
            if not self.halves_measured or (world is not None and world.pending_ops):
                self.halves_measured = True
                return pack([self._union_group(u) for u in self.halves] + repeats)[0]
        if repeats and self.phase in ("repair", "search"):
            busy = {n for g in repeats for n in group_nodes(g.members)}
            if self.phase == "search":
                # The search goes on beside its repeats: a lead waits only for its own
                # unions (``_advance``), not for another's, and each new union keeps off
                # the nodes measured again this round.
                pending = {(g.scope, g.group) for g in repeats}
                out = pack(repeats + self._search(v, blamed, pending, busy))[0]
                if (not self.search_started and self.world is not None and self.halves
                        and any(g.scope == "world" for g in out)):
                    # The halves are measured as often as the world group: held to them,
                    # it is held to no more than they are known to within.
                    self.halves_due = True
                return out
            if len(busy) <= STRAGGLER_SHARE * len(self.nodes):
                # Only a tail of groups is left undecided (in a large fleet, a few measured
                # to their cap): the other nodes' re-pairs go on beside it instead of
                # waiting up to ``max_repeats`` rounds for it, each time.
                return pack(repeats + self._repair(v, blamed, busy))[0]
        if repeats:
            return pack(repeats)[0]
        if self.phase == "intra":
            self.phase = "pairs"
            groups = intra_round(self.nodes, self.shape)
            if groups:
                return groups
        if self.phase == "pairs":
            self.phase = "repair"
            groups = self._first_pairs(v, blamed)
            if groups:
                return groups
        if self.phase == "repair":
            groups = self._repair(v, blamed)
            if groups:
                return groups
            self.phase = "world"
        if self.phase == "world":
            self.phase = "search"
            # Nodes whose NIC is proven: a weak NIC not yet blamed slows every union it is
            # in, and the search would chase it as a slow path through every region (a
            # path is only ever named between two proven ends anyway). Where no node is
            # proven (a small fleet whose pairs are all in doubt), every live node.
            live = [n for n in sorted(self.nodes) if n not in blamed]
            proven = self._proven(v, blamed)
            if len(proven) >= 3:
                live = [n for n in live if n in proven]
            if len(live) >= 3:
                self.world = world_group(self.nodes, live, self.shape)
                # (A fleet small enough to meet every node pair has no use for them.)
                if len(live) > ALL_PAIRS_MAX:
                    step = search_step(("within", tuple(live), ()), self._known())
                    self.halves = [u for u in step.unions[:2]
                                   if spans_paths("inter_node", len(u))]
                self.halves_due = bool(self.halves)
                return [self.world]
        if self.phase == "search":
            groups = self._search(v, blamed)
            if groups:
                return groups
            # What the search found gets its own re-pair rounds; a fleet whose world group
            # was cleared has nothing new to confirm (its NICs had their re-pair rounds).
            self.phase = "confirm"
            self.repaired.clear()
        if self.phase == "confirm":
            groups = self._repair(v, blamed) if self.searched else []
            if groups:
                return groups
            self.phase = "done"
        return []

    def _repeats(self, v: Verdicts, blamed: set[str]) -> list[GroupSpec]:
        """Every group not yet decided, for its undecided ops at the judged size; and a
        node pair that may name a path, decided slow on one op, for its others: a path is
        named only when its ops are slow together."""
        pending = []
        self.index.update(v)
        paths = self._path_candidates(v, blamed)
        # Only the groups with something to measure (``index``): walking and sorting every
        # group of a large fleet after every round cost more than the rest of the plan.
        listed = dict(self.index.with_pending())
        listed.update((key, v[key]) for key in paths)
        for (scope, members), x in sorted(listed.items()):
            ops = x.pending_ops
            if not ops and (scope, members) in paths:
                ops = tuple(op for op, d in sorted(x.decisions.items()) if d.pending)
            if ops and _only_steers(x) and (all(_leads(x, x.decisions[op]) for op in ops)
                                            or _ring_done(x, ops)):
                # Nothing is concluded from this group but where to look next, and what is
                # not cleared is looked into anyway: once it clearly leans slow, its
                # narrower tests (GPU pairs, the search's smaller unions) run instead of its
                # repeats.
                continue
            # A blamed node's groups are not measured on, except one whose slow decision
            # is the provisional one the blame rests on: it is measured again first.
            if ops and (blamed.isdisjoint(x.nodes) or x.provisional):
                pending.append(GroupSpec(scope=scope, members=members.members, ops=ops,
                                         sizes=self.repeat_sizes, dtype=self.shape.dtype,
                                         warmup=self.shape.warmup, iters=self.shape.iters,
                                         deadline_s=self.shape.deadline_s,
                                         redop=self.shape.redop))
        return pending

    def _path_candidates(self, v: Verdicts, blamed: set[str]) -> set[GroupKey]:
        """Slow node pairs with an op still undecided that the path rule could name
        (``localize.path_candidates``)."""
        slow = self.index.slow_pairs(blamed)
        if not any(any(d.pending for d in x.decisions.values()) for x in slow):
            return set()
        return {x.key for x in path_candidates(slow, self.index.by_node(blamed))
                if any(d.pending for d in x.decisions.values())}

    def _first_pairs(self, v: Verdicts, blamed: set[str]) -> list[GroupSpec]:
        """GPU-pair round 1 on suspect nodes, beside one node-pair matching of the rest."""
        # Blamed or not, a slow intra-node group gets its GPU pairs tested: that is
        # what names the pair (or shows the intra-node result was noise).
        suspects = [n for n in sorted(self.nodes)
                    if _suspect(v, "intra_node", node_members(self.nodes, [n]))]
        self.pair_rounds = gpu_pair_rounds(self.nodes, suspects, self.pair_shape)
        others = [n for n in sorted(self.nodes) if n not in blamed and n not in suspects]
        # A small fleet meets every pair (at most 7 rounds): one matching alone would leave
        # a lone node-pair group with no peers to be judged against. A large one gets the
        # ``rotation``-th matching of the tournament.
        if len(others) <= ALL_PAIRS_MAX:
            matchings = circle_matchings(others)
        else:
            matchings = [rotation_matching(others, self.rotation, self.fleet)]
        self.matching_rounds = [[pair_group(self.nodes, a, b, self.shape) for a, b in pairs]
                                for pairs in matchings]
        self.issued_pairs |= {frozenset(p) for pairs in matchings for p in pairs}
        first = self.matching_rounds.pop(0) if self.matching_rounds else []
        return (self.pair_rounds.pop(0) if self.pair_rounds else []) + first

    def _repair(self, v: Verdicts, blamed: set[str],
                busy: AbstractSet[str] = frozenset()) -> list[GroupSpec]:
        """Re-pair nodes that have no good node-pair result with nodes proven good (each
        node at most ``MAX_REPAIRS_PER_NODE`` times in a phase): a NIC is slow with every
        partner, a path only between its two ends. ``busy``: nodes with a group still
        being measured, neither re-paired nor partners this round."""
        live, results, nics, proven = self._node_pairs(v, blamed)
        used: set[str] = set(busy)
        groups = []
        # The proven nodes not yet taken, in order: ``taken`` and ``head`` stand in for
        # removing each partner from the list, which made a round over thousands of
        # nodes quadratic.
        free = [p for p in sorted(proven) if p not in used]
        taken: set[str] = set()
        head = 0
        lonely = []
        for n in sorted(live):
            if (n in proven or n in used or self.repaired[n] >= MAX_REPAIRS_PER_NODE
                    or not nic_needs_more_partners(n, results[n], proven, nics.get(n))):
                continue
            while head < len(free) and free[head] in taken:
                head += 1
            met = {x for g in results[n] for x in g.nodes}
            partner = next((p for i in range(head, len(free)) if (p := free[i]) not in taken
                            and p != n and p not in met), None)
            if partner is not None:
                taken.add(partner)
                used |= {n, partner}
                self.repaired[n] += 1
                groups.append(pair_group(self.nodes, n, partner, self.shape))
            elif not results[n] and n not in self.lonely_paired:
                lonely.append(n)
        # Nobody proven good yet (a small fleet whose intra-node results were all suspect):
        # nodes with no node-pair result at all meet each other, so the network is probed.
        while len(lonely) >= 2:
            a = lonely.pop(0)
            fresh = [x for x in lonely if frozenset((a, x)) not in self.issued_pairs]
            if not fresh:
                continue
            b = fresh[0]
            lonely.remove(b)
            used |= {a, b}
            self.lonely_paired |= {a, b}
            groups.append(pair_group(self.nodes, a, b, self.shape))
        self.issued_pairs |= {group_nodes(g.members) for g in groups}
        return groups

    def _node_pairs(self, v: Verdicts, blamed: set[str]
                    ) -> tuple[set[str], dict[str, list[GroupVerdict]], dict[str, NicCase],
                               set[str]]:
        """The live nodes, their node-pair groups by node (``index``: the verdicts' own
        nodes are the plan's), each NIC weighed over its partners (``localize.weigh_nics``)
        and the nodes proven by them (``localize.proven_nodes``)."""
        live = set(self.nodes) - blamed
        self.index.update(v)
        paired = self.index.by_node(blamed)
        results: dict[str, list[GroupVerdict]] = {n: [] for n in live}
        results.update(paired)
        self.nic_memo.update(paired, self.index.nic_hint(self.nic_memo, blamed))
        return live, results, dict(self.nic_memo.nics), set(self.nic_memo.proven)

    def _proven(self, v: Verdicts, blamed: set[str]) -> set[str]:
        return self._node_pairs(v, blamed)[3]

    def _search(self, v: Verdicts, blamed: set[str], pending: AbstractSet[GroupKey] = frozenset(),
                busy: AbstractSet[str] = frozenset()) -> list[GroupSpec]:
        """The search's next unions. ``pending``: groups still being measured (a lead
        whose unions are among them waits); ``busy``: their nodes, which no new union
        takes this round."""
        if self.world is None:
            return []
        self.index.update(v)
        if not self.search_started:
            gate = [(self.world.scope, self.world.group), *map(self._union_key, self.halves)]
            if self.halves_due or any(key in pending for key in gate):
                return []
            self.search_started = True
            if not any((gv := v.get(key)) is not None and gv.suspect for key in gate):
                return []
            self.searched = True
            live = tuple(sorted(group_nodes(self.world.members)))
            first = _Issued(("within", live, ()))
            first.step = search_step(first.region, self._known())
            # The halves measured beside the world group are the step's first unions
            # where the split is the same: not measured again.
            first.issued = {i for i, u in enumerate(first.step.unions)
                            if u in self.halves and self._union_key(u) in v}
            self.active = [first]
        leads = [x for item in self.active if (x := _without(item, blamed)) is not None]
        self.active = [a for item in leads for a in self._advance(item, v, pending)]
        known = self._known()
        for item in self.active:
            if item.step is None and not self._waits(item):
                item.step = search_step(item.region, known)
        return self._issue(busy)

    def _known(self) -> set[frozenset[str]]:
        """The node pairs known slow so far: a search's split keeps their ends apart."""
        return {frozenset(x.nodes) for x in self.index.slow_pairs()}

    def _waits(self, item: _Issued) -> bool:
        """An across region waits for pending smaller regions that could hold a slow pair
        with both ends among its nodes (within ones, and across ones closer to a pair):
        such a pair makes every union of it holding both ends slow until it is known, and
        then its split keeps them apart. It also waits for an earlier one of its size that
        could: a half slow with both halves of the other side is most often one slow NIC,
        which would lead every such region down to a pair with it, one after another; the
        first finds it, and once it is blamed the others go on without it (``_without``).
        A region that shares only one side's nodes with it holds no pair of its nodes: a
        region across P and Q does not wait for one across P and R, nor for what that one
        is split into (it waited for those before, and the search ran one after another)."""
        kind, a, b = item.region
        if kind != "across":
            return False
        mine = set(a) | set(b)
        before = True
        for o in self.active:
            if o is item:
                before = False
                continue
            if not _could_hold_pair(o.region, mine):
                continue
            theirs = _region_size(o.region)
            if o.region[0] == "within" or theirs < len(mine):
                return True
            if before and o.region[0] == "across" and theirs == len(mine):
                return True
        return False

    def _advance(self, item: _Issued, v: Verdicts, pending: AbstractSet[GroupKey]
                 ) -> list[_Issued]:
        """A step whose unions have all run and been decided (none still ``pending``)
        becomes its still-suspect regions."""
        if not item.done or item.step is None:
            return [item]
        keys = [self._union_key(u) for u in item.step.unions]
        if any(key in pending for key in keys):
            return [item]
        # Not cleared is enough to keep a region: pruning a slow pair away loses it for good.
        slow = [(x := v.get(key)) is not None and x.suspect for key in keys]
        return [_Issued(region) for region, idx in item.step.covers
                if kept([slow[i] for i in idx])]

    def _issue(self, busy: AbstractSet[str] = frozenset()) -> list[GroupSpec]:
        used: set[str] = set(busy)
        groups = []
        for item in self.active:
            if item.step is None:
                continue
            for k, union in enumerate(item.step.unions):
                if k in item.issued or not used.isdisjoint(union):
                    continue
                used.update(union)
                item.issued.add(k)
                groups.append(self._union_group(union))
        return groups

    def _union_group(self, union: tuple[str, ...]) -> GroupSpec:
        g = self.union_groups.get(union)
        if g is None:
            g = self.union_groups[union] = (
                pair_group(self.nodes, union[0], union[1], self.shape) if len(union) == 2
                else self.union_shape.group("inter_node", self._members(union)))
        return g

    def _union_key(self, union: tuple[str, ...]) -> GroupKey:
        """The union's group as verdicts are found under it (``GroupSpec.group`` sorts its
        members again at every call)."""
        key = self.union_keys.get(union)
        if key is None:
            g = self._union_group(union)
            key = self.union_keys[union] = (g.scope, g.group)
        return key

    def _members(self, names: Sequence[str]) -> list[str]:
        """``node_members`` of ``names``, from each node's names made once."""
        out: list[str] = []
        for n in names:
            names_of = self.member_names.get(n)
            if names_of is None:
                names_of = self.member_names[n] = node_members(self.nodes, [n])
            out += names_of
        return out


def _leads(x: GroupVerdict, d: Decision) -> bool:
    """``x`` (a group that only steers) leans slow clearly enough to follow up on ``d``. An
    intra-node group on more than one reading: one low reading under noise is no lead, and
    following it costs its node all the GPU-pair rounds."""
    return d.llr >= x.weighing.follow_up_llr and (
        x.scope != "intra_node" or d.repeats >= x.weighing.confirm_repeats)


def _ring_done(x: GroupVerdict, ops: tuple[str, ...]) -> bool:
    """A node's ring that ``RING_REPEATS`` readings leave undecided, leaning slow by
    ``RING_LEAN``, is not
    measured again: it runs at the slowest of its GPU pairs, so one sitting a little low
    for good neither clears nor leans slow by ``follow_up_llr``, and under noise of several
    percent it was measured up to ``max_repeats`` times, every round of it a round of the
    whole fleet's rings. Its GPU pairs are tested instead (it stays a suspect), and they
    name a link or clear it. One leaning healthy is measured on: following every such ring
    up tested the GPU pairs of 177 of a fault-free 309-node fleet's nodes at 7 % noise,
    four times the CPU of its check."""
    return x.scope == "intra_node" and all(
        x.decisions[op].repeats >= RING_REPEATS and x.decisions[op].llr >= RING_LEAN for op in ops)


def _only_steers(x: GroupVerdict) -> bool:
    """A group whose verdict only steers what is probed next: the world group and the
    search's unions (a path is named from node pairs), an intra-node group of three or more
    ranks (an NVLink from its GPU pairs)."""
    return x.prunes or (x.scope == "intra_node" and len(x.members) > 2)


def _without(item: _Issued, blamed: set[str]) -> _Issued | None:
    """A lead without the nodes blamed since it was split: a slow NIC slows every union it
    is in, and a path is named only between two proven ends. Its step is split again; a
    region left without a node pair is dropped."""
    kind, a, b = item.region
    if blamed.isdisjoint(a) and blamed.isdisjoint(b):
        return item
    a = tuple(n for n in a if n not in blamed)
    b = tuple(n for n in b if n not in blamed)
    if (kind == "within" and len(a) < 2) or (kind == "across" and not (a and b)):
        return None
    return _Issued((kind, a, b))


def _region_size(region: Region) -> int:
    """A region's node count: its two sides never share a node (``search_step``)."""
    return len(region[1]) + len(region[2])


def _could_hold_pair(region: Region, nodes: AbstractSet[str]) -> bool:
    """Whether a node pair ``region`` suspects could have both its ends among ``nodes``."""
    kind, a, b = region
    if kind == "within":
        inside = (n for n in a if n in nodes)
        return next(inside, None) is not None and next(inside, None) is not None
    return not nodes.isdisjoint(a) and not nodes.isdisjoint(b)


def _suspect(v: Verdicts, scope: str, members: Sequence[str]) -> bool:
    x = v.get((scope, Group(members)))
    return x is not None and x.suspect


def layout_of(ranks: Sequence[RankInfo], only: Sequence[str] | None) -> dict[str, list[int]]:
    """node -> sorted local indices, limited to ``only`` where given."""
    wanted = set(only) if only is not None else None
    out: dict[str, list[int]] = {}
    for r in ranks:
        if wanted is None or r.node in wanted:
            out.setdefault(r.node, []).append(r.local_index)
    return {n: sorted(ix) for n, ix in sorted(out.items())}


def rotation_matching(nodes: Sequence[str], rotation: int,
                      fleet: Sequence[str | None] | None = None) -> list[tuple[str, str]]:
    """The ``rotation``-th node-pair matching among ``nodes``, drawn from the tournament of
    ``fleet`` (the whole fleet, busy nodes too) so that a pair's turn stays where it is as
    jobs come and go: its pairs of two ``nodes``, then the ``nodes`` whose partner is
    busy (or left out) paired among themselves by the same rotation. Each cycle then still
    probes every node it may; every pair of nodes idle at its turn meets once a tournament."""
    if fleet is None:
        return circle_matching(list(nodes), rotation)
    here = set(nodes)
    kept = [(a, b) for a, b in circle_matching(list(fleet), rotation)
            if a in here and b in here]
    paired = {n for p in kept for n in p}
    left = [n for n in fleet if n in here and n not in paired]
    left += sorted(here - {n for n in fleet if n is not None} - paired, key=node_order)
    return kept + circle_matching(left, rotation)
