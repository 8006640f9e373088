"""Authentication before anything reads the request body.

FastAPI parses and validates a body before it runs an endpoint's dependencies, so a
token checked in a dependency comes too late: a client with no token could make the API
read and parse whatever it sent, and learn from a 422 what the schema wants. This ASGI
middleware looks the bearer token up first (in a short transaction shared with the tokens
presented beside it, services.store.batches, so no database connection is held while the
endpoint works or waits) and answers 401 at once;
the endpoint's role check then reads the principal it left in the request's state.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy.exc import OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from sqlalchemy.orm import Session, sessionmaker

from ringwatch.api import errors
from ringwatch.services.errors import Unauthorized
from ringwatch.services.store import tokens
from ringwatch.services.store.batches import Batches
from ringwatch.services.store.tokens import Principal

# The API's description, browsable (api/routers/docs.py), and the Swagger UI files it loads.
DOCS_PATH = "/docs"
DOCS_ASSETS_PREFIX = "/docs/assets"
# Paths anyone may read without a token (liveness and readiness, the API's own description,
# and /metrics unless RINGWATCH_METRICS_TOKEN_REQUIRED; that check is the route's own).
PUBLIC_PATHS = frozenset({"/healthz", "/readyz", "/metrics", "/openapi.json", DOCS_PATH})
# The web page's static shell (api/routers/ui.py): it holds no data, only the code that
# asks the API for it with the user's token.
UI_PREFIX = "/ui"
STATE_KEY = "principal"
MISSING_TOKEN = "missing bearer token: send 'Authorization: Bearer <token>'"


def bearer(headers: list[tuple[bytes, bytes]]) -> str | None:
    """The bearer token of an Authorization header; "" when the header is malformed."""
    for name, value in headers:
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            return token.strip() if scheme.lower() == "bearer" else ""
    return None


def is_public(path: str) -> bool:
    return (path in PUBLIC_PATHS or path.startswith(DOCS_ASSETS_PREFIX + "/")
            or path == UI_PREFIX or path.startswith(UI_PREFIX + "/"))


class Authenticate:
    """ASGI middleware: resolve the bearer token to a Principal, or refuse with 401."""

    def __init__(self, app: Any, session_factory: sessionmaker[Session]) -> None:
        self.app = app
        # Tokens presented together are looked up together (a big job's prologs ask at once).
        self.lookup: Batches[str, Principal | str] = Batches(session_factory,
                                                             tokens.authenticate_many)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        token = bearer(scope.get("headers") or [])
        if token is None and is_public(scope.get("path", "")):
            await self.app(scope, receive, send)
            return
        if not token:
            await _refuse(send, MISSING_TOKEN)
            return
        try:
            found = await self.lookup(token)
        except (PoolTimeout, OperationalError) as exc:
            await errors.send(send, errors.unavailable(exc))
            return
        if isinstance(found, str):
            await _refuse(send, found)
            return
        scope.setdefault("state", {})[STATE_KEY] = found
        await self.app(scope, receive, send)


async def _refuse(send: Any, reason: str) -> None:
    await errors.send(send, Unauthorized(reason), {"WWW-Authenticate": "Bearer"})
