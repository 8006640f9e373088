"""Submit, wait for, claim and complete preflight requests.

A request whose nodes all have fresh results is answered at once, its verdict computed
from the stored results. Otherwise it waits in Postgres until a scheduler claims it,
probes the nodes with the check (services.check), ships the results and completes it
with that check's verdict (``complete``); only a completion that brings none has its
verdict computed here from what it shipped.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from agents.groups import node_order
from agents.spec import FINDING_KINDS as KNOWN_KINDS
from agents.spec import utcnow
from agents.workloads import JobLayout, LayoutError
from services.errors import BadInput, NotFound, TooManyRequests
from services.monitor.stored_verdict import verdict_from_store
from services.store import db, events
from services.store import measurements as measurement_store
from services.store import preflight as store
from services.store.models import PreflightRequest


def _out(req: PreflightRequest) -> dict[str, Any]:
    body: dict[str, Any] = {"id": req.id, "status": req.status, "nodes": list(req.nodes),
                            "max_age_s": req.max_age_s, "created_at": req.created_at,
                            "completed_at": req.completed_at, "attempts": req.attempts}
    if req.workload:
        body.update(req.workload)
    if req.error:
        body["error"] = req.error
    if req.verdict is not None:
        body = {**req.verdict, **body}
    return body


def submit(session: Session, nodes: list[str], max_age_s: float, api_url: str = "",
           confirm: bool = False, *, token_id: int | None = None,
           max_waiting: int | None = None, profile: str | None = None,
           job: JobLayout | None = None) -> dict[str, Any]:
    """Record a request; answer it now if every node has fresh results (and, with
    ``confirm``, they look healthy: a suspect is re-probed before a job is refused).
    A request with a workload ``profile`` (and the ``job``'s parallel layout) always waits
    for a scheduler: monitoring never runs a job's own communicators.
    A token with ``max_waiting`` requests already waiting for a scheduler gets a 429
    rather than another (each one costs a scheduler a preflight's probing)."""
    verdict = verdict_from_store(session, nodes, max_age_s)  # 404s unknown nodes
    work = _workload(session, nodes, profile, job)
    looks_well = verdict["healthy"] and not verdict.get("suspects")
    ready = (work is None and not verdict.get("unprobed")
             and (looks_well or not confirm))
    if not ready and token_id is not None and max_waiting is not None:
        waiting = store.waiting_count(session, token_id)
        if waiting >= max_waiting:
            raise TooManyRequests(
                f"this token has {waiting} preflight request(s) waiting for a scheduler, the "
                f"most it may (RINGWATCH_MAX_PENDING_PREFLIGHTS_PER_TOKEN); wait for them "
                "(GET /v1/preflight/{id}) before asking again", retry_after_s=30.0)
    req = store.create_request(session, sorted(set(nodes), key=node_order), max_age_s, verdict if ready else None,
                               utcnow(), token_id=token_id, workload=work)
    if ready and not verdict["healthy"]:
        _failed_event(session, req, api_url)
    return _out(req)


def _workload(session: Session, nodes: list[str], profile: str | None,
              job: JobLayout | None) -> dict[str, Any] | None:
    """What a profiled request stores for its scheduler; a layout that cannot fit the
    nodes' GPUs, as their agents reported them, is refused now rather than after a claim."""
    if profile is None:
        return None
    layout = job or JobLayout()
    gpus = measurement_store.gpu_counts(session, nodes)
    if gpus and len(gpus) == len(set(nodes)):
        try:
            layout.resolve(sum(gpus.values()), max(gpus.values()))
        except LayoutError as exc:
            raise BadInput(f"{exc} ({len(gpus)} node(s), {sum(gpus.values())} GPUs)") from None
    return {"profile": profile, "job": layout.to_dict()}


def submit_committed(factory: sessionmaker[Session], nodes: list[str], max_age_s: float,
                     api_url: str = "", confirm: bool = False, *,
                     token_id: int | None = None, max_waiting: int | None = None,
                     profile: str | None = None, job: JobLayout | None = None) -> dict[str, Any]:
    """``submit`` in a transaction of its own, committed on return: a scheduler can claim the
    request at once, and the caller may wait for it (services.preflight.waiting) without
    holding a database connection."""
    with db.transaction(factory) as s:
        return submit(s, nodes, max_age_s, api_url, confirm, token_id=token_id,
                      max_waiting=max_waiting, profile=profile, job=job)


def get(session: Session, request_id: str) -> dict[str, Any]:
    req = store.get_request(session, request_id)
    if req is None:
        raise NotFound(f"no preflight request {request_id}")
    return _out(req)


def claim(session: Session, worker: str, lease_s: float, *, token_id: int | None = None,
          within: frozenset[str] | None = None) -> dict[str, Any] | None:
    """Lease the oldest waiting request to ``worker`` (a token scoped to some nodes gets only
    requests for those nodes)."""
    req = store.claim_next(session, worker, lease_s, utcnow(), token_id=token_id, within=within)
    return _out(req) if req else None


def _held(req: PreflightRequest, request_id: str, worker: str, token_id: int | None, now: datetime) -> None:
    """Only the holder of a live claim completes or renews a request: an unclaimed one, or
    one whose lease ran out (another scheduler may hold it now), cannot be answered by
    anyone who asks; and the error does not name the holder."""
    holder = req.claim_token_id is None or req.claim_token_id == token_id
    if req.status != "running" or req.claimed_by != worker or not holder:
        raise BadInput(f"preflight request {request_id} is not claimed by this worker "
                       "(claim it first with POST /v1/preflight/claim)")
    if req.lease_until is not None and req.lease_until < now:
        raise BadInput(f"the claim on preflight request {request_id} expired; claim it again")


def renew(session: Session, request_id: str, worker: str, lease_s: float, *,
          token_id: int | None = None) -> dict[str, Any]:
    """Extend a live claim by ``lease_s`` from now: a scheduler whose check outlasts its
    lease (a large, noisy fleet) keeps the request while it is still probing."""
    req = store.get_request(session, request_id)
    if req is None:
        raise NotFound(f"no preflight request {request_id}")
    now = utcnow()
    _held(req, request_id, worker, token_id, now)
    store.renew(session, req, now, lease_s)
    return _out(req)


def complete(session: Session, request_id: str, worker: str, error: str | None = None,
             api_url: str = "", verdict: dict[str, Any] | None = None, *,
             token_id: int | None = None) -> dict[str, Any]:
    """Finish a claimed request: with the verdict of the scheduler's own preflight, or one
    computed from the results it has just shipped."""
    req = store.get_request(session, request_id)
    if req is None:
        raise NotFound(f"no preflight request {request_id}")
    if req.status not in ("running", "pending"):
        raise BadInput(f"preflight request {request_id} is already {req.status}")
    now = utcnow()
    _held(req, request_id, worker, token_id, now)
    if verdict is not None:
        _check_verdict(verdict, list(req.nodes))
        verdict = {**verdict, "source": "probed"}
    elif error is None:
        # Results probed for this request are fresh however small max_age_s was.
        window = max(req.max_age_s, (now - req.created_at).total_seconds() + 1.0)
        verdict = verdict_from_store(session, list(req.nodes), window)
    store.complete(session, req, verdict, now, error)
    if verdict is not None and not verdict["healthy"]:
        _failed_event(session, req, api_url)
    return _out(req)


def _check_verdict(verdict: dict[str, Any], nodes: list[str]) -> None:
    """A scheduler's verdict names only the request's nodes and findings of known kinds."""
    outside = sorted(set(verdict.get("exclude") or []) - set(nodes), key=node_order)
    if outside:
        raise BadInput(f"verdict excludes nodes the request did not name: {', '.join(outside[:10])}")
    unknown = sorted({str(f.get("kind")) for f in verdict.get("findings") or []} - set(KNOWN_KINDS))
    if unknown:
        raise BadInput(f"verdict has findings of unknown kind: {', '.join(unknown)}")
    if verdict.get("healthy") and (verdict.get("findings") or verdict.get("exclude")):
        raise BadInput("a healthy verdict has no findings and excludes no node")


def _failed_event(session: Session, req: PreflightRequest, api_url: str) -> None:
    events.emit(session, events.preflight_failed(req.id, list(req.nodes), req.verdict or {},
                                                 api_url))
