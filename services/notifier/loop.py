"""The notifier: fan outbox events into deliveries, send what is due, retry with backoff.

Deliveries go out from a small thread pool, at most ``per_webhook`` at once to one webhook,
so a receiver that stalls holds up only its own deliveries, and each attempt ends within
``timeout_s`` of its start however slowly the receiver answers (services/notifier/deadline.py).
Each notifier claims under its own id and renews its claims while it sends; only the holder of
a claim records the outcome. A notifier told to stop finishes its deliveries in flight within
``shutdown_s``, then cuts those still going and releases their claims to the next notifier.
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

from ringwatch.agents.spec import utcnow
from ringwatch.services.logs import OutageLog
from ringwatch.services.notifier import url_policy
from ringwatch.services.notifier.channels import CHANNELS, signature_header
from ringwatch.services.notifier.deadline import Cut, attempt_pool
from ringwatch.services.notifier.secret_box import (
    SEALED_PREFIX,
    SecretBox,
    SecretUnreadable,
    box_from_settings,
    open_secret,
)
from ringwatch.services.settings import SHUTDOWN_TIMEOUT_S, Settings
from ringwatch.services.store import db, heartbeats
from ringwatch.services.store import webhooks as store
from ringwatch.services.store.events import OUTBOX_CHANNEL
from ringwatch.services.store.models import OutboxEvent, Webhook, WebhookDelivery

log = logging.getLogger(__name__)

# Deliveries in flight to one webhook at once, over all notifiers.
PER_WEBHOOK = 2
# Seconds between the delivery loop's heartbeats in the database (RingwatchNotifierNotLooping
# fires after five minutes without one).
BEAT_S = 15.0
# Once its LISTEN connection is lost (a database restart or failover), the notifier tries to
# LISTEN again this often, waking from its poll to do so; the pass after it succeeds picks up
# what was committed meanwhile. Each try gives up after LISTEN_CONNECT_TIMEOUT_S (a vanished
# host would otherwise hold the loop for the kernel's SYN retries), and TCP keepalives find a
# connection that died without a word (LISTEN_KEEPALIVE: idle, interval, count; about a
# minute in all).
LISTEN_RETRY_S = 1.0
LISTEN_CONNECT_TIMEOUT_S = 5
LISTEN_KEEPALIVE = (30, 10, 3)


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
                 per_webhook: int = PER_WEBHOOK,
                 shutdown_s: float = SHUTDOWN_TIMEOUT_S) -> None:
        self.factory = factory
        self.policy = policy or RetryPolicy()
        self.batch = batch
        self.timeout_s = timeout_s
        self.box = box
        self.allowed_networks = url_policy.parse_networks(allowed_networks)
        self.concurrency = concurrency
        self.per_webhook = per_webhook
        self.shutdown_s = shutdown_s
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
        # Deliveries given up while stopping: their attempts are cut, their outcome not recorded.
        self._cut = Cut()
        self._released: set[int] = set()
        self._renew_at = 0.0
        self._sealed = False
        # A finished delivery writes a byte here, so the loop waiting on LISTEN wakes at once.
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._listener: Any = None
        # When LISTEN was lost (None: listening, or never tried), and when to try it again.
        self._listen_lost_at: float | None = None
        self._listen_retry_at = 0.0
        # When the delivery loop last came round (services/notifier/health.py reads it), and
        # when its next heartbeat is due in the database (the API's /metrics reports it).
        self.came_round = time.monotonic()
        self._beat_due = 0.0
        # A pass that fails on a fault of its own (not the database) says so with its
        # traceback once, then once a minute, not every pass.
        self._pass_failing = OutageLog(log, "notifier pass", state="failing", back="works again",
                                       settle_s=0)
        if box is None:
            log.warning("RINGWATCH_SECRET_KEY is unset: webhook secrets stored encrypted cannot be "
                        "decrypted, so their deliveries wait (and are retried) until it is set")

    @classmethod
    def from_settings(cls, factory: sessionmaker[Session], settings: Settings) -> Notifier:
        return cls(factory, timeout_s=settings.webhook_timeout_s,
                   policy=RetryPolicy(max_age_s=settings.webhook_max_age_s),
                   box=box_from_settings(settings), allowed_networks=settings.webhook_allowed_networks,
                   concurrency=settings.webhook_concurrency,
                   shutdown_s=settings.shutdown_timeout_s)

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
        every ``poll_s`` for retries. Once stopped, the deliveries in flight are finished or,
        past ``shutdown_s``, released (``_settle``): a rollout sends nothing twice."""
        self._listen()
        while not stop.is_set():
            self.came_round = time.monotonic()
            try:
                self._seal_plaintext_secrets()
                self._prune()
                self._renew_claims()
                with db.transaction(self.factory) as s:
                    store.dispatch_outbox(s)
                    self._beat(s)
                started = self._start_due()
            except db.UNAVAILABLE as exc:  # a database blip must not end the loop
                db.OUTAGE.failed(exc)
                started = 0
            except Exception as exc:  # nor a fault of one pass
                self._pass_failing.failed(exc, traceback=True)
                started = 0
            else:
                self._pass_failing.ok()
            if not started or len(self._in_flight) >= self.concurrency:
                self._wait(poll_s)
        self._settle(self.shutdown_s)
        if self._listener is not None:
            self._listener.close()

    def _beat(self, session: Session) -> None:
        """In the pass's transaction, at most every BEAT_S: the ``notifier`` heartbeat
        (services.store.heartbeats), what RingwatchNotifierNotLooping reads."""
        now = time.monotonic()
        if now >= self._beat_due:
            heartbeats.beat(session, heartbeats.NOTIFIER)
            self._beat_due = now + BEAT_S

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
        with attempt_pool(self.timeout_s, self.ssl_context, self._cut) as pool:
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
        if job.pk in self._released:  # cut while stopping; the next notifier sends it
            return
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

    def _wait_for_one(self, timeout_s: float | None = None) -> None:
        limit = self.lease_s / 3 if timeout_s is None else min(timeout_s, self.lease_s / 3)
        wait(list(self._in_flight), timeout=limit, return_when=FIRST_COMPLETED)
        self._prune()
        self._renew_claims()

    def _settle(self, within_s: float | None = None) -> None:
        """Wait for every delivery in flight, renewing their claims meanwhile; past
        ``within_s``, release those still going and cut their connections."""
        self._prune()
        end = None if within_s is None else time.monotonic() + within_s
        while self._in_flight:
            left = None if end is None else end - time.monotonic()
            if left is not None and left <= 0:
                self._release_in_flight()
                return
            self._wait_for_one(left)

    def _release_in_flight(self) -> None:
        """Give the claims of the deliveries in flight up (due again at once for the next
        notifier, not after their lease), then cut their attempts so their threads end. A
        receiver that had the request but not yet answered it gets it again: at least once."""
        pks = set(self._in_flight.values())
        self._released |= pks
        try:
            with db.transaction(self.factory) as s:
                released = store.release_claims(
                    s, self.holder, pks, f"cut after {self.shutdown_s:g} s when the notifier "
                                         "stopped (RINGWATCH_SHUTDOWN_TIMEOUT_S); sent again")
        except db.UNAVAILABLE as exc:  # the claims run out with their lease instead
            log.warning("could not release %d deliveries in flight: the database is away (%s)",
                        len(pks), type(exc).__name__)
            released = set()
        self._cut.now()
        log.warning("stopping: %d deliveries still in flight after %g s were cut; %d released "
                    "to the next notifier, the rest when their claim runs out", len(pks),
                    self.shutdown_s, len(released))

    def _seal_plaintext_secrets(self) -> None:
        """Once per notifier: encrypt secrets stored in plain text before encryption existed."""
        if self._sealed or self.box is None:
            return
        with db.transaction(self.factory) as s:
            sealed = store.seal_secrets(s, SEALED_PREFIX, self.box.seal)
        if sealed:
            log.info("encrypted the plain-text secrets of %d webhooks", sealed)
        self._sealed = True

    def wake(self) -> None:
        """Wake the loop now (a stop was asked); safe in a signal handler."""
        self._wake(None)

    def _wake(self, _: Future[None] | None) -> None:
        # A full pipe has a wake-up pending anyway; a closed one has nobody to wake.
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"\0")

    def _listen(self) -> bool:
        """Open a connection of its own and LISTEN on the outbox's channel; say once when
        that fails, and once when it works again. Whether it listens now."""
        import psycopg

        url = self.factory.kw["bind"].url.set(drivername="postgresql")
        idle, interval, count = LISTEN_KEEPALIVE
        try:
            conn = psycopg.connect(url.render_as_string(hide_password=False), autocommit=True,
                                   connect_timeout=LISTEN_CONNECT_TIMEOUT_S, keepalives=1,
                                   keepalives_idle=idle, keepalives_interval=interval,
                                   keepalives_count=count)
        except psycopg.Error as exc:
            self._listen_failed(type(exc).__name__)
            return False
        try:
            conn.execute(f"LISTEN {OUTBOX_CHANNEL}")
        except psycopg.Error as exc:
            conn.close()
            self._listen_failed(type(exc).__name__)
            return False
        self._listener = conn
        if self._listen_lost_at is not None:
            log.warning("LISTEN on %s again after %.0f s without it", OUTBOX_CHANNEL,
                     time.monotonic() - self._listen_lost_at)
            self._listen_lost_at = None
        return True

    def _listen_failed(self, why: str) -> None:
        if self._listen_lost_at is None:
            self._listen_lost_at = time.monotonic()
            log.warning("LISTEN on %s unavailable (%s): polling instead, and trying to LISTEN "
                        "again every %g s", OUTBOX_CHANNEL, why, LISTEN_RETRY_S)
        self._listen_retry_at = time.monotonic() + LISTEN_RETRY_S

    def _unlisten(self, why: str) -> None:
        """The LISTEN connection broke: close it, and try again from the next wait on."""
        with contextlib.suppress(Exception):
            self._listener.close()
        self._listener = None
        self._listen_failed(why)

    def _wait(self, poll_s: float) -> None:
        """Until a NOTIFY, a finished delivery, ``poll_s``, or the next claim renewal; while
        not listening, until LISTEN works again too (the pass that follows catches up)."""
        timeout = poll_s
        if self._in_flight:
            timeout = max(0.0, min(poll_s, self._renew_at - time.monotonic()))
        deadline = time.monotonic() + timeout
        while self._listener is None:
            now = time.monotonic()
            if now >= self._listen_retry_at and self._listen():
                return
            step = min(deadline, self._listen_retry_at) - time.monotonic()
            if time.monotonic() >= deadline or self._await(max(0.0, step)):
                return
        self._await(max(0.0, deadline - time.monotonic()), self._listener.fileno())

    def _await(self, timeout: float, listening: int | None = None) -> bool:
        """Wait up to ``timeout`` for a wake-up, or a NOTIFY on the LISTEN connection's
        socket ``listening``; take in what came. Whether anything did."""
        fds = [self._wake_r] if listening is None else [self._wake_r, listening]
        ready, _, _ = select.select(fds, [], [], timeout)
        if self._wake_r in ready:
            with contextlib.suppress(BlockingIOError):
                while os.read(self._wake_r, 4096):
                    pass
        if listening is not None and listening in ready:
            try:
                for _ in self._listener.notifies(timeout=0):
                    pass
            except Exception as exc:  # the server went away (a restart, a failover)
                self._unlisten(type(exc).__name__)
        return bool(ready)

    def close(self) -> None:
        self._settle()
        self._pool.shutdown(wait=True)
        for fd in (self._wake_r, self._wake_w):
            os.close(fd)
