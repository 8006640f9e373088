"""A finding's headline: the one measurement every surface shows for it, naming its op and
size (docs/analysis.md, "The headline").

Pure: assessments in, one small dict out. Made where the finding is made, stored with its
incident and carried in its events unchanged, so the API, the webhooks, ``ringwatch
status``, the preflight verdict and the web page all print the same figure and text.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ringwatch.services.analyzer.assess import Assessment

_UNITS = ((1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB"))


def size_text(size_bytes: int) -> str:
    """A message size as nccl-tests' users say it: 256 MiB, 64 KiB, 1.5 MiB, 512 B."""
    for unit, name in _UNITS:
        if size_bytes >= unit:
            return f"{size_bytes / unit:.4g} {name}"
    return f"{size_bytes} B"


def gbs_text(value: float) -> str:
    """A bandwidth to three figures or whole GB/s: 238, 23.4, 4.21."""
    if value >= 100:
        return f"{value:.0f}"
    return f"{value:.1f}" if value >= 10 else f"{value:.2f}"


def headline_text(h: dict[str, Any]) -> str:
    """``allreduce 256 MiB: 122 of 238 GB/s (0.51)``."""
    return (f"{h['op']} {size_text(h['size_bytes'])}: {gbs_text(h['busbw_gbs'])} of "
            f"{gbs_text(h['expected_gbs'])} GB/s ({h['ratio']:.2f})")


def headline(op: str, size_bytes: int, busbw_gbs: float, expected_gbs: float) -> dict[str, Any]:
    """The headline object: the op (as its series names it), the size, the measured and
    expected busbw, their ratio, and the text every surface prints."""
    h: dict[str, Any] = {"op": op, "size_bytes": size_bytes, "busbw_gbs": round(busbw_gbs, 3),
                         "expected_gbs": round(expected_gbs, 3),
                         "ratio": round(busbw_gbs / expected_gbs, 4)}
    h["text"] = headline_text(h)
    return h


def deciding_result(assessments: Iterable[Assessment]) -> Assessment | None:
    """The headline's measurement among the results a finding rests on: of those judged
    (the bandwidth-bound size) with an expectation, the one at the middle by ratio (the
    lower middle of an even count: always a measurement that was taken). None where there
    is none."""
    rated = sorted((a for a in assessments
                    if a.judged and a.ratio is not None and a.expected_gbs), key=_order)
    return rated[(len(rated) - 1) // 2] if rated else None


def headline_of(a: Assessment) -> dict[str, Any]:
    """The headline of one assessed measurement (one with an expectation)."""
    m = a.measurement
    assert a.expected_gbs is not None
    return headline(m.series, m.size_bytes, m.busbw_gbs, a.expected_gbs)


def _order(a: Assessment) -> tuple[float, str, int, float, tuple[str, ...]]:
    # Ties broken by what the measurement is, so that the same results give the same
    # headline in whatever order they were judged.
    m = a.measurement
    return (a.ratio or 0.0, m.series, m.size_bytes, m.busbw_gbs, tuple(sorted(m.members)))
