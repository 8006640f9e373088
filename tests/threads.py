"""Ranks as threads of the test process: one function per rank, errors brought back."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any


def on_threads(n: int, fn: Callable[[int], Any], timeout_s: float) -> list[Any]:
    """``fn(rank)`` on ``n`` threads; the results by rank. Any rank's exception fails the
    calling test (raised here, in the test's own thread)."""
    results: list[Any] = [None] * n
    errors: list[BaseException] = []

    def work(rank: int) -> None:
        try:
            results[rank] = fn(rank)
        except BaseException as exc:  # reported to the test thread below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
    assert not errors, errors
    return results
