"""The weighing of evidence: a link's own normal, the sequential test and the drift detector,
on seeded noise so each rate below is the same every run."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import numpy as np
import pytest

from agents.spec import Measurement
from services.analyzer.assess import assess, link_key, own_normal
from services.analyzer.evidence import (
    DEGRADED,
    HEALTHY,
    MAD_TO_SIGMA,
    MEDIAN_SE,
    UNDECIDED,
    Cusum,
    Weighing,
    weigh,
)

T0 = datetime(2026, 1, 1, tzinfo=UTC)
W = Weighing()


def _decide(rng: np.random.Generator, true_ratio: float, noise: float, spread: float,
            centre_se: float) -> str:
    """Measure a link until ``weigh`` decides or its repeats run out, as a check does."""
    ratios: list[float] = []
    while True:
        ratios.append(true_ratio * (1 + rng.normal(0, noise)))
        d = weigh(ratios, noise=spread, variation=0.0, centre_se=centre_se, w=W)
        if d.decision != UNDECIDED or d.exhausted:
            return d.decision


def _rates(seed: int, level: float, truth: float, noise: float, links: int = 10,
           decisions: int = 300) -> dict[str, float]:
    """Decisions on links whose own normal is ``level`` (learned from 50 noisy values, as
    the analyzer would), each measured at ``truth`` x that level: the share of each
    outcome over ``links`` links (each with its own, imperfectly learned, normal)."""
    rng = np.random.default_rng(seed)
    out = {DEGRADED: 0, HEALTHY: 0, UNDECIDED: 0}
    for _ in range(links):
        # At 8 % noise a history's MAD now and then passes the "too noisy for a baseline"
        # bar (assess.own_normal); such a link is judged against its peers, not here.
        while (learned := own_normal(list(level * (1 + rng.normal(0, noise, 50))))) is None:
            pass
        spread = MAD_TO_SIGMA * learned.mad / learned.median
        centre_se = MEDIAN_SE * spread / np.sqrt(learned.count)
        for _ in range(decisions):
            out[_decide(rng, truth * level / learned.median, noise, spread, centre_se)] += 1
    return {k: v / (links * decisions) for k, v in out.items()}


def _world(busbw: float) -> Measurement:
    return Measurement(op="allreduce", scope="world", members=["node-000/0", "node-001/0"],
                       size_bytes=1 << 28, dtype="float32", warmup=5, iters=20, time_us=1.0,
                       algbw_gbs=busbw, busbw_gbs=busbw, wrong=0)


def _peer_pairs(busbw: list[float]) -> list[Measurement]:
    return [Measurement(op="allreduce", scope="world",
                        members=[f"node-{2 * i + 2:03d}/0", f"node-{2 * i + 3:03d}/0"],
                        size_bytes=1 << 28, dtype="float32", warmup=5, iters=20, time_us=1.0,
                        algbw_gbs=b, busbw_gbs=b, wrong=0) for i, b in enumerate(busbw)]


def test_a_link_always_slower_than_its_peers_but_steady_is_normal_for_itself() -> None:
    rng = np.random.default_rng(1)
    # Peers run at 100 GB/s; this link at 96 for good, with 5 % noise.
    past = list(96 * (1 + rng.normal(0, 0.05, 50)))
    link = _world(96.0)
    [own, *_] = assess([link, *_peer_pairs([100.0] * 20)], history={link_key(link): past})
    assert own.source == "history"
    assert own.expected_gbs == pytest.approx(96, rel=0.03)
    assert own.spread == pytest.approx(0.05, rel=0.35)
    rates = _rates(1, level=96, truth=1.0, noise=0.05)
    assert rates[DEGRADED] <= 0.01 and rates[HEALTHY] >= 0.95
    # Judged against its peers instead, the same link would look 4 % slow every time.
    [by_peers, *_] = assess([link, *_peer_pairs(list(100 * (1 + rng.normal(0, 0.01, 20))))])
    assert by_peers.source == "peers" and by_peers.ratio is not None and by_peers.ratio < 0.97


def test_a_fifteen_percent_loss_under_eight_percent_noise_is_found() -> None:
    assert _rates(2, level=100, truth=0.85, noise=0.08)[DEGRADED] >= 0.95
    # A decision says how sure it is: past the test's bounds, in either direction.
    learned = own_normal([100.0, 92.0, 108.0, 96.0, 104.0, 100.0])
    assert learned is not None
    spread = MAD_TO_SIGMA * learned.mad / learned.median
    slow = weigh([0.8] * 4, noise=spread, variation=0.0, centre_se=0.01, w=W)
    fine = weigh([1.0] * 4, noise=spread, variation=0.0, centre_se=0.01, w=W)
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
    link = _world(10.0)
    peers = _peer_pairs([9.0, 10.0, 11.0])
    assert assess([link], history={link_key(link): [10.0] * 5})[0].source == "history"
    assert assess([link, *peers], history={link_key(link): [10.0] * 4})[0].source == "peers"
    [profile] = assess([link], history={link_key(link): [10.0]}, expected=lambda m: 400.0)
    assert profile.source == "preset" and profile.expected_gbs == 400.0
    # Less known, wider band: a profile's figure may be off for good, a link's own normal
    # is its own.
    [history] = assess([link], history={link_key(link): [10.0] * 50})
    assert profile.variation > history.variation == 0.0
    assert assess([_world(1.0)])[0].source == "none"
