"""Durable preflight requests and their claims (``FOR UPDATE SKIP LOCKED``)."""

from __future__ import annotations

import uuid
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import bindparam, func, or_, select, text
from sqlalchemy.dialects.postgresql import ARRAY, DOUBLE_PRECISION
from sqlalchemy.orm import Session

from services.store.models import PreflightRequest

# Upper bounds (seconds) of the latency buckets a verdict is counted in: an answer from
# stored results takes milliseconds, one a scheduler probes for takes its check (seconds to
# minutes). Bounds may be added; a verdict counted under an old bound stays there.
LATENCY_BOUNDS = (0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)

# One verdict into its bucket: the smallest bound at or above its latency (created_at is
# the database's clock, completed_at the API's; a negative span is counted as none).
_OBSERVE = text("""
INSERT INTO preflight_latency (answered, le, count, sum_s)
SELECT :answered, coalesce((SELECT min(b) FROM unnest(:bounds) AS b WHERE b >= d),
                           'Infinity'::float8), 1, d
FROM (SELECT greatest(extract(epoch FROM completed_at - created_at)::float8, 0) AS d
      FROM preflight_requests WHERE id = :id) AS done
ON CONFLICT (answered, le) DO UPDATE SET count = preflight_latency.count + 1,
                                         sum_s = preflight_latency.sum_s + excluded.sum_s
""").bindparams(bindparam("bounds", type_=ARRAY(DOUBLE_PRECISION)))


def create_request(session: Session, nodes: list[str], max_age_s: float,
                   verdict: dict[str, Any] | None, now: datetime,
                   token_id: int | None = None,
                   workload: dict[str, Any] | None = None) -> PreflightRequest:
    req = PreflightRequest(
        id=str(uuid.uuid4()), nodes=nodes, max_age_s=max_age_s, attempts=0, token_id=token_id,
        workload=workload,
        status="done" if verdict is not None else "pending", verdict=verdict,
        completed_at=now if verdict is not None else None,
    )
    session.add(req)
    session.flush()
    if verdict is not None:
        _observe_latency(session, req, "at_once")
    return req


def _observe_latency(session: Session, req: PreflightRequest, answered: str) -> None:
    session.flush()
    session.execute(_OBSERVE, {"answered": answered, "bounds": list(LATENCY_BOUNDS),
                               "id": req.id})


def get_request(session: Session, request_id: str) -> PreflightRequest | None:
    return session.get(PreflightRequest, request_id)


def waiting_count(session: Session, token_id: int) -> int:
    """Requests of one token not answered yet."""
    return session.scalar(
        select(func.count()).select_from(PreflightRequest)
        .where(PreflightRequest.token_id == token_id,
               PreflightRequest.status.in_(("pending", "running")))) or 0


def claim_next(session: Session, worker: str, lease_s: float, now: datetime,
               token_id: int | None = None,
               within: frozenset[str] | None = None) -> PreflightRequest | None:
    """The oldest pending request, or one whose claimer's lease ran out, among those whose
    nodes all lie ``within`` (when given); leased to ``worker`` under ``token_id``."""
    query = (
        select(PreflightRequest)
        .where(or_(PreflightRequest.status == "pending",
                   (PreflightRequest.status == "running") & (PreflightRequest.lease_until < now)))
    )
    if within is not None:
        query = query.where(PreflightRequest.nodes.contained_by(sorted(within)))
    req = session.scalar(
        query.order_by(PreflightRequest.created_at).limit(1).with_for_update(skip_locked=True))
    if req is None:
        return None
    req.status = "running"
    req.claimed_by = worker
    req.claim_token_id = token_id
    req.attempts += 1
    req.lease_until = now + timedelta(seconds=lease_s)
    session.flush()
    return req


def renew(session: Session, req: PreflightRequest, now: datetime, lease_s: float) -> None:
    req.lease_until = now + timedelta(seconds=lease_s)
    session.flush()


def complete(session: Session, req: PreflightRequest, verdict: dict[str, Any] | None,
             now: datetime, error: str | None = None) -> None:
    req.status = "done" if error is None else "failed"
    req.verdict = verdict
    req.error = error
    req.completed_at = now
    req.lease_until = None
    _observe_latency(session, req, "probed")


def unanswered(session: Session, request_ids: list[str]) -> set[str]:
    """Which of ``request_ids`` still wait for a scheduler (pending or running)."""
    if not request_ids:
        return set()
    return set(session.scalars(select(PreflightRequest.id).where(
        PreflightRequest.id.in_(request_ids),
        PreflightRequest.status.in_(("pending", "running")))))
