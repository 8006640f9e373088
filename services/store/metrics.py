"""The few aggregate queries behind ``/metrics``: each reads plain tuples, none loads ORM
objects, so one scrape of a 1024-node fleet is a handful of statements."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any, NamedTuple

from sqlalchemy import case, func, or_, select, text
from sqlalchemy.orm import Session

from ringwatch.services.store.models import (
    ApiToken,
    Finding,
    LinkHealth,
    Node,
    PreflightLatency,
    PreflightRequest,
    ProbeRun,
    WebhookDelivery,
)
from ringwatch.services.store.preflight import LATENCY_BOUNDS


class LinkRow(NamedTuple):
    """One link's current reading; ``nodes`` only for a group on one or two nodes and
    ``members`` only for a group of two ranks (None otherwise: a world group's arrays are
    thousands of names no series is labelled with)."""

    scope: str
    op: str
    group_key: str
    status: str
    busbw_gbs: float
    ratio: float | None
    nodes: list[str] | None
    members: list[str] | None


class NodeRow(NamedTuple):
    name: str
    duty_cycle: float | None
    last_probed_at: datetime | None
    # What holds it as the occupancy source last said (None: idle).
    occupied: dict[str, Any] | None = None


class Backlog(NamedTuple):
    """Webhook deliveries waiting to be sent, the oldest one's age, and those given up."""

    pending: int
    oldest_pending_age_s: float | None
    failed: int


# Retired nodes (services.store.nodes): out of the fleet, so out of the per-node and
# per-link families even where an incident on them is still open (it stays counted in
# ringwatch_open_findings) or a link of theirs is not ok.
_RETIRED = "SELECT name::text FROM nodes WHERE retired_at IS NOT NULL"


def link_rows(session: Session, max_age_s: float = 0.0) -> list[LinkRow]:
    """The current reading of every link read within ``max_age_s`` (0: of every link) and of
    every link that is not ok however old, in one pass."""
    c = LinkHealth
    q = select(c.scope, c.op, c.group_key, c.status, c.busbw_gbs, c.ratio,
               case((func.cardinality(c.nodes) <= 2, c.nodes)),
               case((func.cardinality(c.members) == 2, c.members)))
    if max_age_s > 0:
        q = q.where(or_(c.updated_at >= func.now() - timedelta(seconds=max_age_s),
                        c.status != "ok"))
    q = q.where(text(f"NOT (link_health.nodes && ARRAY({_RETIRED}))"))
    return [LinkRow(*r) for r in session.execute(q.order_by(c.scope, c.group_key, c.op))]


def node_rows(session: Session) -> list[NodeRow]:
    rows = session.execute(
        select(Node.name, Node.duty_cycle, Node.last_probed_at, Node.occupied)
        .where(Node.retired_at.is_(None)).order_by(Node.name)).tuples()
    return [NodeRow(*r) for r in rows]


class FindingCount(NamedTuple):
    kind: str
    severity: str
    open: int


class NodeFindingCount(NamedTuple):
    node: str
    kind: str
    severity: str
    open: int


def open_findings(session: Session) -> list[FindingCount]:
    """Open incidents by kind and severity."""
    rows = session.execute(
        select(Finding.kind, Finding.severity, func.count()).where(Finding.status == "open")
        .group_by(Finding.kind, Finding.severity).order_by(Finding.kind, Finding.severity))
    return [FindingCount(*r) for r in rows]


def open_findings_per_node(session: Session) -> list[NodeFindingCount]:
    """Open incidents by each node they touch, kind and severity (an incident on a path
    counts on both its nodes)."""
    rows = session.execute(text(
        "SELECT node, kind, severity, count(*) FROM findings, unnest(nodes) AS node "
        f"WHERE status = 'open' AND node NOT IN ({_RETIRED}) "
        "GROUP BY node, kind, severity ORDER BY node, kind, severity"))
    return [NodeFindingCount(*r) for r in rows]


class CauseRow(NamedTuple):
    """One open cause finding's facts (docs/transport.md): its node and detail."""

    node: str
    kind: str
    detail: dict


def open_causes(session: Session) -> list[CauseRow]:
    """The open ``nic_errors`` and ``transport_fallback`` incidents, with their details as
    the latest cycle that saw them left them."""
    rows = session.execute(text(
        "SELECT nodes[1], kind, detail FROM findings WHERE status = 'open' "
        f"AND kind IN ('nic_errors', 'transport_fallback') AND nodes[1] NOT IN ({_RETIRED}) "
        "ORDER BY nodes[1], kind, id"))
    return [CauseRow(*r) for r in rows]


def preflight_requests_by_status(session: Session) -> dict[str, int]:
    rows = session.execute(
        select(PreflightRequest.status, func.count()).group_by(PreflightRequest.status)).tuples()
    return dict(rows.all())


class IngestTotals(NamedTuple):
    """Batches and measurements stored since the database was made."""

    batches: int
    measurements: int


class LatencyCounts(NamedTuple):
    """Completed preflight requests of one kind: how many took at most each of
    ``LATENCY_BOUNDS`` (in order), how many in all (``total``), and their summed seconds."""

    le: list[int]
    total: int
    sum_s: float


def ingest_totals(session: Session) -> IngestTotals:
    """The probe runs held plus those retention deleted (``ingest_retired``), in one
    statement so a retention pass is seen whole or not at all. Every replica reads the
    same totals, and a restart loses none; a re-sent batch is not stored, so not counted."""
    batches, measurements = session.execute(text(
        "SELECT count(*) + coalesce((SELECT batches FROM ingest_retired), 0), "
        "coalesce(sum(measurement_count), 0) "
        "+ coalesce((SELECT measurements FROM ingest_retired), 0) FROM probe_runs")).one()
    return IngestTotals(int(batches), int(measurements))


def preflight_latency(session: Session) -> dict[str, LatencyCounts]:
    """The verdicts counted in ``preflight_latency`` (written with each one), cumulated
    under each of ``LATENCY_BOUNDS`` as a histogram's buckets, per way of answering."""
    out: dict[str, LatencyCounts] = {}
    rows = session.execute(select(PreflightLatency.answered, PreflightLatency.le,
                                  PreflightLatency.count, PreflightLatency.sum_s)).tuples()
    for answered, le, count, sum_s in rows:
        got = out.setdefault(answered, LatencyCounts([0] * len(LATENCY_BOUNDS), 0, 0.0))
        for i, bound in enumerate(LATENCY_BOUNDS):
            if le <= bound:
                got.le[i] += count
        out[answered] = got._replace(total=got.total + count, sum_s=got.sum_s + sum_s)
    return out


def delivery_backlog(session: Session) -> Backlog:
    pending, age = session.execute(text(
        "SELECT count(*), extract(epoch FROM now() - min(created_at)) "
        "FROM webhook_deliveries WHERE status = 'pending'")).one()
    failed = session.scalar(select(func.count()).select_from(WebhookDelivery)
                            .where(WebhookDelivery.status == "failed"))
    return Backlog(int(pending), float(age) if age is not None else None, int(failed or 0))


def last_ingest(session: Session) -> datetime | None:
    """When the newest batch was stored (by id, so the primary key answers it)."""
    return session.scalar(select(ProbeRun.received_at).order_by(ProbeRun.id.desc()).limit(1))


def database_now(session: Session) -> datetime:
    """The database's clock, which stamped every ``*_at`` being compared with it."""
    now = session.scalar(select(func.now()))
    assert now is not None
    return now


def latest_occupancy(session: Session) -> dict[str, Any] | None:
    """How the occupancy source answered for the newest batch that said (a scheduled
    cycle's): source, error, read_s, busy and unknown counts."""
    return session.scalar(select(ProbeRun.occupancy).where(ProbeRun.occupancy.is_not(None))
                          .order_by(ProbeRun.id.desc()).limit(1))


class TokenExpiry(NamedTuple):
    """An active token's expiry; ``expires_in_s`` as of the database's clock."""

    id: int
    role: str
    name: str
    expires_at: datetime
    expires_in_s: float


def token_expiries(session: Session, within_s: float | None = None) -> list[TokenExpiry]:
    """Active tokens (not revoked, not expired) that have an expiry, soonest first; with
    ``within_s``, only those expiring within that many seconds."""
    t = ApiToken
    q = (select(t.id, t.role, t.name, t.expires_at,
                func.extract("epoch", t.expires_at - func.now()))
         .where(t.revoked_at.is_(None), t.expires_at.is_not(None), t.expires_at > func.now()))
    if within_s is not None:
        q = q.where(t.expires_at <= func.now() + timedelta(seconds=within_s))
    rows = session.execute(q.order_by(t.expires_at, t.id)).tuples()
    return [TokenExpiry(i, role, name, at, float(left)) for i, role, name, at, left in rows
            if at is not None]


def database_size(session: Session) -> int:
    """Bytes the database takes on disk (tables, indexes, TOAST, every partition)."""
    return int(session.scalar(text("SELECT pg_database_size(current_database())")) or 0)


# How far back the newest batch that says its sender's interval is looked for: a scheduler's
# every batch says it, preflight batches and `probe --ship` do not.
INTERVAL_LOOKBACK_RUNS = 1000


def planned_ingest_interval(session: Session) -> float | None:
    """Seconds between its batches the sender of the newest batch that said so planned (its
    cycle and the wait after it: the probe interval, or longer where the duty cycle
    stretched it), among the newest ``INTERVAL_LOOKBACK_RUNS`` batches; None where none
    said."""
    got = session.scalar(text(
        "SELECT (shipper->>'interval_s')::float8 FROM probe_runs "
        "WHERE id > (SELECT coalesce(max(id), 0) FROM probe_runs) - :back "
        "AND jsonb_typeof(shipper->'interval_s') = 'number' ORDER BY id DESC LIMIT 1"),
        {"back": INTERVAL_LOOKBACK_RUNS})
    return float(got) if got is not None else None
