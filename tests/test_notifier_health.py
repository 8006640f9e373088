"""`ringwatch notifier --health-port`: the endpoints a supervisor's probes use. Alive while the
delivery loop comes round (through a database outage too), ready only while it could deliver."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace

import httpx
from sqlalchemy import create_engine

from ringwatch.services.notifier.health import LIVE_FLOOR_S, PATHS, NotifierHealth
from ringwatch.services.store import db
from tests.api_fixtures import TEST_SECRET_KEY
from tests.procs import free_port


@contextmanager
def notifier(env: dict[str, str]) -> Iterator[str]:
    """A real notifier process answering health checks; yields their base URL once up."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "ringwatch.services.cli.main", "notifier",
                             "--health-host", "127.0.0.1", "--health-port", str(port)],
                            env={**env, "RINGWATCH_NOTIFIER_POLL_S": "0.2"},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, "the notifier exited"
            try:
                httpx.get(f"{base}/healthz", timeout=2)
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline, "no health server within 60 s"
                time.sleep(0.1)
        yield base
        assert proc.poll() is None, "the notifier exited"
    finally:
        proc.terminate()
        proc.wait(timeout=15)


def _eventually(url: str, status: int, timeout_s: float = 30.0) -> httpx.Response:
    deadline = time.monotonic() + timeout_s
    while True:
        r = httpx.get(url, timeout=10)
        if r.status_code == status or time.monotonic() > deadline:
            return r
        time.sleep(0.2)


def test_ready_once_the_database_is_migrated_alive_throughout(admin_url: str) -> None:
    name = f"rw_health_{uuid.uuid4().hex[:10]}"
    url = db.create_database(admin_url, name)
    env = {**os.environ, "RINGWATCH_DATABASE_URL": url, "RINGWATCH_SECRET_KEY": TEST_SECRET_KEY}
    try:
        with notifier(env) as base:
            assert httpx.get(f"{base}/healthz").status_code == 200
            r = httpx.get(f"{base}/readyz")
            assert r.status_code == 503, r.text
            assert "(none)" in r.json()["reason"] and "ringwatch db upgrade" in r.json()["reason"]
            db.upgrade(url)
            r = _eventually(f"{base}/readyz", 200)
            assert r.status_code == 200 and r.json() == {"status": "ok"}
            assert httpx.get(f"{base}/healthz").json() == {"status": "ok"}
            assert httpx.get(f"{base}/metrics").status_code == 404
    finally:
        db.drop_database(admin_url, name)


def test_unready_without_its_key_or_its_database_but_alive(database_url: str) -> None:
    keyless = {k: v for k, v in os.environ.items() if k != "RINGWATCH_SECRET_KEY"}
    with notifier({**keyless, "RINGWATCH_DATABASE_URL": database_url}) as base:
        r = httpx.get(f"{base}/readyz")
        assert r.status_code == 503 and "RINGWATCH_SECRET_KEY" in r.json()["reason"]
        assert httpx.get(f"{base}/healthz").status_code == 200

    # Nothing listens where its database should be: every pass fails, the loop goes on.
    gone = create_engine(database_url).url.set(host="127.0.0.1", port=free_port())
    env = {**os.environ, "RINGWATCH_SECRET_KEY": TEST_SECRET_KEY,
           "RINGWATCH_DATABASE_URL": gone.render_as_string(hide_password=False)}
    with notifier(env) as base:
        r = httpx.get(f"{base}/readyz")
        assert r.status_code == 503 and "unreachable" in r.json()["reason"]
        time.sleep(1.0)  # several passes, all failing
        assert httpx.get(f"{base}/healthz").status_code == 200


def test_a_loop_that_stopped_coming_round_is_dead() -> None:
    """The liveness rule on its own: a loop idle past max(10 polls, the floor) is dead; an
    unset key makes it unready without asking the database."""
    stub = SimpleNamespace(came_round=time.monotonic(), box=None)
    health = NotifierHealth(stub, create_engine("postgresql+psycopg://nobody@unused/none"), 1.0)
    assert health.stale_after_s == LIVE_FLOOR_S
    assert health.dead() == ""
    assert health.dead(now=stub.came_round + LIVE_FLOOR_S + 1).startswith(
        "the delivery loop has not come round")
    assert NotifierHealth(stub, health.engine, 60.0).stale_after_s == 600.0

    server = health.serve("127.0.0.1", 0)
    try:
        base = f"http://127.0.0.1:{server.server_address[1]}"
        assert httpx.get(f"{base}/healthz").status_code == 200
        stub.came_round -= LIVE_FLOOR_S + 1
        r = httpx.get(f"{base}/healthz")
        assert r.status_code == 503 and "not come round" in r.json()["reason"]
        assert httpx.get(f"{base}/readyz").status_code == 503
        assert httpx.get(f"{base}/nothing").json()["paths"] == list(PATHS)
    finally:
        server.shutdown()
