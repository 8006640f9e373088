"""Submit, wait for, claim and complete preflight requests.

A request whose nodes all have fresh results is answered at once, its verdict computed
from the stored results. Otherwise it waits in Postgres until a scheduler claims it,
probes the nodes with the check (services.check), ships the results and completes it
with that check's verdict (``complete``); only a completion that brings none has its
verdict computed here from what it shipped.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from ringwatch.agents.groups import node_order
from ringwatch.agents.spec import FINDING_KINDS as KNOWN_KINDS
from ringwatch.agents.spec import utcnow
from ringwatch.agents.workloads import JobLayout, LayoutError
from ringwatch.services.errors import BadInput, NotFound, RingwatchError, TooManyRequests
from ringwatch.services.monitor.stored_verdict import verdict_from_store, verdicts_from_store
from ringwatch.services.store import db, events
from ringwatch.services.store import measurements as measurement_store
from ringwatch.services.store import preflight as store
from ringwatch.services.store.batches import Batches
from ringwatch.services.store.models import PreflightRequest


def _out(req: PreflightRequest | store.Recorded) -> dict[str, Any]:
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


@dataclass(frozen=True)
class Ask:
    """One caller's preflight request, as ``submit`` takes it."""

    nodes: list[str]
    max_age_s: float
    confirm: bool = False
    token_id: int | None = None
    # The most requests this token may have waiting for a scheduler (None: no limit).
    max_waiting: int | None = None
    profile: str | None = None
    job: JobLayout | None = None
    # ... and of those, requests for one node's own gate (one node, no workload); None: as
    # ``max_waiting``.
    max_gate_waiting: int | None = None


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
    out = submit_many(session, [Ask(nodes, max_age_s, confirm, token_id, max_waiting, profile,
                                    job)], api_url)[0]
    if isinstance(out, RingwatchError):
        raise out
    return out


def submit_many(session: Session, asks: Sequence[Ask],
                api_url: str = "") -> list[dict[str, Any] | RingwatchError]:
    """``submit`` for each of ``asks`` in one transaction: the store read once for all of
    them and their requests written in one statement. Each gets its answer, or the error
    that is its own (an unknown node, a layout that does not fit, its token's 429)."""
    verdicts = verdicts_from_store(session, [(a.nodes, a.max_age_s) for a in asks])
    decided: list[tuple[dict[str, Any], dict[str, Any] | None, bool] | RingwatchError] = []
    for ask, verdict in zip(asks, verdicts, strict=True):
        if isinstance(verdict, RingwatchError):
            decided.append(verdict)
            continue
        try:
            work = _workload(session, ask.nodes, ask.profile, ask.job)
        except RingwatchError as exc:
            decided.append(exc)
            continue
        looks_well = verdict["healthy"] and not verdict.get("suspects")
        ready = (work is None and not verdict.get("unprobed")
                 and (looks_well or not ask.confirm))
        decided.append((verdict, work, ready))
    capped = {a.token_id for a, d in zip(asks, decided, strict=True)
              if not isinstance(d, RingwatchError) and not d[2]
              and a.token_id is not None and a.max_waiting is not None}
    waiting = store.waiting_counts(session, sorted(capped)) if capped else {}
    new: list[store.NewRequest] = []
    out: list[dict[str, Any] | RingwatchError | int] = []
    for ask, d in zip(asks, decided, strict=True):
        if isinstance(d, RingwatchError):
            out.append(d)
            continue
        verdict, work, ready = d
        if not ready and ask.token_id is not None and ask.max_waiting is not None:
            # A node's own gate (one node, no workload: a prolog, an epilog, an NHC check)
            # has a cap of its own, as large as a big job's start: a job's 1024 prologs
            # share one token, and a 429 there is a node let in unchecked (fail-open).
            gate = work is None and len(set(ask.nodes)) == 1
            cap = (ask.max_gate_waiting if gate and ask.max_gate_waiting is not None
                   else ask.max_waiting)
            held = waiting.get((ask.token_id, gate), 0)
            if cap is not None and held >= cap:
                out.append(_too_many(held, gate))
                continue
            waiting[(ask.token_id, gate)] = held + 1
        out.append(len(new))
        new.append(store.NewRequest(sorted(set(ask.nodes), key=node_order), ask.max_age_s,
                                    verdict if ready else None, ask.token_id, work))
    reqs = store.create_requests(session, new, utcnow())
    for req in reqs:
        if req.verdict is not None and not req.verdict["healthy"]:
            _failed_event(session, req, api_url)
    return [_out(reqs[x]) if isinstance(x, int) else x for x in out]


def _too_many(waiting: int, gate: bool = False) -> TooManyRequests:
    setting = ("RINGWATCH_MAX_PENDING_GATE_PREFLIGHTS_PER_TOKEN" if gate
               else "RINGWATCH_MAX_PENDING_PREFLIGHTS_PER_TOKEN")
    what = "single-node " if gate else ""
    return TooManyRequests(
        f"this token has {waiting} {what}preflight request(s) waiting for a scheduler, the "
        f"most it may ({setting}); wait for them (GET /v1/preflight/{{id}}) before asking "
        "again", retry_after_s=30.0)


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


# Preflight requests that arrive together, written in one transaction (a big job's prologs).
Submissions = Batches[Ask, dict[str, Any]]


def submissions(factory: sessionmaker[Session], api_url: str = "") -> Submissions:
    """``await submissions(ask)``: ``submit`` in a transaction committed on return (a
    scheduler can claim the request at once, and the caller may wait for it without a
    connection), shared with the requests that arrived beside it."""
    return Batches(factory, lambda s, asks: submit_many(s, asks, api_url))


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
    """Lease the next waiting request to ``worker``: the gate's lane (one node, no workload)
    first, the tokens taking turns in each lane (store.claim_next); a token scoped to some
    nodes gets only requests for those nodes."""
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


def _failed_event(session: Session, req: PreflightRequest | store.Recorded,
                  api_url: str) -> None:
    events.emit(session, events.preflight_failed(req.id, list(req.nodes), req.verdict or {},
                                                 api_url))
