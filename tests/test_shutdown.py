"""Stopping within Kubernetes' grace: on SIGTERM the API answers its waiting preflights at
once (pending, with Retry-After) and exits within 10 s; the notifier finishes the deliveries
it has in flight, or past RINGWATCH_SHUTDOWN_TIMEOUT_S cuts and releases them, and exits 0,
so a rollout sends nothing twice. Through real processes, on a real database."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import httpcore
import httpx
import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select

from ringwatch.api.app import create_app
from ringwatch.services.notifier.deadline import Cut, attempt_pool
from ringwatch.services.notifier.receiver import WebhookReceiver
from ringwatch.services.preflight import service as preflight_service
from ringwatch.services.preflight.waiting import PreflightWaiters
from ringwatch.services.settings import Settings
from ringwatch.services.store import db, tokens
from ringwatch.services.store import preflight as preflight_store
from ringwatch.services.store.models import WebhookDelivery
from tests.api_fixtures import REACT_AT_ONCE, TEST_SECRET_KEY, WEBHOOK_TEST_SETTINGS, fleet_batch
from tests.procs import api_env, start_server, stop_server

ADMIN = "rw_admin_" + uuid.uuid4().hex
SECRET = "s3cret-for-shutdown-tests"
EXIT_BOUND_S = 10.0  # the item's bound: stopped within 10 s of SIGTERM


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def exits_within(proc: subprocess.Popen, bound_s: float) -> tuple[int | None, float]:
    """SIGTERM ``proc``; its exit code (None: still running at ``bound_s``, then killed)
    and the seconds it took."""
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        code: int | None = proc.wait(timeout=bound_s)
    except subprocess.TimeoutExpired:
        code = None
        proc.kill()
        proc.wait()
    return code, time.monotonic() - t0


# -- the API ----------------------------------------------------------------------------


@pytest.fixture
def env(database_url: str, clean_db, tmp_path: Path) -> dict[str, str]:
    return {**api_env(database_url, tmp_path, ADMIN), "RINGWATCH_SECRET_KEY": TEST_SECRET_KEY,
            "RINGWATCH_WEBHOOK_ALLOWED_NETWORKS": '["127.0.0.0/8"]'}


def test_sigterm_answers_waiting_preflights_at_once_and_the_api_exits(env, clean_db) -> None:
    """Twelve callers wait up to 300 s for a verdict no scheduler will bring. SIGTERM:
    each is answered 202 pending with Retry-After, long before its wait; the server (its
    notifier loop included) takes no new connection and exits 0 within 10 s; and the
    requests stay pending in the database, for the caller's next look at another replica."""
    api, callers, wait_s = env["RINGWATCH_API_URL"], 12, 300.0
    proc = start_server(env, notifier=True)
    answers: list[tuple[int, str | None, str | None, float]] = []
    try:
        httpx.post(f"{api}/v1/measurements", json=fleet_batch(),
                   headers=bearer(ADMIN)).raise_for_status()
        with db.transaction(clean_db) as s:
            row, reader = tokens.issue(s, "reader", "prologs")
        crowd = httpx.Client(base_url=api, timeout=wait_s + 30,
                             limits=httpx.Limits(max_connections=callers))
        stopped_at: list[float] = []

        def wait_for_verdict(node: str) -> None:
            resp = crowd.post("/v1/preflight", params={"wait": wait_s}, headers=bearer(reader),
                              json={"nodes": [node], "max_age_s": 0.001})
            answers.append((resp.status_code, resp.json().get("status"),
                            resp.headers.get("retry-after"), time.monotonic() - stopped_at[0]))

        threads = [threading.Thread(target=wait_for_verdict, args=(f"node-00{i % 4}",))
                   for i in range(callers)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        while _waiting(clean_db, row.id) < callers and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _waiting(clean_db, row.id) == callers
        time.sleep(0.5)  # from stored to waiting on the event loop
        assert answers == []

        stopped_at.append(time.monotonic())
        code, took = exits_within(proc, EXIT_BOUND_S)
        for t in threads:
            t.join(30)
        crowd.close()
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{api}/healthz", timeout=2)
    finally:
        stop_server(proc)
    assert code == 0 and took <= EXIT_BOUND_S
    assert len(answers) == callers
    assert {(c, status, retry) for c, status, retry, _ in answers} == {(202, "pending", "1")}
    assert max(after for *_, after in answers) <= EXIT_BOUND_S  # not after their 300 s
    assert _waiting(clean_db, row.id) == callers  # still pending: answered by the next replica


def _waiting(factory, token_id: int) -> int:
    with db.transaction(factory) as s:
        return preflight_store.waiting_count(s, token_id)


def test_a_stopping_waiter_list_answers_every_caller_as_it_stands(api, clean_db) -> None:
    """The rule under the API's stop: ``stop_waiting`` wakes each caller with its request
    as stored (pending), and one that asks to wait afterwards is not made to."""
    api.post("/v1/measurements", json=fleet_batch(), headers=api.h["agent"]).raise_for_status()
    body = preflight_service.submit_committed(clean_db, ["node-000"], 0.001, "http://api.invalid")
    assert body["status"] == "pending"
    waiters = PreflightWaiters(clean_db, capacity=8)

    async def scene() -> tuple[dict, dict, float]:
        waiting = asyncio.ensure_future(waiters.wait(body, 300.0))
        while waiters.waiting < 1:
            await asyncio.sleep(0.01)
        t0 = time.monotonic()
        waiters.stop_waiting()
        first = await asyncio.wait_for(waiting, timeout=30)
        took = time.monotonic() - t0
        later = await asyncio.wait_for(waiters.wait(body, 300.0), timeout=30)
        return first, later, took

    first, later, took = asyncio.run(scene())
    assert first["id"] == body["id"] and first["status"] == "pending"
    assert later["status"] == "pending" and waiters.waiting == 0
    assert took < 30  # answered on the stop, not after its 300 s


# -- the notifier -----------------------------------------------------------------------


def notifier(env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "ringwatch.services.cli.main", "notifier"], env=env)


def notifier_env(database_url: str, **settings: str) -> dict[str, str]:
    return {**os.environ, "RINGWATCH_DATABASE_URL": database_url,
            "RINGWATCH_NOTIFIER_POLL_S": "0.2", "RINGWATCH_SECRET_KEY": TEST_SECRET_KEY,
            "RINGWATCH_WEBHOOK_ALLOWED_NETWORKS": "127.0.0.0/8", **settings}


def degraded_events(clean_db, rx: WebhookReceiver) -> int:
    """A webhook on ``rx`` and batches that degrade three fleets' links: the events it is to
    receive (more than the two one notifier sends one webhook at once)."""
    with db.transaction(clean_db) as s:
        agent, admin = tokens.create_token(s, "agent"), tokens.create_token(s, "admin")
    app = create_app(Settings(database_url="unused", **REACT_AT_ONCE, **WEBHOOK_TEST_SETTINGS),
                     clean_db)
    with TestClient(app) as api:
        api.post("/v1/webhooks", headers=bearer(admin),
                 json={"url": rx.url, "secret": SECRET, "events": ["health.degraded"]}
                 ).raise_for_status()
        expected = 0
        for fleet in ("a", "b", "c"):
            stored = api.post("/v1/measurements", headers=bearer(agent),
                              json=fleet_batch(slow_node=f"{fleet}-001", prefix=fleet))
            stored.raise_for_status()
            expected += len(stored.json()["degraded"])
    assert expected >= 3
    return expected


def test_a_stopped_notifier_finishes_its_deliveries_and_the_next_resends_nothing(
        database_url, clean_db) -> None:
    """A slow receiver (3 s an answer): SIGTERM reaches the notifier mid-delivery; it hears
    the answers, records them, exits 0 within 10 s. A new notifier delivers the rest, and
    the receiver is asked once per event, never twice."""
    env = notifier_env(database_url, RINGWATCH_WEBHOOK_TIMEOUT_S="6")
    with WebhookReceiver(SECRET) as rx:
        rx.pause_s = 3.0
        expected = degraded_events(clean_db, rx)
        first = notifier(env)
        try:
            assert rx.wait_for_requests(1, timeout_s=60) >= 1
            code, took = exits_within(first, EXIT_BOUND_S)
        finally:
            stop_server(first)
        assert code == 0 and took <= EXIT_BOUND_S
        finished = rx.wait_for(1, timeout_s=0)
        assert 1 <= len(finished) == rx.requests  # what was in flight was answered, and recorded
        assert {d for d, status in _deliveries(clean_db) if status == "delivered"} == {
            e["delivery"] for e in finished}

        rx.pause_s = 0.0
        second = notifier(env)
        try:
            events = rx.wait_for(expected, timeout_s=60)
            log = _settled(clean_db)
        finally:
            stop_server(second)
    ids = [e["delivery"] for e in events]
    assert len(ids) == len(set(ids)) == expected and rx.requests == expected
    assert all(e["verified"] for e in events)
    assert {d for d, _ in log} == set(ids) and {s for _, s in log} == {"delivered"}


def test_a_delivery_outliving_the_shutdown_budget_is_released_to_the_next_notifier(
        database_url, clean_db) -> None:
    """A receiver that never answers, a 20 s webhook timeout and a 2 s shutdown budget: the
    notifier cuts the attempt, gives its claim up (not left to its 65 s lease) and exits 0
    within 10 s; the next notifier delivers every event."""
    env = notifier_env(database_url, RINGWATCH_WEBHOOK_TIMEOUT_S="20",
                       RINGWATCH_SHUTDOWN_TIMEOUT_S="2")
    with WebhookReceiver(SECRET) as rx:
        rx.delay_s = 120.0
        expected = degraded_events(clean_db, rx)
        first = notifier(env)
        try:
            assert rx.wait_for_requests(1, timeout_s=60) >= 1
            code, took = exits_within(first, EXIT_BOUND_S)
        finally:
            stop_server(first)
        assert code == 0 and took <= EXIT_BOUND_S
        with db.transaction(clean_db) as s:
            rows = s.scalars(select(WebhookDelivery)).all()
            claimed = [(d.status, d.claimed_by, d.claim_expires_at, d.last_error)
                       for d in rows if d.attempts]
        assert claimed and all(status == "pending" and holder is None and until is None
                               and "RINGWATCH_SHUTDOWN_TIMEOUT_S" in (error or "")
                               for status, holder, until, error in claimed)

        rx.release()
        second = notifier(env)
        try:
            events = rx.wait_for(expected, timeout_s=60)
            log = _settled(clean_db)
        finally:
            stop_server(second)
    assert len({e["delivery"] for e in events}) == expected
    assert {s for _, s in log} == {"delivered"}


def _deliveries(factory) -> list[tuple[str, str]]:
    with db.transaction(factory) as s:
        return [(d.delivery_id, d.status) for d in s.scalars(select(WebhookDelivery))]


def _settled(factory, timeout_s: float = 20.0) -> list[tuple[str, str]]:
    deadline = time.monotonic() + timeout_s
    while True:
        log = _deliveries(factory)
        if all(status != "pending" for _, status in log) or time.monotonic() > deadline:
            return log
        time.sleep(0.2)


def test_a_cut_ends_an_attempt_blocked_on_a_silent_receiver() -> None:
    """The rule under the release: ``Cut.now`` wakes a thread blocked reading an answer that
    will not come, well before the attempt's own deadline, and refuses new connections."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        url = f"http://127.0.0.1:{silent.getsockname()[1]}/hook"
        cut, errors = Cut(), []

        def attempt() -> None:
            try:
                with attempt_pool(120.0, ssl.create_default_context(), cut) as pool:
                    pool.request("POST", url, content=b"{}")
            except (httpcore.NetworkError, httpcore.ProtocolError) as exc:  # read: peer gone
                errors.append(exc)

        sender = threading.Thread(target=attempt, daemon=True)
        sender.start()
        accepted, _ = silent.accept()  # connected, and its request will never be answered
        with accepted:
            time.sleep(0.2)
            cut.now()
            sender.join(30)
            assert not sender.is_alive() and len(errors) == 1
        with pytest.raises(httpcore.ConnectError), \
                attempt_pool(120.0, ssl.create_default_context(), cut) as pool:
            pool.request("POST", url, content=b"{}")
