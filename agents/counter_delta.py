"""How far a cumulative hardware counter rose between two readings, and when that rise cannot
be true: the one rule the NIC, NVML and traffic readers share (docs/security.md, "Names,
counters and batch sizes").

A counter that went back was cleared or its driver reloaded (or, for a 64-bit one, wrapped):
the interval says nothing. One that rose by more than its link could carry in the interval
was misread, or its reading was planted (a jump from 0 to 2^64-1): turned into a delta it
would be a figure no link makes, and past int64 the API could not even store it. Neither is
a rise; the caller drops it and says so.
"""

from __future__ import annotations

# No counter of a link counts more events than the bits the link carried in the interval
# (bytes, 4-byte words, packets, symbols and errors all take at least a bit each); twice that
# leaves room for a rate read between two retrains and for clocks that disagree.
MARGIN = 2.0
# A shorter interval is held to a second's worth: wall clocks step, and two readings taken
# close together still see counters the driver updates in batches.
MIN_SPAN_S = 1.0


def ceiling(bits_per_s: float, interval_s: float) -> float:
    """The most a counter of a link carrying ``bits_per_s`` can rise in ``interval_s``."""
    return bits_per_s * max(interval_s, MIN_SPAN_S) * MARGIN


def rise(before: int, after: int, limit: float) -> tuple[int | None, str | None]:
    """``after - before``, or None with why where it cannot be a rise: the counter went back,
    or rose past ``limit`` (see ``ceiling``)."""
    delta = after - before
    if delta < 0:
        return None, f"went back from {before} to {after} (cleared, reloaded or wrapped)"
    if delta > limit:
        return None, (f"rose from {before} to {after}, more than its link could carry "
                      f"(at most {limit:.3g}): it cannot be true")
    return delta, None
