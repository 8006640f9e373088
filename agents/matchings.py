"""Perfect matchings by the circle method: who meets whom, round by round.

Pure Python (no torch), shared by the probe layer and the planner: GPU pairs inside a
node, node pairs across the fleet.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

T = TypeVar("T")


def _padded(items: Sequence[T]) -> list[T | None]:
    """The tournament's seats: the items, and an empty seat (a bye) when they are odd;
    no seats for fewer than two items."""
    pool: list[T | None] = list(items)
    if len(pool) < 2:
        return []
    return pool + [None] if len(pool) % 2 else pool


def circle_matchings(items: Sequence[T], limit: int | None = None) -> list[list[tuple[T, T]]]:
    """Round-robin tournament (circle method): n - 1 perfect matchings for even n, n for odd
    n (one item sits out each round); every pair meets exactly once. ``limit``: only the
    first matchings."""
    pool = _padded(items)
    if not pool:
        return []
    n = len(pool)
    rounds = []
    for _ in range(n - 1 if limit is None else min(limit, n - 1)):
        pairs = [(pool[i], pool[n - 1 - i]) for i in range(n // 2)]
        rounds.append([(a, b) for a, b in pairs if a is not None and b is not None])
        # Keep the first item fixed and rotate the others by one.
        pool = [pool[0], pool[-1], *pool[1:-1]]
    return rounds  # type: ignore[return-value]


def circle_matching(items: Sequence[T], k: int) -> list[tuple[T, T]]:
    """The ``k``-th matching of ``circle_matchings`` (k taken modulo their number), without
    building the others: what a monitor rotating through the tournament needs each cycle."""
    pool = _padded(items)
    if not pool:
        return []
    n = len(pool)
    r = k % (n - 1)
    tail = pool[1:]
    if r:
        tail = tail[-r:] + tail[:-r]
    pool = [pool[0], *tail]
    pairs = [(pool[i], pool[n - 1 - i]) for i in range(n // 2)]
    return [(a, b) for a, b in pairs if a is not None and b is not None]  # type: ignore[misc]
