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
