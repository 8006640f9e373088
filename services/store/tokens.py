"""API tokens: stored as sha256 hashes; the plain token is shown once at creation."""

from __future__ import annotations

import hashlib
import secrets

from sqlalchemy import select
from sqlalchemy.orm import Session

from services.store.models import ApiToken

ROLES = ("agent", "reader", "admin")


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def create_token(session: Session, role: str, name: str = "", token: str | None = None) -> str:
    """Store a new token for ``role`` and return it in plain text (the only time it is seen)."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
    token = token or f"rw_{secrets.token_urlsafe(32)}"
    session.add(ApiToken(role=role, name=name, token_hash=hash_token(token)))
    session.flush()
    return token


def role_of(session: Session, token: str) -> str | None:
    row = session.scalar(
        select(ApiToken.role).where(
            ApiToken.token_hash == hash_token(token), ApiToken.revoked_at.is_(None)
        )
    )
    return row
