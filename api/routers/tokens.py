"""API tokens (admin)."""

from fastapi import APIRouter, status

from api.deps import AdminDep, SessionDep
from api.schemas import TokenIn, TokenOut
from services.store import tokens

router = APIRouter(prefix="/v1/tokens", tags=["tokens"])


@router.post("", response_model=TokenOut, status_code=status.HTTP_201_CREATED)
def create_token(body: TokenIn, session: SessionDep, _: AdminDep) -> dict:
    """Create a token; its plain text is in this response only."""
    return {"role": body.role, "name": body.name,
            "token": tokens.create_token(session, body.role, body.name)}
