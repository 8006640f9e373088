"""Webhook registration, changes, secret rotation and delivery logs (admin)."""

from typing import Annotated, Any

from fastapi import APIRouter, Query, Response, status

from ringwatch.api.deps import AdminDep, SessionDep, SettingsDep
from ringwatch.api.schemas import (
    DeliveryOut,
    ErrorOut,
    WebhookIn,
    WebhookOut,
    WebhookPatch,
    WebhookRotateIn,
    WebhookSecretOut,
)
from ringwatch.services.notifier import service

router = APIRouter(prefix="/v1/webhooks", tags=["webhooks"])

# 503 not_configured: RINGWATCH_SECRET_KEY is unset, so no secret can be stored.
NEEDS_KEY: dict[int | str, dict[str, Any]] = {503: {"model": ErrorOut}}


@router.post("", response_model=WebhookOut, status_code=status.HTTP_201_CREATED, responses=NEEDS_KEY)
def create_webhook(body: WebhookIn, session: SessionDep, settings: SettingsDep, _: AdminDep) -> dict:
    """Register a webhook for some events; deliveries are signed with ``secret`` (16+
    characters, stored encrypted). The URL must pass the URL policy (422 ``url_refused``:
    loopback, link-local and private addresses unless allowed in settings)."""
    return service.create(session, settings, str(body.url), body.secret, list(body.events), body.format)


@router.get("", response_model=list[WebhookOut])
def list_webhooks(session: SessionDep, _: AdminDep) -> list[dict]:
    """Every registered webhook (secrets are never returned)."""
    return service.list_all(session)


@router.get("/{webhook_id}", response_model=WebhookOut)
def get_webhook(webhook_id: int, session: SessionDep, _: AdminDep) -> dict:
    """One webhook (its secret is never returned)."""
    return service.get(session, webhook_id)


@router.patch("/{webhook_id}", response_model=WebhookOut)
def update_webhook(webhook_id: int, body: WebhookPatch, session: SessionDep, settings: SettingsDep,
                   _: AdminDep) -> dict:
    """Change a webhook's url, events or format, or disable (``active: false``) and enable
    it. A disabled webhook gets no deliveries for new events; queued ones wait for it."""
    changes = body.model_dump(exclude_none=True)
    if "url" in changes:
        changes["url"] = str(body.url)
    return service.update(session, settings, webhook_id, changes)


@router.delete("/{webhook_id}", status_code=status.HTTP_204_NO_CONTENT, response_class=Response)
def delete_webhook(webhook_id: int, session: SessionDep, _: AdminDep) -> None:
    """Delete a webhook and its delivery log; deliveries still queued for it are not sent."""
    service.delete(session, webhook_id)


@router.post("/{webhook_id}/rotate", response_model=WebhookSecretOut, responses=NEEDS_KEY)
def rotate_secret(webhook_id: int, session: SessionDep, settings: SettingsDep, _: AdminDep,
                  body: WebhookRotateIn | None = None) -> dict:
    """Replace the signing secret with ``secret`` or a random one, returned here once. For
    ``grace_s`` seconds the old secret signs too (a second ``v1=`` in the signature)."""
    body = body or WebhookRotateIn()
    return service.rotate(session, settings, webhook_id, body.secret, body.grace_s)


@router.get("/{webhook_id}/deliveries", response_model=list[DeliveryOut])
def list_deliveries(webhook_id: int, session: SessionDep, _: AdminDep,
                    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
                    before: Annotated[int | None, Query(
                        ge=1, le=2**63 - 1,
                        description="a delivery's id: the page of older deliveries below it")] = None,
                    ) -> list[dict]:
    """The delivery log of one webhook, newest first, ``limit`` at a time."""
    return service.deliveries(session, webhook_id, limit, before)


@router.post("/{webhook_id}/test", status_code=status.HTTP_202_ACCEPTED)
def test_webhook(webhook_id: int, session: SessionDep, _: AdminDep) -> dict:
    """Queue a ``webhook.test`` event for this webhook."""
    return service.send_test(session, webhook_id)
