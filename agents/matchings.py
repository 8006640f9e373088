"""Perfect matchings by the circle method: who meets whom, round by round.

Pure Python (no torch), shared by the probe layer and the planner: GPU pairs inside a
node, node pairs across the fleet.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

from ringwatch.agents.groups import node_order

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


def reconcile_slots(slots: Sequence[object], nodes: Sequence[str]) -> tuple[list[str | None], bool]:
    """A fleet's tournament seats (``slots``: node names, None for a vacant seat) brought up
    to the nodes now present, so that the rest keep their place: a node that left leaves
    its seat vacant, a node that joined takes the lowest vacant seat (else a new one at the
    end), trailing vacancies are trimmed. Stored seats that are not a list of distinct
    names and vacancies (hand-edited, corrupted) are rebuilt from the nodes in order; the
    second value says so."""
    present: set[str] = set(nodes)
    valid = isinstance(slots, list | tuple) and all(s is None or isinstance(s, str) for s in slots)
    names = [s for s in slots if s is not None] if valid else []
    if not valid or len(names) != len(set(names)):
        ordered: list[str] = sorted(present, key=node_order)
        return list[str | None](ordered), True
    seats: list[str | None] = [s if s in present else None for s in slots]  # type: ignore[misc]
    seated = {s for s in seats if s is not None}
    vacant = (i for i, s in enumerate(seats) if s is None)
    for node in sorted(present - seated, key=node_order):
        i = next(vacant, None)
        if i is None:
            seats.append(node)
        else:
            seats[i] = node
    while seats and seats[-1] is None:
        seats.pop()
    return seats, False

