"""The notifier: fan outbox events into deliveries, send what is due, retry with backoff."""

from __future__ import annotations

import json
import logging
import random
import threading
from dataclasses import dataclass
from datetime import timedelta

import httpx
from sqlalchemy.orm import Session, sessionmaker

from agents.spec import utcnow
from services.notifier.channels import CHANNELS, sign
from services.store import db
from services.store import webhooks as store
from services.store.health import OUTBOX_CHANNEL

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RetryPolicy:
    base_s: float = 1.0
    cap_s: float = 300.0
    max_age_s: float = 24 * 3600.0

    def next_delay(self, attempts: int) -> float:
        """Exponential backoff with full jitter (so a fleet of receivers is not hit in step)."""
        ceiling = min(self.cap_s, self.base_s * (2 ** max(0, attempts - 1)))
        return random.uniform(ceiling / 2, ceiling)


class Notifier:
    def __init__(self, factory: sessionmaker[Session], *, timeout_s: float = 5.0,
                 policy: RetryPolicy | None = None, batch: int = 50) -> None:
        self.factory = factory
        self.policy = policy or RetryPolicy()
        self.batch = batch
        self.timeout_s = timeout_s
        self.client = httpx.Client(timeout=timeout_s)

    def run_once(self) -> int:
        """Dispatch new events and attempt every due delivery once; return attempts made."""
        with db.transaction(self.factory) as s:
            store.dispatch_outbox(s)
        # The claim commits before any HTTP call, so no row lock is held across the network.
        with db.transaction(self.factory) as s:
            claimed = [
                (d.id, d.delivery_id, d.attempts, d.created_at, h.url, h.secret, h.format,
                 e.event_type, e.payload, e.id)
                for d, h, e in store.claim_due(s, self.batch, lease_s=self.timeout_s * 3 + 5)
            ]
        for item in claimed:
            self._attempt(*item)
        return len(claimed)

    def _attempt(self, pk: int, delivery_id: str, attempts: int, created_at, url: str, secret: str,
                 fmt: str, event_type: str, payload: dict, event_id: int) -> None:
        body = json.dumps(CHANNELS.get(fmt, CHANNELS["json"])(event_type, payload),
                          separators=(",", ":"), sort_keys=True).encode()
        headers = {
            "Content-Type": "application/json",
            "X-Ringwatch-Event": event_type,
            "X-Ringwatch-Delivery": delivery_id,
            "X-Ringwatch-Signature": sign(secret, body),
        }
        code: int | None = None
        try:
            resp = self.client.post(url, content=body, headers=headers)
            code = resp.status_code
            ok = 200 <= code < 300
            error = "" if ok else f"HTTP {code}"
        except httpx.HTTPError as exc:
            ok, error = False, f"{type(exc).__name__}: {exc}"
        now = utcnow()
        with db.transaction(self.factory) as s:
            if ok:
                store.mark_delivered(s, pk, code or 0, now)
                return
            retry_at = now + timedelta(seconds=self.policy.next_delay(attempts))
            too_old = (retry_at - created_at).total_seconds() > self.policy.max_age_s
            store.mark_failed(s, pk, status_code=code, error=error, retry_at=None if too_old else retry_at)
        log.info("delivery %s of event %s to %s failed (%s)", delivery_id, event_id, url, error)

    def run_forever(self, poll_s: float, stop: threading.Event) -> None:
        """Deliver until ``stop``; wake on the outbox's NOTIFY, or every ``poll_s`` for retries."""
        listener = self._listen()
        while not stop.is_set():
            try:
                busy = self.run_once()
            except Exception:  # a database blip must not end the loop
                log.exception("notifier pass failed")
                busy = 0
            if not busy:
                self._wait(listener, poll_s, stop)
        if listener is not None:
            listener.close()

    def _listen(self):  # -> psycopg.Connection | None
        import psycopg

        url = self.factory.kw["bind"].url.set(drivername="postgresql")
        try:
            conn = psycopg.connect(url.render_as_string(hide_password=False), autocommit=True)
            conn.execute(f"LISTEN {OUTBOX_CHANNEL}")
            return conn
        except psycopg.Error:
            log.warning("LISTEN unavailable; polling every pass instead")
            return None

    @staticmethod
    def _wait(listener, poll_s: float, stop: threading.Event) -> None:
        if listener is None:
            stop.wait(poll_s)
            return
        try:
            for _ in listener.notifies(timeout=poll_s, stop_after=1):
                pass
        except Exception:
            log.exception("LISTEN connection failed")
            stop.wait(poll_s)

    def close(self) -> None:
        self.client.close()
