"""Webhook registration, its changes and its read side, for the API.

A URL is checked against the URL policy whenever it is set, and a secret is stored only
sealed with ``RINGWATCH_SECRET_KEY``; no answer here carries a secret except the one a
rotation just made.
"""

from __future__ import annotations

import secrets as random_secrets
from typing import Any

from sqlalchemy.orm import Session

from ringwatch.services.errors import NotConfigured, NotFound
from ringwatch.services.notifier.secret_box import SecretUnreadable, require_box
from ringwatch.services.notifier.url_policy import check_url
from ringwatch.services.settings import Settings
from ringwatch.services.store import events as outbox
from ringwatch.services.store import webhooks as store
from ringwatch.services.store.models import Webhook


def _out(hook: Webhook) -> dict[str, Any]:
    return {"id": hook.id, "url": hook.url, "events": list(hook.events), "format": hook.format,
            "active": hook.active, "created_at": hook.created_at,
            "previous_secret_expires_at": hook.previous_secret_expires_at}


def _existing(session: Session, webhook_id: int) -> Webhook:
    hook = store.get_webhook(session, webhook_id)
    if hook is None:
        raise NotFound(f"no webhook {webhook_id}")
    return hook


def create(session: Session, settings: Settings, url: str, secret: str, events: list[str],
           format: str) -> dict[str, Any]:
    box = require_box(settings)
    check_url(url, settings.webhook_allowed_networks)
    hook = store.create_webhook(session, url, box.seal(secret), events, format)
    session.refresh(hook)
    return _out(hook)


def list_all(session: Session) -> list[dict[str, Any]]:
    return [_out(h) for h in store.list_webhooks(session)]


def get(session: Session, webhook_id: int) -> dict[str, Any]:
    return _out(_existing(session, webhook_id))


def update(session: Session, settings: Settings, webhook_id: int, changes: dict[str, Any]) -> dict[str, Any]:
    """Change any of url, events, format and active; a new URL is checked like a new webhook's."""
    _existing(session, webhook_id)
    if "url" in changes:
        check_url(changes["url"], settings.webhook_allowed_networks)
    hook = store.update_webhook(session, webhook_id, changes)
    if hook is None:  # deleted meanwhile
        raise NotFound(f"no webhook {webhook_id}")
    return _out(hook)


def delete(session: Session, webhook_id: int) -> None:
    """Delete a webhook with its delivery log; deliveries still queued for it are never sent."""
    if not store.delete_webhook(session, webhook_id):
        raise NotFound(f"no webhook {webhook_id}")


def rotate(session: Session, settings: Settings, webhook_id: int, secret: str | None,
           grace_s: float) -> dict[str, Any]:
    """Give the webhook a new secret (``secret``, or a random one) and return it, once.

    For ``grace_s`` the old secret signs too (a second ``v1=``), so receivers can switch
    without dropping a delivery.
    """
    box = require_box(settings)
    current = _existing(session, webhook_id).secret
    previous = None
    if grace_s > 0:
        try:
            previous = box.seal(box.open(current))  # one from before encryption is sealed too
        except SecretUnreadable as exc:
            raise NotConfigured(f"{exc}: the old secret cannot sign during a grace period; "
                                "rotate with grace_s 0") from None
    new = secret or random_secrets.token_urlsafe(32)
    hook = store.rotate_secret(session, webhook_id, box.seal(new), previous, grace_s)
    if hook is None:  # deleted meanwhile
        raise NotFound(f"no webhook {webhook_id}")
    return {"id": hook.id, "secret": new, "previous_secret_expires_at": hook.previous_secret_expires_at}


def deliveries(session: Session, webhook_id: int, limit: int = 100,
               before: int | None = None) -> list[dict[str, Any]]:
    _existing(session, webhook_id)
    return [
        {"id": d.id, "delivery_id": d.delivery_id, "event": e.event_type, "event_id": e.id,
         "status": d.status, "attempts": d.attempts, "last_status_code": d.last_status_code,
         "last_error": d.last_error, "created_at": d.created_at, "delivered_at": d.delivered_at}
        for d, e in store.list_deliveries(session, webhook_id, limit, before)
    ]


def send_test(session: Session, webhook_id: int) -> dict[str, Any]:
    """Queue a test event for one webhook (through the outbox, like any other)."""
    _existing(session, webhook_id)
    event = outbox.emit(session, outbox.WebhookTest(webhook_id=webhook_id))
    store.add_delivery(session, webhook_id, event.id)
    outbox.mark_dispatched(session, [event.id])
    return {"queued": True, "event_id": event.id}
