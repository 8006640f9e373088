"""Planner: matchings cover every pair, and no rank is in two groups of one round."""

from __future__ import annotations

from itertools import combinations

from hypothesis import given, settings
from hypothesis import strategies as st

from ringwatch.agents.groups import Group, nodes_of
from ringwatch.agents.matchings import circle_matching
from ringwatch.services.analyzer.evidence import Weighing
from ringwatch.services.check.planner import (
    ALL_PAIRS_MAX,
    AdaptivePlanner,
    _Issued,
    circle_matchings,
    kept,
    split,
)
from ringwatch.services.check.shape import ProbeShape

# Readings a union (the world group included) is cleared on at least.
CLEAR = Weighing().confirm_clear
# The world group, the search's only gate, is cleared on one reading more.
WORLD_CLEAR = CLEAR + 1


def matching_count(n: int) -> int:
    """How many matchings a round-robin tournament of ``n`` items has."""
    return 0 if n < 2 else n - 1 if n % 2 == 0 else n


def layout(n_nodes: int, gpus: int) -> dict[str, list[int]]:
    return {f"node-{i:03d}": list(range(gpus)) for i in range(n_nodes)}


def assert_disjoint(rounds):
    for groups in rounds:
        seen: set[str] = set()
        for g in groups:
            assert not seen.intersection(g.members)
            seen.update(g.members)


@given(st.integers(0, 40))
def test_circle_matchings_cover_every_pair_once(n):
    rounds = circle_matchings(list(range(n)))
    assert len(rounds) == (0 if n < 2 else n - 1 if n % 2 == 0 else n)
    met = [frozenset(p) for r in rounds for p in r]
    assert len(met) == len(set(met)) == n * (n - 1) // 2
    for r in rounds:
        flat = [x for p in r for x in p]
        assert len(flat) == len(set(flat))


@given(st.integers(0, 40), st.integers(0, 100))
def test_the_kth_matching_is_the_tournaments_kth(n, k):
    rounds = circle_matchings(list(range(n)))
    got = circle_matching(list(range(n)), k)
    assert got == (rounds[k % len(rounds)] if rounds else [])
    assert matching_count(n) == len(rounds)


def healthy_plan(nodes, rotation=0, **shape):
    """Every round the adaptive plan asks for when every result comes back healthy."""
    from ringwatch.agents.spec import Measurement
    from ringwatch.services.analyzer.assess import Thresholds, assess
    from ringwatch.services.analyzer.localize import group_verdicts

    planner = AdaptivePlanner(nodes, ProbeShape(**shape), rotation=rotation)
    rounds, ms, verdicts = [], [], {}
    while groups := planner.next_round(verdicts, set()):
        rounds.append(groups)
        ms += [Measurement(op=op, scope=g.scope, members=list(g.members),
                           size_bytes=max(g.sizes), dtype="float32", warmup=1, iters=1,
                           time_us=1.0, algbw_gbs=10.0, busbw_gbs=10.0, wrong=0)
               for g in groups for op in g.ops]
        verdicts = group_verdicts(assess(ms, Thresholds(), expected=lambda m: 10.0))
    return rounds


@settings(max_examples=60)
@given(st.integers(1, 30), st.integers(1, 4))
def test_healthy_plan_is_disjoint_and_scoped(n_nodes, gpus):
    rounds = healthy_plan(layout(n_nodes, gpus), sizes=(1 << 20,))
    assert_disjoint(rounds)
    intra = [g for r in rounds for g in r if g.scope == "intra_node"]
    assert len(intra) == (n_nodes if gpus >= 2 else 0)
    worlds = [i for i, r in enumerate(rounds) for g in r if g.scope == "world"]
    # Cleared, the world group takes every path out of the search: never on two readings.
    assert len(worlds) == (WORLD_CLEAR if n_nodes >= 3 else 0)
    # Beside node pairs, the world group's two halves in the round after each of its
    # readings, where the fleet is too large to meet every node pair.
    live = tuple(sorted(nodes_of(rounds[worlds[0]][0].members))) if worlds else ()
    halves = {frozenset(u) for u in search_step(("within", live, ())).unions[:2]} if live else set()
    for i, r in enumerate(rounds):
        for g in (g for g in r if g.scope == "inter_node"):
            if len(nodes_of(g.members)) == 2:
                assert g.world_size == 2 * gpus
            else:
                assert n_nodes > ALL_PAIRS_MAX and i > worlds[0]
                assert frozenset(nodes_of(g.members)) in halves


@settings(max_examples=30)
@given(st.integers(2, ALL_PAIRS_MAX))
def test_small_fleet_plan_tests_every_node_pair(n_nodes):
    rounds = healthy_plan(layout(n_nodes, 2))
    tested = {frozenset(nodes_of(g.members)) for r in rounds for g in r if g.scope == "inter_node"}
    assert tested == {frozenset(p) for p in combinations(layout(n_nodes, 2), 2)}
    assert len(rounds) <= 1 + n_nodes + WORLD_CLEAR


@settings(max_examples=10, deadline=None)
@given(st.integers(ALL_PAIRS_MAX + 1, 24))
def test_large_fleet_meets_every_pair_over_a_tournament_of_cycles(n_nodes):
    """One matching per cycle, advanced by the rotation: after n - 1 cycles (n for odd n)
    every node pair has been probed once, so a slow path anywhere is eventually seen."""
    nodes = layout(n_nodes, 2)
    seen: set[frozenset[str]] = set()
    for rotation in range(matching_count(n_nodes)):
        rounds = healthy_plan(nodes, rotation)
        pairs = [frozenset(nodes_of(g.members)) for r in rounds for g in r
                 if g.scope == "inter_node" and len(nodes_of(g.members)) == 2]
        # One matching per cycle; with an odd count the node sitting out is re-paired with
        # a proven one, so every node has network evidence every cycle.
        assert len(pairs) == (n_nodes + 1) // 2
        assert set().union(*pairs) == set(nodes)
        seen |= set(pairs)
    assert len(seen) == n_nodes * (n_nodes - 1) // 2


def test_plan_passes_probe_settings_through():
    g = healthy_plan(layout(3, 2), ops=("alltoall",), sizes=(8,), dtype="bfloat16", warmup=1,
                     iters=2)[0][0]
    assert (g.ops, g.sizes, g.dtype, g.warmup, g.iters) == (("alltoall",), (8,), "bfloat16", 1, 2)


# --- the adaptive preflight plan ----------------------------------------------------------

import math  # noqa: E402

from ringwatch.agents.spec import Measurement  # noqa: E402
from ringwatch.services.analyzer.assess import Assessment  # noqa: E402
from ringwatch.services.analyzer.localize import GroupVerdict  # noqa: E402
from ringwatch.services.check.planner import (  # noqa: E402
    gpu_pair_rounds,
    pack,
    search_step,
)


@given(st.integers(1, 200), st.integers(1, 6))
def test_split_is_near_equal_and_complete(n, parts):
    out = split(list(range(n)), parts)
    assert [x for p in out for x in p] == list(range(n))
    assert max(map(len, out)) - min(map(len, out)) <= 1 and all(out)


def _pairs_in(unions):
    return {frozenset(p) for u in unions for p in combinations(u, 2)}


@given(st.integers(2, 80), st.integers(0, 79))
def test_within_step_unions_cover_every_pair(n, cut):
    names = tuple(f"node-{i:03d}" for i in range(n))
    step = search_step(("within", names, ()))
    assert _pairs_in(step.unions) >= {frozenset(p) for p in combinations(names, 2)}
    # A pair lies in a region whose covering unions all contain it.
    for region, idx in step.covers:
        kind, a, b = region
        inside = combinations(a, 2) if kind == "within" else ((x, y) for x in a for y in b)
        for p in inside:
            assert all(set(p) <= set(step.unions[i]) for i in idx)


@given(st.integers(1, 40), st.integers(1, 40))
def test_across_step_halves_both_sides(na, nb):
    a = tuple(f"a{i}" for i in range(na))
    b = tuple(f"b{i}" for i in range(nb))
    step = search_step(("across", a, b))
    assert _pairs_in(step.unions) >= {frozenset((x, y)) for x in a for y in b}
    for (_, ca, cb), _ in step.covers:
        assert len(ca) <= math.ceil(na / 2) and len(cb) <= math.ceil(nb / 2)


@given(st.integers(1, 6), st.integers(2, 9))
def test_gpu_pair_rounds_cover_every_pair_of_every_suspect(n_nodes, gpus):
    nodes = layout(n_nodes, gpus)
    rounds = gpu_pair_rounds(nodes, sorted(nodes), ProbeShape())
    assert_disjoint(rounds)
    if gpus < 3:
        assert rounds == []
        return
    assert len(rounds) == (gpus - 1 if gpus % 2 == 0 else gpus)
    tested = {frozenset(g.members) for r in rounds for g in r}
    assert len(tested) == n_nodes * gpus * (gpus - 1) // 2


def _verdict(scope, members, bad, old=None, ratio=None):
    m = Measurement(op="alltoall", scope=scope, members=list(members), size_bytes=1,
                    dtype="float32", warmup=1, iters=1, time_us=1.0, algbw_gbs=1.0,
                    busbw_gbs=1.0, wrong=0)
    a = (Assessment(m, 1.0, 0.5 if bad else 1.0, bad, "peers") if ratio is None
         else Assessment(m, 1.0, ratio, False, "peers", variation=0.03))
    # A new verdict with the new measurement, as a fresh judgement makes one.
    items = [*(old.by_op.get("alltoall", []) if old else []), a]
    return GroupVerdict(scope, tuple(sorted(members)), tuple(sorted(nodes_of(members))),
                        by_op={"alltoall": items})


# A group that reads 5 % under its expectation every time, against 3 % between-link
# variation: its test stays undecided until its repeats run out.
UNDECIDED_RATIO = 0.95


def drive(nodes, slow_paths, missed=frozenset(), stalled=frozenset(), blamed_after=None):
    """Run the planner against an oracle fabric: a group is slow when it holds both ends of
    a slow path, but for the node sets in ``missed`` (the noise hid the path from them);
    one whose node set is in ``stalled`` reads ``UNDECIDED_RATIO``. ``blamed_after``:
    (round, node), a node blamed from that round on. Returns the rounds it planned."""
    planner = AdaptivePlanner(nodes, ProbeShape(sizes=(1,)))
    verdicts: dict = {}
    rounds = []
    blamed: set[str] = set()
    while groups := planner.next_round(verdicts, blamed):
        rounds.append(groups)
        if blamed_after is not None and len(rounds) >= blamed_after[0]:
            blamed = {blamed_after[1]}
        for g in groups:
            inside = frozenset(nodes_of(g.members))
            bad = inside not in missed and any(p <= inside for p in slow_paths)
            key = (g.scope, g.group)
            verdicts[key] = _verdict(g.scope, g.members, bad, verdicts.get(key),
                                     UNDECIDED_RATIO if inside in stalled else None)
    return rounds


@settings(max_examples=40, deadline=None)
@given(st.integers(3, 64), st.data())
def test_adaptive_plan_finds_every_slow_path_within_its_bound(n, data):
    nodes = layout(n, 1)
    names = sorted(nodes)
    k = data.draw(st.integers(0, 3))
    slow = {frozenset(data.draw(st.sampled_from(list(combinations(names, 2))))) for _ in range(k)}
    rounds = drive(nodes, slow)
    assert_disjoint(rounds)
    tested = {frozenset(nodes_of(g.members)) for r in rounds for g in r
              if g.scope == "inter_node" and len(nodes_of(g.members)) == 2}
    assert slow <= tested
    # Matching, re-pairs and world are O(1) (a small fleet meets every pair: at most 7 more);
    # each slow path costs O(log n) search levels of three unions, each union cleared on
    # ``CLEAR`` readings.
    small = n if n <= ALL_PAIRS_MAX else 0
    assert len(rounds) <= 7 + WORLD_CLEAR + small + len(slow) * (
        3 * CLEAR * math.ceil(math.log2(n)) + 6)


@given(st.integers(16, 64), st.integers(0, 2))
def test_a_path_within_a_part_survives_one_covering_union_cleared_by_noise(n, which):
    # The first split puts the two lowest nodes in one part, which three of its six unions
    # cover; the noise clears one of them. The others hold it, and the search goes on to
    # the pair itself (before, one cleared union pruned the region for good).
    nodes = layout(n, 1)
    names = sorted(nodes)
    slow = frozenset(names[:2])
    parts = split(names, 4)
    missed = frozenset({frozenset(parts[0] + parts[1 + which])})
    rounds = drive(nodes, {slow}, missed)
    pairs = {frozenset(nodes_of(g.members)) for r in rounds for g in r
             if g.scope == "inter_node" and len(nodes_of(g.members)) == 2}
    assert slow in pairs


def _pair_round(rounds, pair):
    return next(i for i, r in enumerate(rounds) for g in r
                if g.scope == "inter_node" and frozenset(nodes_of(g.members)) == pair)


def test_one_lead_measured_again_does_not_hold_up_the_others():
    # Two slow paths in different quarters of 64 nodes: after the first step each is a lead
    # of its own. One of the first lead's next unions reads 5 % under its model, which its
    # test cannot decide before its repeats run out; the other lead goes on down to its
    # pair meanwhile (it waited for those repeats before).
    nodes = layout(64, 1)
    names = sorted(nodes)
    first, second = frozenset(names[:2]), frozenset(names[32:34])
    quarter = split(names, 4)[0]
    sub = split(quarter, 4)
    stalled = frozenset(sub[0] + sub[1])
    rounds = drive(nodes, {first, second}, stalled=frozenset({stalled}))
    assert_disjoint(rounds)
    repeats = [i for i, r in enumerate(rounds) for g in r
               if frozenset(nodes_of(g.members)) == stalled]
    assert len(repeats) >= 10
    assert _pair_round(rounds, second) < repeats[-1]
    assert {first, second} <= {frozenset(nodes_of(g.members)) for r in rounds for g in r}


def test_a_node_blamed_during_the_search_leaves_its_regions():
    # A node blamed mid-search (its NIC, from its node pairs): no later union holds it, and
    # the slow path elsewhere is still found.
    nodes = layout(64, 1)
    names = sorted(nodes)
    path = frozenset(names[40:42])
    world = next(i for i, r in enumerate(drive(nodes, {path})) for g in r if g.scope == "world")
    gone = names[5]
    rounds = drive(nodes, {path}, blamed_after=(world + 3, gone))
    later = [g for r in rounds[world + 3:] for g in r if g.scope == "inter_node"]
    assert later and all(gone not in nodes_of(g.members) for g in later)
    assert path in {frozenset(nodes_of(g.members)) for g in later}


def test_a_region_is_kept_while_most_of_its_covering_unions_are_slow():
    assert kept([True]) and not kept([False])
    assert kept([True, True, False]) and kept([True, True, True])
    assert not kept([True, False, False]) and not kept([False, False, False])


@given(st.integers(1, 300))
def test_fault_free_plan_is_a_constant_number_of_rounds(n):
    rounds = drive(layout(n, 2), set())
    assert_disjoint(rounds)
    # A fleet too large to meet every node pair measures the world group's halves after
    # each of its readings.
    assert len(rounds) <= 3 + (WORLD_CLEAR + (n - 1) if n <= ALL_PAIRS_MAX else 2 * WORLD_CLEAR)
    if 2 <= n <= ALL_PAIRS_MAX:
        tested = {frozenset(nodes_of(g.members)) for r in rounds for g in r
                  if g.scope == "inter_node"}
        assert len(tested) == n * (n - 1) // 2


def test_pack_keeps_rounds_disjoint():
    nodes = layout(4, 1)
    plan = healthy_plan(nodes)
    groups = plan[0] + plan[1] + plan[-1]
    now, later = pack(groups)
    assert_disjoint([now]) is None and len(now) + len(later) == len(groups)
    assert later


def test_group_deadline_grows_with_the_work_and_covers_forming() -> None:
    from ringwatch.services.check.deadlines import FORM_S, group_deadline_s

    small = group_deadline_s("gloo", ["allreduce"], [8], warmup=1, iters=1)
    big = group_deadline_s("gloo", ["allreduce", "alltoall"], [1 << 22], warmup=5, iters=20)
    more = group_deadline_s("gloo", ["allreduce", "alltoall"], [1 << 22], warmup=5, iters=20,
                            repeats=3)
    assert FORM_S["gloo"] <= small < big < more
    # NVLink-class links move the same bytes far faster than gloo's floor assumes.
    assert group_deadline_s("nccl", ["allreduce"], [1 << 28], warmup=5, iters=20) < \
        group_deadline_s("gloo", ["allreduce"], [1 << 28], warmup=5, iters=20)


def test_eight_gpus_give_seven_rounds_of_four_pairs() -> None:
    rounds = gpu_pair_rounds(layout(2, 8), ["node-000", "node-001"], ProbeShape())
    assert len(rounds) == 7
    assert all(len(groups) == 8 for groups in rounds)  # 4 pairs on each of 2 nodes
    assert all(g.scope == "gpu_pair" for groups in rounds for g in groups)
    pairs = {g.members for groups in rounds for g in groups if g.members[0].startswith("node-000")}
    assert len(pairs) == 28


def test_a_small_fleet_with_no_proven_node_still_probes_its_network():
    """Two nodes whose intra-node results were both suspect: nobody is proven good to pair
    with, so the two meet each other rather than leaving the network unprobed."""
    nodes = layout(2, 2)
    planner = AdaptivePlanner(nodes, ProbeShape())
    intra = planner.next_round({}, set())
    verdicts = _judged(intra, slow={"node-000", "node-001"})
    seen = []
    while groups := planner.next_round(verdicts, set()):
        seen += groups
        verdicts = _judged(intra + seen, slow={"node-000", "node-001"})
    pairs = [g for g in seen if g.scope == "inter_node"]
    assert [nodes_of(g.members) for g in pairs] == [["node-000", "node-001"]]


def _judged(groups, slow):
    from ringwatch.agents.spec import Measurement
    from ringwatch.services.analyzer.assess import Thresholds, assess
    from ringwatch.services.analyzer.localize import group_verdicts

    ms = [Measurement(op=op, scope=g.scope, members=list(g.members), size_bytes=max(g.sizes),
                      dtype="float32", warmup=1, iters=1, time_us=1.0, algbw_gbs=10.0,
                      busbw_gbs=4.0 if g.scope == "intra_node" and set(nodes_of(g.members)) <= slow
                      else 10.0, wrong=0)
          for g in groups for op in g.ops]
    return group_verdicts(assess(ms, Thresholds(), expected=lambda m: 10.0))


def _leaning(scope, members, ratio):
    """A group measured once at ``ratio`` of a path model, under 3 % noise the run has
    measured: slow enough to lean slow, not enough to decide."""
    m = Measurement(op="alltoall", scope=scope, members=list(members), size_bytes=1,
                    dtype="float32", warmup=1, iters=1, time_us=1.0, algbw_gbs=ratio,
                    busbw_gbs=ratio, wrong=0)
    v = GroupVerdict(scope, tuple(sorted(members)), tuple(sorted(nodes_of(members))),
                     noise={"alltoall": 0.03})
    v.by_op["alltoall"] = [Assessment(m, 1.0, ratio, False, "paths", spread=0.03,
                                      variation=0.03)]
    return v


def test_a_group_that_only_steers_the_plan_is_followed_up_not_remeasured_once_it_leans_slow():
    nodes = layout(8, 1)
    planner = AdaptivePlanner(nodes, ProbeShape(sizes=(1,)))
    union = [f"node-00{i}/0" for i in range(4)]
    pair = ["node-004/0", "node-005/0"]
    verdicts = {("inter_node", Group(union)): _leaning("inter_node", union, 0.88),
                ("inter_node", Group(pair)): _leaning("inter_node", pair, 0.88)}
    d = verdicts[("inter_node", Group(union))].decisions["alltoall"]
    assert d.pending and d.llr >= Weighing().follow_up_llr
    # The node pair names a path, so it is weighed until decided; the union only says
    # where to search, and the search keeps it anyway (not cleared).
    again = {g.members for g in planner._repeats(verdicts, set())}
    assert again == {tuple(pair)}
    # One that barely leans slow is measured again all the same.
    verdicts[("inter_node", Group(union))] = _leaning("inter_node", union, 0.94)
    assert len(planner._repeats(verdicts, set())) == 2


def test_a_provisional_slow_pair_is_measured_again_though_its_node_is_blamed():
    # One slow measurement of a GPU pair blames its node at once, but the decision is
    # provisional: that pair is measured again, the node's other groups are not.
    nodes = layout(2, 4)
    planner = AdaptivePlanner(nodes, ProbeShape(sizes=(1,)))
    slow = _verdict("gpu_pair", ["node-000/0", "node-000/1"], bad=True)
    other = _verdict("gpu_pair", ["node-000/2", "node-000/3"], bad=False)
    other = GroupVerdict(other.scope, other.members, other.nodes, by_op={"alltoall": [
        Assessment(other.by_op["alltoall"][0].measurement, 1.0, 0.945, False, "peers")]})
    verdicts = {v.key: v for v in (slow, other)}
    assert slow.provisional and other.decisions["alltoall"].decision == "undecided"
    again = planner._repeats(verdicts, {"node-000"})
    assert [g.members for g in again] == [slow.members]
    # Measured again and slow again: final, and no longer measured.
    slow = verdicts[slow.key] = _verdict("gpu_pair", ["node-000/0", "node-000/1"], bad=True,
                                         old=slow)
    assert not slow.provisional and planner._repeats(verdicts, {"node-000"}) == []


def _cleared(scope, members):
    """A group measured three times at its expectation under 3 % noise: cleared."""
    v = _leaning(scope, members, 1.0)
    v.by_op["alltoall"] = v.by_op["alltoall"] * 3
    return v


def test_confirm_rounds_follow_a_search_and_only_a_search():
    nodes = layout(12, 1)
    repairs = []

    def planner_with_one_repair_each_time() -> AdaptivePlanner:
        p = AdaptivePlanner(nodes, ProbeShape(sizes=(1,)))
        p.phase = "world"
        # What a re-pair round would hold: a node still short of partners.
        p._repair = lambda v, blamed, busy=frozenset(): repairs.append(p.phase) or [  # type: ignore[method-assign]
            p._union_group(("node-000", "node-001"))]
        return p

    # The world group of the proven nodes is cleared: no search, and nothing new to confirm.
    p = planner_with_one_repair_each_time()
    [world] = p.next_round({}, set())
    cleared = {("world", world.group): _cleared("world", world.members)}
    # Its halves are measured once after it (a fleet of 12 meets only some node pairs).
    halves = p.next_round(cleared, set())
    assert [len(nodes_of(h.members)) for h in halves] == [6, 6]
    cleared |= {(h.scope, h.group): _cleared(h.scope, h.members) for h in halves}
    assert p.next_round(cleared, set()) == [] and p.phase == "done" and repairs == []
    # A slow world group is searched, and what the search leaves gets its confirm rounds.
    p = planner_with_one_repair_each_time()
    [world] = p.next_round({}, set())
    slow = {("world", world.group): _leaning("world", world.members, 0.7)}
    assert len(p.next_round(slow, set())) == 2  # its halves
    assert p.next_round(slow, set())  # the search's first unions
    p.active = []  # the search has run out of regions
    assert p.next_round(slow, set()) and repairs == ["confirm"]


def _pair(members, **ratios):
    """A node pair measured at these ratios per op (peers' centre 1, noise 3 % measured)."""
    v = GroupVerdict("inter_node", tuple(sorted(members)), tuple(sorted(nodes_of(members))),
                     noise={"allreduce": 0.03, "alltoall": 0.03})
    for op, values in ratios.items():
        v.by_op[op] = [Assessment(Measurement(op=op, scope="inter_node", members=list(members),
                                              size_bytes=1, dtype="float32", warmup=1,
                                              iters=1, time_us=1.0, algbw_gbs=r, busbw_gbs=r,
                                              wrong=0),
                                  1.0, r, r < 0.85, "peers", spread=0.03, variation=0.03)
                       for r in values]
    return v


def test_a_pair_that_may_name_a_path_is_measured_on_its_undecided_op():
    # node-000 and node-001 are each proven with another partner; their pair is decided
    # slow on AllReduce and leans slow, undecided, on AllToAll. A path is named only when
    # its ops are slow together, so the AllToAll is measured on (only it).
    planner = AdaptivePlanner(layout(4, 2), ProbeShape(sizes=(1,)))
    ranks = {n: [f"node-00{n}/0", f"node-00{n}/1"] for n in range(4)}
    slow = _pair(ranks[0] + ranks[1], allreduce=[0.78] * 3, alltoall=[0.9])
    fine = [_pair(ranks[0] + ranks[2], allreduce=[1.0] * 3, alltoall=[1.0] * 3),
            _pair(ranks[1] + ranks[3], allreduce=[1.0] * 3, alltoall=[1.0] * 3)]
    assert slow.bad and slow.pending_ops == ()
    assert slow.decisions["alltoall"].pending and all(v.cleared for v in fine)
    verdicts = {v.key: v for v in [slow, *fine]}
    again = planner._repeats(verdicts, set())
    assert [(g.members, g.ops) for g in again] == [(slow.members, ("alltoall",))]
    # With node-001 proven nowhere else the pair is a question of its NIC, not a path:
    # nothing more to measure on it here.
    del verdicts[fine[1].key]
    assert planner._repeats(verdicts, set()) == []


def test_a_node_is_re_paired_beside_a_tail_of_other_nodes_undecided_groups():
    # node-000's one pair is slow: it needs another partner. node-001, -002 and -003 are
    # proven; node-004 and node-005's pair is still undecided, two nodes of twenty (a tail
    # of stragglers). The re-pair goes out beside that pair's repeat (in a large fleet a
    # few groups measured to their cap would otherwise hold every re-pair back), and
    # neither undecided end is used for it.
    ranks = {n: [f"node-00{n}/0", f"node-00{n}/1"] for n in range(6)}
    groups = [_pair(ranks[0] + ranks[2], allreduce=[0.7] * 3, alltoall=[0.7] * 3),
              _pair(ranks[2] + ranks[3], allreduce=[1.0] * 3, alltoall=[1.0] * 3),
              _pair(ranks[1] + ranks[3], allreduce=[1.0] * 3, alltoall=[1.0] * 3),
              _pair(ranks[4] + ranks[5], allreduce=[1.0] * 3, alltoall=[0.9])]
    assert groups[0].bad and groups[3].pending_ops == ("alltoall",)

    def planned(n_nodes):
        planner = AdaptivePlanner(layout(n_nodes, 2), ProbeShape(sizes=(1,)))
        planner.phase = "repair"
        verdicts = {v.key: v for v in groups}
        return {(tuple(nodes_of(g.members)), g.ops) for g in planner.next_round(verdicts, set())}

    got = planned(20)
    assert {(("node-004", "node-005"), ("alltoall",)),
            (("node-000", "node-001"), ("allreduce", "alltoall"))} <= got
    assert [p for p, _ in got if {"node-004", "node-005"} & set(p)] == [("node-004", "node-005")]
    # Two of six nodes undecided is no tail: the re-pairs wait for them.
    assert planned(6) == {(("node-004", "node-005"), ("alltoall",))}
    # Its own pair undecided, node-000 waits for it: nothing else is paired with it.
    groups[0] = _pair(ranks[0] + ranks[2], allreduce=[0.9], alltoall=[0.9])
    assert [p for p, _ in planned(20) if "node-000" in p] == [("node-000", "node-002")]


def test_an_across_region_waits_only_for_regions_that_could_hold_a_pair_of_its_nodes():
    names = sorted(layout(32, 1))
    p, q, r = names[:8], names[8:16], names[16:24]
    planner = AdaptivePlanner(layout(32, 1), ProbeShape(sizes=(1,)))
    mine = _Issued(("across", tuple(p), tuple(q)))
    # Across P and R (and what it is split into) holds no pair with both ends in P u Q:
    # the two go on side by side.
    beside = _Issued(("across", tuple(p[:4]), tuple(r[:4])))
    planner.active = [beside, mine]
    assert not planner._waits(mine)
    # Within P, or across two parts of P, could hold one: a union of ``mine`` holding both
    # its ends would be slow for it, so ``mine`` waits for it.
    for region in (("within", tuple(p[:4]), ()), ("across", tuple(p[:2]), tuple(p[2:4]))):
        planner.active = [_Issued(region), mine]
        assert planner._waits(mine)
    # An earlier region of its size across P and Q's other halves (one slow NIC slows both)
    # still goes first.
    first = _Issued(("across", tuple(p[:4] + q[4:]), tuple(q[:4] + p[4:])))
    planner.active = [first, mine]
    assert planner._waits(mine)
    planner.active = [mine, first]
    assert not planner._waits(mine)
