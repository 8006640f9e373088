"""Builders for API tests: tokens, clients and measurement batches shaped like a probe's."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from typing import Any

from ringwatch.agents.collectives import busbw_factor


def measurement(members: list[str], busbw: float, *, op: str = "allreduce", scope: str = "inter_node",
                size: int = 1 << 20, wrong: int = 0, time: datetime | None = None) -> dict[str, Any]:
    """A measurement whose algbw, busbw and time agree with nccl-tests' formulas."""
    n = len(members)
    algbw = busbw / busbw_factor(op, n)
    return {
        "op": op, "scope": scope, "members": members, "size_bytes": size, "dtype": "float32",
        "warmup": 5, "iters": 20, "time_us": size / (algbw * 1e9) * 1e6, "algbw_gbs": algbw,
        "busbw_gbs": busbw, "wrong": wrong, "time": (time or datetime.now(UTC)).isoformat(),
    }


def pair(a: str, b: str) -> list[str]:
    return [f"{a}/0", f"{a}/1", f"{b}/0", f"{b}/1"]


def fleet_batch(slow_node: str | None = None, factor: float = 0.4, nodes: int = 4,
                batch_id: str | None = None, prefix: str = "node") -> dict[str, Any]:
    """Every node pair once (inter_node), each at 10 GB/s unless it touches ``slow_node``."""
    names = [f"{prefix}-{i:03d}" for i in range(nodes)]
    ms = []
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            bw = 10.0 * (factor if slow_node in (a, b) else 1.0)
            ms.append(measurement(pair(a, b), bw))
        ms.append(measurement([f"{a}/0", f"{a}/1"], 20.0 * (factor if a == slow_node else 1.0),
                              scope="intra_node"))
    return {"batch_id": batch_id or str(uuid.uuid4()), "backend": "gloo", "measurements": ms}


# Settings under which one bad cycle degrades a link and one good one recovers it.
REACT_AT_ONCE = {"hysteresis_k_bad": 1, "hysteresis_n_window": 1, "hysteresis_m_good": 1}

# What every test app gets for webhooks: a key to encrypt their secrets with (a Fernet key
# made for the tests) and the loopback network the tests' receivers listen on. A test of
# the URL policy passes its own ``webhook_allowed_networks``.
TEST_SECRET_KEY = "naogk2GfKuRT20e9H-r4rqK3uXY9R2isJDgxyxVaukg="
WEBHOOK_TEST_SETTINGS: dict[str, Any] = {"secret_key": TEST_SECRET_KEY,
                                         "webhook_allowed_networks": ["127.0.0.0/8"]}


def api_client(factory, settings: dict[str, Any] | None = None):
    """A TestClient of the real app on ``factory``'s database, with a token per role
    in ``client.h[role]`` (ready-made Authorization headers)."""
    from fastapi.testclient import TestClient

    from ringwatch.api.app import create_app
    from ringwatch.services.settings import Settings
    from ringwatch.services.store import db, tokens

    with db.transaction(factory) as s:
        toks = {role: tokens.create_token(s, role) for role in ("agent", "reader", "admin")}
    app = create_app(Settings(database_url="unused", api_url="http://rw.test",
                              **{**WEBHOOK_TEST_SETTINGS,
                                 **(REACT_AT_ONCE if settings is None else settings)}), factory)
    client = TestClient(app)
    client.tokens = toks  # type: ignore[attr-defined]
    client.h = {r: {"Authorization": f"Bearer {t}"} for r, t in toks.items()}  # type: ignore[attr-defined]
    return client


# The secret test receivers verify webhook signatures with.
WEBHOOK_SECRET = "s3cret-for-tests"
WEBHOOK_EVENTS = ("health.degraded", "health.recovered", "probe.hang")


def register_webhook(api, url: str, secret: str = WEBHOOK_SECRET,
                     events: tuple[str, ...] | list[str] = WEBHOOK_EVENTS, **extra: Any) -> int:
    """Register a webhook through the API as its admin; its id."""
    resp = api.post("/v1/webhooks", headers=api.h["admin"],
                    json={"url": url, "secret": secret, "events": list(events), **extra})
    assert resp.status_code == 201, resp.text
    return resp.json()["id"]


def decode_pairs(body: dict[str, Any]) -> dict[tuple[int, int], tuple[float | None, bool]]:
    """GET /v1/fleet/pairs read back: each probed pair (i < j) with its ratio and whether it
    is degraded, from the byte-per-pair encoding its docstring gives."""
    import base64

    cells, n = base64.b64decode(body["cells"]), len(body["nodes"])
    assert len(cells) == n * (n - 1) // 2
    out: dict[tuple[int, int], tuple[float | None, bool]] = {}
    k = 0
    for i in range(n):
        for j in range(i + 1, n):
            b = cells[k]
            k += 1
            if b:
                q = b & 0x7F
                out[(i, j)] = (None if q == 127 else (q - 1) / 100, bool(b & 0x80))
    return out
