"""A crowd of callers waiting for preflight verdicts (``POST /v1/preflight?wait=``), and
whether everyone else is still served meanwhile: health reads and an ingest must not
queue behind the waiting, and every waiting caller must get its answer."""

from __future__ import annotations

import math
import threading
import time

import httpx

from bench.chaos.harness import Row, Stage, post_until_stored, wait_until
from ringwatch.services.settings import Settings
from tests.api_fixtures import fleet_batch

NODES = [f"node-{i:03d}" for i in range(4)]
# Health reads taken while the crowd waits, and the bounds they are held to.
HEALTH_CALLS = 40
HEALTH_EVERY_S = 0.25
HEALTH_TIMEOUT_S = 5.0
HEALTH_P99_S = 1.0
INGEST_WITHIN_S = 5.0


def waiters(admin_url: str | None = None, tokens: int = 8, wait_s: float = 25.0) -> Row:
    """``tokens`` reader tokens, each with as many callers waiting as it may have
    (RINGWATCH_MAX_PENDING_PREFLIGHTS_PER_TOKEN), on an API with no scheduler, so that
    none is answered before its wait runs out. Meanwhile a reader polls ``/v1/health``
    and an agent sends one batch. Health must stay fast (p99 under 1 s, none timed out),
    the batch be stored within a few seconds, and every caller get its 202 after its wait."""
    per_token = int(Settings.model_fields["max_pending_preflights_per_token"].default)
    callers = tokens * per_token
    row = Row(f"{callers} waiting preflights", False)
    stage = Stage("waiters", admin_url,
                  env={"RINGWATCH_MAX_PENDING_PREFLIGHTS_PER_TOKEN": str(per_token)})
    threads: list[threading.Thread] = []
    try:
        api = stage.start_api()
        with stage.client(stage.admin) as admin, stage.client(stage.token("agent")) as agent:
            post_until_stored(agent, fleet_batch(), 60)  # the nodes the callers ask about
            readers = [_reader_token(admin, f"waiter-{i}") for i in range(tokens)]
            health = _reader_token(admin, "health")
            answers: list[tuple[int, float, str]] = []
            # One client for the crowd, a connection each: making a client costs a
            # noticeable fraction of a second of CPU, a crowd of them seconds.
            crowd = httpx.Client(base_url=stage.api_url, timeout=wait_s + 60,
                                 limits=httpx.Limits(max_connections=callers))
            threads = [threading.Thread(target=_wait_for_verdict,
                                        args=(crowd, readers[i % tokens], wait_s, answers),
                                        daemon=True)
                       for i in range(callers)]
            started = time.monotonic()
            for t in threads:
                t.start()
            all_waiting = wait_until(lambda: stage.scalar(
                "SELECT count(*) FROM preflight_requests WHERE status = 'pending'") >= callers,
                wait_s / 2, every_s=0.1)
            submitted_s = time.monotonic() - started
            ingest: list[tuple[int, float]] = []
            sender = threading.Thread(target=_timed_ingest, args=(agent, ingest))
            latencies, codes = _poll_health(stage, health, sender)
            health_done_s = time.monotonic() - started
            sender.join(60)
            for t in threads:
                t.join(max(0.0, wait_s + 60 - (time.monotonic() - started)))
            crowd.close()
        row.survived, row.note = _judge(callers, wait_s, bool(all_waiting), submitted_s,
                                        health_done_s, latencies, codes, ingest, answers)
        row.survived = row.survived and api.poll() is None
        return row
    finally:
        stage.close(keep_logs=not row.met)


def _reader_token(admin: httpx.Client, name: str) -> str:
    resp = admin.post("/v1/tokens", json={"role": "reader", "name": name})
    if resp.status_code != 201:
        raise RuntimeError(f"POST /v1/tokens answered {resp.status_code}: {resp.text[:300]}")
    return resp.json()["token"]


def _wait_for_verdict(crowd: httpx.Client, token: str, wait_s: float,
                      answers: list[tuple[int, float, str]]) -> None:
    """One caller: (status code, seconds, request status) appended to ``answers``; code 0
    with the error's name when no answer came."""
    t0 = time.monotonic()
    try:
        # Results younger than 1 ms: none are, so the request waits for a scheduler.
        resp = crowd.post("/v1/preflight", params={"wait": wait_s},
                          json={"nodes": NODES, "max_age_s": 0.001},
                          headers={"Authorization": f"Bearer {token}"})
        status = resp.json().get("status", "") if resp.status_code < 300 else resp.text[:80]
        answers.append((resp.status_code, time.monotonic() - t0, status))
    except httpx.HTTPError as exc:
        answers.append((0, time.monotonic() - t0, type(exc).__name__))


def _timed_ingest(agent: httpx.Client, out: list[tuple[int, float]]) -> None:
    t0 = time.monotonic()
    try:
        code = agent.post("/v1/measurements", json=fleet_batch(), timeout=60).status_code
    except httpx.HTTPError:
        code = 0
    out.append((code, time.monotonic() - t0))


def _poll_health(stage: Stage, token: str, sender: threading.Thread) -> tuple[list[float], list[int]]:
    """``HEALTH_CALLS`` reads of ``/v1/health``, ``HEALTH_EVERY_S`` apart, the batch sent by
    ``sender`` a quarter of the way through; their latencies and codes (0: timed out)."""
    latencies, codes = [], []
    with stage.client(token, timeout=HEALTH_TIMEOUT_S) as reader:
        for k in range(HEALTH_CALLS):
            if k == HEALTH_CALLS // 4:
                sender.start()
            t0 = time.monotonic()
            try:
                codes.append(reader.get("/v1/health").status_code)
            except httpx.HTTPError:
                codes.append(0)
            latencies.append(time.monotonic() - t0)
            time.sleep(HEALTH_EVERY_S)
    return latencies, codes


def _quantile(values: list[float], q: float) -> float:
    """Nearest-rank quantile: the smallest value with at least ``q`` of them at or below."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def _judge(callers: int, wait_s: float, all_waiting: bool, submitted_s: float,
           health_done_s: float, latencies: list[float], codes: list[int],
           ingest: list[tuple[int, float]], answers: list[tuple[int, float, str]]) -> tuple[bool, str]:
    p50, p99, worst = _quantile(latencies, 0.5), _quantile(latencies, 0.99), max(latencies)
    timed_out = codes.count(0)
    not_ok = sum(1 for c in codes if c not in (0, 200))
    ingest_code, ingest_s = ingest[0] if ingest else (0, float("nan"))
    # A 202 that came back before its wait ran out was not waiting; a 200 is a verdict.
    waited = sum(1 for code, s, status in answers
                 if (code == 202 and status in ("pending", "running") and s >= wait_s - 0.5)
                 or code == 200)
    during = health_done_s < wait_s
    survived = (all_waiting and during and p99 < HEALTH_P99_S and not timed_out and not not_ok
                and ingest_code == 200 and ingest_s < INGEST_WITHIN_S and waited == callers)
    others = sorted({f"{c} {st}" for c, _, st in answers if c not in (200, 202)})
    note = (f"{callers} callers waiting {wait_s:.0f} s ({'all' if all_waiting else 'NOT all'} "
            f"pending {submitted_s:.1f} s after the start); health p50 {p50 * 1000:.0f} ms, "
            f"p99 {p99 * 1000:.0f} ms, max {worst * 1000:.0f} ms over {len(codes)} calls, "
            f"{timed_out} timed out"
            + (f", {not_ok} not 200" if not_ok else "")
            + f"; ingest {ingest_code} in {ingest_s:.2f} s; "
            f"{waited}/{callers} answered after their wait"
            + (f" (also: {', '.join(others[:3])})" if others else "")
            + ("" if during else "; the health reads outlasted the wait"))
    return survived, note
