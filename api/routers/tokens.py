"""API tokens (admin): create, list, revoke; and any token's own description."""

from fastapi import APIRouter, Query, Request, Response, status

from ringwatch.api.auth import bearer
from ringwatch.api.deps import AdminDep, ReaderDep, SessionDep, SettingsDep
from ringwatch.api.pages import link_next
from ringwatch.api.schemas import TokenIn, TokenInfoOut, TokenOut, TokenSelfOut
from ringwatch.services.errors import NotFound
from ringwatch.services.store import tokens

router = APIRouter(prefix="/v1/tokens", tags=["tokens"])


def _info(row) -> dict:
    return {"id": row.id, "role": row.role, "name": row.name, "created_at": row.created_at,
            "expires_at": row.expires_at, "last_used_at": row.last_used_at,
            "revoked_at": row.revoked_at, "nodes": row.nodes}


@router.post("", response_model=TokenOut, status_code=status.HTTP_201_CREATED)
def create_token(body: TokenIn, session: SessionDep, settings: SettingsDep, _: AdminDep) -> dict:
    """Create a token; its plain text is in this response only. It expires after
    ``expires_in_days`` (default RINGWATCH_TOKEN_TTL_DAYS; 0: never); an agent token with
    ``nodes`` may report results and answer preflights for those nodes only."""
    ttl = settings.token_ttl_days if body.expires_in_days is None else body.expires_in_days
    row, plain = tokens.issue(session, body.role, body.name, expires_at=tokens.expiry(ttl),
                              nodes=list(body.nodes) if body.nodes is not None else None)
    return {**_info(row), "token": plain}


@router.get("", response_model=list[TokenInfoOut])
def list_tokens(request: Request, response: Response, session: SessionDep, _: AdminDep,
                after: int = Query(default=0, ge=0, description="the id the previous page ended at"),
                limit: int = Query(default=100, ge=1, le=1000),
                include_revoked: bool = False) -> list[dict]:
    """Tokens by id (never their text), with when each was last used and when it expires."""
    rows = tokens.list_tokens(session, after_id=after, limit=limit,
                              include_revoked=include_revoked)
    link_next(request, response, rows, limit, rows[-1].id if rows else None)
    return [_info(r) for r in rows]


@router.get("/self", response_model=TokenSelfOut)
def token_self(request: Request, session: SessionDep, who: ReaderDep) -> dict:
    """The token this request presents, for any role: its id, role, name, the first few
    characters of its text (``prefix``; never the rest), its expiry and its node scope. A
    scheduler or script can warn before its own token expires."""
    row = tokens.get(session, who.token_id)
    if row is None:  # gone since the middleware looked it up
        raise NotFound(f"no token {who.token_id}")
    presented = bearer(request.scope.get("headers") or []) or ""
    return {"id": row.id, "role": row.role, "name": row.name,
            "prefix": tokens.shown_prefix(presented), "expires_at": row.expires_at,
            "nodes": row.nodes}


@router.delete("/{token_id}", status_code=status.HTTP_204_NO_CONTENT)
def revoke_token(token_id: int, session: SessionDep, _: AdminDep) -> Response:
    """Revoke a token: every request with it is refused from now on (revoking twice is
    harmless)."""
    if tokens.revoke(session, token_id) is None:
        raise NotFound(f"no token {token_id}")
    return Response(status_code=status.HTTP_204_NO_CONTENT)
