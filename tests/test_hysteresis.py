"""Hysteresis: k bad of the last n degrade, m good in a row recover; flapping stays quiet."""

from __future__ import annotations

from collections.abc import Iterable

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ringwatch.services.analyzer.hysteresis import DEGRADED, OK, LinkState, Policy, changes, step


def statuses(verdicts: Iterable[bool], policy: Policy = Policy(),
             start: LinkState = LinkState()) -> list[str]:
    """The status after each verdict of a series."""
    out = []
    state = start
    for bad in verdicts:
        state = step(state, bad, policy)
        out.append(state.status)
    return out


policies = st.builds(
    lambda n, k, m: Policy(k_bad=min(k, n), n_window=n, m_good=m),
    st.integers(1, 8), st.integers(1, 8), st.integers(1, 8),
)


def test_flapping_link_degrades_once_and_stays_degraded():
    flapping = [True, False] * 20
    out = statuses(flapping, Policy(k_bad=3, n_window=5, m_good=3))
    assert out[:4] == [OK] * 4 and out[4] == DEGRADED
    assert changes(out) == 1


def test_sparse_bad_verdicts_never_degrade():
    sparse = ([True] + [False] * 3) * 10  # at most 2 bad in any window of 5
    assert set(statuses(sparse, Policy(3, 5, 3))) == {OK}


def test_recovery_needs_m_good_in_a_row():
    series = [True] * 3 + [False, False, True] + [False] * 3
    out = statuses(series, Policy(3, 5, 3))
    assert out[2] == DEGRADED and out[5] == DEGRADED and out[-2] == DEGRADED and out[-1] == OK


def test_bad_policy_is_refused():
    with pytest.raises(ValueError):
        Policy(k_bad=6, n_window=5)
    with pytest.raises(ValueError):
        Policy(m_good=0)


@given(st.lists(st.booleans(), max_size=60), policies)
def test_transitions_follow_their_evidence(series, policy):
    out = statuses(series, policy)
    prev = OK
    for i, status in enumerate(out):
        window = series[max(0, i + 1 - policy.n_window): i + 1]
        if prev == OK and status == DEGRADED:
            assert sum(window) >= policy.k_bad
        if prev == DEGRADED and status == OK:
            assert not any(series[i + 1 - policy.m_good: i + 1])
            assert i + 1 >= policy.m_good
        if prev == OK and status == OK:
            assert sum(window) < policy.k_bad
        prev = status


@given(st.integers(1, 50), policies)
def test_alternating_series_changes_at_most_once(length, policy):
    # good/bad alternation: never m_good >= 2 good in a row, so at most one change.
    if policy.m_good < 2:
        return
    out = statuses([i % 2 == 0 for i in range(length)], policy)
    assert changes(out) <= 1
