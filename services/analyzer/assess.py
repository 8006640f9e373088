"""Judge each measurement against what its link should do: peers, the link's history, presets.

Pure functions over ``agents.spec.Measurement``: no database, no backend. The rules
(which expectation wins, which sizes are judged) are explained in docs/analysis.md.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from agents.spec import Measurement

# A hardware-preset figure for one measurement, or None where the preset has none.
Expected = Callable[[Measurement], "float | None"]
# The key under which peers are compared: they must have done the same work.
PeerKey = tuple[str, str, int, str, int]
# A link's identity across rounds: the same ranks doing the same op at the same size.
LinkKey = tuple[str, str, int, str, tuple[str, ...]]


@dataclass(frozen=True)
class Thresholds:
    """When a ratio measured/expected counts as degraded, and how badly."""

    degraded_ratio: float = 0.7
    critical_ratio: float = 0.5
    # Fewer peers than this and the peer source is not used.
    min_peers: int = 1
    # A high quantile: in a small fleet the median of the peers can itself be faulty.
    peer_quantile: float = 0.75
    # History needs this many past values before it becomes an expectation.
    min_history: int = 5
    history_window: int = 50
    # A value more than this many MADs below the history median is an outlier too.
    history_mad_k: float = 6.0
    # Where a preset exists, the expectation is never below this share of it: peers that
    # are all slow together (one bad node in every group of a search) can't vouch for
    # each other. Below 1 because real links reach a little less than their datasheet.
    preset_floor: float = 0.9
    # Below this share of its hardware profile's rated busbw a measurement is degraded
    # whatever its peers and history say (agents.profiles; RINGWATCH_RATED_FLOOR).
    rated_floor: float = 0.5

    def severity(self, ratio: float) -> str:
        return "critical" if ratio < self.critical_ratio else "warning"


# Modeled and NCCL fabrics: every suspect is re-tested before anyone is blamed (in a
# preflight and in each monitoring cycle alike), so 0.85 is affordable and catches a
# 0.75-factor fault under 3 % noise.
PREFLIGHT_THRESHOLDS = Thresholds(degraded_ratio=0.85)
# gloo times CPU processes that share cores: tens of percent of jitter.
GLOO_THRESHOLDS = Thresholds()


def thresholds_for(backend: str) -> Thresholds:
    """The one judgement's thresholds for a backend's results: monitoring, probe and
    preflight (fresh or stored) all use these."""
    return GLOO_THRESHOLDS if backend == "gloo" else PREFLIGHT_THRESHOLDS


@dataclass
class Assessment:
    """One measurement and the verdict on it."""

    measurement: Measurement
    expected_gbs: float | None
    ratio: float | None
    bad: bool
    # "peers", "history", "preset", "rated" (below the profile's floor), "latency" (small
    # size, not judged) or "none".
    source: str
    severity: str | None = None
    # False for latency-bound sizes: their ratio is informative, never a verdict.
    judged: bool = True


@dataclass(frozen=True)
class Baseline:
    """Robust summary of a link's past busbw values."""

    median: float
    mad: float
    count: int


def peer_key(m: Measurement) -> PeerKey:
    return (m.op, m.scope, m.size_bytes, m.dtype, len(m.members))


def link_key(m: Measurement) -> LinkKey:
    return (m.op, m.scope, m.size_bytes, m.dtype, tuple(sorted(m.members)))


def history_baseline(values: Sequence[float], window: int = 50) -> Baseline | None:
    """Median and MAD of the last ``window`` values; None for an empty history."""
    recent = np.asarray(list(values)[-window:], dtype=float)
    recent = recent[np.isfinite(recent) & (recent > 0)]
    if recent.size == 0:
        return None
    median = float(np.median(recent))
    return Baseline(median, float(np.median(np.abs(recent - median))), int(recent.size))


def history_expected(values: Sequence[float], t: Thresholds = Thresholds()) -> float | None:
    """What the link's own history says it should do, or None with too little history.

    The median is the expectation; the MAD only widens it where the link is naturally
    noisy, so a jittery link is not called degraded for its usual jitter.
    """
    b = history_baseline(values, t.history_window)
    if b is None or b.count < t.min_history:
        return None
    # 1.4826 * MAD estimates a normal sigma; the floor keeps a too-quiet history usable.
    sigma = 1.4826 * b.mad
    floor = b.median - t.history_mad_k * sigma
    if floor < t.critical_ratio * b.median:
        # So noisy that even a critical loss would pass as its usual jitter: no baseline.
        # Saying so beats an expectation near zero that no measurement can ever miss.
        return None
    # Expressed as the expectation whose degraded threshold lands on ``floor``.
    return min(b.median, floor / t.degraded_ratio)


def leave_one_out_quantile(values: np.ndarray, q: float) -> np.ndarray:
    """For each value, the q-quantile (linear interpolation) of all the others."""
    k = values.size
    if k < 2:
        return np.full(k, np.nan)
    order = np.argsort(values, kind="stable")
    s = values[order]
    h = q * (k - 2)
    lo = int(np.floor(h))
    hi = min(lo + 1, k - 2)
    frac = h - lo
    rank = np.empty(k, dtype=int)
    rank[order] = np.arange(k)
    # Index j of the array without element r is j (j < r) or j + 1 (j >= r).
    v_lo = s[lo + (lo >= rank)]
    v_hi = s[hi + (hi >= rank)]
    return v_lo + frac * (v_hi - v_lo)


def judged_flags(measurements: Sequence[Measurement]) -> list[bool]:
    """True for the largest size each group ran an op at: smaller sizes are latency-bound."""
    largest: dict[tuple[str, str, tuple[str, ...]], int] = {}
    for m in measurements:
        key = (m.op, m.scope, tuple(sorted(m.members)))
        largest[key] = max(largest.get(key, 0), m.size_bytes)
    return [m.size_bytes == largest[(m.op, m.scope, tuple(sorted(m.members)))] for m in measurements]


def _peer_expectations(measurements: Sequence[Measurement], t: Thresholds) -> list[float | None]:
    by_key: dict[PeerKey, list[int]] = defaultdict(list)
    for i, m in enumerate(measurements):
        by_key[peer_key(m)].append(i)
    out: list[float | None] = [None] * len(measurements)
    for idx in by_key.values():
        if len(idx) - 1 < max(t.min_peers, 1):
            continue
        values = np.array([measurements[i].busbw_gbs for i in idx], dtype=float)
        for i, e in zip(idx, leave_one_out_quantile(values, t.peer_quantile), strict=True):
            out[i] = float(e) if np.isfinite(e) and e > 0 else None
    return out


def _choose(
    peer: float | None, hist: float | None, preset: float | None, t: Thresholds
) -> tuple[float | None, str]:
    """Peers first: measured under the same conditions, they cancel what presets can't know
    (software versions, real link efficiency). History next, preset where nothing else is;
    and a preset floors whatever was chosen."""
    floor = preset * t.preset_floor if preset is not None and preset > 0 else None
    for value, source in ((peer, "peers"), (hist, "history")):
        if value is not None and value > 0:
            if floor is not None and value < floor:
                return floor, "preset"
            return value, source
    if preset is not None and preset > 0:
        return preset, "preset"
    return None, "none"


def assess(
    measurements: Iterable[Measurement],
    thresholds: Thresholds = Thresholds(),
    expected: Expected | None = None,
    history: Mapping[LinkKey, Sequence[float]] | None = None,
) -> list[Assessment]:
    """One Assessment per measurement, in order.

    ``expected`` is a hardware preset (busbw in GB/s or None); ``history`` maps a
    ``link_key`` to that link's past busbw values, oldest first.
    """
    ms = list(measurements)
    t = thresholds
    peers = _peer_expectations(ms, t)
    judged = judged_flags(ms)
    out: list[Assessment] = []
    for m, peer, is_judged in zip(ms, peers, judged, strict=True):
        past = history.get(link_key(m)) if history else None
        hist = history_expected(past, t) if past else None
        preset = expected(m) if expected is not None else None
        value, source = _choose(peer, hist, preset, t)
        ratio = m.busbw_gbs / value if value else None
        bad = is_judged and ratio is not None and ratio < t.degraded_ratio
        rated = m.rated_gbs
        if is_judged and not bad and rated and m.busbw_gbs < t.rated_floor * rated:
            # Peers and history may all be slow alike: the hardware's rating is not.
            value, source, ratio, bad = rated, "rated", m.busbw_gbs / rated, True
        out.append(Assessment(
            measurement=m, expected_gbs=value, ratio=ratio, bad=bad,
            source=source if is_judged else "latency",
            severity=t.severity(ratio) if bad and ratio is not None else None,
            judged=is_judged,
        ))
    return out
