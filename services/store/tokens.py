"""API tokens: stored as sha256 hashes; the plain token is shown once at creation.

A token is looked up by its hash (an index probe, so the time taken does not depend on
how much of a guess matches), and is refused once revoked or past its expiry.
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import func, or_, select, text, update
from sqlalchemy.orm import Session

from ringwatch.agents.groups import case_twins, check_node_name
from ringwatch.agents.spec import utcnow
from ringwatch.services.errors import BadInput
from ringwatch.services.store import nodes as node_store
from ringwatch.services.store.models import ApiToken

ROLES = ("agent", "reader", "admin")
# Characters of a token's text shown to tell it apart ("rw_" and five of its 43 random
# ones); only its hash is stored, so only the one presenting it can be shown them.
SHOWN_PREFIX_CHARS = 8
# last_used_at is written at most this often per token, so reads do not all become writes.
LAST_USED_GRANULARITY_S = 60


@dataclass(frozen=True)
class Principal:
    """Who a request is from: its token's id, role, and node scope (None: every node)."""

    token_id: int
    role: str
    nodes: frozenset[str] | None = None


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def issue(session: Session, role: str, name: str = "", token: str | None = None, *,
          expires_at: datetime | None = None,
          nodes: list[str] | None = None) -> tuple[ApiToken, str]:
    """Store a new token; return its row and its plain text (the only time it is seen)."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
    if nodes is not None and role != "agent":
        raise ValueError("only agent tokens are scoped to nodes")
    if nodes is not None:
        check_scope(session, nodes)
    token = token or f"rw_{secrets.token_urlsafe(32)}"
    row = ApiToken(role=role, name=name, token_hash=hash_token(token), expires_at=expires_at,
                   nodes=sorted(set(nodes)) if nodes is not None else None)
    session.add(row)
    session.flush()
    return row, token


def check_scope(session: Session, nodes: list[str]) -> None:
    """A token's nodes are named as the fleet names them: by the node-name rule, each host
    in one case, and in the case of a node the fleet holds (the API and the CLI alike).
    A 422 (BadInput) saying which name and why otherwise."""
    for name in nodes:
        try:
            check_node_name(name)
        except ValueError as exc:
            raise BadInput(str(exc)) from None
    twins = case_twins(nodes)
    if twins:
        raise BadInput(f"the scope names one host in more than one case (host names ignore "
                       f"case): {'; '.join(' and '.join(t) for t in twins[:10])}")
    known = node_store.twins_in_fleet(session, nodes)
    if known:
        raise BadInput("node name(s) differ only in case from a node in the fleet (host names "
                       "ignore case; name each as the fleet does): "
                       + ", ".join(f"{a} (the fleet's {b})" for a, b in sorted(known.items())[:10]))


def create_token(session: Session, role: str, name: str = "", token: str | None = None, *,
                 expires_at: datetime | None = None, nodes: list[str] | None = None) -> str:
    """Store a new token for ``role`` and return it in plain text."""
    return issue(session, role, name, token, expires_at=expires_at, nodes=nodes)[1]


def expiry(ttl_days: float | None, now: datetime | None = None) -> datetime | None:
    """The expiry of a token made now that lives ``ttl_days`` (0 or None: never)."""
    if not ttl_days:
        return None
    return (now or utcnow()) + timedelta(days=ttl_days)


def authenticate(session: Session, token: str) -> Principal | str:
    """The principal of a live token, or why the token is refused."""
    return authenticate_many(session, [token])[0]


def authenticate_many(session: Session, presented: Sequence[str]) -> list[Principal | str]:
    """``authenticate`` for each of ``presented``, in one look-up and at most one write
    (the last-used times that are due), however many there are."""
    hashes = [hash_token(t) for t in presented]
    rows = {r.token_hash: r for r in session.scalars(
        select(ApiToken).where(ApiToken.token_hash.in_(sorted(set(hashes)))))}
    now = utcnow()
    stale = now - timedelta(seconds=LAST_USED_GRANULARITY_S)
    out: list[Principal | str] = []
    due: set[int] = set()
    for h in hashes:
        row = rows.get(h)
        if row is None or row.revoked_at is not None:
            out.append("unknown or revoked token")
        elif row.expires_at is not None and row.expires_at <= now:
            out.append(f"token expired at {row.expires_at.isoformat(timespec='seconds')}")
        else:
            if row.last_used_at is None or row.last_used_at < stale:
                due.add(row.id)
            out.append(Principal(row.id, row.role,
                                 frozenset(row.nodes) if row.nodes is not None else None))
    if due:
        session.execute(
            update(ApiToken).where(ApiToken.id.in_(sorted(due)),
                                   or_(ApiToken.last_used_at.is_(None),
                                       ApiToken.last_used_at < stale))
            .values(last_used_at=func.now()))
    return out


def get(session: Session, token_id: int) -> ApiToken | None:
    return session.get(ApiToken, token_id)


def shown_prefix(token: str) -> str:
    """The first characters of a token's text, to tell which token it is: at most
    SHOWN_PREFIX_CHARS and a quarter of it, so a short hand-made token is not given away."""
    return token[:min(SHOWN_PREFIX_CHARS, len(token) // 4)]


def list_tokens(session: Session, *, after_id: int = 0, limit: int = 100,
                include_revoked: bool = False) -> list[ApiToken]:
    query = select(ApiToken).where(ApiToken.id > after_id)
    if not include_revoked:
        query = query.where(ApiToken.revoked_at.is_(None))
    return list(session.scalars(query.order_by(ApiToken.id).limit(limit)))


def revoke(session: Session, token_id: int) -> ApiToken | None:
    """Revoke a token (idempotent); None when there is no such token."""
    row = session.get(ApiToken, token_id, with_for_update=True)
    if row is not None and row.revoked_at is None:
        row.revoked_at = utcnow()
        session.flush()
    return row


def bootstrap(session: Session, token: str, ttl_days: float | None) -> bool:
    """Store ``token`` as an admin token only when no token exists at all; True if stored.

    The lock makes two replicas starting at once store it once; a table with tokens in it
    (the bootstrap token revoked, or replaced by others) is left as the operator left it.
    """
    session.execute(text("LOCK TABLE api_tokens IN SHARE ROW EXCLUSIVE MODE"))
    if session.scalar(select(func.count()).select_from(ApiToken)):
        return False
    issue(session, "admin", "bootstrap", token, expires_at=expiry(ttl_days))
    return True
