"""A notifier process killed mid-delivery loses nothing: its claim expires and another
process delivers, under the same delivery id."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from fastapi.testclient import TestClient

from ringwatch.api.app import create_app
from ringwatch.services.notifier.receiver import WebhookReceiver
from ringwatch.services.settings import Settings
from ringwatch.services.store import db, tokens
from tests.api_fixtures import REACT_AT_ONCE, TEST_SECRET_KEY, WEBHOOK_TEST_SETTINGS, fleet_batch

SECRET = "s3cret-for-tests"


def notifier(env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "ringwatch.services.cli.main", "notifier"], env=env)


def test_killed_notifier_loses_nothing(database_url, clean_db) -> None:
    with db.transaction(clean_db) as s:
        agent, admin = tokens.create_token(s, "agent"), tokens.create_token(s, "admin")
    app = create_app(Settings(database_url="unused", **REACT_AT_ONCE, **WEBHOOK_TEST_SETTINGS), clean_db)
    # A 1 s timeout makes the claim lease (3 timeouts + 5 s, renewed while the notifier
    # lives) short enough for a test.
    env = {**os.environ, "RINGWATCH_DATABASE_URL": database_url, "RINGWATCH_WEBHOOK_TIMEOUT_S": "1",
           "RINGWATCH_NOTIFIER_POLL_S": "0.2", "RINGWATCH_SECRET_KEY": TEST_SECRET_KEY,
           "RINGWATCH_WEBHOOK_ALLOWED_NETWORKS": "127.0.0.0/8"}
    with WebhookReceiver(SECRET) as rx, TestClient(app) as api:
        rx.delay_s = 30.0  # the receiver stalls: the first notifier is caught mid-delivery
        api.post("/v1/webhooks", headers={"Authorization": f"Bearer {admin}"},
                 json={"url": rx.url, "secret": SECRET, "events": ["health.degraded"]}).raise_for_status()
        expected = len(api.post("/v1/measurements", json=fleet_batch(slow_node="node-001"),
                                headers={"Authorization": f"Bearer {agent}"}).json()["degraded"])
        first = notifier(env)
        assert rx.wait_for_requests(1, timeout_s=60) >= 1
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=10)

        rx.release()
        second = notifier(env)
        try:
            events = rx.wait_for(expected, timeout_s=60)
            # The receiver records a delivery before the notifier hears its 200: let it commit.
            log = deliveries_when_settled(clean_db)
        finally:
            second.terminate()
            second.wait(timeout=15)
    ids = {e["delivery"] for e in events}
    assert len(ids) == expected
    assert all(e["verified"] for e in events)
    assert {d for d, _ in log} == ids and {s for _, s in log} == {"delivered"}


def deliveries_when_settled(factory, timeout_s: float = 20.0) -> list[tuple[str, str]]:
    from sqlalchemy import select

    from ringwatch.services.store.models import WebhookDelivery

    deadline = time.monotonic() + timeout_s
    while True:
        with db.transaction(factory) as s:
            log = [(d.delivery_id, d.status) for d in s.scalars(select(WebhookDelivery))]
        if all(status != "pending" for _, status in log) or time.monotonic() > deadline:
            return log
        time.sleep(0.2)
