"""Webhooks, and the delivery queue the notifier fills from the outbox (services.store.events)
and works from.

Deliveries are claimed with ``FOR UPDATE SKIP LOCKED`` by a named holder under a lease,
so several notifier processes can run at once without sending one delivery twice; only
the holder of a claim records its outcome, and a holder renews the lease while it works.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterable
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import delete, func, or_, select, update
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.orm import Session

from ringwatch.services.store import events as outbox
from ringwatch.services.store.models import OutboxEvent, Webhook
from ringwatch.services.store.models import WebhookDelivery as Delivery


def create_webhook(session: Session, url: str, secret: str, events: list[str],
                   format: str = "json") -> Webhook:
    """``secret`` as it is to be stored (sealed by the caller)."""
    hook = Webhook(url=url, secret=secret, events=events, format=format, active=True)
    session.add(hook)
    session.flush()
    return hook


def get_webhook(session: Session, webhook_id: int) -> Webhook | None:
    return session.get(Webhook, webhook_id)


def list_webhooks(session: Session) -> list[Webhook]:
    return list(session.scalars(select(Webhook).order_by(Webhook.id)))


def update_webhook(session: Session, webhook_id: int, values: dict[str, Any]) -> Webhook | None:
    hook = session.get(Webhook, webhook_id, with_for_update=True)
    if hook is None:
        return None
    for name, value in values.items():
        setattr(hook, name, value)
    session.flush()
    return hook


def rotate_secret(session: Session, webhook_id: int, secret: str, previous: str | None,
                  grace_s: float) -> Webhook | None:
    """Replace the secret; ``previous`` stays valid for ``grace_s`` (none when 0)."""
    hook = session.get(Webhook, webhook_id, with_for_update=True)
    if hook is None:
        return None
    keep = previous is not None and grace_s > 0
    hook.secret = secret
    hook.previous_secret = previous if keep else None
    hook.previous_secret_expires_at = (func.now() + timedelta(seconds=grace_s)  # type: ignore[assignment]
                                       if keep else None)
    session.flush()
    session.refresh(hook)
    return hook


def delete_webhook(session: Session, webhook_id: int) -> bool:
    """Delete a webhook and (by cascade) its deliveries, so nothing queued for it is sent."""
    return session.scalar(delete(Webhook).where(Webhook.id == webhook_id).returning(Webhook.id)) is not None


def seal_secrets(session: Session, sealed_prefix: str, seal: Callable[[str], str]) -> int:
    """Seal every secret still stored in plain text (from before encryption); return how many
    webhooks changed."""
    plain = or_(~Webhook.secret.startswith(sealed_prefix),
                Webhook.previous_secret.is_not(None) & ~Webhook.previous_secret.startswith(sealed_prefix))
    hooks = session.scalars(select(Webhook).where(plain).with_for_update(skip_locked=True)).all()
    for hook in hooks:
        if not hook.secret.startswith(sealed_prefix):
            hook.secret = seal(hook.secret)
        if hook.previous_secret is not None and not hook.previous_secret.startswith(sealed_prefix):
            hook.previous_secret = seal(hook.previous_secret)
    session.flush()
    return len(hooks)


def dispatch_outbox(session: Session, limit: int = 100) -> int:
    """Fan undispatched events out into one delivery per subscribed webhook."""
    events = outbox.pending(session, limit)
    if not events:
        return 0
    hooks = session.scalars(select(Webhook).where(Webhook.active.is_(True))).all()
    rows = [
        {"webhook_id": h.id, "event_id": e.id, "delivery_id": str(uuid.uuid4()),
         "status": "pending", "attempts": 0}
        for e in events for h in hooks if e.event_type in h.events or "*" in h.events
    ]
    if rows:
        session.execute(insert(Delivery).values(rows).on_conflict_do_nothing())
    outbox.mark_dispatched(session, [e.id for e in events])
    return len(events)


def database_now(session: Session) -> datetime:
    return session.scalars(select(func.now())).one()


def claim_due(session: Session, holder: uuid.UUID, limit: int, lease_s: float, per_webhook: int,
              due_by: datetime | None = None) -> list[tuple[Delivery, Webhook, OutboxEvent]]:
    """Claim up to ``limit`` deliveries of active webhooks due by ``due_by`` (default: now)
    for ``holder``, at most ``per_webhook`` in flight per webhook, counting those other
    holders have claimed.

    The lease is what makes a killed notifier harmless: its claimed deliveries come due
    again when the lease runs out and another process retries them.
    """
    now = func.now()
    unclaimed = or_(Delivery.claim_expires_at.is_(None), Delivery.claim_expires_at <= now)
    due_now = (Delivery.status == "pending", unclaimed, Webhook.active.is_(True),
               Delivery.next_attempt_at <= (now if due_by is None else due_by))
    in_flight = (
        select(Delivery.webhook_id, func.count().label("n"))
        .where(Delivery.status == "pending", Delivery.claim_expires_at > now)
        .group_by(Delivery.webhook_id).subquery()
    )
    queue = (
        select(Delivery.id, Delivery.webhook_id, func.row_number().over(
            partition_by=Delivery.webhook_id, order_by=(Delivery.next_attempt_at, Delivery.id)).label("place"))
        .join(Webhook, Webhook.id == Delivery.webhook_id)
        .where(*due_now).subquery()
    )
    takeable = (
        select(queue.c.id).outerjoin(in_flight, in_flight.c.webhook_id == queue.c.webhook_id)
        .where(queue.c.place + func.coalesce(in_flight.c.n, 0) <= per_webhook)
    )
    rows = session.execute(
        select(Delivery, Webhook, OutboxEvent)
        .join(Webhook, Webhook.id == Delivery.webhook_id)
        .join(OutboxEvent, OutboxEvent.id == Delivery.event_id)
        # The conditions again, so a row another holder claimed meanwhile is re-checked.
        .where(Delivery.id.in_(takeable), *due_now)
        .order_by(Delivery.next_attempt_at, Delivery.id)
        .limit(limit)
        .with_for_update(of=Delivery, skip_locked=True)
    ).tuples().all()
    for delivery, _, _ in rows:
        delivery.claimed_by = holder
        delivery.claim_expires_at = now + timedelta(seconds=lease_s)  # type: ignore[assignment]
        delivery.attempts += 1
    session.flush()
    return list(rows)


def renew_claims(session: Session, holder: uuid.UUID, delivery_pks: Iterable[int],
                 lease_s: float) -> set[int]:
    """Extend ``holder``'s claims on these deliveries; return those it still holds."""
    return set(session.scalars(
        update(Delivery)
        .where(Delivery.id.in_(list(delivery_pks)), Delivery.claimed_by == holder,
               Delivery.status == "pending")
        .values(claim_expires_at=func.now() + timedelta(seconds=lease_s))
        .returning(Delivery.id)
    ))


def release_claims(session: Session, holder: uuid.UUID, delivery_pks: Iterable[int],
                   why: str) -> set[int]:
    """Give ``holder``'s claims on these deliveries up, due again at once for any notifier
    (not when the lease would have run out); return those released."""
    return set(session.scalars(
        update(Delivery)
        .where(Delivery.id.in_(list(delivery_pks)), Delivery.claimed_by == holder,
               Delivery.status == "pending")
        .values(claimed_by=None, claim_expires_at=None, last_error=why[:2000])
        .returning(Delivery.id)
    ))


def _finish(session: Session, delivery_pk: int, holder: uuid.UUID, values: dict[str, Any]) -> bool:
    """Record an outcome if ``holder`` still holds the claim; False: another notifier took it."""
    return session.scalar(
        update(Delivery)
        .where(Delivery.id == delivery_pk, Delivery.claimed_by == holder, Delivery.status == "pending")
        .values(claim_expires_at=None, **values)
        .returning(Delivery.id)
    ) is not None


def mark_delivered(session: Session, delivery_pk: int, holder: uuid.UUID, status_code: int,
                   at: datetime) -> bool:
    return _finish(session, delivery_pk, holder, {
        "status": "delivered", "last_status_code": status_code, "last_error": None, "delivered_at": at})


def mark_failed(session: Session, delivery_pk: int, holder: uuid.UUID, *, status_code: int | None,
                error: str, retry_at: datetime | None) -> bool:
    """Record a failed attempt; ``retry_at`` None gives up for good."""
    values: dict[str, Any] = {"last_status_code": status_code, "last_error": error[:2000]}
    if retry_at is None:
        values["status"] = "failed"
    else:
        values["next_attempt_at"] = retry_at
    return _finish(session, delivery_pk, holder, values)


def list_deliveries(session: Session, webhook_id: int, limit: int = 100,
                    before: int | None = None) -> list[tuple[Delivery, OutboxEvent]]:
    """Newest first; ``before`` (a delivery's ``id``) continues after a page."""
    q = (select(Delivery, OutboxEvent)
         .join(OutboxEvent, OutboxEvent.id == Delivery.event_id)
         .where(Delivery.webhook_id == webhook_id))
    if before is not None:
        q = q.where(Delivery.id < before)
    return list(session.execute(q.order_by(Delivery.id.desc()).limit(limit)).tuples().all())


def add_delivery(session: Session, webhook_id: int, event_id: int) -> None:
    session.execute(insert(Delivery).values(
        webhook_id=webhook_id, event_id=event_id, delivery_id=str(uuid.uuid4()), status="pending",
        attempts=0).on_conflict_do_nothing())
