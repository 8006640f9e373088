"""Webhook registration and its read side, for the API."""

from __future__ import annotations

from typing import Any

from sqlalchemy.orm import Session

from services.errors import NotFound
from services.store import health as health_store
from services.store import webhooks as store


def _out(hook) -> dict[str, Any]:
    return {"id": hook.id, "url": hook.url, "events": list(hook.events), "format": hook.format,
            "active": hook.active, "created_at": hook.created_at}


def create(session: Session, url: str, secret: str, events: list[str], format: str) -> dict[str, Any]:
    hook = store.create_webhook(session, url, secret, events, format)
    session.refresh(hook)
    return _out(hook)


def list_all(session: Session) -> list[dict[str, Any]]:
    return [_out(h) for h in store.list_webhooks(session)]


def deliveries(session: Session, webhook_id: int) -> list[dict[str, Any]]:
    if store.get_webhook(session, webhook_id) is None:
        raise NotFound(f"no webhook {webhook_id}")
    return [
        {"delivery_id": d.delivery_id, "event": e.event_type, "event_id": e.id, "status": d.status,
         "attempts": d.attempts, "last_status_code": d.last_status_code,
         "last_error": d.last_error, "created_at": d.created_at, "delivered_at": d.delivered_at}
        for d, e in store.list_deliveries(session, webhook_id)
    ]


def send_test(session: Session, webhook_id: int) -> dict[str, Any]:
    """Queue a test event for one webhook (through the outbox, like any other)."""
    hook = store.get_webhook(session, webhook_id)
    if hook is None:
        raise NotFound(f"no webhook {webhook_id}")
    event = health_store.enqueue_event(session, "webhook.test",
                                       {"finding": None, "webhook_id": webhook_id, "test": True})
    store.add_delivery(session, webhook_id, event.id)
    store.mark_dispatched(session, event.id)
    return {"queued": True, "event_id": event.id}
