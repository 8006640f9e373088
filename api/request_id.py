"""Each request's id and its access line (docs/operations.md, "Logs").

The id is the caller's ``X-Request-ID`` where that is one plain token (1 to 128 visible
ASCII characters, no space or control character), else a fresh one: a value too long, with
a control character or sent twice is replaced, never echoed. It is on every line logged
while the request is served (services/logs.py adds it), on the answer's ``X-Request-ID``
(errors included), and on the request's one access line (``ringwatch.access``).
"""

from __future__ import annotations

import logging
import re
import time
import uuid
from typing import Any

from ringwatch.api.request_metrics import METHODS, RouteTemplates
from ringwatch.services import logs

HEADER = b"x-request-id"
MAX_LENGTH = 128
_PLAIN = re.compile(rb"[\x21-\x7e]{1,%d}" % MAX_LENGTH)

access = logging.getLogger("ringwatch.access")


def request_id_of(headers: list[tuple[bytes, bytes]]) -> str:
    """The caller's id where it is one plain token, else a fresh one."""
    sent = [value for name, value in headers if name.lower() == HEADER]
    if len(sent) == 1 and _PLAIN.fullmatch(sent[0]):
        return sent[0].decode("ascii")
    return uuid.uuid4().hex


class RequestLog:
    """ASGI middleware: give the request its id, put the id on the answer, and log one
    access line when the answer's last byte is sent: method, route template (never the raw
    path, which is the caller's text), status, duration in ms, client address.

    It reads only the headers and the status, so it stands outside every other middleware
    and sees their answers (401, 413) too. An error no handler expected is answered by the
    app's own 500 handler outside it, which puts the id on that answer itself."""

    def __init__(self, app: Any, templates: RouteTemplates) -> None:
        self.app = app
        self.templates = templates

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        rid = request_id_of(scope.get("headers") or [])
        path = scope["path"]  # routing rewrites the scope of a mount
        # Each request is served in a task of its own, so these reach no other request; they
        # are left set for the 500 handler that runs after this returns.
        logs.request_id.set(rid)
        logs.route.set(self.templates.match(path))
        status = 500  # unless an answer started before an error

        async def send_with_id(message: dict[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                headers = [h for h in message.get("headers") or [] if h[0].lower() != HEADER]
                message = {**message, "headers": [*headers, (HEADER, rid.encode())]}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            chosen = getattr(scope.get("route"), "path", None)
            route = chosen if isinstance(chosen, str) else self.templates.match(path)
            logs.route.set(route)
            method = scope["method"] if scope["method"] in METHODS else "other"
            duration_ms = round((time.perf_counter() - started) * 1000, 1)
            client = (scope.get("client") or ("", 0))[0]
            access.info("%s %s %d %.1f ms %s", method, route, status, duration_ms, client,
                        extra={"method": method, "status": status,
                               "duration_ms": duration_ms, "client": client})
