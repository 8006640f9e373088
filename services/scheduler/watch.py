"""The scheduler's own health and metrics: ``/healthz`` for a liveness probe and ``/metrics``
for Prometheus, served by the scheduler process itself (the API's ``/metrics`` cannot see a
scheduler that has stopped cycling, or one whose token it refuses).

Rendered by hand in the Prometheus text format 0.0.4: the scheduler's role installs neither
the server extra nor prometheus_client.
"""

from __future__ import annotations

import json
import math
import socket
import threading
import time
from collections.abc import Callable, Iterable
from datetime import datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from ringwatch.services.health_port import READ_TIMEOUT_S, BoundedServer

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# However short the interval, a loop that came round within this many seconds is alive: a
# cycle of a large fleet may take minutes.
MIN_STALE_S = 900.0
# A loop is stale after this many intervals without coming round (the alert's threshold).
STALE_INTERVALS = 3
PREFIX = "ringwatch_scheduler_"
# The routes the server answers: what a probe or a scrape may point at.
PATHS = ("/healthz", "/metrics")


class SchedulerWatch:
    """Thread-safe state of one scheduler process, served at /healthz and /metrics.

    The loop reports into it (``role`` after each lease attempt, ``cycle`` after each cycle,
    ``ingest`` and ``spool`` after each batch sent, ``token`` when it learns of its token);
    the HTTP server's threads read it. ``clock`` is unix time (tests pass their own)."""

    def __init__(self, fleet: str, holder: str, interval_s: float, *,
                 host: str | None = None, clock: Callable[[], float] = time.time) -> None:
        self.fleet = fleet
        self.holder = holder
        self.host = host or socket.gethostname()
        self.interval_s = interval_s
        self._clock = clock
        self._lock = threading.Lock()
        self._started = clock()
        # None until the first lease attempt: a scheduler without a lease counts as leader.
        self._leader: bool | None = None
        self._leader_since = self._started
        self._leader_holder: str | None = None
        self._term: int | None = None
        self._role_at: float | None = None
        self._wait_s: float | None = None
        self._cycle: dict[str, float] | None = None
        self._status: int | None = None
        self._sent = False
        self._refused = False
        self._spool: tuple[int, int, int] | None = None
        self._token_prefix: str | None = None
        self._token_expires: datetime | None = None

    # -- what the loop reports -----------------------------------------------------------

    def role(self, leader: bool, holder: str | None, term: int | None = None) -> None:
        """After each lease attempt: whether this process leads, who does (``holder``: the
        current leader's id, None when no one), and the lease's term where known."""
        with self._lock:
            now = self._clock()
            if leader and self._leader is not True:
                self._leader_since = now
            self._leader = leader
            self._leader_holder = holder
            self._term = term if term is not None else self._term
            self._role_at = now

    def cycle(self, *, ended_at: float, duration_s: float, number: int, probed: int,
              busy: int) -> None:
        """A monitoring cycle ended at ``ended_at`` (unix time): its number, how long it
        took, and the nodes it probed and left alone because jobs held them."""
        with self._lock:
            self._cycle = {"ended_at": ended_at, "duration_s": duration_s, "number": number,
                           "probed": probed, "busy": busy}

    def next_cycle_in(self, seconds: float) -> None:
        """The loop's next cycle is due in ``seconds``: the interval, or longer where the
        duty cycle or a served preflight stretched the wait. Health and the alert allow
        three of the longer of it and the interval."""
        with self._lock:
            self._wait_s = max(0.0, seconds)

    def ingest(self, status_code: int | None) -> None:
        """The API's answer to the last batch sent (None: unreachable). 401 and 403 mean
        the token is refused; a 2xx that it is taken again."""
        with self._lock:
            self._sent = True
            self._status = status_code
            if status_code in (401, 403):
                self._refused = True
            elif status_code is not None and status_code < 300:
                self._refused = False

    def spool(self, batches: int, bytes_: int, dropped_total: int) -> None:
        """What the spool holds (batches waiting to be sent, their bytes) and how many
        batches its bound has dropped since the process started."""
        with self._lock:
            self._spool = (batches, bytes_, dropped_total)

    def token(self, *, refused: bool, prefix: str | None = None,
              expires_at: datetime | None = None) -> None:
        """Whether the API refuses this process's token; its printable prefix (never the
        token) and its expiry where known."""
        with self._lock:
            self._refused = refused
            self._token_prefix = prefix if prefix is not None else self._token_prefix
            self._token_expires = expires_at if expires_at is not None else self._token_expires

    # -- what is served ------------------------------------------------------------------

    def period_s(self) -> float:
        """Seconds between cycles as the loop plans them now."""
        with self._lock:
            return self._period_locked()

    def _period_locked(self) -> float:
        return max(self.interval_s, self._wait_s or 0.0)

    def healthy(self) -> tuple[bool, str]:
        """(True, why) when the loop came round within max(3 intervals, 15 min), or this is a
        standby that renewed its view of the lease as recently; (False, why) otherwise."""
        with self._lock:
            now = self._clock()
            limit = max(STALE_INTERVALS * self._period_locked(), MIN_STALE_S)
            refused = (f"; the API refuses token {self._token_prefix or ''}".rstrip()
                       if self._refused else "")
            if self._leader is False:
                assert self._role_at is not None
                age = now - self._role_at
                ok = age <= limit
                return ok, (f"standby for fleet {self.fleet} (leader: "
                            f"{self._leader_holder or 'none'}): view renewed {age:.0f} s ago"
                            f"{'' if ok else f', more than {limit:.0f} s'}{refused}")
            if self._cycle is not None and self._cycle["ended_at"] >= self._leader_since:
                age = now - self._cycle["ended_at"]
                what = f"cycle {int(self._cycle['number'])} ended {age:.0f} s ago"
            else:
                age = now - self._leader_since
                what = f"no cycle ended in the {age:.0f} s since leading"
            ok = age <= limit
            return ok, (f"leader for fleet {self.fleet}: {what}"
                        f"{'' if ok else f', more than {limit:.0f} s'}{refused}")

    def render(self) -> str:
        """The Prometheus text format 0.0.4."""
        with self._lock:
            return "".join(self._families())

    def _families(self) -> Iterable[str]:
        fleet = {"fleet": self.fleet}
        own = {"fleet": self.fleet, "host": self.host}
        yield from _family("leader", "gauge", "1 while this scheduler holds the fleet's lease, "
                           "0 on a standby", [(fleet, 0.0 if self._leader is False else 1.0)])
        if self._term is not None:
            yield from _family("term", "gauge", "the term of the fleet's lease as this "
                               "scheduler last saw it", [(fleet, self._term)])
        yield from _family("interval_seconds", "gauge", "seconds between cycles: the probe "
                           "interval, or the longer wait the duty cycle or a preflight set",
                           [(fleet, self._period_locked())])
        if self._cycle is not None:
            c = self._cycle
            yield from _family("last_cycle_end_timestamp_seconds", "gauge", "unix time the "
                               "newest cycle this process ran ended", [(fleet, c["ended_at"])])
            yield from _family("last_cycle_duration_seconds", "gauge", "seconds the newest "
                               "cycle took", [(fleet, c["duration_s"])])
            yield from _family("cycle", "gauge", "the fleet's number of the newest cycle this "
                               "process ran", [(fleet, c["number"])])
            yield from _family("nodes", "gauge", "nodes of the newest cycle: probed, or busy "
                               "(left alone: a job held them)",
                               [({**fleet, "state": "probed"}, c["probed"]),
                                ({**fleet, "state": "busy"}, c["busy"])])
        if self._spool is not None:
            batches, size, dropped = self._spool
            yield from _family("spool_batches", "gauge", "batches spooled, waiting to be sent",
                               [(own, batches)])
            yield from _family("spool_bytes", "gauge", "bytes of the batches spooled",
                               [(own, size)])
            yield from _family("spool_dropped_total", "counter", "spooled batches removed, "
                               "oldest first, to keep the spool under its bound",
                               [(own, dropped)])
        if self._sent:
            yield from _family("last_ingest_status", "gauge", "the API's status code for the "
                               "last batch sent; 0 when it was unreachable",
                               [(own, self._status or 0)])
        yield from _family("ingest_refused", "gauge", "1 while the API refuses this "
                           "scheduler's token (401 or 403)", [(own, 1.0 if self._refused else 0.0)])
        if self._token_expires is not None:
            left = self._token_expires.timestamp() - self._clock()
            yield from _family("token_expires_in_seconds", "gauge", "seconds until this "
                               "scheduler's token expires (negative: expired)", [(own, left)])

    def serve(self, host: str, port: int) -> ThreadingHTTPServer:
        """Serve ``/healthz`` and ``/metrics`` on ``host``:``port`` (0: any free port, read
        back from ``server.server_address``) from daemon threads; ``shutdown()`` stops it."""
        server = BoundedServer((host, port), _handler(self))
        threading.Thread(target=server.serve_forever, name="scheduler-watch",
                         daemon=True).start()
        return server


def _handler(watch: SchedulerWatch) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        timeout = READ_TIMEOUT_S  # per connection: a silent one is closed, its thread ends

        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            path = self.path.split("?", 1)[0]
            if path == "/metrics":
                self._answer(200, CONTENT_TYPE, watch.render().encode())
            elif path == "/healthz":
                ok, reason = watch.healthy()
                self._json(200 if ok else 503,
                           {"status": "ok" if ok else "unavailable", "reason": reason})
            else:
                self._json(404, {"status": "not found", "paths": list(PATHS)})

        def _json(self, code: int, body: dict[str, object]) -> None:
            self._answer(code, "application/json", json.dumps(body).encode())

        def _answer(self, code: int, content_type: str, data: bytes) -> None:
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: object) -> None:  # noqa: A002
            pass  # a scrape every 30 s is not news

    return Handler


def _family(name: str, kind: str, help_: str,
            samples: list[tuple[dict[str, str], float]]) -> Iterable[str]:
    name = PREFIX + name
    yield f"# HELP {name} {_escape_help(help_)}\n"
    yield f"# TYPE {name} {kind}\n"
    for labels, value in samples:
        text = ",".join(f'{k}="{_escape_label(v)}"' for k, v in labels.items())
        yield f"{name}{{{text}}} {_number(value)}\n"


def _escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def _escape_label(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _number(value: float) -> str:
    value = float(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(value)
