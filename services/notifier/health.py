"""The notifier's health over HTTP, for a supervisor's probes (Kubernetes' liveness and
readiness): ``/healthz`` while its delivery loop comes round, ``/readyz`` while it could
deliver (its key set, its database reachable and at this code's migrations).

A database outage makes it unready, never dead: restarting a notifier brings no database
back, and its loop carries on through the outage by itself.

It listens on loopback unless told otherwise (``--health-host``; in a pod, the manifest
names 0.0.0.0, as a kubelet probes the pod's address). Whoever reaches it cannot hold a
thread per idle connection: each connection has READ_TIMEOUT_S to send its request, and past
MAX_CONNECTIONS open at once the oldest is dropped, so idle ones never lock a probe out.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Protocol

from sqlalchemy import Engine

from ringwatch.services.health_port import READ_TIMEOUT_S, BoundedServer
from ringwatch.services.store import db

# The loop is alive while it came round within this many poll intervals, and never less than
# LIVE_FLOOR_S: a connection attempt to a database that vanished may hold a pass for about
# two minutes (the kernel's SYN retries) before the loop comes round again; a pass stuck
# longer (a query on a half-open connection waits for ever) only a restart mends.
LIVE_POLLS = 10
LIVE_FLOOR_S = 300.0
# The routes the health server answers: what a probe may point at.
PATHS = ("/healthz", "/readyz")


class Looping(Protocol):
    """What the health check reads of a notifier (services.notifier.loop.Notifier)."""

    came_round: float  # time.monotonic() of the latest pass's start
    box: object  # None: RINGWATCH_SECRET_KEY unset


class NotifierHealth:
    """Answers /healthz and /readyz for one notifier polling every ``poll_s``."""

    def __init__(self, notifier: Looping, engine: Engine, poll_s: float) -> None:
        self.notifier = notifier
        self.engine = engine
        self.stale_after_s = max(LIVE_POLLS * poll_s, LIVE_FLOOR_S)

    def dead(self, now: float | None = None) -> str:
        """Why the loop counts as dead ('' while it is alive)."""
        idle = (time.monotonic() if now is None else now) - self.notifier.came_round
        if idle > self.stale_after_s:
            return (f"the delivery loop has not come round for {idle:.0f} s "
                    f"(more than {self.stale_after_s:g} s)")
        return ""

    def unready(self) -> str:
        """Why the notifier could not deliver now ('' when it could)."""
        if self.notifier.box is None:
            return "RINGWATCH_SECRET_KEY is unset: stored webhook secrets cannot be read"
        return db.schema_state(self.engine).why

    def serve(self, host: str, port: int) -> ThreadingHTTPServer:
        """Answer on ``host:port`` from a thread of its own; ``shutdown()`` the returned
        server to stop."""
        server = BoundedServer((host, port), _handler(self))
        threading.Thread(target=server.serve_forever, daemon=True, name="notifier-health").start()
        return server


def _handler(health: NotifierHealth) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        timeout = READ_TIMEOUT_S  # per connection: a silent one is closed, its thread ends

        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            path = self.path.split("?", 1)[0]
            if path not in PATHS:
                self._answer(404, {"status": "not found", "paths": list(PATHS)})
                return
            reason = health.dead() if path == "/healthz" else health.unready()
            if reason:
                self._answer(503, {"status": "unavailable", "reason": reason})
            else:
                self._answer(200, {"status": "ok"})

        def _answer(self, code: int, body: dict[str, object]) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: object) -> None:  # noqa: A002
            pass  # a probe every few seconds is not news

    return Handler
