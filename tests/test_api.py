"""The REST API through its real ASGI app, on a real migrated Postgres."""

from __future__ import annotations

import uuid

import pytest
from fastapi.testclient import TestClient

from ringwatch.api.app import create_app
from ringwatch.services.settings import Settings
from ringwatch.services.store import db, tokens
from tests.api_fixtures import api_client, fleet_batch, measurement


def auth(client, role: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {client.tokens[role]}"}


def test_healthz_and_openapi(api) -> None:
    assert api.get("/healthz").json() == {"ok": True}
    paths = api.get("/openapi.json").json()["paths"]
    for path in ("/v1/measurements", "/v1/nodes", "/v1/links", "/v1/series", "/v1/health",
                 "/v1/preflight", "/v1/webhooks"):
        assert path in paths


@pytest.mark.parametrize("headers,status", [
    ({}, 401),
    ({"Authorization": "Bearer nope"}, 401),
    ({"Authorization": "Basic abc"}, 401),
])
def test_measurements_need_a_valid_token(api, headers, status) -> None:
    resp = api.post("/v1/measurements", json=fleet_batch(), headers=headers)
    assert resp.status_code == status
    assert resp.json()["error"] == "unauthorized"
    assert "token" in resp.json()["message"]


def test_reader_may_not_write_and_agent_may_not_admin(api) -> None:
    resp = api.post("/v1/measurements", json=fleet_batch(), headers=auth(api, "reader"))
    assert resp.status_code == 403
    assert "reader" in resp.json()["message"]
    resp = api.post("/v1/webhooks", headers=auth(api, "agent"),
                    json={"url": "http://127.0.0.1:9/x", "secret": "12345678", "events": ["probe.hang"]})
    assert resp.status_code == 403


def test_malformed_json_is_a_422_with_a_reason(api) -> None:
    resp = api.post("/v1/measurements", content=b"{not json", headers={
        **auth(api, "agent"), "Content-Type": "application/json"})
    assert resp.status_code == 422
    assert resp.json()["error"] == "invalid_input"
    assert "JSON" in resp.json()["message"]


@pytest.mark.parametrize("field,value,needle", [
    ("size_bytes", -1, "size_bytes"),
    ("iters", 0, "iters"),
    ("op", "allreduse", "op"),
    ("members", ["node-000"], "NODE/LOCAL_INDEX"),
    ("time", "2026-01-01T00:00:00", "UTC offset"),
    ("redop", "mean", "redop"),
])
def test_bad_measurement_fields_are_rejected_by_name(api, field, value, needle) -> None:
    batch = fleet_batch()
    batch["measurements"][0][field] = value
    resp = api.post("/v1/measurements", json=batch, headers=auth(api, "agent"))
    assert resp.status_code == 422, resp.text
    assert needle in resp.text
    # Nothing of a rejected batch is stored.
    assert api.get("/v1/nodes", headers=auth(api, "reader")).json() == []


def test_retried_batch_is_stored_once(api) -> None:
    batch = fleet_batch(batch_id="batch-" + uuid.uuid4().hex)
    first = api.post("/v1/measurements", json=batch, headers=auth(api, "agent")).json()
    again = api.post("/v1/measurements", json=batch, headers=auth(api, "agent")).json()
    assert first["created"] is True and again["created"] is False
    assert first["stored"] == again["stored"] == len(batch["measurements"])
    series = api.get("/v1/series", params={"members": "node-000/0,node-000/1,node-001/0,node-001/1"},
                     headers=auth(api, "reader")).json()
    assert len(series["points"]) == 1


def test_ingest_registers_nodes_and_serves_links_and_series(api) -> None:
    api.post("/v1/measurements", json=fleet_batch(), headers=auth(api, "agent")).raise_for_status()
    nodes = api.get("/v1/nodes", headers=auth(api, "reader")).json()
    assert [n["name"] for n in nodes] == ["node-000", "node-001", "node-002", "node-003"]
    links = api.get("/v1/links", params={"scope": "inter_node"}, headers=auth(api, "reader")).json()
    assert len(links) == 6 and {x["status"] for x in links} == {"ok"}
    assert api.get("/v1/health", headers=auth(api, "reader")).json()["status"] == "healthy"


def test_redop_round_trips_through_measurements_and_series(api) -> None:
    from ringwatch.agents.spec import Measurement

    members = ["node-000/0", "node-000/1"]
    ms = [{**measurement(members, 20.0, scope="intra_node"), "redop": "max"},
          measurement(members, 20.0, op="reducescatter", scope="intra_node")]
    batch = {"batch_id": uuid.uuid4().hex, "backend": "gloo", "measurements": ms}
    api.post("/v1/measurements", json=batch, headers=auth(api, "agent")).raise_for_status()
    points = api.get("/v1/series", params={"members": ",".join(members)},
                     headers=auth(api, "reader")).json()["points"]
    # Stored as sent; a sender that says nothing gets the default, sum.
    assert sorted((p["op"], p["redop"]) for p in points) == [
        ("allreduce", "max"), ("reducescatter", "sum")]
    # What a probe's Measurement.to_dict sends is what the API takes.
    probe = Measurement(op="allreduce", scope="intra_node", members=members, size_bytes=4096,
                        dtype="float32", warmup=1, iters=2, time_us=10.0, algbw_gbs=0.4,
                        busbw_gbs=0.4, wrong=0, redop="min")
    sent = {"batch_id": uuid.uuid4().hex, "backend": "gloo", "measurements": [probe.to_dict()]}
    api.post("/v1/measurements", json=sent, headers=auth(api, "agent")).raise_for_status()
    points = api.get("/v1/series", params={"members": ",".join(members), "size_bytes": 4096},
                     headers=auth(api, "reader")).json()["points"]
    assert [p["redop"] for p in points] == ["min"]


def test_how_a_measurement_was_timed_is_kept_and_checked(api) -> None:
    members = ["node-000/0", "node-000/1"]
    ms = [{**measurement(members, 20.0, scope="intra_node", size=s), "timing": t}
          for s, t in ((4096, "cuda_graph"), (8192, "host"))]
    ms.append(measurement(members, 20.0, scope="intra_node", size=16384))  # an older sender
    batch = {"batch_id": uuid.uuid4().hex, "backend": "nccl", "measurements": ms}
    api.post("/v1/measurements", json=batch, headers=auth(api, "agent")).raise_for_status()
    points = api.get("/v1/series", params={"members": ",".join(members)},
                     headers=auth(api, "reader")).json()["points"]
    assert sorted((p["size_bytes"], p["timing"]) for p in points) == [
        (4096, "cuda_graph"), (8192, "host"), (16384, None)]
    bad = {**batch, "batch_id": uuid.uuid4().hex,
           "measurements": [{**ms[0], "timing": "stopwatch"}]}
    r = api.post("/v1/measurements", json=bad, headers=auth(api, "agent"))
    assert r.status_code == 422 and "timing" in r.text


def test_a_world_group_of_8192_ranks_is_stored_and_read_back(api) -> None:
    """A 1024 x 8 world group: its member list is too long for a btree key, so the series
    is keyed by a hash; it must be accepted, judged and readable like any other."""
    world = [f"node-{n:04d}/{g}" for n in range(1024) for g in range(8)]
    batch = fleet_batch()
    batch["measurements"].append(measurement(world, 40.0, scope="world", size=1 << 28))
    r = api.post("/v1/measurements", json=batch, headers=auth(api, "agent"))
    assert r.status_code == 200, r.text
    links = api.get("/v1/links", params={"scope": "world"}, headers=auth(api, "reader")).json()
    assert len(links) == 1 and len(links[0]["members"]) == 8192
    key = links[0]["group_key"]
    assert key.startswith("sha256:") and len(key) < 100
    got = api.get("/v1/series", params={"group": key}, headers=auth(api, "reader")).json()
    assert got["members"] == sorted(world)
    assert [p["busbw_gbs"] for p in got["points"]] == [pytest.approx(40.0)]
    # A small group is still addressed by its members, and its key is them.
    pair = api.get("/v1/links", params={"scope": "intra_node"}, headers=auth(api, "reader")).json()
    assert pair[0]["group_key"] == ",".join(pair[0]["members"])
    r = api.get("/v1/series", headers=auth(api, "reader"))
    assert r.status_code == 422 and "members" in r.json()["message"]
    r = api.get("/v1/series", params={"group": "sha256:nope"}, headers=auth(api, "reader"))
    assert r.status_code == 404


def test_a_body_over_the_limit_is_a_413_before_anything_reads_it(clean_db) -> None:
    with api_client(clean_db, settings={"max_body_bytes": 4096}) as small:
        big = fleet_batch(nodes=8)
        r = small.post("/v1/measurements", json=big, headers=auth(small, "agent"))
        assert r.status_code == 413
        assert r.json()["error"] == "too_large" and "4096" in r.json()["message"]
        # Refused before the token is looked at: no token, same answer.
        r = small.post("/v1/measurements", content=b"x" * 10_000)
        assert r.status_code == 413

        def chunks():  # no Content-Length: cut off as the stream passes the limit
            for _ in range(10):
                yield b"y" * 1000

        r = small.post("/v1/measurements", content=chunks(), headers=auth(small, "agent"))
        assert r.status_code == 413
        assert small.post("/v1/measurements", json=fleet_batch(nodes=2),
                          headers=auth(small, "agent")).status_code == 200


def test_unknown_nodes_are_404s(api) -> None:
    api.post("/v1/measurements", json=fleet_batch(), headers=auth(api, "agent")).raise_for_status()
    r = api.get("/v1/links", params={"node": "node-999"}, headers=auth(api, "reader"))
    assert r.status_code == 404 and "node-999" in r.json()["message"]
    r = api.post("/v1/preflight", json={"nodes": ["node-000", "node-999"]}, headers=auth(api, "reader"))
    assert r.status_code == 404 and "node-999" in r.json()["message"]
    r = api.get("/v1/series", params={"members": "bogus"}, headers=auth(api, "reader"))
    assert r.status_code == 422


def test_slow_node_degrades_then_recovers(api) -> None:
    """A slow node shows in its own group and every node pair it is in: one incident,
    localized to the node, and every link it slowed marked degraded for reading."""
    r = api.post("/v1/measurements", json=fleet_batch(slow_node="node-002"), headers=auth(api, "agent"))
    body = r.json()
    assert [(d["kind"], d["node"]) for d in body["degraded"]] == [("nvlink_degraded", "node-002")]
    evidence = body["degraded"][0]["evidence"]
    assert evidence and all("node-002" in e["nodes"] for e in evidence)
    bad = api.get("/v1/links", params={"status": "degraded"}, headers=auth(api, "reader")).json()
    assert bad and all("node-002" in x["nodes"] for x in bad)
    assert api.get("/v1/health", headers=auth(api, "reader")).json()["status"] == "degraded"
    open_ = api.get("/v1/findings", params={"status": "open"}, headers=auth(api, "reader")).json()
    assert [(f["kind"], f["nodes"]) for f in open_] == [("nvlink_degraded", ["node-002"])]

    r = api.post("/v1/measurements", json=fleet_batch(), headers=auth(api, "agent")).json()
    assert [(d["kind"], d["node"]) for d in r["recovered"]] == [("nvlink_degraded", "node-002")]
    assert api.get("/v1/links", params={"status": "degraded"}, headers=auth(api, "reader")).json() == []
    assert api.get("/v1/findings", params={"status": "open"}, headers=auth(api, "reader")).json() == []
    assert api.get("/v1/health", headers=auth(api, "reader")).json()["status"] == "healthy"


def test_preflight_from_fresh_results(api) -> None:
    nodes = ["node-000", "node-001", "node-002", "node-003"]
    api.post("/v1/measurements", json=fleet_batch(slow_node="node-001"), headers=auth(api, "agent"))
    v = api.post("/v1/preflight", json={"nodes": nodes}, headers=auth(api, "reader")).json()
    assert v["healthy"] is False and v["exclude"] == ["node-001"]
    assert v["nodes_checked"] == 4

    api.post("/v1/measurements", json=fleet_batch(), headers=auth(api, "agent"))
    v = api.post("/v1/preflight", json={"nodes": nodes}, headers=auth(api, "reader")).json()
    assert v["healthy"] is True and v["exclude"] == [] and v["findings"] == []


def test_probe_findings_become_open_findings(api) -> None:
    batch = fleet_batch()
    batch["findings"] = [{"kind": "hang", "node": "node-003", "gpu": 1}]
    api.post("/v1/measurements", json=batch, headers=auth(api, "agent")).raise_for_status()
    open_ = api.get("/v1/findings", params={"status": "open"}, headers=auth(api, "reader")).json()
    assert [(f["kind"], f["nodes"]) for f in open_] == [("hang", ["node-003"])]


def test_webhook_validation_and_admin_flow(api) -> None:
    bad = api.post("/v1/webhooks", headers=auth(api, "admin"),
                   json={"url": "not a url", "secret": "12345678", "events": ["probe.hang"]})
    assert bad.status_code == 422 and "url" in bad.json()["message"]
    bad = api.post("/v1/webhooks", headers=auth(api, "admin"),
                   json={"url": "http://127.0.0.1:9/x", "secret": "12345678", "events": ["nope"]})
    assert bad.status_code == 422
    ok = api.post("/v1/webhooks", headers=auth(api, "admin"),
                  json={"url": "http://127.0.0.1:9/x", "secret": "a-secret-for-the-tests", "events": ["probe.hang"]})
    assert ok.status_code == 201 and "secret" not in ok.json()
    assert api.get("/v1/webhooks/999/deliveries", headers=auth(api, "admin")).status_code == 404


def test_metrics_are_prometheus_text(api) -> None:
    api.post("/v1/measurements", json=fleet_batch(slow_node="node-001"), headers=auth(api, "agent"))
    from prometheus_client.parser import text_string_to_metric_families

    samples: dict[str, list] = {}
    for family in text_string_to_metric_families(api.get("/metrics").text):
        for s in family.samples:
            samples.setdefault(s.name, []).append((s.labels, s.value))
    assert ({"status": "degraded"}, 4.0) in samples["ringwatch_links"]  # 3 pairs, 1 node
    assert samples["ringwatch_open_findings"] == [
        ({"kind": "nvlink_degraded", "severity": "critical"}, 1.0)]
    degraded = [labels for labels, v in samples["ringwatch_link_degraded"] if v == 1]
    assert degraded and all("node-001" in (labels["node"], labels["peer_node"])
                            for labels in degraded)
    assert ({"scope": "intra_node", "op": "allreduce", "node": "node-000", "gpu": "0",
             "peer_node": "node-000", "peer_gpu": "1"}, 20e9) in \
        samples["ringwatch_link_busbw_bytes_per_second"]


def test_repeated_hang_is_one_incident_resolved_by_a_clean_probe(api) -> None:
    hang = {"kind": "hang", "node": "node-003", "gpu": 1}
    for _ in range(2):
        batch = fleet_batch()
        batch["measurements"] = [m for m in batch["measurements"] if "node-003/1" not in m["members"]]
        batch["findings"] = [hang]
        r = api.post("/v1/measurements", json=batch, headers=auth(api, "agent")).json()
    assert r["probe_findings"] == []  # the repeat opened nothing new
    open_ = api.get("/v1/findings", params={"status": "open"}, headers=auth(api, "reader")).json()
    assert [f["kind"] for f in open_] == ["hang"]

    r = api.post("/v1/measurements", json=fleet_batch(), headers=auth(api, "agent")).json()
    assert [x["kind"] for x in r["recovered"]] == ["hang"]
    assert api.get("/v1/findings", params={"status": "open"}, headers=auth(api, "reader")).json() == []


def test_one_rank_fault_seen_by_several_groups_is_one_incident(api) -> None:
    """A hung or failing rank is reported by each group it belongs to (its node, a node
    pair, the world): one incident per rank and kind, not one per group."""
    batch = fleet_batch()
    batch["findings"] = [{"kind": kind, "node": "node-002", "gpu": 1, "scope": scope}
                         for kind in ("hang", "probe_error")
                         for scope in ("intra_node", "inter_node", "world")]
    r = api.post("/v1/measurements", json=batch, headers=auth(api, "agent")).json()
    assert sorted(f["kind"] for f in r["probe_findings"]) == ["hang", "probe_error"]
    open_ = api.get("/v1/findings", params={"status": "open"}, headers=auth(api, "reader")).json()
    assert sorted((f["kind"], f["nodes"]) for f in open_) == [
        ("hang", ["node-002"]), ("probe_error", ["node-002"])]


def test_default_hysteresis_keeps_a_flapping_link_quiet(clean_db) -> None:
    """Production settings: 2 bad of the last 3 cycles degrade, 2 good in a row recover."""
    with db.transaction(clean_db) as s:
        agent = tokens.create_token(s, "agent")
    app = create_app(Settings(database_url="unused"), clean_db)
    h = {"Authorization": f"Bearer {agent}"}
    with TestClient(app) as client:
        def cycle(slow: bool) -> dict:
            batch = fleet_batch(slow_node="node-001" if slow else None)
            return client.post("/v1/measurements", json=batch, headers=h).json()

        # bad, good, good, bad, good: never 2 bad within 3, so nothing degrades.
        assert all(not cycle(slow)["degraded"] for slow in (True, False, False, True, False))
        assert cycle(False)["degraded"] == []
        # Two bad in a row: degraded on the second.
        assert cycle(True)["degraded"] == []
        assert cycle(True)["degraded"]
        # One good is not enough to recover; the second is.
        assert cycle(False)["recovered"] == []
        assert cycle(False)["recovered"]


def test_input_postgres_cannot_hold_is_a_422_not_a_500(api) -> None:
    """Found by fuzzing the OpenAPI schema: a NUL byte passes the schema but not Postgres."""
    r = api.post("/v1/webhooks", headers=auth(api, "admin"),
                 json={"url": "http://127.0.0.1:9/x", "secret": "1234\x005678", "events": ["probe.hang"]})
    assert r.status_code == 422 and "NUL" in r.json()["message"]
    r = api.post("/v1/preflight", json={"nodes": ["node\x00-1"]}, headers=auth(api, "reader"))
    assert r.status_code == 422


def test_a_group_without_peers_is_judged_by_its_own_history(api) -> None:
    world = [f"node-00{i}/{g}" for i in range(4) for g in range(2)]

    def cycle(busbw: float) -> dict:
        batch = {"batch_id": str(uuid.uuid4()), "backend": "gloo",
                 "measurements": [measurement(world, busbw, scope="world")]}
        return api.post("/v1/measurements", json=batch, headers=auth(api, "agent")).json()

    for bw in (10.0, 10.3, 9.8, 10.1, 9.9):  # five cycles of history, no peers ever
        cycle(bw)
    links = api.get("/v1/links", params={"scope": "world"}, headers=auth(api, "reader")).json()
    assert links[0]["status"] == "ok" and links[0]["expected_gbs"] is None
    cycle(10.0)
    link = api.get("/v1/links", params={"scope": "world"}, headers=auth(api, "reader")).json()[0]
    assert link["status"] == "ok" and link["expected_gbs"] == pytest.approx(10.0, rel=0.05)
    cycle(4.0)
    link = api.get("/v1/links", params={"scope": "world"}, headers=auth(api, "reader")).json()[0]
    assert link["status"] == "degraded" and link["ratio"] < 0.5


def test_a_noisy_history_gives_no_baseline_not_one_near_zero(api) -> None:
    """A link whose own history swings wildly must say it has no baseline, never carry an
    expectation so low that it can no longer be degraded."""
    world = [f"node-00{i}/{g}" for i in range(4) for g in range(2)]
    for bw in (10.0, 0.2, 25.0, 0.5, 14.0, 0.1, 30.0, 0.3):
        batch = {"batch_id": str(uuid.uuid4()), "backend": "gloo",
                 "measurements": [measurement(world, bw, scope="world")]}
        api.post("/v1/measurements", json=batch, headers=auth(api, "agent")).raise_for_status()
        link = api.get("/v1/links", params={"scope": "world"}, headers=auth(api, "reader")).json()[0]
        assert link["expected_gbs"] is None or link["expected_gbs"] > 1.0, link
