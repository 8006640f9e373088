"""Rank-map checks: is a job's rank table sound, and are its hosts known and healthy?"""

from fastapi import APIRouter

from ringwatch.api.deps import ReaderDep, SessionDep
from ringwatch.api.schemas import RankMapCheckOut, RankMapIn
from ringwatch.services.rankmap import service

router = APIRouter(prefix="/v1/rank-maps", tags=["rank-maps"])


@router.post("/check", response_model=RankMapCheckOut)
def check_rank_map(body: RankMapIn, session: SessionDep, _: ReaderDep) -> dict:
    """Check a rank table, given as ``ranks`` (entries of ``rank``, ``host``, ``local_rank``
    and optionally ``gpu_uuid``) or as a ``hostfile`` (``host slots=N``, ``host:N`` or
    ``host`` a line). Each finding is a ``rank_mapping`` finding with a ``problem``:
    ``duplicate_gpu``, ``duplicate_rank``, ``missing_rank``, ``local_rank_mismatch``,
    ``non_contiguous`` (with ``crossings``, ``minimum_crossings`` and a
    ``suggested_order``), ``unknown_host`` or ``unhealthy_host`` (with the finding or
    degraded link ``because`` of which). ``ok`` is true when there is none."""
    return service.check_request(session, **body.model_dump())
