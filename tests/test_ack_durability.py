"""What an answer promises, through the real server process: a 2xx means committed (a
kill -9 the moment it arrives loses nothing, and the very next request sees the write),
and callers waiting for preflight verdicts leave the API answering everyone else."""

from __future__ import annotations

import os
import signal
import threading
import time
import uuid
from pathlib import Path

import httpx
import pytest

from ringwatch.services.store import db, tokens
from ringwatch.services.store import measurements as measurement_store
from ringwatch.services.store import preflight as preflight_store
from tests.api_fixtures import TEST_SECRET_KEY, WEBHOOK_SECRET, fleet_batch
from tests.procs import api_env, start_server, stop_server

ADMIN = "rw_admin_" + uuid.uuid4().hex


@pytest.fixture
def env(database_url: str, clean_db, tmp_path: Path) -> dict[str, str]:
    # Webhooks need a key for their secrets and the loopback network allowed.
    return {**api_env(database_url, tmp_path, ADMIN), "RINGWATCH_SECRET_KEY": TEST_SECRET_KEY,
            "RINGWATCH_WEBHOOK_ALLOWED_NETWORKS": '["127.0.0.0/8"]'}


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def kill9(proc) -> None:
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)


def test_a_batch_acknowledged_right_before_a_kill_9_is_stored(env, clean_db) -> None:
    api = env["RINGWATCH_API_URL"]
    acked = []
    proc = start_server(env)
    try:
        for i in range(3):  # each kill costs a server start, a few seconds
            batch = fleet_batch(prefix=f"ack{i}")
            resp = httpx.post(f"{api}/v1/measurements", json=batch, headers=bearer(ADMIN))
            kill9(proc)  # the moment the 200 is in
            assert resp.status_code == 200, resp.text
            assert resp.json()["created"] is True
            acked.append(batch)
            proc = start_server(env)
        for batch in acked:
            again = httpx.post(f"{api}/v1/measurements", json=batch, headers=bearer(ADMIN))
            assert again.status_code == 200, again.text
            assert again.json()["created"] is False, batch["batch_id"]
    finally:
        stop_server(proc)
    with db.transaction(clean_db) as s:
        stored = {b["batch_id"]: measurement_store.find_run(s, b["batch_id"]) for b in acked}
        counts = {k: run.measurement_count if run else None for k, run in stored.items()}
    assert counts == {b["batch_id"]: len(b["measurements"]) for b in acked}


def test_the_very_next_request_sees_a_write(env) -> None:
    """A revoke's 204 shuts the token out at once; a webhook, a token and a batch are
    readable the moment their 2xx arrives. Several rounds: a write committed after its
    answer would be missed some of the time, not every time."""
    api = env["RINGWATCH_API_URL"]
    proc = start_server(env)
    try:
        with httpx.Client(base_url=api, headers=bearer(ADMIN)) as admin:
            for i in range(5):
                made = admin.post("/v1/tokens", json={"role": "reader", "name": f"next-{i}"})
                assert made.status_code == 201, made.text
                token = made.json()
                assert httpx.get(f"{api}/v1/health", headers=bearer(token["token"])).status_code == 200
                assert admin.delete(f"/v1/tokens/{token['id']}").status_code == 204
                assert httpx.get(f"{api}/v1/health", headers=bearer(token["token"])).status_code == 401

                hook = admin.post("/v1/webhooks", json={"url": f"http://127.0.0.1:9/hook{i}",
                                                        "secret": WEBHOOK_SECRET,
                                                        "events": ["health.degraded"]})
                assert hook.status_code == 201, hook.text
                assert admin.get(f"/v1/webhooks/{hook.json()['id']}").status_code == 200

                stored = admin.post("/v1/measurements", json=fleet_batch(prefix=f"seen{i}"))
                assert stored.status_code == 200, stored.text
                assert admin.get(f"/v1/nodes/seen{i}-000").status_code == 200
    finally:
        stop_server(proc)


def test_health_is_answered_while_48_callers_wait_for_preflights(env, clean_db) -> None:
    """Three reader tokens, each with the 16 waiting requests it may have, on an API with no
    scheduler: none is answered before its wait runs out. Health reads made meanwhile are
    each answered within their client's 5 s (a bound on correctness, not a benchmark), and
    every caller still gets its 202 once its wait is over."""
    api, wait_s, callers = env["RINGWATCH_API_URL"], 10.0, 48
    proc = start_server(env)
    try:
        httpx.post(f"{api}/v1/measurements", json=fleet_batch(),
                   headers=bearer(ADMIN)).raise_for_status()
        with db.transaction(clean_db) as s:
            issued = [tokens.issue(s, "reader", f"waiter-{i}") for i in range(3)]
            health_token = tokens.create_token(s, "reader", "health")
        ids, readers = [row.id for row, _ in issued], [plain for _, plain in issued]
        answers: list[tuple[int, float, str]] = []
        crowd = httpx.Client(base_url=api, timeout=wait_s + 60,
                             limits=httpx.Limits(max_connections=callers))

        def wait_for_verdict(token: str) -> None:
            t0 = time.monotonic()
            resp = crowd.post("/v1/preflight", params={"wait": wait_s}, headers=bearer(token),
                              json={"nodes": ["node-000", "node-001"], "max_age_s": 0.001})
            answers.append((resp.status_code, time.monotonic() - t0, resp.json().get("status")))

        threads = [threading.Thread(target=wait_for_verdict, args=(readers[i % 3],))
                   for i in range(callers)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + wait_s / 2
        while _waiting(clean_db, ids) < callers and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _waiting(clean_db, ids) == callers

        with httpx.Client(base_url=api, headers=bearer(health_token), timeout=5.0) as reader:
            for _ in range(10):
                assert reader.get("/v1/health").status_code == 200
                time.sleep(0.2)
        assert answers == []  # the health reads were answered while every caller waited

        for t in threads:
            t.join(wait_s + 60)
        crowd.close()
    finally:
        stop_server(proc)
    assert len(answers) == callers
    assert {(code, status) for code, _, status in answers} == {(202, "pending")}
    assert min(s for _, s, _ in answers) >= wait_s - 0.5


def _waiting(factory, token_ids: list[int]) -> int:
    with db.transaction(factory) as s:
        return sum(preflight_store.waiting_count(s, t) for t in token_ids)
