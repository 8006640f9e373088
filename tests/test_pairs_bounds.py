"""GET /v1/fleet/pairs stays bounded: the whole node-pair map up to
RINGWATCH_MAX_PAIR_MAP_NODES nodes, tiles of it at any fleet size, and a 422 naming the
setting for the whole map of a larger fleet. Through the real app on a real Postgres."""

from __future__ import annotations

import base64

import pytest
from sqlalchemy import text

from ringwatch.services.store import db
from ringwatch.services.store import health as health_store
from tests.api_fixtures import REACT_AT_ONCE, api_client, decode_pairs, fleet_batch, measurement

NODES = [f"node-{i:03d}" for i in range(8)]


def store_fleet(api, nodes: int = 8) -> None:
    """Every node pair probed with AllReduce, node-002's slow; AllToAll on some pairs only
    (a pair's byte is its worst op); the pair (node-003, node-005) never probed."""
    batch = fleet_batch(slow_node="node-002", nodes=nodes)
    batch["measurements"] = [m for m in batch["measurements"]
                             if not {"node-003/0", "node-005/0"} <= set(m["members"])]
    batch["measurements"] += [
        measurement([f"{a}/0", f"{a}/1", f"{b}/0", f"{b}/1"], 10.0, op="alltoall")
        for a, b in (("node-000", "node-001"), ("node-001", "node-004"))]
    api.post("/v1/measurements", json=batch, headers=api.h["agent"]).raise_for_status()


def stored_pairs(factory, names: list[str]) -> dict[tuple[int, int], tuple[float | None, bool]]:
    """What the map must show, from the link rows themselves: per node pair (i < j), its
    worst ratio (capped at 1.25, in hundredths) and whether any of its rows is degraded."""
    out: dict[tuple[int, int], tuple[float | None, bool]] = {}
    with db.transaction(factory) as s:
        rows = s.execute(text("SELECT nodes, ratio, status FROM link_health "
                              "WHERE scope = 'inter_node' AND cardinality(nodes) = 2")).all()
    for nodes, ratio, status in rows:
        i, j = sorted(names.index(n) for n in nodes)
        worst, bad = out.get((i, j), (None, False))
        if ratio is not None:
            worst = ratio if worst is None else min(worst, ratio)
        out[(i, j)] = (worst, bad or status != "ok")
    return {k: (None if r is None else round(min(r, 1.25), 2), bad) for k, (r, bad) in out.items()}


def tile(api, **window: int) -> dict:
    query = "&".join(f"{k}={v}" for k, v in window.items())
    resp = api.get(f"/v1/fleet/pairs?{query}", headers=api.h["reader"])
    assert resp.status_code == 200, resp.text
    return resp.json()


def tile_cells(body: dict) -> dict[tuple[int, int], int]:
    """A tile read back: its cells by (row, column) index into the fleet."""
    raw = base64.b64decode(body["cells"])
    rows, cols = len(body["rows"]), len(body["cols"])
    assert len(raw) == rows * cols
    return {(body["row_from"] + r, body["col_from"] + c): raw[r * cols + c]
            for r in range(rows) for c in range(cols)}


@pytest.fixture
def small_limit(clean_db):
    """A client of the same app and database with the whole map limited to 4 nodes."""
    with api_client(clean_db, {**REACT_AT_ONCE, "max_pair_map_nodes": 4}) as client:
        yield client


def test_a_fleet_at_the_limit_gets_the_whole_map_as_stored_and_as_one_tile(clean_db) -> None:
    with api_client(clean_db, {**REACT_AT_ONCE, "max_pair_map_nodes": 8}) as api:
        store_fleet(api)
        body = api.get("/v1/fleet/pairs", headers=api.h["reader"]).json()
        assert body["nodes"] == NODES
        pairs = decode_pairs(body)
        assert pairs == stored_pairs(clean_db, NODES)
        assert len(pairs) == 27 and (3, 5) not in pairs
        assert {bad for _, bad in pairs.values()} == {True, False}
        # The same map as one tile of the whole square: both sides of the diagonal.
        square = tile(api, row_from=0, row_to=8, col_from=0, col_to=8)
        assert square["node_count"] == 8 and square["rows"] == square["cols"] == NODES
        cells = tile_cells(square)
        triangle = base64.b64decode(body["cells"])
        k = 0
        for i in range(8):
            assert cells[(i, i)] == 0
            for j in range(i + 1, 8):
                assert cells[(i, j)] == cells[(j, i)] == triangle[k]
                k += 1


def test_over_the_limit_the_whole_map_is_refused_naming_the_setting(api, small_limit) -> None:
    store_fleet(api)
    resp = small_limit.get("/v1/fleet/pairs", headers=small_limit.h["reader"])
    assert resp.status_code == 422
    body = resp.json()
    assert body["error"] == "invalid_input"
    assert "RINGWATCH_MAX_PAIR_MAP_NODES (4)" in body["message"]
    assert "8 nodes" in body["message"]
    assert "?row_from=0&row_to=4&col_from=0&col_to=4" in body["message"]


def test_tiles_under_the_limit_rebuild_the_whole_map_exactly(api, small_limit) -> None:
    store_fleet(api)
    whole = api.get("/v1/fleet/pairs", headers=api.h["reader"]).json()  # default limit
    triangle = base64.b64decode(whole["cells"])
    cells: dict[tuple[int, int], int] = {}
    for r in (0, 4):
        for c in (0, 4):
            body = tile(small_limit, row_from=r, row_to=r + 4, col_from=c, col_to=c + 4)
            assert body["rows"] == NODES[r:r + 4] and body["cols"] == NODES[c:c + 4]
            assert body["node_count"] == 8
            cells.update(tile_cells(body))
    assert len(cells) == 64
    k = 0
    for i in range(8):
        assert cells[(i, i)] == 0
        for j in range(i + 1, 8):
            assert cells[(i, j)] == cells[(j, i)] == triangle[k], (i, j)
            k += 1
    assert cells[(3, 5)] == 0 and cells[(0, 2)] & 0x80


def test_a_tile_is_bounded_by_the_setting_and_clamped_to_the_fleet(api, small_limit) -> None:
    store_fleet(api)
    h = small_limit.h["reader"]
    wide = small_limit.get("/v1/fleet/pairs?row_from=0&row_to=2&col_from=0&col_to=5", headers=h)
    assert wide.status_code == 422
    assert "RINGWATCH_MAX_PAIR_MAP_NODES (4)" in wide.json()["message"]
    assert "2 x 5" in wide.json()["message"]
    # A side left open runs to the fleet's edge: 8 columns, more than 4.
    assert small_limit.get("/v1/fleet/pairs?row_from=6", headers=h).status_code == 422
    backwards = small_limit.get("/v1/fleet/pairs?row_from=3&row_to=1", headers=h)
    assert backwards.status_code == 422 and "row_from" in backwards.json()["message"]
    # The last tile of a fleet that is not a multiple of the tile: only what is there.
    edge = tile(small_limit, row_from=6, row_to=10, col_from=4, col_to=8)
    assert edge["rows"] == NODES[6:8] and edge["cols"] == NODES[4:8]
    assert len(base64.b64decode(edge["cells"])) == 2 * 4
    assert tile(small_limit, row_from=9, row_to=12, col_from=0, col_to=4)["rows"] == []


def test_a_tile_reads_only_its_own_pairs_from_the_store(api, clean_db) -> None:
    store_fleet(api)
    with db.transaction(clean_db) as s:
        rows = list(health_store.node_pairs_between(s, ("node-000", "node-001"),
                                                    ("node-006", "node-007")))
    pairs = {(r.a, b) for r in rows for b in r.bs}
    assert pairs == {(a, b) for a in ("node-000", "node-001") for b in ("node-006", "node-007")}
    degraded = {(r.a, b): bad for r in rows for b, bad in zip(r.bs, r.degraded, strict=True)}
    assert not any(degraded.values())
