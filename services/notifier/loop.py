"""The notifier: fan outbox events into deliveries, send what is due, retry with backoff.

Deliveries go out from a small thread pool, at most ``per_webhook`` at once to one webhook,
so a receiver that stalls holds up only its own deliveries, and each attempt ends within
``timeout_s`` of its start however slowly the receiver answers (services/notifier/deadline.py).
Each notifier claims under its own id and renews its claims while it sends; only the holder of
a claim records the outcome.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import select
import threading
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import httpcore
import httpx
from sqlalchemy.orm import Session, sessionmaker

from agents.spec import utcnow
from services.notifier import url_policy
from services.notifier.channels import CHANNELS, signature_header
from services.notifier.deadline import attempt_pool
from services.notifier.secret_box import (
    SEALED_PREFIX,
    SecretBox,
    SecretUnreadable,
    box_from_settings,
    open_secret,
)
from services.settings import Settings
from services.store import db
from services.store import webhooks as store
from services.store.events import OUTBOX_CHANNEL
from services.store.models import OutboxEvent, Webhook, WebhookDelivery

log = logging.getLogger(__name__)

# Deliveries in flight to one webhook at once, over all notifiers.
PER_WEBHOOK = 2


@dataclass(frozen=True)
class RetryPolicy:
    base_s: float = 1.0
    cap_s: float = 300.0
    max_age_s: float = 24 * 3600.0

    def next_delay(self, attempts: int) -> float:
        """Exponential backoff with full jitter (so a fleet of receivers is not hit in step)."""
        ceiling = min(self.cap_s, self.base_s * (2 ** max(0, attempts - 1)))
        return random.uniform(ceiling / 2, ceiling)


@dataclass(frozen=True)
class Job:
    """One claimed delivery, with all it needs to be sent outside the claim's transaction."""

    pk: int
    delivery_id: str
    attempts: int
    created_at: datetime
    webhook_id: int
    url: str
    # The current secret first, then one in its grace period; empty when they cannot be read.
    secrets: tuple[str, ...]
    unreadable: str
    format: str
    event_type: str
    payload: dict[str, Any]
    sequence: int


@dataclass(frozen=True)
class Outcome:
    status_code: int | None
    error: str  # empty: delivered
    retry: bool = True


class Notifier:
    def __init__(self, factory: sessionmaker[Session], *, timeout_s: float = 5.0,
                 policy: RetryPolicy | None = None, batch: int = 50, box: SecretBox | None = None,
                 allowed_networks: Sequence[str] = (), concurrency: int = 8,
                 per_webhook: int = PER_WEBHOOK) -> None:
        self.factory = factory
        self.policy = policy or RetryPolicy()
        self.batch = batch
        self.timeout_s = timeout_s
        self.box = box
        self.allowed_networks = url_policy.parse_networks(allowed_networks)
        self.concurrency = concurrency
        self.per_webhook = per_webhook
        self.holder = uuid.uuid4()
        # Renewed every third of it while a delivery is in flight, so it covers the work
        # however long that takes, and runs out soon after a notifier dies.
        self.lease_s = timeout_s * 3 + 5
        # Each attempt gets a connection pool of its own, cut at its deadline. Redirects are
        # not followed (the policy checked this URL, not where it points), and proxy and CA
        # variables are ignored (a proxy would resolve the name again itself).
        self.ssl_context = httpx.create_ssl_context(trust_env=False)
        self._pool = ThreadPoolExecutor(concurrency, thread_name_prefix="notifier")
        self._in_flight: dict[Future[None], int] = {}
        self._renew_at = 0.0
        self._sealed = False
        # A finished delivery writes a byte here, so the loop waiting on LISTEN wakes at once.
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._listener: Any = None
        # When the delivery loop last came round (services/notifier/health.py reads it).
        self.came_round = time.monotonic()
        if box is None:
            log.warning("RINGWATCH_SECRET_KEY is unset: webhook secrets stored encrypted cannot be "
                        "decrypted, so their deliveries wait (and are retried) until it is set")

    @classmethod
    def from_settings(cls, factory: sessionmaker[Session], settings: Settings) -> Notifier:
        return cls(factory, timeout_s=settings.webhook_timeout_s,
                   policy=RetryPolicy(max_age_s=settings.webhook_max_age_s),
                   box=box_from_settings(settings), allowed_networks=settings.webhook_allowed_networks,
                   concurrency=settings.webhook_concurrency)

    # -- passes ---------------------------------------------------------------------------

    def run_once(self) -> int:
        """Dispatch new events and attempt every delivery due now once (under the same
        limits as ``run_forever``); return the attempts made."""
        self._seal_plaintext_secrets()
        with db.transaction(self.factory) as s:
            store.dispatch_outbox(s)
            due_by = store.database_now(s)
        attempts = 0
        while True:
            started = self._start_due(due_by)
            attempts += started
            self._prune()
            if not started and not self._in_flight:
                return attempts
            if not started or len(self._in_flight) >= self.concurrency:
                self._wait_for_one()

    def run_forever(self, poll_s: float, stop: threading.Event) -> None:
        """Deliver until ``stop``; wake on the outbox's NOTIFY, when a delivery finishes, or
        every ``poll_s`` for retries."""
        self._listener = self._listen()
        while not stop.is_set():
            self.came_round = time.monotonic()
            try:
                self._seal_plaintext_secrets()
                self._prune()
                self._renew_claims()
                with db.transaction(self.factory) as s:
                    store.dispatch_outbox(s)
                started = self._start_due()
            except Exception:  # a database blip must not end the loop
                log.exception("notifier pass failed")
                started = 0
            if not started or len(self._in_flight) >= self.concurrency:
                self._wait(poll_s)
        self._settle()
        if self._listener is not None:
            self._listener.close()

    def _start_due(self, due_by: datetime | None = None) -> int:
        free = self.concurrency - len(self._in_flight)
        if free <= 0:
            return 0
        if not self._in_flight:  # fresh claims hold a whole lease
            self._renew_at = time.monotonic() + self.lease_s / 3
        # The claim commits before any HTTP call, so no row lock is held across the network.
        with db.transaction(self.factory) as s:
            jobs = [self._job(d, h, e) for d, h, e in store.claim_due(
                s, self.holder, min(self.batch, free), self.lease_s, self.per_webhook, due_by)]
        for job in jobs:
            future = self._pool.submit(self._attempt, job)
            self._in_flight[future] = job.pk
            future.add_done_callback(self._wake)
        return len(jobs)

    def _job(self, delivery: WebhookDelivery, hook: Webhook, event: OutboxEvent) -> Job:
        stored = [hook.secret]
        expires = hook.previous_secret_expires_at
        if hook.previous_secret is not None and expires is not None and expires > utcnow():
            stored.append(hook.previous_secret)
        try:
            secrets, unreadable = tuple(open_secret(self.box, s) for s in stored), ""
        except SecretUnreadable as exc:
            secrets, unreadable = (), str(exc)
        return Job(delivery.id, delivery.delivery_id, delivery.attempts, delivery.created_at,
                   hook.id, hook.url, secrets, unreadable, hook.format, event.event_type,
                   event.payload, event.id)

    # -- one delivery (on a pool thread) ---------------------------------------------------

    def _attempt(self, job: Job) -> None:
        self._record(job, self._send(job))

    def _send(self, job: Job) -> Outcome:
        if (utcnow() - job.created_at).total_seconds() > self.policy.max_age_s:
            return Outcome(None, "expired before it could be sent (RINGWATCH_WEBHOOK_MAX_AGE_S)",
                           retry=False)
        if job.unreadable:
            return Outcome(None, f"cannot sign: {job.unreadable}")
        try:
            target = url_policy.resolve(job.url, self.allowed_networks)
        except url_policy.HostUnresolved as exc:
            return Outcome(None, exc.reason)
        except url_policy.UrlRefused as exc:
            # Never connected: the log says why, and nothing about what answers there.
            return Outcome(None, f"refused by URL policy: {exc.reason}", retry=False)
        render = CHANNELS.get(job.format, CHANNELS["json"])
        body = json.dumps(render(job.event_type, job.sequence, job.payload),
                          separators=(",", ":"), sort_keys=True).encode()
        headers = {
            "Content-Type": "application/json",
            "X-Ringwatch-Event": job.event_type,
            "X-Ringwatch-Delivery": job.delivery_id,
            "X-Ringwatch-Sequence": str(job.sequence),
            "X-Ringwatch-Signature": signature_header(job.secrets, body, job.delivery_id,
                                                      int(time.time())),
        }
        return self._post(target, body, headers)

    def _post(self, target: url_policy.CheckedUrl, body: bytes, headers: dict[str, str]) -> Outcome:
        """POST to the addresses that were checked, in turn until one connects, all of it
        within one deadline of ``timeout_s``."""
        error = "no address"
        timeouts = dict.fromkeys(("connect", "read", "write", "pool"), self.timeout_s)
        with attempt_pool(self.timeout_s, self.ssl_context) as pool:
            for address in target.addresses:
                url, host, extensions = target.pinned(address)
                try:
                    # Streamed and closed unread: the status is all we need, and a receiver
                    # cannot make us hold a large answer.
                    with pool.stream("POST", str(url), content=body,
                                     headers=[*headers.items(), *host.items()],
                                     extensions={**extensions, "timeout": timeouts}) as resp:
                        code = resp.status
                except httpcore.ConnectError as exc:
                    error = f"ConnectError: {exc}"
                    continue
                except httpcore.TimeoutException:
                    return Outcome(None, f"no complete answer within {self.timeout_s:g} s "
                                         "(RINGWATCH_WEBHOOK_TIMEOUT_S)")
                except (httpcore.NetworkError, httpcore.ProtocolError,
                        httpcore.UnsupportedProtocol) as exc:
                    return Outcome(None, f"{type(exc).__name__}: {exc}")
                return Outcome(code, "" if 200 <= code < 300 else f"HTTP {code}")
        return Outcome(None, error)

    def _record(self, job: Job, outcome: Outcome) -> None:
        now = utcnow()
        with db.transaction(self.factory) as s:
            if not outcome.error:
                held = store.mark_delivered(s, job.pk, self.holder, outcome.status_code or 0, now)
            else:
                next_at = now + timedelta(seconds=self.policy.next_delay(job.attempts))
                too_old = (next_at - job.created_at).total_seconds() > self.policy.max_age_s
                retry_at = next_at if outcome.retry and not too_old else None
                held = store.mark_failed(s, job.pk, self.holder, status_code=outcome.status_code,
                                         error=outcome.error, retry_at=retry_at)
        if not held:
            log.warning("delivery %s (event %s, webhook %s): the claim is no longer ours (another "
                        "notifier took it, or the webhook was deleted); outcome %r not recorded",
                        job.delivery_id, job.sequence, job.webhook_id, outcome.error or "delivered")
        elif outcome.error:
            log.info("delivery %s of event %s to webhook %s failed (%s)", job.delivery_id,
                     job.sequence, job.webhook_id, outcome.error)

    # -- claims and waiting ----------------------------------------------------------------

    def _prune(self) -> None:
        for future in [f for f in self._in_flight if f.done()]:
            pk = self._in_flight.pop(future)
            if future.exception() is not None:
                log.error("delivery %s: attempt failed unexpectedly", pk, exc_info=future.exception())

    def _renew_claims(self) -> None:
        if not self._in_flight or time.monotonic() < self._renew_at:
            return
        self._renew_at = time.monotonic() + self.lease_s / 3
        pks = set(self._in_flight.values())
        with db.transaction(self.factory) as s:
            held = store.renew_claims(s, self.holder, pks, self.lease_s)
        for pk in sorted(pks - held):
            log.warning("delivery %s: claim lost while sending (another notifier took it, or the "
                        "webhook was deleted)", pk)

    def _wait_for_one(self) -> None:
        wait(list(self._in_flight), timeout=self.lease_s / 3, return_when=FIRST_COMPLETED)
        self._prune()
        self._renew_claims()

    def _settle(self) -> None:
        """Wait for every delivery in flight, renewing their claims meanwhile."""
        self._prune()
        while self._in_flight:
            self._wait_for_one()

    def _seal_plaintext_secrets(self) -> None:
        """Once per notifier: encrypt secrets stored in plain text before encryption existed."""
        if self._sealed or self.box is None:
            return
        with db.transaction(self.factory) as s:
            sealed = store.seal_secrets(s, SEALED_PREFIX, self.box.seal)
        if sealed:
            log.info("encrypted the plain-text secrets of %d webhooks", sealed)
        self._sealed = True

    def _wake(self, _: Future[None]) -> None:
        # A full pipe has a wake-up pending anyway; a closed one has nobody to wake.
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"\0")

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

    def _wait(self, poll_s: float) -> None:
        """Until a NOTIFY, a finished delivery, ``poll_s``, or the next claim renewal."""
        timeout = poll_s
        if self._in_flight:
            timeout = max(0.0, min(poll_s, self._renew_at - time.monotonic()))
        fds = [self._wake_r] + ([self._listener.fileno()] if self._listener is not None else [])
        ready, _, _ = select.select(fds, [], [], timeout)
        if self._wake_r in ready:
            with contextlib.suppress(BlockingIOError):
                while os.read(self._wake_r, 4096):
                    pass
        if len(fds) > 1 and fds[1] in ready:
            try:
                for _ in self._listener.notifies(timeout=0):
                    pass
            except Exception:
                log.exception("LISTEN connection failed; polling every %s s instead", poll_s)
                self._listener.close()
                self._listener = None

    def close(self) -> None:
        self._settle()
        self._pool.shutdown(wait=True)
        for fd in (self._wake_r, self._wake_w):
            os.close(fd)
