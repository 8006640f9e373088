"""The API's one error shape, ``{"error", "message"}``, for exception handlers and for the
ASGI middlewares that answer before any route (body limit, authentication)."""

from __future__ import annotations

import json
from typing import Any

from fastapi.responses import JSONResponse
from sqlalchemy.exc import OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout

from ringwatch.services.errors import Busy, DatabaseUnavailable, RetryLater, RingwatchError
from ringwatch.services.store import db


def body(code: str, message: str, detail: list | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"error": code, "message": message}
    if detail is not None:
        out["detail"] = detail
    return out


def headers_of(exc: RingwatchError) -> dict[str, str]:
    if isinstance(exc, RetryLater):
        return {"Retry-After": str(max(1, round(exc.retry_after_s)))}
    return {}


def response(exc: RingwatchError) -> JSONResponse:
    return JSONResponse(status_code=exc.status_code, content=body(exc.code, exc.message),
                        headers=headers_of(exc))


def unavailable(exc: PoolTimeout | OperationalError) -> RetryLater:
    """What a client is told when the database cannot serve it: retry later."""
    if isinstance(exc, PoolTimeout):
        # Every database connection is busy: back off, do not pile on.
        return Busy("the database is busy (no free connection); retry later", retry_after_s=5)
    reason = str(exc.orig).splitlines()[0] if exc.orig else "unavailable"
    db.OUTAGE.failed(reason)  # a line when the outage starts and one a minute, not per request
    return DatabaseUnavailable(f"the database is unavailable or too slow ({reason}); "
                               "retry later", retry_after_s=10)


async def send(send_: Any, exc: RingwatchError, headers: dict[str, str] | None = None) -> None:
    """Answer an ASGI request with ``exc`` as the JSON error shape."""
    raw = json.dumps(body(exc.code, exc.message)).encode()
    extra = {**headers_of(exc), **(headers or {})}
    await send_({"type": "http.response.start", "status": exc.status_code,
                 "headers": [(b"content-type", b"application/json"),
                             (b"content-length", str(len(raw)).encode()),
                             *((k.lower().encode(), v.encode()) for k, v in extra.items())]})
    await send_({"type": "http.response.body", "body": raw})
