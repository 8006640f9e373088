"""Request dependencies: the database session (one transaction per request) and auth."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated

from fastapi import Depends, Request
from sqlalchemy.orm import Session

from services.config import Settings
from services.errors import Forbidden, Unauthorized
from services.store import db, tokens

# Which roles may do what; admin may do everything.
READ_ROLES = frozenset({"reader", "admin", "agent"})
WRITE_ROLES = frozenset({"agent", "admin"})
ADMIN_ROLES = frozenset({"admin"})


def get_session(request: Request) -> Iterator[Session]:
    """One transaction per request: commit when the endpoint returns, roll back on error."""
    with db.transaction(request.app.state.session_factory) as session:
        yield session


def get_settings(request: Request) -> Settings:
    return request.app.state.settings


SessionDep = Annotated[Session, Depends(get_session)]
SettingsDep = Annotated[Settings, Depends(get_settings)]


def _role(request: Request, session: Session) -> str:
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise Unauthorized("missing bearer token: send 'Authorization: Bearer <token>'")
    role = tokens.role_of(session, token.strip())
    if role is None:
        raise Unauthorized("unknown or revoked token")
    return role


def require(roles: frozenset[str]):
    def check(request: Request, session: SessionDep) -> str:
        role = _role(request, session)
        if role not in roles:
            raise Forbidden(f"role {role!r} may not do this; needs one of {sorted(roles)}")
        return role

    return check


ReaderDep = Annotated[str, Depends(require(READ_ROLES))]
AgentDep = Annotated[str, Depends(require(WRITE_ROLES))]
AdminDep = Annotated[str, Depends(require(ADMIN_ROLES))]
