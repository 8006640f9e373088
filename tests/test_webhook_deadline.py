"""One webhook attempt ends within RINGWATCH_WEBHOOK_TIMEOUT_S however slowly the receiver
answers: a receiver that trickles its answer a byte at a time (each byte well within any
per-read timeout) gets a failed attempt that is retried, not a delivery held for minutes.

A real TCP server on 127.0.0.1 and the real notifier against real Postgres."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from datetime import timedelta

import pytest

from ringwatch.agents.spec import utcnow
from ringwatch.services.notifier.loop import RetryPolicy
from ringwatch.services.store import db
from ringwatch.services.store.models import WebhookDelivery
from tests.api_fixtures import register_webhook as register
from tests.test_notifier import make_notifier

# About a hundred bytes at one every 0.3 s: the whole answer would take ~30 s.
ANSWER = (b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 2\r\n"
          b"X-Padding: " + b"." * 30 + b"\r\n\r\nok")
BYTE_EVERY_S = 0.3
TRICKLE_S = len(ANSWER) * BYTE_EVERY_S


class TricklingReceiver:
    """Accepts connections and answers each with ANSWER, one byte every BYTE_EVERY_S."""

    def __init__(self) -> None:
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.2)
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}/hook"
        self.connections = 0
        self.bytes_sent = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)

    def __enter__(self) -> TricklingReceiver:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self._listener.close()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            self.connections += 1
            with conn:
                self._trickle(conn)

    def _trickle(self, conn: socket.socket) -> None:
        conn.settimeout(5)
        conn.recv(65536)  # the request (small: one read holds it)
        for i in range(len(ANSWER)):
            if self._stop.wait(BYTE_EVERY_S):
                return
            try:
                conn.sendall(ANSWER[i:i + 1])
            except OSError:  # the notifier hung up: the attempt is over
                return
            self.bytes_sent += 1


@pytest.fixture
def trickling() -> Iterator[TricklingReceiver]:
    with TricklingReceiver() as r:
        yield r


def test_a_trickling_receiver_is_cut_off_at_the_deadline(api, clean_db, trickling) -> None:
    hook = register(api, trickling.url)
    assert api.post(f"/v1/webhooks/{hook}/test", headers=api.h["admin"]).status_code == 202
    # Retries an hour away, so this pass makes one attempt and the retry can be seen.
    notifier = make_notifier(clean_db, timeout_s=1.0,
                             policy=RetryPolicy(base_s=3600.0, cap_s=3600.0))
    started = time.monotonic()
    try:
        assert notifier.run_once() == 1
    finally:
        notifier.close()
    took = time.monotonic() - started
    assert trickling.connections == 1
    # The deadline held: the receiver had sent part of its status line, far from all of it.
    assert took < 6.0 < TRICKLE_S, f"the attempt took {took:.1f} s"
    assert 0 < trickling.bytes_sent < len(ANSWER)

    [delivery] = api.get(f"/v1/webhooks/{hook}/deliveries", headers=api.h["admin"]).json()
    assert delivery["status"] == "pending" and delivery["delivered_at"] is None
    assert delivery["attempts"] == 1 and delivery["last_status_code"] is None
    assert delivery["last_error"].startswith("no complete answer within 1 s")
    # Retried later with backoff, like any other failed attempt.
    with db.transaction(clean_db) as s:
        row = s.get(WebhookDelivery, delivery["id"])
        assert row is not None and row.next_attempt_at is not None
        assert row.next_attempt_at > utcnow() + timedelta(minutes=20)
