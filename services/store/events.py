"""Webhook events: their names, their payloads, and the outbox they travel through.

The one place an event is named or shaped (docs/webhooks.md is its contract). It lives in
the store because the outbox write is SQL that must run in the session of the change it
announces: ``emit`` adds the event to the caller's transaction, so an event exists exactly
when its change does, and the notifier reads the outbox back with ``pending`` and
``mark_dispatched``. ``body`` turns a stored event into the ``json`` body a receiver gets.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from enum import StrEnum
from typing import Any, ClassVar, Literal, get_args

from psycopg.types.json import Jsonb
from sqlalchemy import func, select, text, update
from sqlalchemy.orm import Session

from ringwatch.services.store.models import OutboxEvent

# Postgres NOTIFY channel: a notifier listening on it wakes when an event commits.
OUTBOX_CHANNEL = "ringwatch_outbox"


class EventType(StrEnum):
    """Every event a webhook can receive, as it appears in ``X-Ringwatch-Event``,
    ``event`` and a webhook's ``events``."""

    HEALTH_DEGRADED = "health.degraded"
    HEALTH_RECOVERED = "health.recovered"
    PREFLIGHT_FAILED = "preflight.failed"
    PROBE_HANG = "probe.hang"
    PROBE_ERROR = "probe.error"
    WEBHOOK_TEST = "webhook.test"


# What a webhook may subscribe to: a test event goes only to the webhook it tests.
# (A type too, for the API's schemas: the OpenAPI document lists the values.)
Subscribable = Literal[EventType.HEALTH_DEGRADED, EventType.HEALTH_RECOVERED,
                       EventType.PREFLIGHT_FAILED, EventType.PROBE_HANG, EventType.PROBE_ERROR]
SUBSCRIBABLE = frozenset(get_args(Subscribable))


# ---- payloads: one per event, the fields of its body besides ``event`` and ``sequence`` ----


@dataclass(frozen=True, kw_only=True)
class _Incident:
    """An incident's change: the finding (the localized fault, ``fault`` its key) with its
    id, nodes, the slow results behind it (``links``) and its API resource (``url``)."""

    event: ClassVar[EventType]
    finding: dict[str, Any]
    finding_id: int | None
    nodes: list[str]
    links: list[Any]
    url: str


@dataclass(frozen=True, kw_only=True)
class HealthDegraded(_Incident):
    event: ClassVar[EventType] = EventType.HEALTH_DEGRADED


@dataclass(frozen=True, kw_only=True)
class ProbeHang(_Incident):
    event: ClassVar[EventType] = EventType.PROBE_HANG


@dataclass(frozen=True, kw_only=True)
class ProbeError(_Incident):
    event: ClassVar[EventType] = EventType.PROBE_ERROR


@dataclass(frozen=True, kw_only=True)
class HealthRecovered(_Incident):
    """``finding_id`` None: the fault cleared before its incident row could be read."""

    event: ClassVar[EventType] = EventType.HEALTH_RECOVERED


@dataclass(frozen=True, kw_only=True)
class PreflightFailed:
    """An unhealthy preflight verdict; ``finding`` is its first finding, so a receiver that
    reads only ``finding`` (as for an incident) still sees one."""

    event: ClassVar[EventType] = EventType.PREFLIGHT_FAILED
    preflight_id: str
    nodes: list[str]
    exclude: list[str]
    findings: list[dict[str, Any]]
    finding: dict[str, Any] | None
    links: list[Any] = field(default_factory=list)
    url: str


@dataclass(frozen=True, kw_only=True)
class WebhookTest:
    event: ClassVar[EventType] = EventType.WEBHOOK_TEST
    finding: None = None
    webhook_id: int
    test: bool = True


Payload = HealthDegraded | ProbeHang | ProbeError | HealthRecovered | PreflightFailed | WebhookTest

# Each event's payload type: exactly one per name.
PAYLOADS: dict[EventType, type[Payload]] = {
    p.event: p for p in (HealthDegraded, ProbeHang, ProbeError, HealthRecovered, PreflightFailed,
                         WebhookTest)
}

# A fault of these kinds opens its incident as its own event; any other is health.degraded.
_OPENED_BY_KIND: dict[str, type[HealthDegraded | ProbeHang | ProbeError]] = {
    "hang": ProbeHang, "probe_error": ProbeError}


def incident_opened(kind: str, finding: dict[str, Any], finding_id: int, nodes: list[str],
                    api_url: str) -> HealthDegraded | ProbeHang | ProbeError:
    """The event of an incident opening for a fault of ``kind``."""
    return _OPENED_BY_KIND.get(kind, HealthDegraded)(
        finding=finding, finding_id=finding_id, nodes=nodes,
        links=finding.get("evidence", []), url=f"{api_url}/v1/findings/{finding_id}")


def incident_recovered(finding: dict[str, Any], finding_id: int | None, nodes: list[str],
                       api_url: str) -> HealthRecovered:
    where = f"/v1/findings/{finding_id}" if finding_id is not None else "/v1/findings"
    return HealthRecovered(finding=finding, finding_id=finding_id, nodes=nodes, links=[],
                           url=f"{api_url}{where}")


def preflight_failed(preflight_id: str, nodes: list[str], verdict: Mapping[str, Any],
                     api_url: str) -> PreflightFailed:
    return PreflightFailed(
        preflight_id=preflight_id, nodes=nodes, exclude=verdict.get("exclude", []),
        findings=verdict.get("findings", []), finding=(verdict.get("findings") or [None])[0],
        url=f"{api_url}/v1/preflight/{preflight_id}")


def to_payload(payload: Payload) -> dict[str, Any]:
    """What the outbox stores for ``payload``: its fields, as JSON values. Shallow: every
    field is a JSON value already, and ``asdict``'s deep copy of each finding cost more
    than writing it."""
    return {f.name: getattr(payload, f.name) for f in fields(payload)}


def body(event_type: str, sequence: int, payload: Mapping[str, Any]) -> dict[str, Any]:
    """The ``json`` body of a stored event (docs/webhooks.md): its payload's fields, with
    ``event`` and ``sequence``. Takes the stored dict, not a ``Payload``, so events written
    before a payload type changed are still sent as they were written."""
    return {"event": str(event_type), **payload, "sequence": sequence}


# ---- the outbox ---------------------------------------------------------------------------


def emit(session: Session, payload: Payload) -> OutboxEvent:
    """Write ``payload``'s event in the caller's transaction: it exists iff the change does."""
    event = OutboxEvent(event_type=str(payload.event), payload=to_payload(payload))
    session.add(event)
    session.flush()
    # Delivered to listening notifiers at commit, never for a rolled-back change.
    session.execute(text(f"NOTIFY {OUTBOX_CHANNEL}"))
    return event


def emit_many(session: Session, payloads: Sequence[Payload]) -> None:
    """``emit`` for a batch's events, in order: one COPY and one NOTIFY however many (a
    batch of thousands of findings wrote them one round trip each, for seconds)."""
    if not payloads:
        return
    dbapi = session.connection().connection.driver_connection
    assert dbapi is not None
    with dbapi.cursor() as cur, cur.copy(
            "COPY outbox_events (event_type, payload) FROM STDIN") as cp:
        for p in payloads:
            cp.write_row((str(p.event), Jsonb(to_payload(p))))
    session.execute(text(f"NOTIFY {OUTBOX_CHANNEL}"))


def pending(session: Session, limit: int = 100) -> list[OutboxEvent]:
    """Events not yet fanned out into deliveries, oldest first, locked for this transaction;
    rows another notifier holds are skipped, so two notifiers never fan out one event."""
    return list(session.scalars(
        select(OutboxEvent).where(OutboxEvent.dispatched_at.is_(None))
        .order_by(OutboxEvent.id).limit(limit).with_for_update(skip_locked=True)
    ))


def mark_dispatched(session: Session, event_ids: Sequence[int]) -> None:
    """These events have their deliveries: ``pending`` no longer returns them."""
    session.execute(update(OutboxEvent).where(OutboxEvent.id.in_(list(event_ids)))
                    .values(dispatched_at=func.now()))
