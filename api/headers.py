"""Security headers on every answer: the web page, /docs, the JSON routes and the errors
the middlewares answer before any route (401, 413) alike.

The policy allows scripts, styles and connections from this server only, and no inline
script or style attribute at all: the pages at /ui and /docs load everything they run from
files the API serves (api/ui, api/swagger), so a value that reaches a page from the
database can never run there. No page may be framed (clickjacking).
"""

from __future__ import annotations

from typing import Any

CONTENT_SECURITY_POLICY = "; ".join((
    "default-src 'self'",
    "script-src 'self'",
    "style-src 'self'",
    # Swagger UI's stylesheet draws its icons as data: SVG.
    "img-src 'self' data:",
    "connect-src 'self'",
    "object-src 'none'",
    "base-uri 'none'",
    "form-action 'self'",
    "frame-ancestors 'none'",
))

SECURITY_HEADERS: tuple[tuple[bytes, bytes], ...] = (
    (b"content-security-policy", CONTENT_SECURITY_POLICY.encode()),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
    (b"x-frame-options", b"DENY"),
)


class SecurityHeaders:
    """ASGI middleware: add SECURITY_HEADERS to each response that does not set them itself.

    It touches only what is sent, never the request, so it may stand outside the body
    limit and authentication and cover their answers too."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_headers(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers") or [])
                present = {name.lower() for name, _ in headers}
                headers += [h for h in SECURITY_HEADERS if h[0] not in present]
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_headers)
