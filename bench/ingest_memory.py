"""Peak memory of the API while it takes maximal measurement batches, one and several at once.

    python -m bench.ingest_memory            # 64 MiB bodies (RINGWATCH_MAX_BODY_BYTES' default)
    python -m bench.ingest_memory --quick    # 16 MiB bodies

A real ``ringwatch serve`` on a fresh database; each batch is as large as the body limit
lets it be (measurements of 8-rank groups, as a scheduler sends). Printed per case: the
server's resident set before, its peak (VmHWM) after, the growth, and the seconds to the
last answer. The ingest slots (RINGWATCH_MAX_CONCURRENT_INGESTS, default 2) bound how many
bodies are read and parsed at once, so three concurrent batches should peak near two.
Nothing is asserted; docs/security.md quotes the figures.
"""

from __future__ import annotations

import json
import os
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path

import httpx

from ringwatch.services.cli.api_process import free_port, start_api, stop
from ringwatch.services.settings import Settings
from ringwatch.services.store import db

MIB = 1 << 20


def _measurement(i: int, at: str) -> dict:
    node = f"node-{i % 1000:03d}"
    members = [f"{node}/{g}" for g in range(8)]
    return {"op": "allreduce", "scope": "intra_node", "members": members,
            "size_bytes": 1 << 24, "dtype": "float32", "warmup": 5, "iters": 20,
            "time_us": 98765.4, "algbw_gbs": 169.87, "busbw_gbs": 297.27, "wrong": 0,
            "time": at}


def maximal_body(limit: int) -> bytes:
    """A batch whose JSON is just under ``limit`` bytes."""
    at = datetime.now(UTC).isoformat()
    one = len(json.dumps(_measurement(0, at))) + 2
    count = (limit - 200) // one
    batch = {"batch_id": uuid.uuid4().hex, "backend": "gloo",
             "measurements": [_measurement(i, at) for i in range(count)]}
    raw = json.dumps(batch).encode()
    while len(raw) > limit:
        batch["measurements"] = batch["measurements"][:-50]
        raw = json.dumps(batch).encode()
    return raw


def _status(pid: int) -> dict[str, int]:
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0]) * 1024
    return out


def _post(url: str, token: str, raw: bytes) -> int:
    body = json.loads(raw)
    body["batch_id"] = uuid.uuid4().hex
    resp = httpx.post(f"{url}/v1/measurements", content=json.dumps(body).encode(),
                      headers={"Authorization": f"Bearer {token}",
                               "Content-Type": "application/json"}, timeout=600)
    return resp.status_code


def _agent_token(api_url: str, admin: str, i: int) -> str:
    r = httpx.post(f"{api_url}/v1/tokens", json={"role": "agent", "name": f"sender-{i}"},
                   headers={"Authorization": f"Bearer {admin}"}, timeout=30)
    r.raise_for_status()
    return str(r.json()["token"])


def run_case(admin_url: str, raw: bytes, concurrent: int) -> dict[str, float]:
    name = f"rw_bench_mem_{uuid.uuid4().hex[:8]}"
    url = db.create_database(admin_url, name)
    token = "rw_admin_" + uuid.uuid4().hex
    api_url = f"http://127.0.0.1:{free_port()}"
    env = {**os.environ, "RINGWATCH_DATABASE_URL": url, "RINGWATCH_API_URL": api_url,
           "RINGWATCH_BOOTSTRAP_ADMIN_TOKEN": token,
           "RINGWATCH_MAX_BATCH_MEASUREMENTS": "1000000"}
    try:
        db.upgrade(url)
        proc = start_api(env, notifier=False)
        try:
            # A token per sender, as each scheduler and agent has its own: one token holds
            # at most half the ingest slots (docs/security.md, "Ingest slots").
            senders = [_agent_token(api_url, token, i) for i in range(concurrent)]
            before = _status(proc.pid)["VmRSS"]
            started = time.monotonic()
            with ThreadPoolExecutor(concurrent) as pool:
                codes = list(pool.map(lambda t: _post(api_url, t, raw), senders))
            seconds = time.monotonic() - started
            peak = _status(proc.pid)["VmHWM"]
        finally:
            stop(proc)
    finally:
        db.drop_database(admin_url, name)
    return {"before": before / MIB, "peak": peak / MIB, "growth": (peak - before) / MIB,
            "seconds": seconds, "ok": sum(c == 200 for c in codes), "sent": concurrent}


def main(flags: list[str]) -> None:
    limit = (16 if "--quick" in flags else 64) * MIB
    settings = Settings()
    admin_url = db.resolve_database_url(settings.database_url, settings.state_dir)
    raw = maximal_body(limit)
    count = len(json.loads(raw)["measurements"])
    print(f"body {len(raw) / MIB:.1f} MiB, {count} measurements (8-rank groups)")
    print(f"{'concurrent':>10} {'rss before':>11} {'peak':>9} {'growth':>9} {'seconds':>8} {'200s':>5}")
    for concurrent in (1, 3):
        r = run_case(admin_url, raw, concurrent)
        print(f"{concurrent:>10} {r['before']:>8.0f} MiB {r['peak']:>5.0f} MiB "
              f"{r['growth']:>5.0f} MiB {r['seconds']:>8.1f} {r['ok']:>2}/{r['sent']}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
