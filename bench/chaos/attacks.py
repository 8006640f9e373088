"""One agent's attacks on the monitor, each against a live ``ringwatch serve`` at default
settings: what a token scoped to a few nodes may send (slow bodies, label floods, made-up
nodes, another scheduler's spool state, crafted names, impossible counters, a flood of
findings). Each attack must leave every other agent ingesting and every surface answering;
docs/security.md, "What one agent, reader or file cannot do to the fleet's monitor", says
what holds each one."""

from __future__ import annotations

import json
import re
import select
import socket
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import httpx

from bench.chaos.harness import Row, Stage, wait_until
from ringwatch.services.store import tokens
from tests.api_fixtures import fleet_batch, measurement


def _batch(**fields: Any) -> dict[str, Any]:
    return {"batch_id": uuid.uuid4().hex, "backend": "gloo", "measurements": [],
            "findings": [], **fields}


def _scoped(stage: Stage, nodes: list[str]) -> str:
    from ringwatch.services.store import db

    with db.transaction(stage.factory) as s:
        return tokens.create_token(s, "agent", f"chaos-scoped-{uuid.uuid4().hex[:6]}",
                                   nodes=nodes)


class _SlowBody(threading.Thread):
    """A batch declaring a MiB and sending a byte a second, until answered or ``give_up_s``."""

    def __init__(self, port: int, token: str, give_up_s: float) -> None:
        super().__init__(daemon=True)
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.sendall((f"POST /v1/measurements HTTP/1.1\r\nHost: rw\r\nAuthorization: "
                           f"Bearer {token}\r\nContent-Type: application/json\r\n"
                           f"Content-Length: {1 << 20}\r\n\r\n{{").encode())
        self.give_up_s = give_up_s
        self.status: int | None = None
        self.start()

    def run(self) -> None:
        started = time.monotonic()
        try:
            while time.monotonic() - started < self.give_up_s:
                if select.select([self.sock], [], [], 1.0)[0]:
                    head = self.sock.recv(65536).decode("latin-1")
                    self.status = int(head.split()[1]) if head.startswith("HTTP/") else None
                    return
                self.sock.sendall(b" ")
        except OSError:
            pass
        finally:
            self.sock.close()


def _slow_bodies(stage: Stage, others: httpx.Client) -> tuple[bool, str]:
    """Two slow bodies of one scoped token; another agent's batch still goes in."""
    token = _scoped(stage, ["slow-000", "slow-001"])
    port = int(stage.api_url.rsplit(":", 1)[1])
    slow = [_SlowBody(port, token, give_up_s=90) for _ in range(2)]
    time.sleep(2.0)  # both hold what they can
    started = time.monotonic()
    r = others.post("/v1/measurements", json=fleet_batch(nodes=3, prefix="other"))
    waited = time.monotonic() - started
    for s in slow:
        s.join(100)
    if r.status_code != 200:
        return False, (f"another agent's batch got {r.status_code} while two slow bodies "
                       "went on")
    if any(s.status not in (408, 503) for s in slow):
        return False, f"slow bodies answered {[s.status for s in slow]}, not 408/503"
    return True, f"other agent in after {waited:.1f} s; slow bodies {[s.status for s in slow]}"


def _label_flood(stage: Stage, agent: httpx.Client) -> tuple[bool, str]:
    """3 000 made-up NIC counters, 1 KiB device names and 3 000 transport fallbacks with
    2 kB transports: /metrics stays small and answers."""
    before = httpx.get(f"{stage.api_url}/metrics", timeout=60).text
    n = 3000
    made_up = [{"device": f"mlx5_{i}", "port": i % 256, "counter": f"counter_{i}",
                "rate_per_s": 1.0} for i in range(n)]
    findings: list[dict[str, Any]] = [{"kind": "nic_errors", "node": "flood-000",
                                       "severity": "warning", "source": "sysfs",
                                       "counters": made_up}]
    findings += [{"kind": "nic_errors", "node": f"flood-00{k + 1}", "severity": "warning",
                  "source": "sysfs", "counters": [
                      {"device": f"{k}{'x' * 1024}{i}", "port": 1, "counter": "symbol_error",
                       "rate_per_s": 1.0} for i in range(300)]} for k in range(3)]
    findings += [{"kind": "transport_fallback", "node": "flood-000", "severity": "warning",
                  "source": "nccl_log", "transport": "t" * 2000 + str(i),
                  "expected": "p2p_nvlink", "gpus": [i % 4096, (i + 1) % 4096]}
                 for i in range(n)]
    r = agent.post("/v1/measurements", json=_batch(findings=findings, measurements=[
        measurement([f"flood-00{k}/0", f"flood-00{k}/1"], 20.0, scope="intra_node")
        for k in range(4)]))
    if r.status_code not in (200, 413, 422):
        return False, f"the flood batch got {r.status_code}"
    after = httpx.get(f"{stage.api_url}/metrics", timeout=60)
    if after.status_code != 200:
        return False, f"/metrics answered {after.status_code}"
    grew = _series(after.text) - _series(before)
    if grew > 1000 or len(after.content) > 1 << 20:
        return False, f"/metrics grew by {grew} series to {len(after.content)} bytes"
    return True, (f"/metrics +{grew} series, {len(after.content) // 1024} KiB "
                  f"(flood answered {r.status_code})")


def _series(text: str) -> int:
    return sum(1 for line in text.splitlines() if line and not line.startswith("#"))


def _node_flood(stage: Stage, agent: httpx.Client) -> tuple[bool, str]:
    """Two world measurements of 4 000 made-up nodes each from one token: the second is
    past its new-node quota (4 096 a day), and a real new node on its own token still joins."""
    codes = []
    with stage.client(stage.token("agent"), timeout=120) as flooder:
        for k in range(2):
            names = [f"fake{k}-{i:04d}/0" for i in range(4000)]
            r = flooder.post("/v1/measurements", json=_batch(
                measurements=[measurement(names, 10.0, scope="world")]))
            codes.append(r.status_code)
    with stage.client(_scoped(stage, ["real-new-000"])) as real:
        joined = real.post("/v1/measurements", json=_batch(measurements=[
            measurement(["real-new-000/0", "real-new-000/1"], 20.0, scope="intra_node")]))
    if codes != [200, 429] or joined.status_code != 200:
        return False, f"flood answered {codes}, the real new node {joined.status_code}"
    return True, f"flood answered {codes}; a real new node joined"


def _shipper_spoof(stage: Stage, agent: httpx.Client) -> tuple[bool, str]:
    """A scoped token claims another scheduler's spool: its claim shows under its own
    token, never as that scheduler's."""
    token = _scoped(stage, ["spoof-000"])
    with stage.client(token) as spoof:
        r = spoof.post("/v1/measurements", json=_batch(
            measurements=[measurement(["spoof-000/0", "spoof-000/1"], 20.0, scope="intra_node")],
            shipper={"host": "sched-rack-b", "pending": 0, "failed": 4242, "rejected": 0}))
    if r.status_code != 200:
        return False, f"the spoofing batch got {r.status_code}"
    own = stage.scalar("SELECT id FROM api_tokens WHERE name LIKE 'chaos-scoped-%' "
                       "ORDER BY id DESC LIMIT 1")

    def claims() -> list[str]:
        scrape = httpx.get(f"{stage.api_url}/metrics", timeout=60).text
        return re.findall(r'ringwatch_shipper_batches\{[^}]*host="sched-rack-b"[^}]*\}', scrape)

    # A scrape is cached for RINGWATCH_METRICS_CACHE_S (10 s): wait for one after the claim.
    found = wait_until(claims, timeout_s=30, every_s=1.0) or []
    if not found or any(f'token="{own}"' not in c for c in found):
        return False, f"the claim reads {found[:2]}"
    return True, "claimed spool shown under the claiming token only"


def _names(stage: Stage, agent: httpx.Client) -> tuple[bool, str]:
    bad = ["node-000\n", "node-000.", "NODE-000", "n/\u0663"]
    codes = {}
    for name in bad:
        node = name.split("/")[0]
        members = [name, f"{node}/0"] if "/" in name else [f"{node}/0", f"{node}/1"]
        r = agent.post("/v1/measurements", json=_batch(measurements=[
            measurement(members, 20.0, scope="intra_node")]))
        codes[name] = r.status_code
    wrong = {k: v for k, v in codes.items() if v != 422}
    if wrong:
        return False, f"names let in: {wrong}"
    return True, f"{len(bad)} crafted names refused (422)"


def _counter(stage: Stage, agent: httpx.Client) -> tuple[bool, str]:
    r = agent.post("/v1/measurements", json=_batch(
        measurements=[measurement(["ctr-000/0", "ctr-000/1"], 20.0, scope="intra_node")],
        findings=[{"kind": "nic_errors", "node": "ctr-000", "severity": "warning",
                   "source": "sysfs", "counters": [
                       {"device": "efa_0", "port": 1, "counter": "rx_drops",
                        "delta": (1 << 64) - 1, "rate_per_s": 1.0}]}]))
    if r.status_code != 200 or not r.json().get("dropped"):
        return False, f"one impossible counter: {r.status_code} {r.text[:120]}"
    return True, "one impossible counter dropped, the batch stored"


def _findings_flood(stage: Stage, agent: httpx.Client) -> tuple[bool, str]:
    many = [{"kind": "transport_fallback", "node": f"node-{i % 4:03d}", "severity": "warning",
             "source": "nccl_log", "transport": "shm", "expected": "p2p_nvlink",
             "gpus": [i % 64, i % 64 + 1]} for i in range(70_000)]
    too_many = agent.post("/v1/measurements", json=_batch(findings=many), timeout=120)
    started = time.monotonic()
    ok = agent.post("/v1/measurements", json=_batch(findings=many[:4000]), timeout=120)
    seconds = time.monotonic() - started
    if too_many.status_code != 413 or ok.status_code != 200:
        return False, f"70 000 findings: {too_many.status_code}; 4 000: {ok.status_code}"
    return True, f"70 000 findings 413; 4 000 stored in {seconds:.1f} s"


ATTACKS: dict[str, Callable[[Stage, httpx.Client], tuple[bool, str]]] = {
    "slow bodies": _slow_bodies, "label flood": _label_flood, "node flood": _node_flood,
    "shipper spoof": _shipper_spoof, "names": _names, "impossible counter": _counter,
    "findings flood": _findings_flood,
}


def agent_attacks(admin_url: str | None = None) -> Row:
    """Each attack in turn on one live API; an attack held where its check names no
    failure. The row's note lists each attack's outcome."""
    row = Row("one agent's attacks", False)
    stage = Stage("attacks", admin_url)
    try:
        api = stage.start_api()
        with stage.client(stage.token("agent"), timeout=120) as agent:
            agent.post("/v1/measurements", json=fleet_batch(nodes=4)).raise_for_status()
            outcomes: list[str] = []
            held = 0
            for name, attack in ATTACKS.items():
                ok, note = attack(stage, agent)
                held += ok
                outcomes.append(f"{name}: {'' if ok else 'MISSED '}{note}")
        alive = api.poll() is None and httpx.get(f"{stage.api_url}/healthz",
                                                 timeout=10).status_code == 200
        row.survived = alive and held == len(ATTACKS)
        row.note = (f"{held}/{len(ATTACKS)} held" + ("" if alive else "; the API died") + "; "
                    + "; ".join(outcomes))[:1500]
        print(json.dumps({"attacks": outcomes}, indent=1))
        return row
    finally:
        stage.close(keep_logs=not row.met)
