"""``POST /v1/preflight``: may a job launch on these nodes?"""

from fastapi import APIRouter

from api.deps import ReaderDep, SessionDep
from api.schemas import PreflightIn
from services.analyzer.stored_verdict import verdict_from_store

router = APIRouter(prefix="/v1", tags=["preflight"])


@router.post("/preflight")
def preflight(body: PreflightIn, session: SessionDep, _: ReaderDep) -> dict:
    """The verdict of DESIGN.md for ``nodes`` from results younger than ``max_age_s``.
    Nodes without fresh results are listed in ``unprobed`` and make the verdict unhealthy."""
    return verdict_from_store(session, list(body.nodes), body.max_age_s)
