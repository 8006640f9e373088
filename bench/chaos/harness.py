"""The stage each fault is played on: a database of its own, real ringwatch processes (API,
notifier, scheduler) started as an operator starts them, a token per role, and the counts
that say what a fault lost or doubled."""

from __future__ import annotations

import base64
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy import text

import bench
from ringwatch.services.cli.api_process import (
    ApiDidNotStart,
    free_port,
    serve_args,
    stop,
    wait_ready,
)
from ringwatch.services.config import STATE_DIR
from ringwatch.services.notifier.receiver import WebhookReceiver
from ringwatch.services.store import db, tokens

ROLES = ("reader", "agent", "admin")
# Keep every fault's folder (process logs), not only those of faults that missed the target.
KEEP_LOGS = False
HEALTH_EVENTS = ["health.degraded", "health.recovered"]
# Hysteresis under which one bad batch opens an incident and one good one closes it: every
# flip of a fleet is an event.
REACT_AT_ONCE = {"RINGWATCH_HYSTERESIS_K_BAD": "1", "RINGWATCH_HYSTERESIS_N_WINDOW": "1",
                 "RINGWATCH_HYSTERESIS_M_GOOD": "1"}


@dataclass
class Row:
    """One line of the table. ``survived`` None: the fault was not run (``note`` says why);
    a count None: the fault does not put that kind of data at risk."""

    fault: str
    survived: bool | None
    results_lost: int | None = None
    events_lost: int | None = None
    events_doubled: int | None = None
    note: str = ""
    seconds: float = 0.0

    @property
    def met(self) -> bool:
        """Survived, nothing lost and nothing doubled (a negative count is a miscount, a miss too)."""
        return bool(self.survived) and not any((self.results_lost, self.events_lost,
                                                 self.events_doubled))

    def to_dict(self) -> dict[str, Any]:
        return {"fault": self.fault, "survived": self.survived, "results_lost": self.results_lost,
                "events_lost": self.events_lost, "events_doubled": self.events_doubled,
                "met": self.met, "note": self.note, "seconds": round(self.seconds, 1)}


def fernet_key() -> str:
    """A key in Fernet's format (32 random bytes, urlsafe base64) for RINGWATCH_SECRET_KEY."""
    return base64.urlsafe_b64encode(os.urandom(32)).decode()



class Stage:
    """A migrated database of its own on ``admin_url``'s server, a state folder, and the
    environment every process of this fault runs with. Processes it starts are stopped, and
    the database dropped, on ``close``; the folder (process logs) is kept when the fault failed."""

    def __init__(self, name: str, admin_url: str | None = None, env: dict[str, str] | None = None) -> None:
        self.name = name
        self.admin_url = admin_url or bench.admin_url()
        self.db_name = f"rw_chaos_{uuid.uuid4().hex[:10]}"
        self.url = db.create_database(self.admin_url, self.db_name)
        db.upgrade(self.url)
        self.dir = STATE_DIR / "chaos" / f"{name}-{uuid.uuid4().hex[:6]}"
        self.dir.mkdir(parents=True)
        self.api_url = f"http://127.0.0.1:{free_port()}"
        self.admin = f"rw_chaos_{uuid.uuid4().hex}"
        self.env = {**os.environ, "RINGWATCH_DATABASE_URL": self.url, "RINGWATCH_API_URL": self.api_url,
                    "RINGWATCH_BOOTSTRAP_ADMIN_TOKEN": self.admin, "RINGWATCH_TOKEN": self.admin,
                    "RINGWATCH_STATE_DIR": str(self.dir),
                    # Test receivers listen on 127.0.0.1; secrets are encrypted at rest.
                    "RINGWATCH_WEBHOOK_ALLOWED_NETWORKS": '["127.0.0.1/32"]',
                    "RINGWATCH_SECRET_KEY": fernet_key(), **(env or {})}
        self.engine = db.make_engine(self.url)
        self.factory = db.make_session_factory(self.engine)
        with db.transaction(self.factory) as s:  # the stage's admin, whatever bootstrap does
            tokens.create_token(s, "admin", "chaos-admin", self.admin)
        self.procs: list[subprocess.Popen] = []
        self._logs = 0

    # -- processes -----------------------------------------------------------------------

    def spawn(self, name: str, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
        """``ringwatch ARGS`` as a child process; its output goes to a log file in the folder."""
        self._logs += 1
        log = open(self.dir / f"{self._logs:02d}-{name}.log", "wb")  # noqa: SIM115 (kept by the child)
        proc = subprocess.Popen([sys.executable, "-m", "ringwatch.services.cli.main", *args],
                                env={**self.env, **(env or {})}, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        proc.log_path = Path(log.name)  # type: ignore[attr-defined]
        self.procs.append(proc)
        return proc

    def start_api(self, *, notifier: bool = False, env: dict[str, str] | None = None,
                  timeout_s: float = 60.0) -> subprocess.Popen:
        """``ringwatch serve`` on this stage's port; returns once /healthz answers 200."""
        proc = self.spawn("api", *serve_args(self.api_url, notifier), env=env)
        try:
            return wait_ready(proc, self.api_url, timeout_s)
        except ApiDidNotStart as exc:
            raise RuntimeError(f"{exc}: {tail(proc)}") from None

    def close(self, keep_logs: bool = False) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                stop(proc)
        self.engine.dispose()
        db.drop_database(self.admin_url, self.db_name)
        if not (keep_logs or KEEP_LOGS):
            shutil.rmtree(self.dir, ignore_errors=True)

    # -- clients and the database ---------------------------------------------------------

    def token(self, role: str) -> str:
        with db.transaction(self.factory) as s:
            return tokens.create_token(s, role, f"chaos-{role}")

    def client(self, token: str | None = None, timeout: float = 30.0) -> httpx.Client:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        return httpx.Client(base_url=self.api_url, headers=headers, timeout=timeout)

    def rows(self, sql: str, **params: Any) -> list[tuple]:
        with self.engine.connect() as conn:
            return [tuple(r) for r in conn.execute(text(sql), params)]

    def scalar(self, sql: str, **params: Any) -> Any:
        with self.engine.connect() as conn:
            return conn.execute(text(sql), params).scalar()

    def webhook(self, admin: httpx.Client, url: str, secret: str, events: list[str]) -> int:
        resp = admin.post("/v1/webhooks", json={"url": url, "secret": secret, "events": events})
        if resp.status_code != 201:
            raise RuntimeError(f"POST /v1/webhooks answered {resp.status_code}: {resp.text[:300]}")
        return int(resp.json()["id"])


def kill9(proc: subprocess.Popen) -> None:
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)


def tail(proc: subprocess.Popen, chars: int = 600) -> str:
    path = getattr(proc, "log_path", None)
    if path is None or not path.exists():
        return ""
    return path.read_text(errors="replace")[-chars:].strip()


def wait_until(check: Callable[[], Any], timeout_s: float, every_s: float = 0.2) -> Any:
    """Poll ``check`` until it returns something truthy; its last answer either way."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = check()
        if got or time.monotonic() > deadline:
            return got
        time.sleep(every_s)


# -- results: what a scheduler measured against what the database holds ------------------

CYCLE_LINE = re.compile(r"cycle (\d+): \d+ rounds, (\d+) measurements, .*?(\d+) batch\(es\) still spooled")


class SimScheduler:
    """``ringwatch scheduler`` on the sim backend, restartable, and the count of what it
    measured: every cycle it completes prints its measurements, so what it produced is the
    sum over its lines plus whatever its spool still holds."""

    def __init__(self, stage: Stage, fabric: dict[str, Any], interval_s: float = 0.5,
                 token: str | None = None) -> None:
        self.stage = stage
        self.fabric = stage.dir / "fabric.json"
        self.fabric.write_text(json.dumps(fabric))
        self.interval_s = interval_s
        # The duty-cycle floor would stretch a sim cycle's wait to minutes: this is load.
        self.env = {"RINGWATCH_TOKEN": token or stage.token("agent"), "RINGWATCH_MAX_DUTY_CYCLE": "1"}
        self.procs: list[subprocess.Popen] = []

    @property
    def spool(self) -> Path:
        return self.stage.dir / "spool"

    def start(self) -> subprocess.Popen:
        proc = self.stage.spawn("scheduler", "scheduler", "--fabric", str(self.fabric),
                                "--interval", str(self.interval_s), env=self.env)
        self.procs.append(proc)
        return proc

    def cycles(self) -> list[tuple[int, int]]:
        """(measurements, batches still spooled) of every cycle completed, all runs together."""
        out = []
        for proc in self.procs:
            for m in CYCLE_LINE.finditer(proc.log_path.read_text(errors="replace")):  # type: ignore[attr-defined]
                out.append((int(m.group(2)), int(m.group(3))))
        return out

    def wait_cycles(self, n: int, timeout_s: float) -> bool:
        return bool(wait_until(lambda: len(self.cycles()) >= n, timeout_s))

    def stop_between_cycles(self, timeout_s: float = 60.0) -> bool:
        """Kill the running scheduler right after a cycle that left its spool empty, in the
        wait before the next one, so no cycle is half counted. False if none came in time."""
        proc = self.procs[-1]
        seen = len(self.cycles())
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and proc.poll() is None:
            done = self.cycles()
            if len(done) > seen and done[-1][1] == 0:
                kill9(proc)
                return True
            seen = len(done)
            time.sleep(0.02)
        if proc.poll() is None:
            kill9(proc)
        return False

    def leftovers(self) -> tuple[int, int]:
        """(batches, measurements) the spool holds unsent, and batches moved aside
        (rejected or failed: the API will not store them without a human) as a third count."""
        batches = measurements = 0
        for path in sorted(self.spool.glob("*.json")) + sorted(self.spool.glob("*.tmp")):
            with contextlib.suppress(OSError, ValueError, KeyError):  # a torn write holds none
                measurements += len(json.loads(path.read_text())["measurements"])
            batches += 1
        return batches, measurements

    def moved_aside(self) -> int:
        return sum(len(list((self.spool / d).glob("*"))) for d in ("rejected", "failed")
                   if (self.spool / d).exists())

    def alive(self) -> bool:
        return bool(self.procs) and self.procs[-1].poll() is None


def results_lost(stage: Stage, produced: int) -> tuple[int, int]:
    """(lost, stored): measurements produced that the database does not hold."""
    stored = int(stage.scalar("SELECT count(*) FROM measurements"))
    return produced - stored, stored


def drain(stage: Stage, sched: SimScheduler, token: str) -> None:
    """Send what a killed scheduler left in its spool, with the scheduler's own shipper."""
    from ringwatch.services.scheduler.shipper import Shipper

    shipper = Shipper(stage.api_url, token, sched.spool, timeout_s=30)
    try:
        wait_until(lambda: shipper.flush() == 0, 60, every_s=1.0)
    finally:
        shipper.close()


# -- events: what the outbox holds against what a receiver accepted ------------------------

@dataclass
class EventCount:
    expected: int
    delivered: int
    lost: int
    doubled: int
    # Deliveries received again under the same X-Ringwatch-Delivery id: at-least-once over
    # HTTP (answered 2xx, not yet recorded when a notifier died). A receiver deduplicating
    # on that id, as docs/webhooks.md asks, acts on each event once: not doubled.
    resent: int
    unverified: int
    pending: int


def count_events(stage: Stage, rx: WebhookReceiver, webhook_id: int,
                 event_types: Iterable[str]) -> EventCount:
    """Events of the subscribed kinds in the outbox against the deliveries ``rx`` accepted:
    lost = events none of whose deliveries arrived; doubled = events that arrived under two
    different delivery ids (a receiver deduplicating on the id would act twice); resent =
    a delivery id accepted again."""
    expected = {r[0] for r in stage.rows(
        "SELECT id FROM outbox_events WHERE event_type = ANY(:types)", types=list(event_types))}
    log = {d: (e, s) for d, e, s in stage.rows(
        "SELECT delivery_id, event_id, status FROM webhook_deliveries WHERE webhook_id = :w",
        w=webhook_id)}
    accepted = [e["delivery"] for e in rx.events]
    ids_of: dict[int, set[str]] = {}
    for d in accepted:
        if d in log:
            ids_of.setdefault(log[d][0], set()).add(d)
    arrived = set(ids_of)
    pending = sum(1 for _, s in log.values() if s == "pending")
    return EventCount(expected=len(expected), delivered=len(arrived & expected),
                      lost=len(expected - arrived),
                      doubled=sum(1 for ids in ids_of.values() if len(ids) > 1),
                      resent=len(accepted) - len(set(accepted)),
                      unverified=sum(1 for e in rx.events if not e.get("verified")), pending=pending)


def deliveries_settled(stage: Stage, webhook_id: int) -> bool:
    return not stage.scalar("SELECT count(*) FROM webhook_deliveries WHERE webhook_id = :w "
                            "AND status = 'pending'", w=webhook_id)


def flip_fleets(agent: httpx.Client, fleets: int, prefix: str = "evt",
                retry_s: float = 60.0) -> int:
    """Degrade, then recover, ``fleets`` small fleets of their own: at least two health events
    each. Each batch is sent until the API stores it (same batch id on every try, as the
    shipper does). Returns the measurements sent."""
    from tests.api_fixtures import fleet_batch

    sent = 0
    for i in range(fleets):
        for slow in (f"{prefix}{i}-001", None):
            batch = fleet_batch(slow_node=slow, prefix=f"{prefix}{i}")
            post_until_stored(agent, batch, retry_s)
            sent += len(batch["measurements"])
    return sent


def post_until_stored(agent: httpx.Client, batch: dict[str, Any], retry_s: float) -> None:
    deadline = time.monotonic() + retry_s
    while True:
        try:
            resp = agent.post("/v1/measurements", json=batch)
            if resp.status_code < 300:
                return
            if resp.status_code < 500 and resp.status_code not in (408, 429):
                raise RuntimeError(f"batch refused: {resp.status_code} {resp.text[:300]}")
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"batch {batch['batch_id']} not stored within {retry_s:.0f} s")
        time.sleep(0.5)
