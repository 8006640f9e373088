"""Limits enforced before and while a request body is read.

A body limit: a declared length over the limit is refused at once, and a streamed body is
cut off as soon as it passes it; either way the client gets 413 with the JSON error shape
and the limit in the message. And ingest slots: a measurement batch is read and parsed
only once it holds one, one token holds at most its share of them, and its body must come
at a bounded pace (a slower one is a 408 that frees the slot)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from ringwatch.api import errors
from ringwatch.services.errors import Busy, RetryLater, RingwatchError, TooLarge

Scope = dict[str, Any]
Message = dict[str, Any]


class BodyTooLarge(Exception):
    pass


class BodyLimit:
    """ASGI middleware: at most ``max_bytes`` of request body per request."""

    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._refuse(send)
            return
        seen = 0
        over = False
        started = False

        async def limited_receive() -> Message:
            nonlocal seen, over
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    over = True
                    raise BodyTooLarge
            return message

        async def guarded_send(message: Message) -> None:
            # Once the body overflowed, whatever the app answers (its body parser turns the
            # exception into a 400) is replaced by the 413.
            nonlocal started
            if over:
                if message["type"] == "http.response.start" and not started:
                    started = True
                    await self._refuse(send)
                return
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, limited_receive, guarded_send)
        except BodyTooLarge:
            if not started:
                started = True
                await self._refuse(send)

    async def _refuse(self, send: Any) -> None:
        await errors.send(send, TooLarge(f"request body over the limit of {self.max_bytes} bytes "
                                         "(RINGWATCH_MAX_BODY_BYTES); send smaller batches"))


class SlowBody(RetryLater):
    """A request body that came slower than the server reads bodies inside an ingest slot.
    (An HTTP matter, so it lives here; the one error handler maps it like the rest.)"""

    status_code = 408
    code = "body_too_slow"


class ClientGone(RingwatchError):
    """The client closed the connection before its body was whole (nobody reads the
    answer; the slot is freed all the same)."""

    code = "client_gone"


@dataclass(frozen=True)
class BodyPace:
    """How fast a body read inside an ingest slot must come: whole within ``timeout_s``,
    and, once ``grace_s`` have passed, at least ``min_bytes_per_s`` on average since the
    read began (0: no floor). Two bodies at a byte a second held both slots for days."""

    timeout_s: float = 60.0
    min_bytes_per_s: int = 16384
    grace_s: float = 5.0

    def deadline(self, started: float, received: int) -> float:
        """When a read that began at ``started`` and has ``received`` bytes is too slow,
        unless more come first."""
        by_rate = (max(self.grace_s, received / self.min_bytes_per_s)
                   if self.min_bytes_per_s > 0 else self.timeout_s)
        return started + min(self.timeout_s, by_rate)


async def _chunks(receive: Any, pace: BodyPace) -> AsyncIterator[bytes]:
    """The request body's chunks from ASGI ``receive``, at ``pace``: SlowBody (408) when it
    comes slower, ClientGone when the client hangs up."""
    loop = asyncio.get_running_loop()
    started = loop.time()
    received = 0
    while True:
        remaining = pace.deadline(started, received) - loop.time()
        try:
            if remaining <= 0:
                raise TimeoutError
            message = await asyncio.wait_for(receive(), timeout=remaining)
        except TimeoutError:
            raise SlowBody(
                f"the request body came too slowly ({received} bytes in "
                f"{loop.time() - started:.0f} s); a batch must arrive within "
                f"{pace.timeout_s:g} s (RINGWATCH_INGEST_BODY_TIMEOUT_S) at "
                f"{pace.min_bytes_per_s} bytes/s or more (RINGWATCH_INGEST_BODY_MIN_BYTES_PER_S)",
                retry_after_s=5.0) from None
        if message["type"] == "http.disconnect":
            raise ClientGone("the client closed the connection before its body was whole")
        body = message.get("body", b"")
        received += len(body)
        yield body
        if not message.get("more_body", False):
            return


async def read_body(receive: Any, pace: BodyPace) -> bytes:
    """The whole request body, at ``pace`` (``_chunks``)."""
    return b"".join([chunk async for chunk in _chunks(receive, pace)])


async def drain_body(receive: Any, pace: BodyPace) -> None:
    """Read and drop the request body, at ``pace`` and no further: a client that writes its
    whole body before it reads (urllib, requests) then reads the refusal it is about to get,
    where a connection closed under its unread body resets it mid-write. A body over the
    body limit is still cut there (BodyLimit's 413)."""
    with contextlib.suppress(SlowBody, ClientGone):
        async for _ in _chunks(receive, pace):
            pass


class IngestSlots:
    """At most ``slots`` measurement batches are read, parsed and stored at once, and one
    token (``holder``) holds at most ``share`` of them: half, rounded up.

    A slot is taken before the body is read, so concurrent large batches cannot each hold
    a parsed copy in memory (three 25 MiB batches took the server from 374 to 1,710 MiB
    when bodies were parsed first); the body is then read at a bounded pace (``BodyPace``).
    The share keeps one token's batches, slow or many, from taking every slot while other
    agents wait. Waiting is awaited, not a worker thread; one that waits longer than
    ``wait_s`` is a 503 with Retry-After.
    """

    def __init__(self, slots: int, wait_s: float) -> None:
        self.slots = slots
        self.share = (slots + 1) // 2
        self.wait_s = wait_s
        self._held: dict[Any, int] = {}
        self._waiters: list[asyncio.Future[None]] = []
        self._loop: asyncio.AbstractEventLoop | None = None

    def _check_loop(self) -> None:
        # Waiters belong to one event loop; a server has one, a test client one each.
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            self._loop, self._waiters = loop, []

    def _busy(self, holder: Any) -> str | None:
        """Why ``holder`` cannot take a slot now (None: it can)."""
        if sum(self._held.values()) >= self.slots:
            return (f"{self.slots} batch(es) are being stored; retry after the interval given "
                    "(RINGWATCH_MAX_CONCURRENT_INGESTS)")
        if self._held.get(holder, 0) >= self.share:
            return (f"this token has {self.share} batch(es) being stored, its share of the "
                    f"{self.slots} ingest slots (RINGWATCH_MAX_CONCURRENT_INGESTS); retry "
                    "after the interval given")
        return None

    async def acquire(self, holder: Any = None) -> None:
        """Take a slot for ``holder``, waiting up to ``wait_s``; Busy (503) when none came
        free. A free slot is taken at once, whatever ``wait_s`` is."""
        self._check_loop()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.wait_s
        while (why := self._busy(holder)) is not None:
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise Busy(why, retry_after_s=5.0)
            woken: asyncio.Future[None] = loop.create_future()
            self._waiters.append(woken)
            try:
                await asyncio.wait_for(woken, timeout=remaining)
            except TimeoutError:
                pass
            finally:
                if woken in self._waiters:
                    self._waiters.remove(woken)
        self._held[holder] = self._held.get(holder, 0) + 1

    def release(self, holder: Any = None) -> None:
        left = self._held.get(holder, 0) - 1
        if left > 0:
            self._held[holder] = left
        else:
            self._held.pop(holder, None)
        # Every waiter looks again: which of them may take the slot depends on its token.
        waiters, self._waiters = self._waiters, []
        for woken in waiters:
            if not woken.done():
                woken.set_result(None)

    @contextlib.asynccontextmanager
    async def hold(self, holder: Any = None) -> AsyncIterator[None]:
        await self.acquire(holder)
        try:
            yield
        finally:
            self.release(holder)
