"""Evidence, weighed: a group's repeated measurements, and slow drift across cycles.

Pure functions and small state objects over busbw ratios, for the judgement of weak
faults in noisy, uneven fleets (docs/analysis.md, "Weighing evidence" and "Slow drift"):

- ``weigh``: healthy, degraded or not yet, from a group's ratios to its expectation, with
  the link's lasting offset from its peers as a nuisance no number of repeats averages
  away; a suspect is re-measured until the evidence decides, within ``max_repeats``.
- ``Cusum``: a one-sided CUSUM on a place's ratio across cycles, for a slight loss that
  persists: it accumulates what one cycle cannot show and says since when.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from functools import lru_cache
from statistics import NormalDist
from typing import Any

# MAD to standard deviation for normal data.
MAD_TO_SIGMA = 1.4826
# A median's standard error, in standard deviations times sqrt(n), for normal data.
MEDIAN_SE = 1.2533

DEGRADED, HEALTHY, UNDECIDED = "degraded", "healthy", "undecided"

# What a run estimates of itself (its noise, the variation between links, the spread of a
# kind's peers) is taken to this step of its log (2.5 %, so at most 1.25 % off): within
# what each is known to (a thousand degrees of freedom leave 2 % of error in a noise
# estimate; a spread read from a few hundred groups, several times that), and coarse
# enough that one round's repeats seldom move it. A check judging again after every round
# then assesses and weighs again only the groups its new measurements touched, not every
# group whenever a repeat nudged an estimate.
ESTIMATE_STEP = 0.025


def stepped(x: float) -> float:
    """``x`` on the ``ESTIMATE_STEP`` grid of its log (0 stays 0: a run without noise)."""
    return math.exp(round(math.log(x) / ESTIMATE_STEP) * ESTIMATE_STEP) if x > 0 else 0.0


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
    miss: float = 0.2
    min_loss: float = 0.10
    max_repeats: int = 20
    # How far healthy links of one kind differ from each other for good (one standard
    # deviation, relative): a setting of the fleet, which a run replaces with its own
    # figure only where it measures it beyond doubt (localize.measured_variation; under
    # noise of several percent it cannot).
    variation_prior: float = 0.03
    # What a run that measures its between-link variation may take it down to: links of
    # one kind are never assumed more alike than this.
    min_variation: float = 0.005
    # The noise of one measurement is taken as at least this.
    min_noise: float = 0.01
    # Until the run has measured its noise, a slow decision must also stand at this much
    # noise (the noisiest fabric the weak-fault regime plans for): a stand-in read off a
    # few peers, or the variation prior under the hardware model, can be half the real
    # noise, and two low readings then look like a fault (a fault-free 2-node fleet at 8 %
    # noise excluded a node so).
    unmeasured_noise: float = 0.08
    # False: no test, a group is slow when every measurement of it was (below the
    # thresholds' degraded ratio), cleared by one that was not; for backends too noisy for
    # a sequential test at any affordable number of repeats (gloo).
    sequential: bool = True
    # How far below its peers a link's own normal may sit and still be its normal, in
    # between-link standard deviations (assess._choose).
    band_z: float = 2.5
    # Futility: a group leaning healthy stops being re-measured once no mean within this
    # many standard errors of its own could pass either bound by ``max_repeats`` (its
    # lasting offset, not the noise, keeps it undecided); one link, once the slow bound is
    # not within this many spreads of the mean its repeats predict (``weigh``).
    futility_z: float = 2.0
    # A group whose verdict only steers the plan (the world group, the path search's
    # unions, an intra-node group) is followed up instead of re-measured once its
    # log-likelihood ratio leans slow by this much (odds of about 7 to 1).
    follow_up_llr: float = 2.0
    # A slow decision rests on at least this many measurements of the group: one is
    # provisional, and a check measures it again (a batch judged after the fact takes it as
    # it stands). One measurement's tail, a hiccup of the machine, or a 4-sigma draw of the
    # noise among the tens of thousands a large check takes, then never excludes a node by
    # itself; a real fault costs one repeat of its group.
    confirm_repeats: int = 2
    # A group whose clearing prunes (the world group, the search's unions: every path in
    # it is dropped from the search for good) is cleared on at least this many
    # measurements: one reading high by the noise must not lose a path.
    confirm_clear: int = 2
    # The smallest loss a check is built to find (the size its recall is held to): a group
    # that names a place is decided once its evidence shows it cannot hide a loss this
    # large (``can_hide``), and a union of many paths is weighed against the shortfall one
    # path this slow would leave on it (``union_min_loss``).
    smallest_loss: float = 0.15
    # A union's test misses a slow path this often at most (``miss`` is a link's): a
    # union cleared takes every path in it out of the search for good, and a region
    # across two halves has one union, which decides alone (a union of 62 nodes holding
    # a path of 17 % cleared on two readings at 1.008 of its model under ``miss``).
    union_miss: float = 0.05
    # "Cannot hide": the mean sits this many of its standard deviations (lasting offset,
    # centre's error and noise together) above the smallest loss.
    hide_z: float = 2.0
    # The chance that one check excludes any healthy GPU pair, node or NIC, or names a
    # healthy path: a slow decision of one link must also stand against the noise measured
    # in the run, below the edge of the healthy band, at this rate shared among the places
    # the check judged (``stands_apart``).
    false_exclusion_rate: float = 0.01
    # Where the healthy band of one kind's links ends below their centre, in between-link
    # standard deviations: a healthy link may sit this low for good, and is never excluded
    # for it.
    exclusion_band_z: float = 2.0

    @property
    def terminal_z(self) -> float:
        """The one-sided normal quantile of ``false_alarm``: where a link whose repeats ran
        out is decided degraded (``weigh``'s ``terminal``)."""
        return NormalDist().inv_cdf(1.0 - self.false_alarm)

    def family_z(self, places: int) -> float:
        """The one-sided normal quantile a slow decision's noise must pass in a check that
        judged ``places`` places: ``false_exclusion_rate`` shared among them (a union
        bound)."""
        return _family_z(self.false_exclusion_rate, max(places, 1))

    def union_min_loss(self, nodes: int, variation: float | None = None,
                       lift: float = 0.0) -> float:
        """The loss a union of ``nodes`` nodes is weighed against: what one path losing
        ``smallest_loss`` takes off it, now that it runs at the slowest of its paths
        (``slowest_path_share``), where that is less than ``min_loss``. A world group
        of 1024 nodes is expected at 0.866 of its node pairs: a path 15 % slow takes it
        only to 0.85, 1.8 % under, and a union weighed against a 10 % loss cleared it.
        ``variation``: the node pairs' lasting spread where the run measured it (else the
        prior); ``lift``: how far (in log) the run's healthy unions read above that model
        (``localize.UnionLevels``), which a slow path takes off as well."""
        return _union_min_loss(self.smallest_loss, self.min_loss,
                               self.variation_prior if variation is None else variation, nodes,
                               round(lift, 4))

    @property
    def upper(self) -> float:
        """Log-likelihood ratio at which "degraded" is decided."""
        return math.log((1 - self.miss) / self.false_alarm)

    @property
    def lower(self) -> float:
        """Log-likelihood ratio at which "healthy" is decided."""
        return math.log(self.miss / (1 - self.false_alarm))


@lru_cache(maxsize=256)
def _family_z(rate: float, places: int) -> float:
    return NormalDist().inv_cdf(1.0 - rate / places)


@lru_cache(maxsize=4096)
def slowest_path_share(nodes: int, variation: float) -> float:
    """Where a healthy group of ``nodes`` nodes runs, as a share of its median node pair: it
    loads every path between its nodes and runs at the slowest, the expected least of
    nodes * (nodes - 1) / 2 paths whose lasting offsets spread by ``variation`` (normal: a
    bounded spread ends sooner, so this errs low, towards fewer false leads)."""
    paths = max(nodes * (nodes - 1) // 2, 1)
    return math.exp(-variation * NormalDist().inv_cdf(1.0 - 1.0 / (paths + 1)))


@lru_cache(maxsize=4096)
def _union_min_loss(smallest: float, min_loss: float, variation: float, nodes: int,
                    lift: float = 0.0) -> float:
    share = min(slowest_path_share(nodes, variation) * math.exp(lift), 1.0)
    if lift > 0:
        # Held to its peers, not the model: the slow path's own node pair may sit a lasting
        # offset above the median pair, and what it is left with is that much higher.
        share /= 1.0 + variation
    return min(min_loss, max(1.0 - (1.0 - smallest) / share, 0.005))


@lru_cache(maxsize=4096)
def slowest_spread_share(nodes: int) -> float:
    """How far the slowest of a union's paths strays from where it is expected, as a share
    of how far one path does: the least of P normal draws has a standard deviation of about
    (pi / sqrt 6) / sqrt(2 ln P) of theirs (its Gumbel limit), a third of it at 64 nodes.
    Weighed with one path's lasting offset, a union's test could neither clear it nor hold
    it against the small shortfall one slow path leaves on it (``union_min_loss``)."""
    paths = max(nodes * (nodes - 1) // 2, 1)
    if paths < 3:
        return 1.0
    return min(1.0, (math.pi / math.sqrt(6.0)) / math.sqrt(2.0 * math.log(paths)))


def can_hide(m: float, s2: float, w: Weighing) -> bool:
    """Whether a group whose mean log ratio is ``m``, of variance ``s2`` (its lasting offset,
    its centre's error and the noise left in the mean), could still hide a loss of
    ``w.smallest_loss``: its mean is not ``w.hide_z`` standard deviations above it."""
    return m - math.log(1.0 - w.smallest_loss) <= w.hide_z * math.sqrt(s2)


def stands_apart(m: float, noise_var: float, variation: float, places: int,
                 w: Weighing) -> bool:
    """Whether a slow decision stands at the check's false-exclusion rate: the mean log
    ratio ``m`` lies below the edge of the healthy band (``exclusion_band_z`` lasting
    offsets under the centre, where a healthy link may sit for good) by ``family_z(places)``
    standard errors of the noise left in it (``noise_var``: the measured noise over the
    repeats, and the centre's error). A healthy link anywhere in its band passes it with
    probability at most ``false_exclusion_rate / places`` at each look: so a check of
    ``places`` places excludes a healthy one at about that rate at most (docs/analysis.md,
    "The false-exclusion rate", for the looks a sequential test takes)."""
    edge = math.log(max(1.0 - w.exclusion_band_z * variation, 1e-6))
    return m - edge <= -w.family_z(places) * math.sqrt(max(noise_var, 1e-12))


def noise_terms(values: Sequence[float]) -> tuple[float, int]:
    """One group's repeats as evidence of the noise: the squared deviations of their log
    values about their own mean (a fault or a slow link moves a group's mean, never its
    scatter), and their degrees of freedom; (0, 0) for fewer than two positive values."""
    # Plain floats: a group has a few repeats, and a check asks this of thousands of them.
    logs = [math.log(v) for v in values if v > 0]
    if len(logs) < 2:
        return 0.0, 0
    mean = math.fsum(logs) / len(logs)
    return math.fsum((x - mean) ** 2 for x in logs), len(logs) - 1


@dataclass
class Decision:
    """One op of one group, weighed: the decision, how sure it is, and on what."""

    decision: str
    confidence: float
    repeats: int
    mean_ratio: float
    # The standard deviation of the mean's log ratio the decision was weighed with.
    sigma: float
    # No repeat worth taking: ``max_repeats`` reached, or none could pass either bound.
    exhausted: bool
    # Decided, but on less evidence than a check should act on when it can measure again
    # (the plain rule's single slow result): the check re-measures it; a batch judged
    # after the fact (monitoring, with hysteresis across cycles) takes it as it stands.
    provisional: bool = False
    # The log-likelihood ratio of slow against healthy: above 0, the evidence so far leans
    # slow.
    llr: float = 0.0

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
    # The plain rule has no likelihood: ``llr`` carries only which way it leaned (below
    # ``follow_up_llr``, so a provisional slow result is measured again, never skipped).
    return Decision(decision, 0.9, n, 0.0, 0.0, n >= w.max_repeats,
                    provisional=decision == DEGRADED and n < w.confirm_repeats,
                    llr=1.0 if decision == DEGRADED else -1.0)


def weigh(ratios: Sequence[float], *, noise: float, variation: float, centre_se: float,
          w: Weighing, futility: bool = True, early_clear: bool = False,
          terminal: bool = False) -> Decision:
    """Decide on a group's ratios to its expectation: healthy, degraded, or not yet.

    The mean ``m`` of the n log ratios is normal about ``log(1 - loss)`` with variance
    ``variation^2 + centre_se^2 + noise^2 / n``: the group's lasting offset from the centre
    and the centre's own error are the same on every repeat, only the noise averages down.
    The log-likelihood ratio of a loss of at least ``min_loss`` (the larger of it and the
    loss ``m`` suggests: a generalized likelihood ratio) against none;
    ``Decision.confidence`` is the posterior of the decided side at even prior odds. A link
    whose lasting offset alone could explain its mean is never decided degraded, however
    often it is measured: it stays undecided (a suspect) when its repeats run out, or as
    soon as no plausible mean could pass either bound by then (``futility``; off while the
    variance itself is a stand-in that repeats will sharpen). ``early_clear``: one leaning
    healthy also stops, cleared, once the slow bound alone is out of reach: for one link,
    on which a loss shows in full (a GPU pair; a node pair on enough readings, since
    cleared it proves both its NICs); never for a group that runs at its slowest of many
    edges (a node's intra-node ring, a union of paths), a few percent under its
    expectation when one edge of it is 15 % slow.

    ``terminal``: one link whose repeats ran out undecided is decided degraded when its mean
    sits at least ``Weighing.terminal_z`` standard deviations below its expectation (a
    fixed-sample test at ``false_alarm`` on its last look; Wald's bound before that asks
    for more, to pay for the looks). The judgement asks it for GPU pairs: a node pair's
    evidence is pooled over its ends' partners to tell a NIC from a path, and a pair
    decided alone takes it out of that pooling.
    """
    n = len(ratios)
    m = sum(math.log(max(r, 1e-9)) for r in ratios) / n if n else 0.0
    return weigh_log_mean(m, n, noise=noise, variation=variation, centre_se=centre_se, w=w,
                          futility=futility, early_clear=early_clear, terminal=terminal)


def weigh_log_mean(m: float, n: int, *, noise: float, variation: float, centre_se: float,
                   w: Weighing, futility: bool = True, early_clear: bool = False,
                   terminal: bool = False) -> Decision:
    """``weigh`` of ``n`` ratios whose logs have mean ``m``."""
    if n == 0:
        return Decision(UNDECIDED, 0.5, 0, 1.0, 0.0, False)
    noise = max(noise, 1e-6)
    floor = variation ** 2 + centre_se ** 2
    s2 = floor + noise ** 2 / n
    llr = _llr(m, s2, w)
    exhausted = n >= w.max_repeats
    if futility and not exhausted and w.lower < llr <= 0:
        # Leaning healthy: would the repeats left decide it? Only the noise term shrinks.
        big_n = w.max_repeats
        s2_end = floor + noise ** 2 / big_n
        if early_clear:
            # The mean they would end at is predicted by the repeats so far (its spread
            # shrinks to 0 at the last repeat); if the slow bound is not within
            # ``futility_z`` of that spread, no loss can show: cleared now, as it would
            # be when its repeats ran out.
            reach = w.futility_z * noise * math.sqrt((big_n - n) / (n * big_n))
            exhausted = _llr(m - reach, s2_end, w) < w.upper
        else:
            # Stopped only where no plausible mean (its own within ``futility_z``
            # standard errors) could pass either bound by the last repeat. One leaning
            # slow is measured on: a loss that is there shows itself with repeats.
            reach = w.futility_z * noise / math.sqrt(n)
            exhausted = (_llr(m - reach, s2_end, w) < w.upper
                         and _llr(m + reach, s2_end, w) > w.lower)
    # No repeat would decide an exhausted group that is more likely healthy than not:
    # nothing to follow up.
    decision = _decide(llr, w, healthy_lean=exhausted)
    if (terminal and decision == UNDECIDED and n >= w.max_repeats
            and m <= -w.terminal_z * math.sqrt(s2)):
        decision = DEGRADED
    return Decision(decision, _confidence(decision, llr), n, math.exp(m), math.sqrt(s2),
                    exhausted, provisional=decision == DEGRADED and n < w.confirm_repeats,
                    llr=llr)


def out_of_reach(m: float, floor: float, w: Weighing) -> bool:
    """Whether no number of readings at a mean log ratio ``m`` could clear a group whose
    variance never falls below ``floor`` (its lasting offset and its centre's error): its
    log-likelihood ratio with the noise averaged away is still above Wald's healthy bound.
    Only the noise averages down; a union whose slowest path sits a little low for good
    leans healthy, yet more of the same readings leave it where it is."""
    return _llr(m, max(floor, 1e-12), w) > w.lower


def followed_up(d: Decision) -> Decision:
    """``d`` left undecided and not measured again (a suspect whose narrower tests run
    instead: a union's regions are split)."""
    return replace(d, exhausted=True)


def held_open(d: Decision) -> Decision:
    """``d`` kept undecided with its evidence (the check measures it again), whatever it
    leaned to."""
    return replace(d, decision=UNDECIDED, provisional=False,
                   confidence=_confidence(UNDECIDED, d.llr))


def cleared_now(d: Decision) -> Decision:
    """``d`` decided healthy, its repeats done (``can_hide`` says no loss of the check's
    smallest size fits its evidence)."""
    return replace(d, decision=HEALTHY, exhausted=True, provisional=False,
                   confidence=_confidence(HEALTHY, d.llr))


def unconfirmed(d: Decision) -> Decision:
    """``d`` held open: a healthy decision on too few readings to act on (``Weighing.
    confirm_clear``), kept undecided with its evidence so the check measures it again."""
    if d.decision != HEALTHY:
        return d
    return replace(d, decision=UNDECIDED, confidence=_confidence(UNDECIDED, d.llr))


def weigh_mean(m: float, s2: float, repeats: int, w: Weighing) -> Decision:
    """Decide on a mean log ratio ``m`` of variance ``s2`` already pooled by the caller
    (a NIC's evidence over its partners): Wald's bounds on the same likelihood ratio as
    ``weigh``, with no repeats of its own to ask for."""
    llr = _llr(m, s2, w)
    decision = _decide(llr, w)
    return Decision(decision, _confidence(decision, llr), repeats, math.exp(m), math.sqrt(s2),
                    False, llr=llr)


def _decide(llr: float, w: Weighing, healthy_lean: bool = False) -> str:
    """Wald's bounds; with ``healthy_lean``, a log-likelihood ratio at or below 0 is
    healthy too."""
    if llr >= w.upper:
        return DEGRADED
    if llr <= w.lower or (healthy_lean and llr <= 0):
        return HEALTHY
    return UNDECIDED


def _confidence(decision: str, llr: float) -> float:
    """The posterior of the side decided (or leaned to) at even prior odds."""
    p_bad = 1.0 / (1.0 + math.exp(-max(min(llr, 50.0), -50.0)))
    return p_bad if decision == DEGRADED or (decision == UNDECIDED and llr > 0) else 1 - p_bad


def _llr(m: float, s2: float, w: Weighing) -> float:
    """Log-likelihood ratio of "a loss of at least ``min_loss``" against "none" for a mean
    log ratio ``m`` of variance ``s2``. Degraded is composite: against the loss the mean
    itself suggests where that is larger (a generalized likelihood ratio), so a gross fault
    decides at once."""
    ell = min(math.log(1.0 - w.min_loss), m)
    return (2.0 * m * ell - ell * ell) / (2.0 * s2)
