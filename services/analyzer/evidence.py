"""Evidence, weighed: a link's own normal, sequential tests, and slow drift.

Pure functions and small state objects over busbw values, for the judgement of weak
faults in noisy, uneven fleets (docs/analysis.md):

- ``expectation``: what a link should do and how sure that is: its own history when it
  has one (median and MAD), else its peers', else its hardware profile's, each with a
  wider band than the one before.
- ``Sprt``: Wald's sequential probability ratio test of "healthy" against "slower by at
  least ``min_loss``" on a link's ratios to its expectation; a suspect is re-measured
  until the evidence decides, within a bounded number of repeats.
- ``Cusum``: a one-sided CUSUM on the same ratios across cycles, for a slight loss that
  persists: it accumulates what one cycle cannot show and says since when.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import numpy as np

# MAD to standard deviation for normal data.
MAD_TO_SIGMA = 1.4826
# The spread assumed where nothing measured says better: a profile's figure is a
# datasheet, and links reach it to within a few percent only.
PROFILE_SPREAD = 0.10


@dataclass(frozen=True)
class Expectation:
    """What a link should measure: ``centre`` GB/s, with a per-measurement ``spread``
    (a relative standard deviation) and the uncertainty of the centre itself."""

    centre: float
    spread: float
    source: str  # "history", "peers" or "profile"
    n: int = 0

    @property
    def centre_uncertainty(self) -> float:
        """Relative standard error of the centre (a median's: 1.25 sigma / sqrt(n))."""
        if self.n <= 0:
            return self.spread
        return 1.2533 * self.spread / math.sqrt(self.n)

    @property
    def sigma(self) -> float:
        """The relative spread a new measurement's ratio to the centre has: its own noise
        and the centre's uncertainty together."""
        return math.hypot(self.spread, self.centre_uncertainty)


def robust_centre(values: Sequence[float]) -> tuple[float, float]:
    """Median and relative robust spread (MAD scaled to a standard deviation, over the
    median) of ``values``."""
    a = np.asarray(values, dtype=float)
    centre = float(np.median(a))
    if centre <= 0:
        return centre, 1.0
    mad = float(np.median(np.abs(a - centre)))
    return centre, MAD_TO_SIGMA * mad / centre


def expectation(history: Sequence[float], peers: Sequence[float] = (),
                profile_gbs: float | None = None, *, min_history: int = 5,
                min_peers: int = 3, min_spread: float = 0.01) -> Expectation | None:
    """The link's own normal when it has ``min_history`` values; else its peers' (which
    differ from it for good by a few percent, so their spread widens the band); else the
    profile's figure with a wide band; None when there is nothing to go by."""
    if len(history) >= min_history:
        centre, spread = robust_centre(history)
        return Expectation(centre, max(spread, min_spread), "history", len(history))
    if len(peers) >= min_peers:
        centre, spread = robust_centre(peers)
        # A new link is one more draw from the peers: their spread, plus the noise of its
        # own first measurements, which the peers' spread already holds.
        return Expectation(centre, max(spread, min_spread), "peers", len(peers))
    if profile_gbs:
        return Expectation(profile_gbs, PROFILE_SPREAD, "profile", 0)
    return None


# ---- sequential test --------------------------------------------------------------------


@dataclass(frozen=True)
class SprtPolicy:
    """Error rates and effect size of the sequential test.

    ``false_alarm`` is per decision; ``per_day`` converts a budget per link-day (a link
    tested ``tests_per_day`` times) into that. ``min_loss`` is the smallest loss that must
    be found; ``max_repeats`` bounds the measurements one decision may take.
    """

    # Per decision on a suspect (a link one snapshot already flagged), not per link-cycle.
    false_alarm: float = 0.01
    miss: float = 0.05
    min_loss: float = 0.12
    max_repeats: int = 16

    @classmethod
    def per_day(cls, false_alarm_per_link_day: float, tests_per_day: float,
                **kw: Any) -> SprtPolicy:
        return cls(false_alarm=false_alarm_per_link_day / max(tests_per_day, 1.0), **kw)

    @property
    def upper(self) -> float:
        """Log-likelihood ratio at which "degraded" is decided."""
        return math.log((1 - self.miss) / self.false_alarm)

    @property
    def lower(self) -> float:
        """Log-likelihood ratio at which "healthy" is decided."""
        return math.log(self.miss / (1 - self.false_alarm))


DEGRADED, HEALTHY, UNDECIDED = "degraded", "healthy", "undecided"


@dataclass
class Sprt:
    """Wald's SPRT on ratios x = measured / expected: x ~ N(1 - b, s) (healthy) against
    N(1 - d, s) (degraded by at least d).

    ``margin`` (b) is how far below 1 a healthy link's ratios may sit because the
    expectation itself is uncertain: that error is the same for every repeat of one link,
    so it moves the healthy hypothesis rather than adding to each measurement's noise.
    """

    policy: SprtPolicy
    sigma: float
    margin: float = 0.0
    llr: float = 0.0
    ratios: list[float] = field(default_factory=list)

    @classmethod
    def against(cls, policy: SprtPolicy, expected: Expectation, k: float = 2.0) -> Sprt:
        """A test of ratios to ``expected``: its spread as noise, k standard errors of its
        centre as the margin (kept under half the loss to be found)."""
        margin = min(k * expected.centre_uncertainty, policy.min_loss / 2)
        return cls(policy, expected.spread, margin)

    def add(self, ratio: float) -> str:
        """Weigh one more ratio; the decision so far."""
        self.ratios.append(ratio)
        d, s = self.policy.min_loss, max(self.sigma, 1e-6)
        h0, h1 = 1.0 - self.margin, 1.0 - d
        # log N(x; h1, s) - log N(x; h0, s)
        self.llr += ((ratio - h0) ** 2 - (ratio - h1) ** 2) / (2 * s * s)
        return self.decision

    @property
    def decision(self) -> str:
        if self.llr >= self.policy.upper:
            return DEGRADED
        if self.llr <= self.policy.lower:
            return HEALTHY
        return UNDECIDED

    @property
    def exhausted(self) -> bool:
        return len(self.ratios) >= self.policy.max_repeats

    @property
    def confidence(self) -> float:
        """Posterior probability of the decided hypothesis, at even prior odds."""
        p_bad = 1.0 / (1.0 + math.exp(-max(min(self.llr, 50.0), -50.0)))
        return p_bad if self.llr >= 0 else 1.0 - p_bad


# ---- drift ------------------------------------------------------------------------------


@dataclass(frozen=True)
class CusumPolicy:
    """A one-sided lower CUSUM in units of the link's sigma: ``slack`` (k) is half the
    shift to be found; ``threshold`` (h) sets the run length between false alarms
    (h = 8, k = 0.5: tens of thousands of in-control cycles)."""

    slack: float = 0.5
    threshold: float = 8.0


@dataclass
class Cusum:
    """Accumulated evidence of a slight, persistent loss across cycles."""

    policy: CusumPolicy = field(default_factory=CusumPolicy)
    score: float = 0.0
    # When the current excursion began (the last time the score left zero).
    since: datetime | None = None
    cycles: int = 0

    def add(self, ratio: float, sigma: float, at: datetime) -> bool:
        """Weigh one cycle's ratio; True while the accumulated loss is past the threshold."""
        z = (1.0 - ratio) / max(sigma, 1e-6)
        before = self.score
        self.score = max(0.0, self.score + z - self.policy.slack)
        if self.score == 0.0:
            self.since, self.cycles = None, 0
        else:
            if before == 0.0:
                self.since = at
            self.cycles += 1
        return self.alarm

    @property
    def alarm(self) -> bool:
        return self.score > self.policy.threshold

    def to_dict(self) -> dict[str, Any]:
        return {"score": self.score, "since": self.since.isoformat() if self.since else None,
                "cycles": self.cycles}

    @classmethod
    def from_dict(cls, d: dict[str, Any], policy: CusumPolicy | None = None) -> Cusum:
        since = d.get("since")
        return cls(policy or CusumPolicy(), float(d.get("score", 0.0)),
                   datetime.fromisoformat(since) if since else None, int(d.get("cycles", 0)))


# ---- the judgement's weighing of a group -----------------------------------------------


@dataclass(frozen=True)
class Weighing:
    """How the judgement weighs a group's repeated measurements (settings read theirs from
    here; docs/analysis.md, "Weighing evidence").

    A group's log ratios to its expectation have a mean that differs from 0 for two
    reasons: a fault (a loss of at least ``min_loss`` is what must be found), and the
    group's own lasting offset from its peers (between-link variation, which no number of
    repeats averages away). ``weigh`` compares "no loss" against "``min_loss``" on the mean
    of the repeats, with the offset as a nuisance of known spread, and decides when the
    likelihood ratio passes Wald's bounds for ``false_alarm`` and ``miss`` (per decision);
    ``max_repeats`` bounds the measurements one decision may take (then the group stays a
    suspect, never an exclusion).
    """

    false_alarm: float = 1e-4
    miss: float = 0.1
    min_loss: float = 0.10
    max_repeats: int = 20
    # The between-link spread assumed at least (links are never identical), and assumed
    # where too few links of a kind ran to measure it.
    min_variation: float = 0.01
    variation_prior: float = 0.03
    # The noise of one measurement is taken as at least this.
    min_noise: float = 0.01
    # False: no test, a group is slow when every measurement of it was (below the
    # thresholds' degraded ratio), cleared by one that was not; for backends too noisy for
    # a sequential test at any affordable number of repeats (gloo).
    sequential: bool = True
    # How far below its peers a link's own normal may sit and still be its normal, in
    # between-link standard deviations (assess._choose).
    band_z: float = 2.5

    @property
    def upper(self) -> float:
        """Log-likelihood ratio at which "degraded" is decided."""
        return math.log((1 - self.miss) / self.false_alarm)

    @property
    def lower(self) -> float:
        """Log-likelihood ratio at which "healthy" is decided."""
        return math.log(self.miss / (1 - self.false_alarm))


def pooled_noise(series: Sequence[Sequence[float]], min_pairs: int = 8) -> float | None:
    """The per-measurement relative noise, pooled over groups measured more than once: the
    spread of each group's log values about their own mean (a fault or a slow link moves a
    group's mean, never its scatter). None with fewer than ``min_pairs`` degrees of
    freedom."""
    ss, dof = 0.0, 0
    for values in series:
        logs = np.log(np.asarray([v for v in values if v > 0], dtype=float))
        if logs.size >= 2:
            ss += float(((logs - logs.mean()) ** 2).sum())
            dof += logs.size - 1
    if dof < min_pairs:
        return None
    return math.sqrt(ss / dof)


@dataclass
class Decision:
    """One op of one group, weighed: the decision, how sure it is, and on what."""

    decision: str
    confidence: float
    repeats: int
    mean_ratio: float
    # The standard deviation of the mean's log ratio the decision was weighed with.
    sigma: float
    exhausted: bool
    # Decided, but on less evidence than a check should act on when it can measure again
    # (the plain rule's single slow result): the check re-measures it; a batch judged
    # after the fact (monitoring, with hysteresis across cycles) takes it as it stands.
    provisional: bool = False

    @property
    def pending(self) -> bool:
        """Worth measuring again: undecided or provisional, with repeats left."""
        return not self.exhausted and (self.decision == UNDECIDED or self.provisional)

    @property
    def degraded(self) -> bool:
        return self.decision == DEGRADED

    @property
    def cleared(self) -> bool:
        return self.decision == HEALTHY


def by_majority(bad: Sequence[bool], w: Weighing) -> Decision:
    """The plain rule: slow when every measurement was, cleared by one that was not; a
    single slow one is slow provisionally, and a check measures it again."""
    n = len(bad)
    decision = DEGRADED if n and all(bad) else HEALTHY
    return Decision(decision, 0.9, n, 0.0, 0.0, n >= w.max_repeats,
                    provisional=decision == DEGRADED and n < 2)


def weigh(ratios: Sequence[float], *, noise: float, variation: float, centre_se: float,
          w: Weighing) -> Decision:
    """Decide on a group's ratios to its expectation: healthy, degraded, or not yet.

    The mean ``m`` of the n log ratios is normal about ``log(1 - loss)`` with variance
    ``variation^2 + centre_se^2 + noise^2 / n``: the group's lasting offset from the centre
    and the centre's own error are the same on every repeat, only the noise averages down.
    The log-likelihood ratio of a loss of at least ``min_loss`` (the larger of it and the
    loss ``m`` suggests: a generalized likelihood ratio) against none;
    ``Decision.confidence`` is the posterior of the decided side at even prior odds. A link
    whose lasting offset alone could explain its mean is never decided degraded, however
    often it is measured: it stays undecided (a suspect) when its repeats run out.
    """
    n = len(ratios)
    if n == 0:
        return Decision(UNDECIDED, 0.5, 0, 1.0, 0.0, False)
    m = sum(math.log(max(r, 1e-9)) for r in ratios) / n
    s2 = variation ** 2 + centre_se ** 2 + max(noise, 1e-6) ** 2 / n
    # Degraded is composite (any loss of at least min_loss): against the loss the mean
    # itself suggests where that is larger, so a gross fault decides at once.
    ell = min(math.log(1.0 - w.min_loss), m)
    llr = (2.0 * m * ell - ell * ell) / (2.0 * s2)
    if llr >= w.upper:
        decision = DEGRADED
    elif llr <= w.lower or (n >= w.max_repeats and llr <= 0):
        # Out of repeats and more likely healthy than not: nothing to follow up.
        decision = HEALTHY
    else:
        decision = UNDECIDED
    p_bad = 1.0 / (1.0 + math.exp(-max(min(llr, 50.0), -50.0)))
    confidence = p_bad if decision == DEGRADED or (decision == UNDECIDED and llr > 0) else 1 - p_bad
    return Decision(decision, confidence, n, math.exp(m), math.sqrt(s2), n >= w.max_repeats)
