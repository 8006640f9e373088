"""Durable preflight requests: written many to a statement, claimed in lanes (the gate's first)
and in turns per token, under ``FOR UPDATE SKIP LOCKED``."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Any, NamedTuple

from sqlalchemy import (
    Integer,
    Text,
    any_,
    bindparam,
    case,
    func,
    insert,
    literal,
    literal_column,
    or_,
    select,
    text,
)
from sqlalchemy.dialects.postgresql import ARRAY, DOUBLE_PRECISION
from sqlalchemy.orm import Session

from ringwatch.services.store.models import Node, PreflightRequest

# Upper bounds (seconds) of the latency buckets a verdict is counted in: an answer from
# stored results takes milliseconds, one a scheduler probes for takes its check (seconds to
# minutes). Bounds may be added; a verdict counted under an old bound stays there.
LATENCY_BOUNDS = (0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)

# Verdicts into their buckets, as many as were answered in one statement: each at the
# smallest bound at or above its latency (created_at is the database's clock, completed_at
# the API's; a negative span is counted as none).
_OBSERVE = text("""
INSERT INTO preflight_latency (answered, le, count, sum_s)
SELECT :answered, le, count(*), sum(d)
FROM (SELECT coalesce((SELECT min(b) FROM unnest(:bounds) AS b WHERE b >= d),
                      'Infinity'::float8) AS le, d
      FROM (SELECT greatest(extract(epoch FROM completed_at - created_at)::float8, 0) AS d
            FROM preflight_requests WHERE id = ANY(:ids)) AS done) AS binned
GROUP BY le
ON CONFLICT (answered, le) DO UPDATE SET count = preflight_latency.count + excluded.count,
                                         sum_s = preflight_latency.sum_s + excluded.sum_s
""").bindparams(bindparam("bounds", type_=ARRAY(DOUBLE_PRECISION)),
                bindparam("ids", type_=ARRAY(Text)))


class NewRequest(NamedTuple):
    """A request to record: answered at once where it comes with its ``verdict``."""

    nodes: list[str]
    max_age_s: float
    verdict: dict[str, Any] | None
    token_id: int | None = None
    workload: dict[str, Any] | None = None


class Recorded(NamedTuple):
    """A request as ``create_requests`` wrote it (the fields a caller is answered with)."""

    id: str
    nodes: list[str]
    max_age_s: float
    status: str
    verdict: dict[str, Any] | None
    created_at: datetime
    completed_at: datetime | None
    token_id: int | None
    workload: dict[str, Any] | None
    attempts: int = 0
    error: str | None = None


class NodeProbe(NamedTuple):
    """What a preflight reads of one node of the fleet: when it was last probed, and on
    which backend."""

    last_probed_at: datetime | None
    backend: str | None


def create_requests(session: Session, new: Sequence[NewRequest], now: datetime) -> list[Recorded]:
    """Record ``new`` in one INSERT (created_at the database's clock, as every request's),
    and count those answered at once in the latency buckets in one more statement, however
    many there are: a big job's prologs ask at once, and an ORM object each cost more than
    the database did."""
    if not new:
        return []
    ids = [str(uuid.uuid4()) for _ in new]
    rows = [{"id": i, "nodes": r.nodes, "max_age_s": r.max_age_s, "attempts": 0,
             "token_id": r.token_id, "workload": r.workload, "status": _status(r),
             "verdict": r.verdict, "completed_at": _completed(r, now)}
            for i, r in zip(ids, new, strict=True)]
    created = session.execute(
        insert(PreflightRequest).returning(PreflightRequest.created_at,
                                           sort_by_parameter_order=True), rows).scalars().all()
    out = [Recorded(i, r.nodes, r.max_age_s, _status(r), r.verdict, at, _completed(r, now),
                    r.token_id, r.workload) for i, r, at in zip(ids, new, created, strict=True)]
    _observe_latency(session, [r.id for r in out if r.verdict is not None], "at_once")
    return out


def _status(r: NewRequest) -> str:
    return "done" if r.verdict is not None else "pending"


def _completed(r: NewRequest, now: datetime) -> datetime | None:
    return now if r.verdict is not None else None


def _observe_latency(session: Session, ids: list[str], answered: str) -> None:
    if not ids:
        return
    session.flush()
    session.execute(_OBSERVE, {"answered": answered, "bounds": list(LATENCY_BOUNDS), "ids": ids})


def node_probes(session: Session, names: Sequence[str]) -> dict[str, NodeProbe]:
    """The nodes of the fleet among ``names`` (retired ones left out), each with its last
    probe: one statement for every node a batch of preflights names."""
    rows = session.execute(
        select(Node.name, Node.last_probed_at, Node.backend)
        .where(Node.name == any_(literal(sorted(set(names)), ARRAY(Text))),
               Node.retired_at.is_(None))).tuples()
    return {name: NodeProbe(at, backend) for name, at, backend in rows}


def get_request(session: Session, request_id: str) -> PreflightRequest | None:
    return session.get(PreflightRequest, request_id)


def waiting_count(session: Session, token_id: int) -> int:
    """Requests of one token not answered yet, both lanes."""
    counts = waiting_counts(session, [token_id])
    return counts.get((token_id, True), 0) + counts.get((token_id, False), 0)


def waiting_counts(session: Session, token_ids: Sequence[int]) -> dict[tuple[int, bool], int]:
    """Requests not answered yet, per token of ``token_ids`` and lane (True: the gate's,
    GATE_LANE); a token and lane with none left out."""
    if not token_ids:
        return {}
    rows = session.execute(
        select(PreflightRequest.token_id, GATE_LANE, func.count())
        .where(PreflightRequest.token_id == any_(literal(sorted(set(token_ids)), ARRAY(Integer))),
               PreflightRequest.status.in_(("pending", "running")))
        .group_by(PreflightRequest.token_id, GATE_LANE)).tuples()
    return {(token, bool(gate)): n for token, gate, n in rows if token is not None}


# The gate's lane: a request naming one node and no workload is what a node's prolog (or
# NHC check, or epilog) sends before or after a job there, and is claimed before every
# request of the other lane. (A missing workload is stored as JSON null.)
GATE_LANE = ((func.cardinality(PreflightRequest.nodes) == 1)
             & (func.coalesce(PreflightRequest.workload, literal_column("'null'::jsonb"))
                == literal_column("'null'::jsonb")))
# How far back a token's last claimed request counts for whose turn it is.
TURN_MEMORY = timedelta(hours=1)


def claim_next(session: Session, worker: str, lease_s: float, now: datetime,
               token_id: int | None = None,
               within: frozenset[str] | None = None) -> PreflightRequest | None:
    """The next waiting request (pending, or one whose claimer's lease ran out), among
    those whose nodes all lie ``within`` (when given); leased to ``worker`` under
    ``token_id``. The gate's lane first (GATE_LANE); in each lane the askers' tokens take
    turns: each token's oldest waiting request before any token's second, and among those
    the token served longest ago (or never) first, then the oldest. So a prolog's request
    never waits behind the queue another caller keeps (its
    RINGWATCH_MAX_PENDING_PREFLIGHTS_PER_TOKEN requests): at most behind one gate request
    of each other token."""
    claimable = or_(PreflightRequest.status == "pending",
                    (PreflightRequest.status == "running") & (PreflightRequest.lease_until < now))
    ranked = select(
        PreflightRequest.id, PreflightRequest.token_id, GATE_LANE.label("gate"),
        func.row_number().over(partition_by=(PreflightRequest.token_id, GATE_LANE),
                               order_by=(PreflightRequest.created_at, PreflightRequest.id))
        .label("turn")).where(claimable)
    if within is not None:
        ranked = ranked.where(PreflightRequest.nodes.contained_by(sorted(within)))
    queue = ranked.cte("queue")
    # When each waiting token was last served: its claim running now, else its latest
    # completed claim of the last TURN_MEMORY (requests answered at once were never queued).
    served = select(
        PreflightRequest.token_id,
        func.max(case((PreflightRequest.status == "running", literal(now)),
                      else_=PreflightRequest.completed_at)).label("at")).where(
        PreflightRequest.token_id.in_(select(queue.c.token_id)),
        PreflightRequest.attempts > 0,
        or_(PreflightRequest.status == "running",
            PreflightRequest.status.in_(("done", "failed"))
            & (PreflightRequest.created_at >= now - TURN_MEMORY)),
    ).group_by(PreflightRequest.token_id).cte("served")
    # The claimable test again on the row locked: another claimer may have taken it since.
    req = session.scalar(
        select(PreflightRequest).join(queue, queue.c.id == PreflightRequest.id)
        .outerjoin(served, served.c.token_id == PreflightRequest.token_id).where(claimable)
        .order_by(queue.c.gate.desc(), queue.c.turn, served.c.at.asc().nulls_first(),
                  PreflightRequest.created_at)
        .limit(1).with_for_update(skip_locked=True, of=PreflightRequest))
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
    _observe_latency(session, [req.id], "probed")


def unanswered(session: Session, request_ids: list[str]) -> set[str]:
    """Which of ``request_ids`` still wait for a scheduler (pending or running)."""
    if not request_ids:
        return set()
    return set(session.scalars(select(PreflightRequest.id).where(
        PreflightRequest.id.in_(request_ids),
        PreflightRequest.status.in_(("pending", "running")))))
