"""A request body limit enforced before anything reads the body: a declared length over
the limit is refused at once, and a streamed body is cut off as soon as it passes it.
Either way the client gets 413 with the JSON error shape and the limit in the message."""

from __future__ import annotations

from typing import Any

from api import errors
from services.errors import TooLarge

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
