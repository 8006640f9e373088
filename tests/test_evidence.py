"""The weighing of evidence: a link's own normal, the sequential test and the drift detector,
on seeded noise so each rate below is the same every run."""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta

import numpy as np
import pytest

from ringwatch.agents.spec import Measurement
from ringwatch.services.analyzer.assess import assess, link_key, own_normal
from ringwatch.services.analyzer.evidence import (
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


def test_a_group_its_lasting_offset_keeps_undecided_stops_before_its_repeats_run_out() -> None:
    # 5 % under its expectation with little noise: with links spreading 3 % for good, no
    # number of repeats would decide it, and the test says so long before the cap.
    stuck = weigh([0.95] * 4, noise=0.005, variation=0.03, centre_se=0.0, w=W)
    assert stuck.decision == HEALTHY and stuck.exhausted and stuck.repeats < W.max_repeats
    # One at 11 % under is as stuck, but leaning slow: measured on (a loss that is there
    # shows itself), and a suspect, never an exclusion, if its repeats run out.
    slow_side = weigh([0.89] * 4, noise=0.005, variation=0.03, centre_se=0.0, w=W)
    assert slow_side.decision == UNDECIDED and slow_side.pending
    assert weigh([0.89] * W.max_repeats, noise=0.005, variation=0.03, centre_se=0.0,
                 w=W).decision == UNDECIDED
    # Under 8 % noise the mean of two may yet move either way: measured again.
    early = weigh([0.93, 0.95], noise=0.08, variation=0.03, centre_se=0.0, w=W)
    assert early.decision == UNDECIDED and early.pending
    # Five at 3.5 % under, under 8 % noise, lean healthy without reaching the healthy bound;
    # fifteen repeats more could not carry their mean to the slow one: cleared now, not
    # after all twenty.
    low_end = weigh([0.965] * 5, noise=0.08, variation=0.03, centre_se=0.0, w=W,
                    early_clear=True)
    assert low_end.llr > W.lower and low_end.decision == HEALTHY and not low_end.pending
    # A node pair cleared proves both its NICs, and a union of many paths is slowed by a
    # slow path far less than the path's loss: the same five readings leave either
    # measured on while the healthy bound is in reach.
    vouching = weigh([0.965] * 5, noise=0.08, variation=0.03, centre_se=0.0, w=W)
    assert vouching.decision == UNDECIDED and vouching.pending
    # Two that lean healthy by a hair leave the slow bound in reach: measured on.
    unsure = weigh([0.98, 0.92], noise=0.08, variation=0.03, centre_se=0.0, w=W,
                   early_clear=True)
    assert unsure.llr <= 0 and unsure.decision == UNDECIDED and unsure.pending
    # The log-likelihood ratio says which way the evidence leans.
    assert slow_side.llr > 0 > stuck.llr


def test_a_link_whose_repeats_ran_out_far_below_its_peers_is_decided_on_its_last_look() -> None:
    # Twenty readings 13 % under, under 8 % noise: Wald's bound (4.24 deviations at the
    # defaults) is not reached, but a healthy link's lasting offset sits this far down
    # (4.0 deviations) less often than the false alarm allows: decided on the last look.
    last = weigh([0.87] * W.max_repeats, noise=0.08, variation=0.03, centre_se=0.0, w=W,
                 terminal=True)
    assert last.llr < W.upper and last.decision == DEGRADED
    # Without the last look (a union, an intra-node ring: only part of a loss shows there),
    # or before the repeats ran out, it stays undecided.
    assert weigh([0.87] * W.max_repeats, noise=0.08, variation=0.03, centre_se=0.0,
                 w=W).decision == UNDECIDED
    assert weigh([0.87] * (W.max_repeats - 1), noise=0.08, variation=0.03, centre_se=0.0,
                 w=W, terminal=True).decision == UNDECIDED
    # 10 % under is three deviations: a healthy link's offset can be there; undecided.
    assert weigh([0.90] * W.max_repeats, noise=0.08, variation=0.03, centre_se=0.0, w=W,
                 terminal=True).decision == UNDECIDED
    assert W.terminal_z == pytest.approx(3.719, abs=1e-3)


def test_one_measurement_in_the_far_tail_is_measured_again_before_it_is_a_fault() -> None:
    # A healthy path 5 % under its peers for good, caught by a 4-sigma draw of 7 % noise:
    # one measurement at 0.72 of its expectation. Its weighing alone passes the slow bound,
    # but a slow decision on one measurement is provisional: the check measures it again.
    one = weigh([0.72], noise=0.07, variation=0.0, centre_se=0.0, w=W)
    assert one.degraded and one.provisional and one.pending
    # Measured again at its usual rate, it is no longer slow.
    again = weigh([0.72, 0.95], noise=0.07, variation=0.03, centre_se=0.0, w=W)
    assert not again.degraded
    # A real fault keeps its verdict on the second measurement, which is then final.
    fault = weigh([0.5, 0.52], noise=0.07, variation=0.03, centre_se=0.0, w=W)
    assert fault.degraded and not fault.provisional and not fault.pending


def test_a_run_measures_how_alike_its_links_are_where_noise_allows() -> None:
    from ringwatch.services.analyzer.localize import group_verdicts

    def fleet(variation: float, noise: float, seed: int) -> dict:
        rng = np.random.default_rng(seed)
        offsets = 1 + rng.normal(0, variation, 200)
        ms = [intra_group(n, 100 * o * (1 + rng.normal(0, noise))) for n, o in enumerate(offsets)]
        # Every fourth group measured again: the run's own noise figure.
        ms += [intra_group(n, 100 * offsets[n] * (1 + rng.normal(0, noise)))
               for n in range(0, 200, 4)]
        verdicts = group_verdicts(assess(ms), W)
        return next(iter(verdicts.values())).variation

    alike = fleet(0.003, 0.02, 1)
    [(kind, figure)] = alike.items()
    assert kind[:2] == ("allreduce", "intra_node") and W.min_variation <= figure < 0.02
    uneven = fleet(0.08, 0.02, 2)
    assert list(uneven.values())[0] > W.variation_prior
    # Under 8 % noise one run cannot tell 0.3 % from 3 %: the prior stands.
    assert fleet(0.003, 0.08, 3) == {}


def intra_group(node: int, busbw: float) -> Measurement:
    return Measurement(op="allreduce", scope="intra_node",
                       members=[f"node-{node:04d}/{g}" for g in range(8)], size_bytes=1 << 28,
                       dtype="float32", warmup=5, iters=20, time_us=1.0, algbw_gbs=busbw,
                       busbw_gbs=busbw, wrong=0)


def test_a_union_is_expected_at_its_slowest_path() -> None:
    from ringwatch.services.analyzer.assess import slowest_path_share

    assert slowest_path_share(2, 0.03) == pytest.approx(1.0)
    shares = [slowest_path_share(k, 0.03) for k in (2, 4, 16, 64, 1024)]
    assert shares == sorted(shares, reverse=True)
    # 1024 nodes: half a million paths, the least of them about 4.8 sigmas down.
    assert shares[-1] == pytest.approx(np.exp(-0.03 * 4.8), rel=0.01)
    assert slowest_path_share(64, 0.0) == 1.0


def test_the_noise_is_measured_from_repeats_the_first_reading_did_not_select() -> None:
    from ringwatch.services.analyzer.localize import group_verdicts, measured_noise

    rng = np.random.default_rng(5)
    # 200 links under 8 % noise, 3 % apart for good. A check repeats the ones whose first
    # reading was far from the rest (a quarter of them), three times more each.
    offsets = 1 + rng.normal(0, 0.03, 200)
    firsts = offsets * np.exp(rng.normal(0, 0.08, 200))
    far = np.argsort(np.abs(np.log(firsts)))[-50:]
    ms = [intra_group(n, 100 * f) for n, f in enumerate(firsts)]
    ms += [intra_group(int(n), 100 * offsets[n] * math.exp(rng.normal(0, 0.08)))
           for n in far for _ in range(3)]
    noise = measured_noise(group_verdicts(assess(ms), W).values())["allreduce"]
    # The repeats' own scatter: 8 %, not the far first readings' distance from them.
    assert 0.065 < noise < 0.09
    # Counted in, those first readings would have read the noise a fifth larger.
    with_firsts = [np.log([f * 100, *(100 * offsets[n] * np.exp(rng.normal(0, 0.08, 3)))])
                   for n, f in zip(far, firsts[far], strict=True)]
    pooled = math.sqrt(sum(((x - x.mean()) ** 2).sum() for x in with_firsts)
                       / sum(x.size - 1 for x in with_firsts))
    assert pooled > 1.15 * noise
