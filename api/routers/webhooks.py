"""Webhook registration and delivery logs (admin)."""

from fastapi import APIRouter, status

from api.deps import AdminDep, SessionDep
from api.schemas import DeliveryOut, WebhookIn, WebhookOut
from services.notifier import service

router = APIRouter(prefix="/v1/webhooks", tags=["webhooks"])


@router.post("", response_model=WebhookOut, status_code=status.HTTP_201_CREATED)
def create_webhook(body: WebhookIn, session: SessionDep, _: AdminDep) -> dict:
    """Register a webhook for some events; deliveries are signed with ``secret``."""
    return service.create(session, str(body.url), body.secret, list(body.events), body.format)


@router.get("", response_model=list[WebhookOut])
def list_webhooks(session: SessionDep, _: AdminDep) -> list[dict]:
    """Every registered webhook (secrets are never returned)."""
    return service.list_all(session)


@router.get("/{webhook_id}/deliveries", response_model=list[DeliveryOut])
def list_deliveries(webhook_id: int, session: SessionDep, _: AdminDep) -> list[dict]:
    """The delivery log of one webhook, newest first."""
    return service.deliveries(session, webhook_id)


@router.post("/{webhook_id}/test", status_code=status.HTTP_202_ACCEPTED)
def test_webhook(webhook_id: int, session: SessionDep, _: AdminDep) -> dict:
    """Queue a ``webhook.test`` event for this webhook."""
    return service.send_test(session, webhook_id)
