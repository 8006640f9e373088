"""Request dependencies: the database session (one transaction per request) and the role
check on the principal that api.auth resolved before the body was read."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated

from fastapi import Depends, Request
from sqlalchemy.orm import Session

from ringwatch.api.auth import MISSING_TOKEN, STATE_KEY
from ringwatch.services.errors import Forbidden, Unauthorized
from ringwatch.services.settings import Settings
from ringwatch.services.store import db
from ringwatch.services.store.tokens import Principal

# Which roles may do what; admin may do everything.
READ_ROLES = frozenset({"reader", "admin", "agent"})
WRITE_ROLES = frozenset({"agent", "admin"})
ADMIN_ROLES = frozenset({"admin"})


def get_session(request: Request) -> Iterator[Session]:
    """One transaction per request: commit when the endpoint returns, roll back on error.

    Bound with ``scope="function"`` below, so the commit happens before the response is
    sent: a 2xx means the write is durable (a client that reads straight after it, or a
    shipper that deletes its spooled copy on it, can rely on that)."""
    with db.transaction(request.app.state.session_factory) as session:
        yield session


# The dependencies that only read the request are coroutines: FastAPI runs a plain function
# in its worker threads, and a hop there and back for each of them per request queued behind
# every database call (a big job's prologs, a thousand requests at once).
async def get_settings(request: Request) -> Settings:
    return request.app.state.settings


SessionDep = Annotated[Session, Depends(get_session, scope="function")]
SettingsDep = Annotated[Settings, Depends(get_settings)]


def principal(request: Request) -> Principal:
    """The request's principal, as the Authenticate middleware resolved it."""
    found = request.scope.get("state", {}).get(STATE_KEY)
    if found is None:
        # Only public paths pass the middleware without a token.
        raise Unauthorized(MISSING_TOKEN)
    return found


def require(roles: frozenset[str]):
    def check(request: Request) -> Principal:
        who = principal(request)
        if who.role not in roles:
            raise Forbidden(f"role {who.role!r} may not do this; needs one of {sorted(roles)}")
        return who

    return check


def _requiring(roles: frozenset[str]):
    """``require(roles)`` as a dependency that runs on the event loop (see get_settings)."""
    check = require(roles)

    async def checked(request: Request) -> Principal:
        return check(request)

    return checked


ReaderDep = Annotated[Principal, Depends(_requiring(READ_ROLES))]
AgentDep = Annotated[Principal, Depends(_requiring(WRITE_ROLES))]
AdminDep = Annotated[Principal, Depends(_requiring(ADMIN_ROLES))]
