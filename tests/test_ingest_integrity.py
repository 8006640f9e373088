"""What an agent sends is typed and bounded, stays inside its token's scope, and cannot
break a read: the launch gate holds against any token holder (docs/security.md)."""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import create_engine, text

from ringwatch.services.store import db, tokens
from tests.api_fixtures import api_client, fleet_batch, measurement, pair

# Names that render as "node-000" but are not: zero-width space, Cyrillic o, a
# right-to-left override, a byte-order mark.
LOOK_ALIKES = ["node-\u200b000", "n\u043ede-000", "node-000\u202e", "\ufeffnode-000"]


def _batch(**extra) -> dict:
    base = {"batch_id": uuid.uuid4().hex, "backend": "gloo",
            "measurements": [measurement(pair("node-000", "node-001"), 10.0)]}
    return {**base, **extra}


@pytest.fixture
def api(clean_db):
    with api_client(clean_db) as client:
        yield client


def _scoped(factory, nodes: list[str]) -> dict[str, str]:
    with db.transaction(factory) as s:
        _, plain = tokens.issue(s, "agent", nodes=nodes)
    return {"Authorization": f"Bearer {plain}"}


# -- the scope check reads every node a batch names -------------------------------------


@pytest.mark.parametrize("finding", [
    {"kind": "hang", "nodes": ["node-010"]},
    {"kind": "net_path_degraded", "node": "node-000", "nodes": ["node-000", "node-010"]},
])
def test_a_scoped_token_cannot_name_another_node_in_a_finding(api, clean_db, finding) -> None:
    scoped = _scoped(clean_db, ["node-000", "node-001"])
    r = api.post("/v1/measurements", headers=scoped, json=_batch(findings=[finding]))
    assert r.status_code == 403 and "node-010" in r.json()["message"]
    # Nothing opened on node-010, and no node of that name exists.
    assert api.get("/v1/nodes/node-010", headers=api.h["reader"]).status_code == 404
    assert api.get("/v1/health", headers=api.h["reader"]).json()["open_findings"] == 0


def test_a_scoped_token_cannot_set_another_nodes_duty_cycle(api, clean_db) -> None:
    scoped = _scoped(clean_db, ["node-000", "node-001"])
    r = api.post("/v1/measurements", headers=scoped, json=_batch(duty_cycle={"node-010": 0.5}))
    assert r.status_code == 403


# -- one strict schema ------------------------------------------------------------------


@pytest.mark.parametrize("field, finding", [
    ("gpus", {"kind": "nvlink_degraded", "node": "node-000", "gpus": "abc"}),
    ("measured_gbs", {"kind": "nic_degraded", "node": "node-000", "measured_gbs": "fast"}),
    ("detail", {"kind": "hang", "node": "node-000", "detail": "a string"}),
    ("detail", {"kind": "hang", "node": "node-000", "detail": [1, 2]}),
    ("gpu", {"kind": "hang", "node": "node-000", "gpu": {"a": 1}}),
    ("nodes", {"kind": "net_path_degraded", "nodes": [{"a": 1}, "node-001"]}),
    ("severity", {"kind": "hang", "node": "node-000", "severity": ["x"]}),
])
def test_a_mistyped_finding_is_a_422_naming_the_field(api, field, finding) -> None:
    r = api.post("/v1/measurements", headers=api.h["agent"], json=_batch(findings=[finding]))
    assert r.status_code == 422, r.text
    assert field in r.json()["message"]


@pytest.mark.parametrize("field, value", [("iters", 2**63), ("wrong", 2**70),
                                          ("warmup", 2**64)])
def test_integers_past_int64_are_a_422_not_a_500(api, field, value) -> None:
    batch = _batch()
    batch["measurements"][0][field] = value
    r = api.post("/v1/measurements", headers=api.h["agent"], json=batch)
    assert r.status_code == 422 and field in r.json()["message"]


@pytest.mark.parametrize("literal", ["Infinity", "NaN", "-Infinity"])
def test_a_non_finite_bandwidth_is_refused(api, literal) -> None:
    raw = json.dumps(_batch()).replace('"busbw_gbs": 10.0', f'"busbw_gbs": {literal}')
    assert literal in raw
    r = api.post("/v1/measurements", headers={**api.h["agent"], "Content-Type":
                                              "application/json"}, content=raw)
    assert r.status_code == 422, r.text


def test_telemetry_nested_deeper_than_the_bound_is_refused_and_reads_stay_whole(api) -> None:
    deep: dict = {}
    for _ in range(900):
        deep = {"x": deep}
    rank = {"node": "node-000", "local_index": 0, "telemetry": deep}
    r = api.post("/v1/measurements", headers=api.h["agent"], json=_batch(ranks=[rank]))
    assert r.status_code == 422
    ok = api.post("/v1/measurements", headers=api.h["agent"],
                  json=_batch(ranks=[{**rank, "telemetry": {"nvlink": {"0": "active"}}}]))
    assert ok.status_code == 200, ok.text
    assert api.get("/v1/nodes/node-000", headers=api.h["reader"]).status_code == 200


def test_finding_extras_are_bounded_json_under_identifier_names(api) -> None:
    good = {"kind": "probe_error", "node": "node-000", "gpu": 1, "message": "NCCL error",
            "evidence": [{"op": "allreduce", "ratio": 0.4}]}
    r = api.post("/v1/measurements", headers=api.h["agent"], json=_batch(findings=[good]))
    assert r.status_code == 200, r.text
    for bad in ({**good, "bad key!": 1}, {**good, "evidence": "x" * 10_000}):
        r = api.post("/v1/measurements", headers=api.h["agent"], json=_batch(findings=[bad]))
        assert r.status_code == 422, r.text


@pytest.mark.parametrize("name", LOOK_ALIKES)
def test_invisible_and_look_alike_node_names_are_refused(api, name) -> None:
    r = api.post("/v1/measurements", headers=api.h["agent"], json={
        "batch_id": uuid.uuid4().hex, "backend": "gloo",
        "measurements": [measurement([f"{name}/0", f"{name}/1"], 10.0, scope="intra_node")]})
    assert r.status_code == 422
    assert "members" in r.json()["message"]
    r = api.post("/v1/preflight", headers=api.h["reader"], json={"nodes": [name]})
    assert r.status_code == 422 and "hostname-like" in r.json()["message"]


# -- reads survive a record stored before the checks ------------------------------------


def test_a_mistyped_stored_finding_leaves_preflight_and_findings_readable(api, clean_db) -> None:
    assert api.post("/v1/measurements", headers=api.h["agent"],
                    json=fleet_batch(nodes=2)).status_code == 200
    with db.transaction(clean_db) as s:
        s.execute(text(
            "INSERT INTO findings (kind, status, severity, nodes, detail) VALUES "
            "('nvlink_degraded', 'open', 'critical', '{node-000}', "
            "'{\"kind\": \"nvlink_degraded\", \"node\": \"node-000\", \"gpus\": \"abc\", "
            "\"measured_gbs\": \"fast\"}')"))
    r = api.post("/v1/preflight", headers=api.h["reader"],
                 json={"nodes": ["node-000", "node-001"]})
    assert r.status_code == 200, r.text
    found = r.json()["findings"][0]
    assert found["node"] == "node-000" and "gpus" not in found
    assert found["invalid"]["gpus"] == "'abc'"
    assert r.json()["exclude"] == ["node-000"]
    assert api.get("/v1/findings", headers=api.h["reader"]).status_code == 200


def test_the_migration_trims_json_stored_too_deep(admin_url: str) -> None:
    name = f"rw_mig_{uuid.uuid4().hex[:10]}"
    url = db.create_database(admin_url, name)
    try:
        db.upgrade(url, "0012")
        engine = create_engine(url)
        deep = "{}"
        for _ in range(900):
            deep = '{"x": ' + deep + "}"
        with engine.begin() as conn:
            conn.execute(text("INSERT INTO nodes (name, last_seen_at) VALUES ('n1', now())"))
            conn.execute(text("INSERT INTO gpus (node_id, local_index, telemetry) SELECT id, 0, "
                              "CAST(:t AS jsonb) FROM nodes"), {"t": deep})
        db.upgrade(url)
        with engine.begin() as conn:
            kept = json.loads(conn.execute(text("SELECT telemetry::text FROM gpus")).scalar())
        engine.dispose()
        depth = 0
        while isinstance(kept, dict):
            kept, depth = kept["x"], depth + 1
        assert depth == 8 and kept == "(removed: nested too deep)"
    finally:
        db.drop_database(admin_url, name)


# -- bounded by settings ------------------------------------------------------------------


def test_nodes_created_per_batch_and_per_fleet_are_capped(clean_db) -> None:
    with api_client(clean_db, settings={"max_new_nodes_per_batch": 3, "max_nodes": 5}) as api:
        r = api.post("/v1/measurements", headers=api.h["agent"], json=fleet_batch(nodes=4))
        assert r.status_code == 413 and "RINGWATCH_MAX_NEW_NODES_PER_BATCH" in r.json()["message"]
        assert api.post("/v1/measurements", headers=api.h["agent"],
                        json=fleet_batch(nodes=3)).status_code == 200
        r = api.post("/v1/measurements", headers=api.h["agent"],
                     json=fleet_batch(nodes=3, prefix="rack"))
        assert r.status_code == 422 and "RINGWATCH_MAX_NODES" in r.json()["message"]
        # Known nodes are not new: the same fleet reports on.
        assert api.post("/v1/measurements", headers=api.h["agent"],
                        json=fleet_batch(nodes=3)).status_code == 200
        assert api.get("/v1/health", headers=api.h["reader"]).json()["nodes"] == 3


def test_a_batch_is_read_only_once_it_holds_an_ingest_slot(clean_db) -> None:
    with api_client(clean_db, settings={"max_concurrent_ingests": 1, "ingest_wait_s": 0}) as api:
        slots = api.app.state.ingest_slots
        api.portal.call(slots.acquire)

        async def release() -> None:
            slots.release()

        try:
            # Not JSON at all: parsed first, this would be a 422; held back, it is a 503.
            r = api.post("/v1/measurements", headers={**api.h["agent"],
                                                      "Content-Type": "application/json"},
                         content=b"{not json")
        finally:
            api.portal.call(release)
        assert r.status_code == 503 and r.json()["error"] == "busy"
        r = api.post("/v1/measurements", headers={**api.h["agent"],
                                                  "Content-Type": "application/json"},
                     content=b"{not json")
        assert r.status_code == 422


# -- freshness per node -----------------------------------------------------------------


def test_each_node_is_as_fresh_as_its_own_newest_measurement(api) -> None:
    now = datetime.now(UTC)
    batch = {"batch_id": uuid.uuid4().hex, "backend": "gloo", "measurements": [
        measurement(["node-a/0", "node-a/1"], 20.0, scope="intra_node", time=now),
        measurement(["node-b/0", "node-b/1"], 20.0, scope="intra_node",
                    time=now - timedelta(hours=2))]}
    assert api.post("/v1/measurements", headers=api.h["agent"], json=batch).status_code == 200
    r = api.post("/v1/preflight", headers=api.h["reader"],
                 json={"nodes": ["node-b"], "max_age_s": 60})
    assert r.status_code == 202 and r.json()["status"] == "pending"
    r = api.post("/v1/preflight", headers=api.h["reader"],
                 json={"nodes": ["node-a"], "max_age_s": 60})
    assert r.status_code == 200 and r.json()["unprobed"] == []
    b = api.get("/v1/nodes/node-b", headers=api.h["reader"]).json()
    assert datetime.fromisoformat(b["last_probed_at"]) < now - timedelta(minutes=119)


# -- batch ids ----------------------------------------------------------------------------


def test_a_reused_batch_id_with_other_content_is_a_409(api) -> None:
    batch = fleet_batch(nodes=2)
    first = api.post("/v1/measurements", headers=api.h["agent"], json=batch)
    assert first.status_code == 200 and first.json()["created"]
    again = api.post("/v1/measurements", headers=api.h["agent"],
                     json={**batch, "shipper": {"host": "h", "pending": 3}})
    assert again.status_code == 200 and not again.json()["created"]
    other = fleet_batch(nodes=2, slow_node="node-001", batch_id=batch["batch_id"])
    r = api.post("/v1/measurements", headers=api.h["agent"], json=other)
    assert r.status_code == 409 and "other content" in r.json()["message"]


def test_a_batch_id_is_not_claimed_across_tokens(api, clean_db) -> None:
    batch = fleet_batch(nodes=2)
    mine = _scoped(clean_db, ["node-000", "node-001"])
    assert api.post("/v1/measurements", headers=mine, json=batch).status_code == 200
    r = api.post("/v1/measurements", headers=api.h["agent"], json=batch)
    assert r.status_code == 409 and "another token" in r.json()["message"]
    assert "run_id" not in r.json()


def test_a_node_whose_probe_hung_was_probed_and_is_excluded_at_once(api) -> None:
    batch = fleet_batch(nodes=2)
    batch["findings"] = [{"kind": "hang", "node": "node-002", "gpu": 1}]
    assert api.post("/v1/measurements", headers=api.h["agent"], json=batch).status_code == 200
    r = api.post("/v1/preflight", headers=api.h["reader"],
                 json={"nodes": ["node-000", "node-002"], "max_age_s": 60})
    assert r.status_code == 200, r.text
    assert r.json()["unprobed"] == [] and r.json()["exclude"] == ["node-002"]


def test_a_request_made_while_the_waiting_places_filled_is_answered_as_it_stands() -> None:
    import asyncio

    from ringwatch.services.preflight.waiting import PreflightWaiters

    waiters = PreflightWaiters(factory=None, capacity=1)  # type: ignore[arg-type]
    waiters._waiting = 1  # another caller took the last place while this one was written
    body = {"id": "r1", "status": "pending"}
    # Answered at once with its id (202), not refused: the request exists already.
    assert asyncio.run(waiters.wait(body, 30.0)) is body


def _golden_batch() -> dict:
    from datetime import UTC, datetime

    b = fleet_batch(slow_node="node-002", batch_id="golden")
    t = datetime(2026, 11, 1, tzinfo=UTC).isoformat()
    for m in b["measurements"]:
        m["time"] = t
    b["counters"] = [{"node": "node-001", "local_index": 0, "before": [{"link": 0, "crc": 1}],
                      "after": [{"link": 0, "crc": 9}], "xid": [], "findings": ["nvlink_degraded"]}]
    b["skipped"] = {"node-003": "other work"}
    return b


# The digest this batch had under the schema before `occupancy`, `facts`, a measurement's
# `contended` and a counter snapshot's `fabric` existed (recorded from that release).
DIGEST_BEFORE_LATER_FIELDS = "ea75259327348668ea4780cdfba5bf93765fb5b789e7dd221e23430123538092"


def test_a_batch_spooled_before_the_later_fields_is_still_its_own_retry() -> None:
    from ringwatch.api.schemas import MeasurementBatch

    assert MeasurementBatch.model_validate(_golden_batch()).content_digest() == \
        DIGEST_BEFORE_LATER_FIELDS
    # Each later field, once set, is content: the same id with it is another batch.
    for change in (lambda b: b.update(facts=["node-001"]),
                   lambda b: b["measurements"][0].update(contended="other traffic: x"),
                   lambda b: b["counters"][0].update(fabric={"state": 3}),
                   lambda b: b.update(occupancy={"source": "none"})):
        b = _golden_batch()
        change(b)
        assert MeasurementBatch.model_validate(b).content_digest() != DIGEST_BEFORE_LATER_FIELDS
