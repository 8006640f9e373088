"""Preflight: may a job launch on these nodes? Durable requests that a scheduler completes."""

import asyncio
from typing import Any

from fastapi import APIRouter, Query, Request, Response, status

from ringwatch.agents.workloads import JobLayout
from ringwatch.api.deps import AgentDep, ReaderDep, SessionDep, SettingsDep
from ringwatch.api.schemas import ClaimIn, CompleteIn, PreflightIn, PreflightOut
from ringwatch.services.preflight import service
from ringwatch.services.preflight.waiting import POLL_S, PreflightWaiters

router = APIRouter(prefix="/v1/preflight", tags=["preflight"])
# A 202's Retry-After: seconds before a caller looks at its waiting request again.
RETRY_AFTER_S = "1"


def _code(body: dict, response: Response) -> dict:
    if body["status"] in ("pending", "running"):
        response.status_code = status.HTTP_202_ACCEPTED
        # When to look again (GET /v1/preflight/{id}); a server that is stopping answers its
        # waiting callers so at once, and the next look reaches another replica.
        response.headers["Retry-After"] = RETRY_AFTER_S
    return body


# A request that waits for a scheduler is answered 202 with the same body, its status
# pending or running.
WAITING: dict[int | str, dict[str, Any]] = {202: {"model": PreflightOut,
                 "description": "waiting for a scheduler: poll GET /v1/preflight/{id} after "
                                "Retry-After"}}


@router.post("", response_model=PreflightOut, response_model_exclude_unset=True,
             responses=WAITING)
async def create_preflight(body: PreflightIn, request: Request, settings: SettingsDep,
                           who: ReaderDep, response: Response,
                           wait: float = Query(default=0.0, ge=0, le=600,
                                               description="seconds to wait for a probing "
                                                           "scheduler")) -> dict:
    """The verdict for ``nodes`` (docs/formats.md, "Verdict"). Answered at once (200) when every node has
    results younger than ``max_age_s``; otherwise the request waits for a scheduler to probe
    (202 with its ``id`` and ``status``; poll ``GET /v1/preflight/{id}`` or pass ``?wait=``).
    With ``confirm``, fresh results that look unhealthy are re-probed by a scheduler first.
    With a workload ``profile`` (ddp, fsdp, moe, pipeline; and the job's ``tp``, ``pp``,
    ``dp``), a scheduler always probes: the fabric check with the profile's ops, then the
    job's own communicators at its sizes; the verdict's ``workload`` section says how they
    ran (docs/workloads.md). A layout that cannot fit the nodes' GPUs is a 422.
    A token may have RINGWATCH_MAX_PENDING_PREFLIGHTS_PER_TOKEN requests waiting at once,
    and RINGWATCH_MAX_PENDING_GATE_PREFLIGHTS_PER_TOKEN single-node ones (a node's own gate:
    a job's prologs share a token) (429 with Retry-After beyond); a caller that waits holds no worker thread, and at most
    RINGWATCH_MAX_WAITING_PREFLIGHTS callers wait at once (429 beyond). A 202 carries
    Retry-After; a server that is stopping answers its waiting callers so at once."""
    waiters: PreflightWaiters = request.app.state.preflight_waiters
    if wait > 0:
        waiters.check_room()
    job = JobLayout.from_dict(body.model_dump(include={"tp", "pp", "dp"}))
    submissions: service.Submissions = request.app.state.preflight_submissions
    out = await submissions(service.Ask(
        list(body.nodes), body.max_age_s, confirm=body.confirm, token_id=who.token_id,
        max_waiting=settings.max_pending_preflights_per_token, profile=body.profile, job=job,
        max_gate_waiting=settings.max_pending_gate_preflights_per_token))
    return _code(await waiters.wait(out, wait, hung_up=lambda: _hung_up(request)), response)


async def _hung_up(request: Request) -> None:
    """Returns once the caller has closed its connection. Its body has been read, so the
    server's next message is the disconnect (awaited, not polled)."""
    while (await request.receive())["type"] != "http.disconnect":
        await asyncio.sleep(POLL_S)  # a server that sends more: look again later


@router.get("/{request_id}", response_model=PreflightOut, response_model_exclude_unset=True,
            responses=WAITING)
def get_preflight(request_id: str, session: SessionDep, _: ReaderDep, response: Response) -> dict:
    """One preflight request: its status and, once done, its verdict."""
    return _code(service.get(session, request_id), response)


@router.post("/claim", response_model=None)
def claim_preflight(body: ClaimIn, session: SessionDep, who: AgentDep) -> Response | dict:
    """A scheduler takes the next waiting request (204 when there is none): one naming a
    single node and no workload (a node's prolog asking about itself) before any other, and
    in each lane the askers' tokens in turn, each one's oldest first. A token scoped to some
    nodes is given only requests for those nodes."""
    claimed = service.claim(session, body.worker, body.lease_s, token_id=who.token_id,
                            within=who.nodes)
    return claimed if claimed is not None else Response(status_code=status.HTTP_204_NO_CONTENT)


@router.post("/{request_id}/renew")
def renew_preflight(request_id: str, body: ClaimIn, session: SessionDep, who: AgentDep) -> dict:
    """The claiming scheduler is still probing: its lease runs ``lease_s`` from now. Only the
    token and worker holding a live claim may."""
    return service.renew(session, request_id, body.worker, body.lease_s, token_id=who.token_id)


@router.post("/{request_id}/complete")
def complete_preflight(request_id: str, body: CompleteIn, session: SessionDep,
                       settings: SettingsDep, who: AgentDep) -> dict:
    """The claiming scheduler has shipped its results: compute and store the verdict. Only
    the token and worker holding a live claim may."""
    verdict = body.verdict.model_dump(exclude_none=True) if body.verdict else None
    return service.complete(session, request_id, body.worker, body.error, settings.api_url,
                            verdict=verdict, token_id=who.token_id)
