"""The launch gate under a big job's start: every node's prolog asks about itself at once.

A 1024 x 8 fleet (the sim, with a hang, an NVLink pair and a NIC fault) is monitored once by
the real `ringwatch scheduler --once`, so every node has fresh stored results; then 1024
prologs' requests (``POST /v1/preflight?wait=10.0`` naming one node, ``max_age_s`` 900, one
reader token, as ``ringwatch slurm prolog`` sends it) are fired at once at the real
`ringwatch serve`, one connection each. Printed: p50, p99 and max from each connect to its
whole answer, how many were answered (200) and how many failed, and how many answers drain
their node. Then the same with 16 other reader tokens each keeping 16 preflights waiting for a
scheduler (held open with ``?wait=``) before the prologs ask.

    python -m bench.run launch_gate            # 1024 x 8
    python -m bench.run launch_gate --quick    # 256 x 8
"""

from __future__ import annotations

import asyncio
import json
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

GPUS = 8
# What ``ringwatch slurm prolog`` gives the API (its bound less the time to drain) and the
# wait it asks for (services/cli/slurm.py, WAIT_S).
PROLOG_BUDGET_S = 25.0
PROLOG_WAIT_S = 10.0
# The same benchmark on the code before requests arriving together shared a transaction
# (commit 4c69c21), on this 2-core machine: p50, p99, max seconds, alone and behind 256
# waiting; every request answered. Printed beside this run's, for comparison.
BEFORE = {"alone": (8.24, 11.99, 12.01), "behind": (8.91, 12.80, 12.83)}
READERS = 16
WAITING_PER_READER = 16
# Nodes each reader's waiting preflight names.
WAITING_NODES = 64


def name(i: int) -> str:
    return f"node-{i:03d}"


def scenario(nodes: int) -> dict[str, Any]:
    return {"nodes": nodes, "gpus_per_node": GPUS, "gpu": "H100-SXM", "noise": 0.03, "seed": 5,
            "faults": [{"kind": "hang", "node": name(nodes // 3), "gpu": 2},
                       {"kind": "nvlink", "node": name(nodes // 2), "gpus": [1, 6], "factor": 0.5},
                       {"kind": "nic", "node": name(2 * nodes // 3), "factor": 0.5}]}


@dataclass
class Reply:
    status: int
    seconds: float
    body: dict[str, Any] | None


async def _post(host: str, port: int, path: str, token: str, body: dict[str, Any],
                timeout_s: float) -> Reply:
    """One request on a connection of its own (each prolog is its own process on its own
    node), read whole; a small HTTP/1.1 client so that the bench's own CPU stays out of the
    figures as far as it can on a machine the server shares."""
    payload = json.dumps(body).encode()
    head = (f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nAuthorization: Bearer {token}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n"
            "Connection: close\r\n\r\n").encode()
    t0 = time.monotonic()
    writer = None
    try:
        async with asyncio.timeout(timeout_s):
            reader, writer = await asyncio.open_connection(host, port)
            writer.write(head + payload)
            await writer.drain()
            raw = await reader.read(-1)
    except (TimeoutError, OSError):
        return Reply(0, time.monotonic() - t0, None)
    finally:
        if writer is not None:
            writer.close()
    seconds = time.monotonic() - t0
    header, _, rest = raw.partition(b"\r\n\r\n")
    try:
        status = int(header.split(b" ", 2)[1])
        return Reply(status, seconds, json.loads(rest) if rest else None)
    except (IndexError, ValueError):
        return Reply(0, seconds, None)


async def _prologs(url: str, token: str, nodes: int) -> list[Reply]:
    parts = urlsplit(url)
    path = f"/v1/preflight?wait={PROLOG_WAIT_S:.1f}"
    return list(await asyncio.gather(*(
        _post(parts.hostname or "127.0.0.1", parts.port or 80, path, token,
              {"nodes": [name(i)], "max_age_s": 900.0}, PROLOG_BUDGET_S)
        for i in range(nodes))))


async def _with_waiting(url: str, token: str, readers: list[str], nodes: int) -> tuple[list[Reply], int]:
    """The prologs, once every reader keeps its preflights waiting (held open, ?wait=)."""
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    held = []
    for k, reader in enumerate(readers):
        for j in range(WAITING_PER_READER):
            first = (k * WAITING_PER_READER + j) * WAITING_NODES % nodes
            ask = {"nodes": [name((first + i) % nodes) for i in range(WAITING_NODES)],
                   "max_age_s": 0.001}  # only a probe made for it answers it
            held.append(asyncio.ensure_future(
                _post(host, port, "/v1/preflight?wait=600", reader, ask, 600)))
    await asyncio.sleep(3.0)  # every one of them written and waiting
    replies = await _prologs(url, token, nodes)
    refused = sum(1 for t in held if t.done())  # a held request that came back is not waiting
    for t in held:
        t.cancel()
    await asyncio.gather(*held, return_exceptions=True)
    return replies, len(held) - refused


def summary(label: str, replies: list[Reply]) -> str:
    ok = [r for r in replies if r.status == 200 and r.body and r.body.get("status") == "done"]
    failed = len(replies) - len(ok)
    secs = sorted(r.seconds for r in replies)
    p99 = secs[min(len(secs) - 1, int(round(0.99 * len(secs))) - 1)]
    drained = sum(1 for r in ok if set(r.body.get("exclude") or ()) & set(r.body["nodes"]))
    codes: dict[int, int] = {}
    for r in replies:
        if r not in ok:
            codes[r.status] = codes.get(r.status, 0) + 1
    others = ", ".join(f"{n} x {c or 'no answer'}" for c, n in sorted(codes.items()))
    return (f"  {label:<44}{statistics.median(secs):>7.2f}{p99:>7.2f}{secs[-1]:>7.2f}"
            f"{len(ok):>9}{failed:>8}{drained:>9}" + (f"   ({others})" if others else ""))


def main(flags: list[str]) -> None:
    from bench.monitoring import Fleet

    nodes = 256 if "--quick" in flags else 1024
    with tempfile.TemporaryDirectory(prefix="rw-gate-") as tmp:
        state = Path(tmp)
        path = state / f"gate-{nodes}.json"
        path.write_text(json.dumps(scenario(nodes)))
        fleet = Fleet(path, state / "fleet")
        try:
            wall = fleet.cycle()

            def token(role: str, label: str) -> str:
                r = fleet.api.post("/v1/tokens", json={"role": role, "name": label})
                r.raise_for_status()
                return r.json()["token"]

            prolog = token("reader", "prolog")
            readers = [token("reader", f"reader-{k}") for k in range(READERS)]
            url = fleet.env["RINGWATCH_API_URL"]
            alone = asyncio.run(_prologs(url, prolog, nodes))
            behind, waiting = asyncio.run(_with_waiting(url, prolog, readers, nodes))
        finally:
            fleet.close()
    print(f"\n{nodes} x {GPUS}, results from one monitoring cycle ({wall:.0f} s) fresh; "
          f"{nodes} single-node prolog preflights at once, one connection each, "
          f"{PROLOG_BUDGET_S:g} s each")
    print(f"  {'':<44}{'p50 s':>7}{'p99 s':>7}{'max s':>7}{'answered':>9}{'failed':>8}"
          f"{'drained':>9}")
    print(summary("alone", alone))
    print(summary(f"behind {waiting} waiting ({READERS} readers x {WAITING_PER_READER})",
                  behind))
    for label, (p50, p99, top) in BEFORE.items() if nodes == 1024 else ():
        print(f"  {'before (4c69c21), ' + label:<44}{p50:>7.2f}{p99:>7.2f}{top:>7.2f}")
