"""Callers waiting for a preflight verdict (``POST /v1/preflight?wait=N``), without a thread each.

A waiting caller is an asyncio event, not a sleeping worker thread: the worker threads are
shared with token checks, ingest and every synchronous route, and 128 callers sleeping in
them starved the whole API. One poller per event loop asks Postgres, in one short query,
which of all the waited-for requests are still unanswered, and wakes the rest. A server
that is stopping wakes every caller at once (``stop_waiting``): each is answered with its
request as it stands, and asks again (``GET /v1/preflight/{id}``) at another replica.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from anyio import to_thread
from sqlalchemy.orm import Session, sessionmaker

from ringwatch.services.errors import TooManyRequests
from ringwatch.services.preflight import service
from ringwatch.services.store import db
from ringwatch.services.store import preflight as store

POLL_S = 0.25


class PreflightWaiters:
    """At most ``capacity`` callers wait at once across every token; one more is a 429."""

    def __init__(self, factory: sessionmaker[Session], capacity: int, poll_s: float = POLL_S) -> None:
        self.factory = factory
        self.capacity = capacity
        self.poll_s = poll_s
        self._events: dict[str, list[asyncio.Event]] = {}
        self._waiting = 0
        self._poller: asyncio.Task[None] | None = None
        self.stopping = False

    @property
    def waiting(self) -> int:
        return self._waiting

    def stop_waiting(self) -> None:
        """The server is stopping: every caller waiting now is answered at once, and one
        that comes later is not made to wait. Call on the event loop's thread."""
        self.stopping = True
        for events in self._events.values():
            for event in events:
                event.set()

    def check_room(self) -> None:
        """Refuse before a request is even created when every waiting place is taken."""
        if self._waiting >= self.capacity:
            raise TooManyRequests(
                f"{self._waiting} callers are waiting for preflight verdicts, the most this "
                "server holds (RINGWATCH_MAX_WAITING_PREFLIGHTS); ask without ?wait= and poll "
                "GET /v1/preflight/{id}", retry_after_s=5.0)

    async def wait(self, body: dict[str, Any], wait_s: float,
                   hung_up: Callable[[], Awaitable[object]] | None = None) -> dict[str, Any]:
        """``body`` once its request is answered, or as it stands after ``wait_s``. The
        request exists by now: when the waiting places filled while it was written, it is
        answered as it stands (202 with its id), not refused. ``hung_up``: returns once the
        caller has gone; its place is then freed at once, not when ``wait_s`` runs out (a
        caller that hangs up and asks again would otherwise hold a place per try)."""
        if (body["status"] not in ("pending", "running") or wait_s <= 0
                or self._waiting >= self.capacity or self.stopping):
            return body
        event = asyncio.Event()
        self._events.setdefault(body["id"], []).append(event)
        self._waiting += 1
        self._ensure_poller()
        answered = asyncio.ensure_future(event.wait())
        gone = asyncio.ensure_future(hung_up()) if hung_up is not None else None
        try:
            await asyncio.wait([t for t in (answered, gone) if t is not None],
                               timeout=wait_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (answered, gone):
                if task is not None and not task.done():
                    task.cancel()
            self._waiting -= 1
            self._forget(body["id"], event)
        if gone is not None and gone.done() and not gone.cancelled() and not answered.done():
            return body  # nobody is left to read the answer
        try:
            return await to_thread.run_sync(self._read, body["id"])
        except db.UNAVAILABLE:
            if not self.stopping:
                raise
            return body  # stopping with the database away: as it was, the caller asks again

    def _read(self, request_id: str) -> dict[str, Any]:
        with db.transaction(self.factory) as s:
            return service.get(s, request_id)

    def _forget(self, request_id: str, event: asyncio.Event) -> None:
        events = self._events.get(request_id, [])
        if event in events:
            events.remove(event)
        if not events:
            self._events.pop(request_id, None)

    def _ensure_poller(self) -> None:
        # The task belongs to the running loop; a test client that closed its loop left a
        # finished (or foreign) task behind, so a new one is started.
        loop = asyncio.get_running_loop()
        if self._poller is None or self._poller.done() or self._poller.get_loop() is not loop:
            self._poller = loop.create_task(self._poll())

    async def _poll(self) -> None:
        while self._events:
            await asyncio.sleep(self.poll_s)
            ids = list(self._events)
            try:
                still = await to_thread.run_sync(self._unanswered, ids)
            except Exception:
                # The database is away for a moment: the callers keep waiting to their
                # deadline, which reads the request once more and answers with what it is.
                continue
            for request_id in set(ids) - still:
                for event in self._events.get(request_id, []):
                    event.set()

    def _unanswered(self, ids: list[str]) -> set[str]:
        with db.transaction(self.factory) as s:
            return store.unanswered(s, ids)
