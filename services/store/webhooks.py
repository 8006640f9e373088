"""Webhooks, and the delivery queue the notifier works from.

Deliveries are claimed with ``FOR UPDATE SKIP LOCKED`` so several notifier
processes can run at once without sending one delivery twice.
"""

from __future__ import annotations

import uuid
from datetime import datetime, timedelta

from sqlalchemy import func, select, update
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.orm import Session

from services.store.models import OutboxEvent, Webhook, WebhookDelivery


def create_webhook(session: Session, url: str, secret: str, events: list[str],
                   format: str = "json") -> Webhook:
    hook = Webhook(url=url, secret=secret, events=events, format=format, active=True)
    session.add(hook)
    session.flush()
    return hook


def get_webhook(session: Session, webhook_id: int) -> Webhook | None:
    return session.get(Webhook, webhook_id)


def list_webhooks(session: Session) -> list[Webhook]:
    return list(session.scalars(select(Webhook).order_by(Webhook.id)))


def dispatch_outbox(session: Session, limit: int = 100) -> int:
    """Fan undispatched events out into one delivery per subscribed webhook."""
    events = session.scalars(
        select(OutboxEvent).where(OutboxEvent.dispatched_at.is_(None))
        .order_by(OutboxEvent.id).limit(limit).with_for_update(skip_locked=True)
    ).all()
    if not events:
        return 0
    hooks = session.scalars(select(Webhook).where(Webhook.active.is_(True))).all()
    rows = [
        {"webhook_id": h.id, "event_id": e.id, "delivery_id": str(uuid.uuid4()),
         "status": "pending", "attempts": 0}
        for e in events for h in hooks if e.event_type in h.events or "*" in h.events
    ]
    if rows:
        session.execute(insert(WebhookDelivery).values(rows).on_conflict_do_nothing())
    now = func.now()
    session.execute(
        update(OutboxEvent).where(OutboxEvent.id.in_([e.id for e in events])).values(dispatched_at=now)
    )
    return len(events)


def claim_due(session: Session, limit: int, lease_s: float) -> list[tuple[WebhookDelivery, Webhook, OutboxEvent]]:
    """Claim due deliveries and push their next attempt past a lease.

    The lease is what makes a killed notifier harmless: its claimed deliveries
    come due again when the lease runs out and another process retries them.
    """
    rows = session.execute(
        select(WebhookDelivery, Webhook, OutboxEvent)
        .join(Webhook, Webhook.id == WebhookDelivery.webhook_id)
        .join(OutboxEvent, OutboxEvent.id == WebhookDelivery.event_id)
        .where(WebhookDelivery.status == "pending", WebhookDelivery.next_attempt_at <= func.now())
        .order_by(WebhookDelivery.next_attempt_at)
        .limit(limit)
        .with_for_update(of=WebhookDelivery, skip_locked=True)
    ).tuples().all()
    for delivery, _, _ in rows:
        delivery.next_attempt_at = func.now() + timedelta(seconds=lease_s)  # type: ignore[assignment]
        delivery.attempts += 1
    session.flush()
    return list(rows)


def mark_delivered(session: Session, delivery_pk: int, status_code: int, at: datetime) -> None:
    session.execute(
        update(WebhookDelivery).where(WebhookDelivery.id == delivery_pk)
        .values(status="delivered", last_status_code=status_code, last_error=None, delivered_at=at)
    )


def mark_failed(session: Session, delivery_pk: int, *, status_code: int | None, error: str,
                retry_at: datetime | None) -> None:
    """Record a failed attempt; ``retry_at`` None gives up for good."""
    values: dict[str, object] = {"last_status_code": status_code, "last_error": error[:2000]}
    if retry_at is None:
        values["status"] = "failed"
    else:
        values["next_attempt_at"] = retry_at
    session.execute(update(WebhookDelivery).where(WebhookDelivery.id == delivery_pk).values(**values))


def list_deliveries(session: Session, webhook_id: int, limit: int = 200) -> list[tuple[WebhookDelivery, OutboxEvent]]:
    return list(session.execute(
        select(WebhookDelivery, OutboxEvent)
        .join(OutboxEvent, OutboxEvent.id == WebhookDelivery.event_id)
        .where(WebhookDelivery.webhook_id == webhook_id)
        .order_by(WebhookDelivery.id.desc()).limit(limit)
    ).tuples().all())


def add_delivery(session: Session, webhook_id: int, event_id: int) -> None:
    session.execute(insert(WebhookDelivery).values(
        webhook_id=webhook_id, event_id=event_id, delivery_id=str(uuid.uuid4()), status="pending",
        attempts=0).on_conflict_do_nothing())


def mark_dispatched(session: Session, event_id: int) -> None:
    session.execute(update(OutboxEvent).where(OutboxEvent.id == event_id).values(dispatched_at=func.now()))
