"""A small webhook receiver that verifies signatures: for the demo and for tests."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from ringwatch.services.notifier.channels import verify


class WebhookReceiver:
    """Listens on 127.0.0.1; records every delivery, and whether its signature verifies with
    one of ``secrets``; answers ``status`` (settable: 503 = down)."""

    def __init__(self, secrets: str | Sequence[str], port: int = 0) -> None:
        self.secrets = [secrets] if isinstance(secrets, str) else list(secrets)
        self.status = 200
        # Seconds to stall and then drop the request unanswered (``release`` ends a stall
        # early); a stalled request is counted in ``requests`` but not recorded as received.
        self.delay_s = 0.0
        # Seconds to pause before answering (a slow receiver that does answer, and records).
        self.pause_s = 0.0
        self._release = threading.Event()
        self.requests = 0
        self.events: list[dict[str, Any]] = []
        self._lock = threading.Condition()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                raw = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                with receiver._lock:
                    receiver.requests += 1
                    receiver._lock.notify_all()
                if receiver.delay_s:
                    receiver._release.wait(receiver.delay_s)
                    return
                if receiver.pause_s:
                    time.sleep(receiver.pause_s)
                code = receiver.status
                if code < 300:
                    receiver._record(self.headers, raw)
                self.send_response(code)
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def _record(self, headers: Any, raw: bytes) -> None:
        delivery = headers.get("X-Ringwatch-Delivery", "")
        signature = headers.get("X-Ringwatch-Signature", "")
        sequence = headers.get("X-Ringwatch-Sequence", "")
        with self._lock:
            self.events.append({
                "event": headers.get("X-Ringwatch-Event"),
                "delivery": delivery,
                "sequence": int(sequence) if sequence.isdigit() else None,
                "signature": signature,
                "verified": verify(self.secrets, raw, delivery, signature),
                "host": headers.get("Host"),
                "raw": raw,
                "body": json.loads(raw or b"{}"),
            })
            self._lock.notify_all()

    def release(self) -> None:
        """End every stall now and from now on (``delay_s`` back to 0)."""
        self.delay_s = 0.0
        self._release.set()

    def wait_for_requests(self, count: int, timeout_s: float) -> int:
        """Wait until ``count`` requests have arrived, answered or not."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while self.requests < count and time.monotonic() < deadline:
                self._lock.wait(max(0.0, deadline - time.monotonic()))
            return self.requests

    def wait_for(self, count: int, timeout_s: float) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while len(self.events) < count and time.monotonic() < deadline:
                self._lock.wait(max(0.0, deadline - time.monotonic()))
            return list(self.events)

    def __enter__(self) -> WebhookReceiver:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
        self.server.shutdown()
        self.server.server_close()
