"""One scheduler per fleet: the lease its active scheduler holds, and the fleet's rotation
(docs/operations.md, "One scheduler per fleet"). No route takes a time from its caller:
the lease runs on the database's clock."""

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Request, Response, status
from pydantic import AfterValidator

from ringwatch.api.deps import WRITE_ROLES, ReaderDep, SessionDep, require
from ringwatch.api.schemas import (
    FLEET_NAME_PATTERN,
    CycleIn,
    CycleOut,
    ErrorOut,
    FleetOut,
    LeaseIn,
    LeaseOut,
    printable,
)
from ringwatch.services.errors import Forbidden
from ringwatch.services.store import fleets
from ringwatch.services.store.tokens import Principal

router = APIRouter(prefix="/v1/scheduler", tags=["scheduler"])

_write = require(WRITE_ROLES)


def fleet_scheduler(request: Request) -> Principal:
    """An agent or admin token for the whole fleet: a token scoped to some nodes speaks for
    those nodes only, never for the fleet's schedule."""
    who = _write(request)
    if who.nodes is not None:
        raise Forbidden("a token scoped to nodes may not schedule the fleet; use an unscoped "
                        "agent token")
    return who


SchedulerDep = Annotated[Principal, Depends(fleet_scheduler)]
# The query's fleet and holder, bounded as LeaseIn's are.
FleetQuery = Annotated[str, Query(min_length=1, max_length=128, pattern=FLEET_NAME_PATTERN)]
HolderQuery = Annotated[str, Query(min_length=1, max_length=255), AfterValidator(printable)]
CONFLICT: dict[int | str, dict[str, Any]] = {
    409: {"model": ErrorOut, "description": "the asker does not hold the fleet's lease "
                                            "(not_leader)"}}


@router.post("/lease", response_model=LeaseOut)
def take_lease(body: LeaseIn, session: SessionDep, who: SchedulerDep) -> dict:
    """Take the fleet's lease for ``lease_s`` seconds, or renew it as its holder. ``leader``
    says whether the asker holds it now; where another scheduler does, ``holder`` names it
    and ``expires_at`` says until when (it takes over once the lease runs out, ``term``
    one higher). The expiry is on the database's clock; renew well within ``lease_s``."""
    got = fleets.take_lease(session, body.fleet, body.holder, body.lease_s, who.token_id)
    return {"fleet": got.fleet, "holder": got.holder, "leader": got.leader, "term": got.term,
            "expires_at": got.expires_at, "lease_s": body.lease_s, "cycle": got.cycle}


@router.delete("/lease", status_code=status.HTTP_204_NO_CONTENT)
def release_lease(session: SessionDep, who: SchedulerDep, fleet: FleetQuery,
                  holder: HolderQuery) -> Response:
    """Hand the fleet's lease back (a clean stop): a standby takes it at its next ask.
    Harmless where ``holder`` does not hold it."""
    fleets.release_lease(session, fleet, holder, who.token_id)
    return Response(status_code=status.HTTP_204_NO_CONTENT)


@router.post("/cycle", response_model=CycleOut, responses=CONFLICT)
def start_cycle(body: CycleIn, session: SessionDep, who: SchedulerDep) -> dict:
    """Start the fleet's next cycle: its number (one more than the last, whoever started
    that) and the node-pair tournament's ``slots`` for ``nodes``: a node keeps its slot, a
    node gone leaves its slot vacant (null), a new node takes the lowest vacant slot or one
    at the end. Only the holder of the unexpired lease may (409 ``not_leader`` otherwise)."""
    cycle, slots = fleets.start_cycle(session, body.fleet, body.holder, body.nodes,
                                      who.token_id)
    return {"fleet": body.fleet, "cycle": cycle, "slots": slots}


@router.get("/fleets", response_model=list[FleetOut])
def list_fleets(session: SessionDep, _: ReaderDep) -> list[dict]:
    """Every fleet's scheduler: who holds its lease until when (on the database's clock),
    its term, the number of its last cycle and the nodes in its rotation."""
    return [{"name": f.name, "holder": f.holder, "term": f.term,
             "lease_expires_at": f.lease_expires_at, "cycle": f.cycle, "nodes": f.nodes}
            for f in fleets.fleet_states(session)]
