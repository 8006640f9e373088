"""Limits enforced before anything reads a request body.

A body limit: a declared length over the limit is refused at once, and a streamed body is
cut off as soon as it passes it; either way the client gets 413 with the JSON error shape
and the limit in the message. And ingest slots: a measurement batch is read and parsed
only once it holds one."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

from api import errors
from services.errors import Busy, TooLarge

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


class IngestSlots:
    """At most ``slots`` measurement batches are read, parsed and stored at once.

    A slot is taken before the body is read, so concurrent large batches cannot each hold
    a parsed copy in memory (three 25 MiB batches took the server from 374 to 1,710 MiB
    when bodies were parsed first). Waiting for a slot is an awaited semaphore, not a
    worker thread; one that waits longer than ``wait_s`` is a 503 with Retry-After.
    """

    def __init__(self, slots: int, wait_s: float) -> None:
        self.slots = slots
        self.wait_s = wait_s
        self._semaphore: asyncio.Semaphore | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def _current(self) -> asyncio.Semaphore:
        # A semaphore belongs to one event loop; a server has one, a test client one each.
        loop = asyncio.get_running_loop()
        if self._semaphore is None or self._loop is not loop:
            self._semaphore, self._loop = asyncio.Semaphore(self.slots), loop
        return self._semaphore

    async def acquire(self) -> None:
        """Take a slot, waiting up to ``wait_s``; Busy (503) when none came free."""
        semaphore = self._current()
        try:
            if semaphore.locked():
                await asyncio.wait_for(semaphore.acquire(), timeout=self.wait_s)
            else:
                await semaphore.acquire()  # free: taken at once, whatever wait_s is
        except TimeoutError:
            raise Busy(f"{self.slots} batch(es) are being stored; retry after the interval "
                       "given (RINGWATCH_MAX_CONCURRENT_INGESTS)", retry_after_s=5.0) from None

    def release(self) -> None:
        self._current().release()

    @contextlib.asynccontextmanager
    async def hold(self) -> AsyncIterator[None]:
        await self.acquire()
        try:
            yield
        finally:
            self.release()
