"""The launch gate when a big job starts: every node's prolog asks about itself at once, and
other callers keep their own preflights waiting for a scheduler.

The rules first, on a real database: requests that arrive together are answered together,
each with its own verdict or its own error; a scheduler claims the gate's lane (one node, no
workload: a prolog's request) before every other request, and the askers' tokens in turn.
Then the fail-open case, through real processes: 16 reader tokens keep 16 preflights each
waiting for the scheduler, and the prolog of a node with an open hang, whose stored results
are older than its max age, asks after them. Claimed oldest first, the prolog ran out its
bound behind them and let the node take the job; now its request is claimed next, the
scheduler probes the node, and the prolog drains it."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import httpx
import pytest
from sqlalchemy import update
from sqlalchemy.orm import Session, sessionmaker

from ringwatch.agents.spec import utcnow
from ringwatch.services.cli import slurm
from ringwatch.services.errors import NodeNotFound, TooManyRequests
from ringwatch.services.monitor.stored_verdict import verdict_from_store
from ringwatch.services.preflight import service
from ringwatch.services.store import db, tokens
from ringwatch.services.store import preflight as store
from ringwatch.services.store.models import Node, PreflightRequest
from tests.api_fixtures import api_client, fleet_batch
from tests.procs import api_env, start_server, stop_server
from tests.test_slurm import _scontrol_recorder

ROOT = Path(__file__).resolve().parents[1]
ADMIN = "rw_gate_" + uuid.uuid4().hex
READERS = 16
WAITING_PER_READER = 16
HUNG = "node-005"


def _ingest(factory: sessionmaker[Session], slow_node: str | None = None) -> None:
    """Two cycles of results for node-000...node-003 through the real app: ``slow_node``'s
    incident opens (the test app opens one on the first bad cycle)."""
    with api_client(factory) as client:
        for _ in range(2):
            client.post("/v1/measurements", json=fleet_batch(slow_node=slow_node),
                        headers=client.h["agent"]).raise_for_status()


# ---- the rules ------------------------------------------------------------------------------


def test_requests_written_together_each_get_their_own_answer(clean_db) -> None:
    _ingest(clean_db, slow_node="node-002")
    with db.transaction(clean_db) as s:
        reader = tokens.issue(s, "reader")[0].id
        other = tokens.issue(s, "reader")[0].id
    asks = [service.Ask([f"node-{i:03d}"], 900.0, token_id=reader) for i in range(4)]
    asks += [service.Ask(["node-001", "node-002"], 900.0, token_id=reader),
             service.Ask(["node-000", "node-404"], 900.0, token_id=reader),
             # Waiting for a scheduler: the second of this token's is one too many.
             service.Ask(["node-003"], 0.001, token_id=other, max_waiting=1),
             service.Ask(["node-001"], 0.001, token_id=other, max_waiting=1)]
    with db.transaction(clean_db) as s:
        out = service.submit_many(s, asks, "http://rw.test")
    with db.transaction(clean_db) as s:
        for ask, got in zip(asks[:5], out[:5], strict=True):
            assert isinstance(got, dict) and got["status"] == "done"
            alone = verdict_from_store(s, ask.nodes, ask.max_age_s)
            assert {k: got[k] for k in alone if k != "max_age_s"} == \
                {k: v for k, v in alone.items() if k != "max_age_s"}
        stored = {r.id: r for r in s.query(PreflightRequest)}
    assert [o["exclude"] for o in out[:5] if isinstance(o, dict)] == \
        [[], [], ["node-002"], [], ["node-002"]]
    assert isinstance(out[5], NodeNotFound) and "node-404" in str(out[5])
    assert isinstance(out[6], dict) and out[6]["status"] == "pending"
    assert isinstance(out[7], TooManyRequests)
    # Six requests written (not the 404 nor the 429), each as it was answered.
    assert sorted(len(r.nodes) for r in stored.values()) == [1, 1, 1, 1, 1, 2]
    assert all(stored[o["id"]].status == o["status"] for o in out if isinstance(o, dict))


def _pending(s: Session, nodes: list[str], token_id: int, workload: dict | None = None) -> str:
    return store.create_requests(s, [store.NewRequest(nodes, 900.0, None, token_id, workload)],
                                 utcnow())[0].id


def test_the_gate_lane_is_claimed_first_and_tokens_take_turns(session: Session) -> None:
    reader, prolog, launcher = (tokens.issue(session, "reader")[0].id for _ in range(3))
    session.add_all(Node(name=f"node-{i:03d}") for i in range(8))
    # Oldest first: the reader's queue of multi-node requests, then a launcher's profiled
    # one, a prolog's, the reader's own single-node request and another prolog's.
    asked = [(["node-000", "node-001"], reader, None)] * 3 + [
        (["node-002"], launcher, {"profile": "ddp", "job": {}}), (["node-003"], prolog, None),
        (["node-005"], reader, None), (["node-004"], prolog, None)]
    ids = [_pending(session, nodes, token, work) for nodes, token, work in asked]
    for age, request_id in enumerate(reversed(ids)):
        session.execute(update(PreflightRequest).where(PreflightRequest.id == request_id)
                        .values(created_at=utcnow() - timedelta(seconds=age)))
    order = []
    while (req := store.claim_next(session, "w", 60.0, utcnow())) is not None:
        order.append(ids.index(req.id))
    # The gate's lane (one node, no workload) first, each token's oldest before any token's
    # second: the prolog's, the reader's, the prolog's next. Then the other lane, the token
    # served longest ago first: the launcher's (never), then the reader's three in turn.
    assert order == [4, 5, 6, 3, 0, 1, 2]


def test_a_token_that_queued_first_takes_turns_with_one_that_came_later(session: Session) -> None:
    early, late = (tokens.issue(session, "reader")[0].id for _ in range(2))
    session.add_all(Node(name=f"node-{i:03d}") for i in range(4))
    ids = [_pending(session, ["node-000", "node-001"], early) for _ in range(3)]
    ids += [_pending(session, ["node-002", "node-003"], late) for _ in range(3)]
    for age, request_id in enumerate(reversed(ids)):
        session.execute(update(PreflightRequest).where(PreflightRequest.id == request_id)
                        .values(created_at=utcnow() - timedelta(seconds=age)))
    order = []
    while (req := store.claim_next(session, "w", 60.0, utcnow())) is not None:
        order.append(ids.index(req.id))
        store.complete(session, req, {"healthy": True}, utcnow())
    assert order == [0, 3, 1, 4, 2, 5]


def test_a_claim_skips_what_another_scheduler_holds(clean_db) -> None:
    with db.transaction(clean_db) as s:
        token = tokens.issue(s, "reader")[0].id
        s.add_all(Node(name=f"node-{i:03d}") for i in range(2))
        a = _pending(s, ["node-000"], token)
        b = _pending(s, ["node-001"], token)
    with db.transaction(clean_db) as first, db.transaction(clean_db) as second:
        one = store.claim_next(first, "one", 60.0, utcnow())
        two = store.claim_next(second, "two", 60.0, utcnow())
        assert one is not None and two is not None
        assert {one.id, two.id} == {a, b}
    with db.transaction(clean_db) as s:
        assert store.claim_next(s, "three", 60.0, utcnow()) is None


def test_concurrent_requests_through_the_app_are_answered_each_its_own(clean_db) -> None:
    _ingest(clean_db, slow_node="node-001")
    client = api_client(clean_db)
    with client:
        app = client.app

        async def ask_all() -> list[httpx.Response]:
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://rw.test",
                                         headers=client.h["reader"]) as http:
                asks = [{"nodes": [f"node-{i % 4:03d}"]} for i in range(60)]
                asks += [{"nodes": ["node-000", "node-404"]}, {"nodes": ["node-002"]}]
                return list(await asyncio.gather(*(
                    http.post("/v1/preflight?wait=1", json=a) for a in asks)))

        replies = asyncio.run(ask_all())
    assert [r.status_code for r in replies] == [200] * 60 + [404, 200]
    for i, r in enumerate(replies[:60]):
        body = r.json()
        assert body["nodes"] == [f"node-{i % 4:03d}"] and body["status"] == "done"
        assert body["exclude"] == (["node-001"] if i % 4 == 1 else [])
    assert replies[60].json()["message"] == "unknown or retired node(s): node-404"
    assert len({r.json()["id"] for r in replies if r.status_code == 200}) == 61


# ---- the fail-open case, through real processes ---------------------------------------------


def _scenario(path: Path) -> Path:
    path.write_text(json.dumps({
        "nodes": 16, "gpus_per_node": 4, "gpu": "H100-SXM", "noise": 0.03, "seed": 7,
        "faults": [{"kind": "hang", "node": HUNG, "gpu": 1}]}))
    return path


def _scheduler(fabric: Path, *more: str) -> list[str]:
    return [sys.executable, "-m", "ringwatch.services.cli.main", "scheduler", "--fabric", str(fabric),
            *more]


@pytest.fixture
def gate_api(database_url, clean_db, tmp_path) -> Iterator[dict[str, str]]:
    env = api_env(database_url, tmp_path / "api", ADMIN)
    proc = start_server(env)
    try:
        yield env
    finally:
        stop_server(proc)


def _token(env: dict[str, str], role: str) -> str:
    r = httpx.post(f"{env['RINGWATCH_API_URL']}/v1/tokens", json={"role": role}, timeout=30,
                   headers={"Authorization": f"Bearer {ADMIN}"})
    r.raise_for_status()
    return r.json()["token"]


def test_a_prolog_behind_other_callers_queues_drains_the_node_with_an_open_hang(
        gate_api: dict[str, str], clean_db, tmp_path: Path) -> None:
    env, url = gate_api, gate_api["RINGWATCH_API_URL"]
    fabric = _scenario(tmp_path / "fabric.json")
    for _ in range(2):  # two cycles: the hang's incident is open
        done = subprocess.run(_scheduler(fabric, "--once"), env=env, capture_output=True,
                              text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
    admin = {"Authorization": f"Bearer {ADMIN}"}
    opened = httpx.get(f"{url}/v1/findings", headers=admin, timeout=30).json()
    assert [(f["kind"], f["nodes"], f["status"]) for f in opened] == [("hang", [HUNG], "open")]

    # Other callers fill the queue first: each reader token keeps as many requests waiting
    # as it may, each only a probe made for it answers.
    readers = [_token(env, "reader") for _ in range(READERS)]
    for k, reader in enumerate(readers):
        for j in range(WAITING_PER_READER):
            nodes = [f"node-{(k + j + i) % 16:03d}" for i in range(4)]
            r = httpx.post(f"{url}/v1/preflight", json={"nodes": nodes, "max_age_s": 0.001},
                           headers={"Authorization": f"Bearer {reader}"}, timeout=30)
            assert r.status_code == 202, r.text
    time.sleep(1.5)  # the hung node's results are now older than the prolog's max age

    bin_dir, calls = _scontrol_recorder(tmp_path)
    env_file = tmp_path / "prolog.env"
    env_file.write_text(f"RINGWATCH_API_URL={url}\nRINGWATCH_TOKEN={_token(env, 'reader')}\n"
                        f"RINGWATCH_SLURM_BIN={bin_dir}\nRINGWATCH_SLURM_LOG={tmp_path / 'log'}\n"
                        # Stands for a node a job held past the max age (not probed since).
                        "RINGWATCH_SLURM_MAX_AGE_S=1\n")
    env_file.chmod(0o600)
    prolog = subprocess.Popen(
        [sys.executable, "-m", "ringwatch.services.cli.main", "slurm", "prolog", "--env-file",
         str(env_file)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**{k: v for k, v in os.environ.items() if not k.startswith(("RINGWATCH_", "SLURM"))},
             "SLURMD_NODENAME": HUNG, "SLURM_JOB_ID": "4242"})
    # Its request waits behind theirs; then a scheduler starts serving the queue.
    _wait_until(lambda: _requests(clean_db, [HUNG]), 20, "the prolog's request")
    scheduler = subprocess.Popen(_scheduler(fabric, "--interval", "3600"), env=env,
                                 stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        _, err_prolog = prolog.communicate(timeout=slurm.BOUND_S + 30)
    finally:
        scheduler.terminate()
        try:
            _, err = scheduler.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            scheduler.kill()
            _, err = scheduler.communicate()
    said = (tmp_path / "log").read_text() if (tmp_path / "log").exists() else ""
    assert prolog.returncode == 1, f"{err_prolog}\n{said}\nscheduler: {err[-1500:]}"
    update_, node, state, reason = calls.read_text().splitlines()
    assert (update_, node, state) == ("update", f"NodeName={HUNG}", "State=DRAIN")
    assert reason.startswith(f"Reason=ringwatch: hang {HUNG} GPU 1")
    assert f"job 4242 on {HUNG}: drained: {reason.removeprefix('Reason=')}" in said
    # Its request was the first the scheduler served, though every reader's was older.
    (mine,) = _requests(clean_db, [HUNG])
    assert (mine.status, mine.attempts, mine.verdict["exclude"]) == ("done", 1, [HUNG])
    theirs = [r for r in _requests(clean_db) if r.id != mine.id]
    assert len(theirs) == READERS * WAITING_PER_READER
    assert all(r.created_at < mine.created_at for r in theirs)
    assert all(r.completed_at > mine.completed_at for r in theirs if r.completed_at)


def _requests(factory: sessionmaker[Session], nodes: list[str] | None = None) -> list[PreflightRequest]:
    with db.transaction(factory) as s:
        q = s.query(PreflightRequest)
        found = q.filter(PreflightRequest.nodes == nodes).all() if nodes else q.all()
        s.expunge_all()
        return found


def _wait_until(ready, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} within {timeout:g} s")
        time.sleep(0.2)
