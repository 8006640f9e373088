"""Calls that arrive together share one transaction: those that come while one runs wait for
the next, which runs them all at once.

A big job's start sends a request per node at once (each node's prolog asks about itself).
A transaction each for its token and one for its preflight, 1024 of each queued for the
worker threads and the pool's connections, made prologs wait 10 s for what the store held;
shared, a few transactions answer them all, and no caller holds a thread or a connection
while it waits. Each call still reads the database after it arrived.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

from anyio import to_thread
from sqlalchemy.exc import OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from sqlalchemy.orm import Session, sessionmaker

from ringwatch.services.store import db

T = TypeVar("T")
R = TypeVar("R")

# The most calls one transaction runs: a burst larger than this runs in several in turn,
# none of them long.
MAX_BATCH = 256


class _Queue(Generic[T, R]):
    """The calls waiting for the next transaction on one event loop, and the task that
    runs them."""

    def __init__(self) -> None:
        self.calls: list[tuple[T, asyncio.Future[R]]] = []
        self.runner: asyncio.Task[None] | None = None


class Batches(Generic[T, R]):
    """``await batches(item)``: ``run(session, items)[i]`` for the ``items`` gathered, in a
    transaction committed before anyone is answered. ``run`` answers each item with its
    result or with the error that is its own (``Exception`` instances, raised to that
    caller alone); an error it raises reaches every caller of the batch, except where one
    item's value undid the transaction (the database refused it): then each item is run
    alone, and only its caller hears."""

    def __init__(self, factory: sessionmaker[Session],
                 run: Callable[[Session, list[T]], Sequence[R | Exception]],
                 max_batch: int = MAX_BATCH) -> None:
        self.factory = factory
        self.run = run
        self.max_batch = max_batch
        # Per event loop: a test client's loop that ended leaves its queue behind, unused.
        self._queues: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Queue[T, R]] = (
            weakref.WeakKeyDictionary())

    async def __call__(self, item: T) -> R:
        loop = asyncio.get_running_loop()
        queue = self._queues.setdefault(loop, _Queue())
        answer: asyncio.Future[R] = loop.create_future()
        queue.calls.append((item, answer))
        if queue.runner is None or queue.runner.done():
            queue.runner = loop.create_task(self._run_all(queue))
        return await answer

    async def _run_all(self, queue: _Queue[T, R]) -> None:
        while queue.calls:
            batch, queue.calls = queue.calls[:self.max_batch], queue.calls[self.max_batch:]
            live = [(i, a) for i, a in batch if not a.done()]  # a caller that left is not run
            if not live:
                continue
            outcomes: Sequence[R | BaseException]
            try:
                outcomes = await to_thread.run_sync(self._in_transaction, [i for i, _ in live])
            except Exception as exc:  # the database is away: every caller hears it
                outcomes = [exc] * len(live)
            for (_, answer), outcome in zip(live, outcomes, strict=True):
                if answer.done():
                    continue
                if isinstance(outcome, BaseException):
                    answer.set_exception(outcome)
                else:
                    answer.set_result(outcome)

    def _in_transaction(self, items: list[T]) -> Sequence[R | Exception]:
        try:
            with db.transaction(self.factory) as s:
                return self.run(s, items)
        except (OperationalError, PoolTimeout):
            raise
        except Exception:
            if len(items) == 1:
                raise
        return [self._alone(i) for i in items]

    def _alone(self, item: T) -> R | Exception:
        try:
            with db.transaction(self.factory) as s:
                return self.run(s, [item])[0]
        except Exception as exc:
            return exc
