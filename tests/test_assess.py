"""assess: peer, history and preset expectations; which sizes are judged."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from ringwatch.agents.spec import Measurement
from ringwatch.services.analyzer.assess import (
    Thresholds,
    assess,
    healthy_centres,
    history_baseline,
    leave_one_out_quantile,
    link_key,
    node_weights,
    own_normal,
    weighted_leave_one_out_quantile,
)
from ringwatch.services.analyzer.localize import group_verdicts


def meas(members, busbw, *, op="allreduce", scope="inter_node", size=1 << 22) -> Measurement:
    return Measurement(op=op, scope=scope, members=list(members), size_bytes=size,
                       dtype="float32", warmup=1, iters=1, time_us=1.0, algbw_gbs=busbw,
                       busbw_gbs=busbw, wrong=0)


def pair(a: int, b: int) -> list[str]:
    return [f"node-{a:03d}/0", f"node-{b:03d}/0"]


def test_slow_one_of_three_nodes_is_bad_even_though_the_median_pair_is_slow():
    # node-002 slow: two of the three node pairs are slow, the median pair is slow too.
    ms = [meas(pair(0, 1), 10.0), meas(pair(0, 2), 5.0), meas(pair(1, 2), 5.1)]
    out = assess(ms)
    assert [a.bad for a in out] == [False, True, True]
    assert out[1].source == "peers"
    assert out[1].expected_gbs is not None and out[1].expected_gbs > 7.0
    assert out[1].severity == "warning" or out[1].ratio < 0.5


def test_severity_follows_critical_ratio():
    ms = [meas(pair(i, i + 1), 10.0) for i in range(0, 8, 2)] + [meas(pair(8, 9), 4.0)]
    out = assess(ms)
    assert out[-1].bad and out[-1].severity == "critical"
    ms[-1] = meas(pair(8, 9), 6.0)
    out = assess(ms)
    assert out[-1].bad and out[-1].severity == "warning"


def test_peers_must_match_op_scope_size_and_world_size():
    ms = [meas(pair(0, 1), 10.0), meas(pair(2, 3), 1.0, op="alltoall"),
          meas(["node-004/0", "node-004/1"], 1.0, scope="intra_node"),
          meas(pair(5, 6) + ["node-007/0"], 1.0)]
    out = assess(ms)
    assert all(a.source == "none" and not a.bad for a in out)


def test_only_largest_size_is_judged():
    small = [meas(pair(i, i + 1), 1.0 if i == 0 else 10.0, size=1 << 10) for i in (0, 2, 4)]
    large = [meas(pair(i, i + 1), 10.0, size=1 << 24) for i in (0, 2, 4)]
    out = assess(small + large)
    assert not any(a.bad for a in out)
    assert out[0].ratio is not None and out[0].ratio < 0.2 and not out[0].judged
    assert all(a.judged for a in out[3:])


def test_preset_is_used_without_peers_and_floors_them():
    lone = meas(pair(0, 1) + ["node-002/0"], 30.0)
    out = assess([lone], Thresholds(), expected=lambda m: 100.0)
    assert out[0].source == "preset" and out[0].bad and out[0].expected_gbs == 100.0
    peers = [meas(pair(i, i + 1), 95.0) for i in (0, 2, 4)]
    out = assess(peers, Thresholds(), expected=lambda m: 100.0)
    assert all(a.source == "peers" and not a.bad and a.expected_gbs == 95.0 for a in out)
    # Peers that are all slow together can't vouch for each other.
    slow = [meas(pair(i, i + 1), 30.0) for i in (0, 2, 4)]
    out = assess(slow, Thresholds(), expected=lambda m: 100.0)
    assert all(a.source == "preset" and a.bad and a.expected_gbs == 90.0 for a in out)


def test_history_expectation_from_median_and_mad():
    past = [100.0, 101.0, 99.0, 100.5, 99.5, 100.0]
    b = history_baseline(past)
    assert b is not None and b.median == 100.0 and b.count == 6
    assert own_normal(past[:3]) is None  # too little history
    lone = meas(pair(0, 1), 60.0)
    out = assess([lone], history={link_key(lone): past})
    assert out[0].source == "history" and out[0].bad
    out = assess([meas(pair(0, 1), 98.0)], history={link_key(lone): past})
    assert not out[0].bad


def test_noisy_history_widens_the_expectation():
    noisy = [100.0, 92.0, 108.0, 95.0, 105.0, 100.0]
    quiet = [100.0] * 6
    lone = meas(pair(0, 1), 97.0, scope="world")
    [a_noisy] = assess([lone], history={link_key(lone): noisy})
    [a_quiet] = assess([lone], history={link_key(lone): quiet})
    assert a_noisy.source == a_quiet.source == "history"
    assert a_noisy.spread > a_quiet.spread and a_noisy.centre_se > a_quiet.centre_se


@given(st.lists(st.floats(1e-3, 1e3), min_size=5, max_size=50))
def test_a_history_never_yields_an_expectation_no_loss_could_miss(values):
    """However noisy the history, the link's own normal is either None ("no baseline") or
    narrow enough that losing half its median bandwidth is decided degraded at once."""
    normal = own_normal(values)
    if normal is None:
        return
    lone = meas(pair(0, 1), normal.median * 0.5, scope="world")
    [v] = group_verdicts(assess([lone], history={link_key(lone): values})).values()
    assert v.bad


def test_a_link_too_noisy_for_a_baseline_says_so():
    lone = meas(("node-000/0", "node-001/0"), 0.001, scope="world")
    past = [100.0, 1.0, 300.0, 0.5, 150.0, 2.0, 90.0]
    [a] = assess([lone], history={link_key(lone): past})
    assert a.expected_gbs is None and a.ratio is None and a.source == "none"


@given(st.lists(st.floats(0.1, 1000.0), min_size=2, max_size=30), st.floats(0.0, 1.0))
def test_leave_one_out_quantile_matches_numpy(values, q):
    v = np.array(values)
    got = leave_one_out_quantile(v, q)
    for i in range(v.size):
        want = np.quantile(np.delete(v, i), q)
        assert abs(got[i] - want) <= 1e-9 * max(1.0, abs(want))


def test_a_node_re_paired_many_times_does_not_drag_its_peers_centre_down():
    # Eight healthy node pairs, and a slow NIC on node-040 that the check re-paired with
    # nine partners: more slow pairs than healthy ones.
    healthy = [meas(pair(2 * i, 2 * i + 1), 100.0) for i in range(8)]
    slow = [meas(pair(40, 41 + i), 80.0) for i in range(9)]
    out = assess(healthy + slow)
    # Each node counts about once: node-040's nine pairs weigh as much as one.
    assert {a.expected_gbs for a in out} == {100.0}
    assert all(a.ratio == 0.8 for a in out[8:])
    # Unweighted, the slow pairs' median peer would be halfway between.
    values = np.array([m.busbw_gbs for m in [*healthy, *slow]])
    assert leave_one_out_quantile(values, 0.5)[-1] == 90.0


def test_a_fleet_with_half_its_node_pairs_slow_judges_them_against_the_healthy_ones():
    # Four slow NICs (18 % loss) in a fleet of 14 nodes, each re-paired with three
    # partners and re-measured five times: twelve slow node pairs, five healthy ones.
    rng = np.random.default_rng(7)
    healthy = [meas(pair(2 * i, 2 * i + 1), 100.0 * rng.uniform(0.97, 1.03)) for i in range(5)]
    slow = [meas(pair(20 + k, p), 82.0 * rng.uniform(0.98, 1.02) * rng.normal(1, 0.03))
            for k in range(4) for p in (2 * k, 2 * k + 1, 9 - k) for _ in range(5)]
    out = assess(healthy + slow)
    # Every pair is judged against the healthy pairs' level, not a median of all of them.
    assert all(96.0 <= (a.expected_gbs or 0.0) <= 104.0 for a in out)
    assert all((a.ratio or 1.0) < 0.88 for a in out[5:])
    # The weighted median of the pairs, which each node counts in about once, sits among
    # the slow ones here: half the nodes' pairs run through a slow NIC.
    groups = {m.group: m.busbw_gbs for m in healthy + slow}
    median = weighted_leave_one_out_quantile(np.array(list(groups.values())),
                                             node_weights(list(groups)), 0.5)
    assert float(median[0]) < 90.0


def test_a_few_slow_node_pairs_leave_the_median_of_them_all():
    # One slow NIC among 30 node pairs: the median is robust to it, and kept.
    rng = np.random.default_rng(11)
    healthy = [meas(pair(2 * i, 2 * i + 1), 100.0 * rng.uniform(0.9, 1.1)) for i in range(29)]
    out = assess([*healthy, meas(pair(70, 71), 75.0)])
    values = np.array([m.busbw_gbs for m in healthy] + [75.0])
    want = weighted_leave_one_out_quantile(values, np.ones(values.size), 0.5)
    assert [a.expected_gbs for a in out] == list(want)


@given(st.lists(st.floats(0.0, 0.09), min_size=9, max_size=40),
       st.lists(st.floats(0.1, 1.0), min_size=40, max_size=40))
def test_with_no_group_a_loss_below_the_others_the_centre_is_their_weighted_median(
        offsets, weights):
    # Every group within 9 % of every other: none can be slow by the 10 % a fault is
    # sought from, and the mixture leaves the plain weighted median of the others.
    x = np.exp(-np.array(offsets))
    w = np.array(weights[:x.size])
    centres, _, healthy = healthy_centres(x, w, np.full(x.size, 0.03), 0.10)
    assert healthy == x.size
    assert np.array_equal(centres, weighted_leave_one_out_quantile(x, w, 0.5))


@given(st.lists(st.floats(1.0, 100.0), min_size=2, max_size=30), st.floats(0.0, 1.0))
def test_the_weighted_leave_one_out_quantile_with_equal_weights_is_a_quantile_of_the_rest(
        values, q):
    v = np.array(values)
    got = weighted_leave_one_out_quantile(v, np.ones(v.size), q)
    for i in range(v.size):
        rest = np.sort(np.delete(v, i))
        # The smallest of the others whose share of them, counted from below, reaches q.
        k = max(int(np.ceil(q * rest.size - 1e-9)) - 1, 0)
        assert got[i] == rest[k]
