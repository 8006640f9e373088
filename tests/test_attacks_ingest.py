"""One agent cannot stop the fleet's ingest: slow bodies, shares of the ingest slots,
thousands of findings in a batch, waiting places kept by callers gone, and a busy answer a
large body still sees (docs/security.md, "Ingest slots: slow bodies and shares")."""

from __future__ import annotations

import asyncio
import json
import select
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from itertools import combinations
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import event

from ringwatch.api.limits import BodyPace, IngestSlots
from ringwatch.services.errors import Busy
from ringwatch.services.store import db, tokens
from tests.api_fixtures import api_client, fleet_batch, measurement, pair
from tests.procs import api_env, start_server, stop_server

ADMIN = "rw_admin_" + uuid.uuid4().hex


@contextmanager
def _serve(database_url: str, state_dir: Path, **settings: str) -> Iterator[tuple[str, int]]:
    """A real ``ringwatch serve`` with these RINGWATCH_* settings: its URL and port."""
    env = api_env(database_url, state_dir, ADMIN)
    env.update({f"RINGWATCH_{k.upper()}": v for k, v in settings.items()})
    proc = start_server(env, notifier=False)
    try:
        url = env["RINGWATCH_API_URL"]
        yield url, int(url.rsplit(":", 1)[1])
    finally:
        stop_server(proc)


def _agent(factory, nodes: list[str]) -> str:
    with db.transaction(factory) as s:
        return tokens.issue(s, "agent", nodes=nodes)[1]


def _reader(factory) -> str:
    with db.transaction(factory) as s:
        return tokens.issue(s, "reader")[1]


def _head(path: str, token: str, length: int, extra: str = "") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: rw.test\r\nAuthorization: Bearer {token}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {length}\r\n{extra}\r\n").encode()


def _answer(sock: socket.socket, timeout_s: float = 30.0) -> tuple[int, dict[str, Any]]:
    """The status and JSON body of the one response on ``sock``."""
    sock.settimeout(timeout_s)
    raw = b""
    while b"\r\n\r\n" not in raw:
        chunk = sock.recv(65536)
        assert chunk, f"the connection closed before an answer: {raw!r}"
        raw += chunk
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    while len(body) < int(headers["content-length"]):
        chunk = sock.recv(65536)
        assert chunk, "the connection closed inside the answer"
        body += chunk
    return int(lines[0].split()[1]), json.loads(body)


class SlowBody(threading.Thread):
    """A batch whose body comes at one byte a second (of the MiB it declares), until the
    server answers or ``give_up_s`` passes."""

    def __init__(self, port: int, token: str, give_up_s: float = 40.0) -> None:
        super().__init__(daemon=True)
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.sendall(_head("/v1/measurements", token, 1 << 20) + b"{")
        self.give_up_s = give_up_s
        self.answered_at: float | None = None
        self.answer: tuple[int, dict[str, Any]] | None = None
        self.start()

    def run(self) -> None:
        started = time.monotonic()
        try:
            while time.monotonic() - started < self.give_up_s:
                if select.select([self.sock], [], [], 1.0)[0]:
                    self.answered_at = time.monotonic()
                    self.answer = _answer(self.sock)
                    return
                self.sock.sendall(b" ")
        except (OSError, AssertionError):
            pass  # the server hung up without an answer: ``answer`` stays None
        finally:
            self.sock.close()


# -- item 1: two slow bodies do not stop everyone's ingest --------------------------------


def _batch_of(a: str, b: str) -> dict[str, Any]:
    return {"batch_id": uuid.uuid4().hex, "backend": "gloo",
            "measurements": [measurement(pair(a, b), 10.0)]}


def test_two_slow_bodies_leave_other_agents_ingesting(clean_db, database_url, tmp_path) -> None:
    mallory = _agent(clean_db, ["node-000", "node-001"])
    alice = _agent(clean_db, ["node-002", "node-003"])
    with _serve(database_url, tmp_path) as (url, port):
        slow = [SlowBody(port, mallory), SlowBody(port, mallory)]
        time.sleep(1.5)  # both bodies are being read, or waiting for a slot
        started = time.monotonic()
        r = httpx.post(f"{url}/v1/measurements", json=_batch_of("node-002", "node-003"),
                       timeout=60, headers={"Authorization": f"Bearer {alice}"})
        accepted_at = time.monotonic()
        assert r.status_code == 200, r.text
        # Within a bounded wait, and while the slow bodies still go on.
        assert accepted_at - started < 8.0
        assert all(s.answered_at is None or s.answered_at > accepted_at for s in slow)
        for s in slow:
            s.join(60)
        # Each slow sender is refused in JSON that says why, and the slot is free again.
        for s in slow:
            assert s.answer is not None, "a slow body was never answered"
            status, body = s.answer
            assert (status, body["error"]) in ((408, "body_too_slow"), (503, "busy")), body
            assert "RINGWATCH_" in body["message"]
        # The slots are free again: the same token's batch that comes whole is taken.
        r = httpx.post(f"{url}/v1/measurements", json=_batch_of("node-000", "node-001"),
                       headers={"Authorization": f"Bearer {mallory}"}, timeout=60)
        assert r.status_code == 200, r.text


def test_one_token_holds_at_most_its_share_of_the_slots() -> None:
    async def scenario() -> None:
        slots = IngestSlots(2, wait_s=0.2)
        await slots.acquire(1)
        with pytest.raises(Busy, match="share"):
            await slots.acquire(1)  # the other slot is free, but not for this token
        await slots.acquire(2)  # another token takes it at once
        slots.release(1)
        await slots.acquire(1)
        with pytest.raises(Busy, match="RINGWATCH_MAX_CONCURRENT_INGESTS"):
            await slots.acquire(3)  # every slot taken
        slots.release(1)
        slots.release(2)
        # One slot only: a token may hold it (there is no smaller share).
        one = IngestSlots(1, wait_s=0.1)
        await one.acquire(1)
        one.release(1)

    asyncio.run(scenario())


def test_a_body_must_keep_a_pace_once_it_holds_a_slot() -> None:
    pace = BodyPace(timeout_s=60, min_bytes_per_s=1000, grace_s=5)
    assert pace.deadline(100.0, 0) == 105.0          # nothing yet: the grace
    assert pace.deadline(100.0, 20_000) == 120.0     # 20 kB buy 20 s at 1 kB/s
    assert pace.deadline(100.0, 10**9) == 160.0      # never past the timeout
    assert BodyPace(60, 0).deadline(100.0, 0) == 160.0  # no floor: the timeout alone


# -- item 13b: a busy answer reaches a client sending a large body ------------------------


def test_a_large_body_refused_as_busy_sees_the_503(clean_db, database_url, tmp_path) -> None:
    holder = _agent(clean_db, ["node-000"])
    other = _agent(clean_db, ["node-001"])
    with _serve(database_url, tmp_path, max_concurrent_ingests="1", ingest_wait_s="1",
                ingest_body_min_bytes_per_s="0") as (_, port):
        slow = SlowBody(port, holder, give_up_s=10)  # holds the one slot
        time.sleep(1.0)
        size = 32 << 20
        sock = socket.create_connection(("127.0.0.1", port))
        try:
            # As urllib and requests send: the whole body, then read; the connection closes
            # after the answer.
            sock.sendall(_head("/v1/measurements", other, size, "Connection: close\r\n"))
            sock.sendall(b" " * size)
            status, body = _answer(sock)
        finally:
            sock.close()
        assert status == 503 and body["error"] == "busy", body
        assert slow.answer is None  # the slot was held all along
        slow.join(30)


# -- item 13a: a caller that hangs up frees its waiting place -----------------------------


def test_a_caller_that_hangs_up_frees_its_waiting_place(clean_db, database_url,
                                                        tmp_path) -> None:
    reader, agent = _reader(clean_db), _agent(clean_db, ["node-000", "node-001"])
    with _serve(database_url, tmp_path, max_waiting_preflights="2") as (url, port):
        old = datetime.now(UTC) - timedelta(hours=2)
        batch = {"batch_id": uuid.uuid4().hex, "backend": "gloo",
                 "measurements": [measurement(pair("node-000", "node-001"), 10.0, time=old)]}
        r = httpx.post(f"{url}/v1/measurements", json=batch, timeout=30,
                       headers={"Authorization": f"Bearer {agent}"})
        assert r.status_code == 200, r.text
        ask = json.dumps({"nodes": ["node-000"], "max_age_s": 60}).encode()
        callers = []
        for _ in range(2):
            sock = socket.create_connection(("127.0.0.1", port))
            sock.sendall(_head("/v1/preflight?wait=120", reader, len(ask)) + ask)
            callers.append(sock)
        time.sleep(1.5)
        h = {"Authorization": f"Bearer {reader}"}
        full = httpx.post(f"{url}/v1/preflight?wait=1", json=json.loads(ask), headers=h,
                          timeout=30)
        assert full.status_code == 429  # every place is taken
        for sock in callers:
            sock.close()
        started = time.monotonic()
        while True:
            r = httpx.post(f"{url}/v1/preflight?wait=1", json=json.loads(ask), headers=h,
                           timeout=30)
            if r.status_code != 429 or time.monotonic() - started > 10:
                break
            time.sleep(0.5)
        assert r.status_code == 202, r.text  # admitted, waited, answered as it stands
        assert time.monotonic() - started < 10


# -- item 12: findings are bounded per batch, and judged in a few statements --------------


def _cause_findings(nodes: int, count: int, prefix: str = "node") -> list[dict[str, Any]]:
    """``count`` transport_fallback findings, each a GPU pair's (a fault of its own)."""
    pairs = [list(p) for p in combinations(range(64), 2)]
    return [{"kind": "transport_fallback", "node": f"{prefix}-{i % nodes:03d}",
             "gpus": pairs[i // nodes], "severity": "critical",
             "detail": {"source": "nccl", "scope": "gpu_pair", "transport": "shm",
                        "expected_transport": "nvls", "cause": "GPUs over SHM"}}
            for i in range(count)]


def test_findings_per_batch_are_bounded_by_a_setting(clean_db) -> None:
    with api_client(clean_db, settings={"max_batch_findings": 10}) as api:
        batch = fleet_batch(nodes=2)
        batch["findings"] = _cause_findings(2, 11)
        r = api.post("/v1/measurements", headers=api.h["agent"], json=batch)
        assert r.status_code == 413, r.text[:300]
        assert "RINGWATCH_MAX_BATCH_FINDINGS" in r.json()["message"]
        batch["findings"] = batch["findings"][:10]
        assert api.post("/v1/measurements", headers=api.h["agent"],
                        json=batch).status_code == 200


def test_judging_a_batch_costs_statements_independent_of_its_findings(clean_db) -> None:
    engine = clean_db.kw["bind"]
    statements = [0]

    def count(*_: Any) -> None:
        statements[0] += 1

    event.listen(engine, "before_cursor_execute", count)
    try:
        with api_client(clean_db) as api:
            seen = []
            for prefix, findings in (("a", 20), ("b", 400), ("a", 20), ("b", 400)):
                batch = fleet_batch(nodes=4, prefix=prefix)
                batch["findings"] = _cause_findings(4, findings, prefix)
                statements[0] = 0
                r = api.post("/v1/measurements", headers=api.h["agent"], json=batch)
                assert r.status_code == 200, r.text
                seen.append(statements[0])
            assert len(r.json()["findings"]) == 400
    finally:
        event.remove(engine, "before_cursor_execute", count)
    # Opening 20 incidents or 400, and seeing them again, take the same statements: within
    # two, for what else a request may do now and then (a token's last use written at most
    # once a minute); before, 400 findings took 1 900 more than 20.
    assert abs(seen[1] - seen[0]) <= 2 and abs(seen[3] - seen[2]) <= 2, seen
