"""The weighing of evidence: a link's own normal, the sequential test and the drift detector,
on seeded noise so each rate below is the same every run."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.analyzer.evidence import (
    DEGRADED,
    HEALTHY,
    Cusum,
    Expectation,
    Sprt,
    SprtPolicy,
    expectation,
    robust_centre,
)

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def _decide(rng: np.random.Generator, true_ratio: float, noise: float, policy: SprtPolicy,
            expected: Expectation) -> str:
    test = Sprt.against(policy, expected)
    while not test.exhausted:
        if test.add(true_ratio * (1 + rng.normal(0, noise))) != "undecided":
            break
    return test.decision


def _rates(seed: int, level: float, truth: float, noise: float, links: int = 10,
           decisions: int = 300) -> dict[str, float]:
    """Decisions on links whose own normal is ``level`` (learned from 50 noisy values, as
    the analyzer would), each measured at ``truth`` x that level: the share of each
    outcome over ``links`` links (each with its own, imperfectly learned, expectation)."""
    rng = np.random.default_rng(seed)
    out = {DEGRADED: 0, HEALTHY: 0, "undecided": 0}
    for _ in range(links):
        learned = expectation(list(level * (1 + rng.normal(0, noise, 50))))
        assert learned is not None and learned.source == "history"
        for _ in range(decisions):
            out[_decide(rng, truth * level / learned.centre, noise, SprtPolicy(), learned)] += 1
    return {k: v / (links * decisions) for k, v in out.items()}


def test_a_link_always_slower_than_its_peers_but_steady_is_normal_for_itself() -> None:
    rng = np.random.default_rng(1)
    # Peers run at 100 GB/s; this link at 96 for good, with 5 % noise.
    own = expectation(list(96 * (1 + rng.normal(0, 0.05, 50))), peers=[100.0] * 20)
    assert own is not None and own.source == "history"
    assert own.centre == pytest.approx(96, rel=0.03)
    assert own.spread == pytest.approx(0.05, rel=0.35)
    rates = _rates(1, level=96, truth=1.0, noise=0.05)
    assert rates[DEGRADED] <= 0.01 and rates[HEALTHY] >= 0.95
    # Judged against its peers instead, the same link would look 4 % slow every time.
    peers = expectation([], peers=list(100 * (1 + rng.normal(0, 0.01, 20))))
    assert peers is not None and peers.source == "peers" and 96 / peers.centre < 0.97


def test_a_fifteen_percent_loss_under_eight_percent_noise_is_found() -> None:
    assert _rates(2, level=100, truth=0.85, noise=0.08)[DEGRADED] >= 0.95
    # A decision says how sure it is: past the test's bounds, in either direction.
    learned = expectation([100.0, 92.0, 108.0, 96.0, 104.0, 100.0])
    assert learned is not None
    slow, fine = Sprt.against(SprtPolicy(), learned), Sprt.against(SprtPolicy(), learned)
    while slow.add(0.8) == "undecided" or fine.add(1.0) == "undecided":
        pass
    assert slow.decision == DEGRADED and slow.confidence >= 0.95
    assert fine.decision == HEALTHY and fine.confidence >= 0.95
    healthy = _rates(3, level=100, truth=1.0, noise=0.08)
    # Undecided at the bound is a suspect, never an exclusion; most clear well before it.
    assert healthy[DEGRADED] <= 0.02 and healthy[HEALTHY] >= 0.95


def test_a_drifting_fault_is_found_before_it_reaches_a_quarter_loss() -> None:
    rng = np.random.default_rng(3)
    sigma = 0.05
    drift = Cusum()
    found_at = None
    for cycle in range(60):
        loss = 0.01 * cycle  # one point worse every cycle
        at = T0 + timedelta(minutes=5 * cycle)
        if drift.add((1 - loss) * (1 + rng.normal(0, sigma)), sigma, at):
            found_at = cycle
            break
    assert found_at is not None and 0.01 * found_at < 0.25
    # It says since when: the excursion began before the alarm, after the drift did.
    assert drift.since is not None and T0 < drift.since < T0 + timedelta(minutes=5 * found_at)
    assert Cusum.from_dict(drift.to_dict()).score == pytest.approx(drift.score)


def test_a_steady_link_raises_no_drift_alarm_in_thousands_of_cycles() -> None:
    rng = np.random.default_rng(4)
    drift = Cusum()
    alarms = sum(drift.add(1 + rng.normal(0, 0.05), 0.05, T0 + timedelta(minutes=5 * i))
                 for i in range(5000))
    assert alarms == 0


def test_expectation_falls_back_from_history_to_peers_to_profile() -> None:
    assert expectation([10.0] * 5).source == "history"  # type: ignore[union-attr]
    assert expectation([10.0] * 4, peers=[9.0, 10.0, 11.0]).source == "peers"  # type: ignore[union-attr]
    profile = expectation([10.0], peers=[9.0], profile_gbs=400.0)
    assert profile is not None and profile.source == "profile" and profile.centre == 400.0
    # Less known, wider band: a profile's figure is the least certain expectation.
    assert profile.sigma > expectation([10.0] * 50).sigma  # type: ignore[union-attr]
    assert expectation([], peers=[1.0]) is None


def test_the_per_day_budget_splits_over_the_days_tests() -> None:
    policy = SprtPolicy.per_day(0.01, tests_per_day=288)
    assert policy.false_alarm == pytest.approx(0.01 / 288)
    assert policy.upper > SprtPolicy().upper > 0 > policy.lower


@given(st.lists(st.floats(min_value=0.1, max_value=1e4), min_size=1, max_size=200))
def test_the_robust_centre_lies_within_the_values(values: list[float]) -> None:
    centre, spread = robust_centre(values)
    assert min(values) <= centre <= max(values)
    assert spread >= 0
