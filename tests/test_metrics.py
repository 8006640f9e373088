"""/metrics through the real app on a real Postgres: what Prometheus' and OpenMetrics'
parsers read back, checked against the rows the database holds and against what a
preflight answers; and the API process's own request and process families."""

from __future__ import annotations

import uuid
import zlib
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from prometheus_client.openmetrics.parser import (
    text_string_to_metric_families as openmetrics_families,
)
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import text

from ringwatch.services.store import db, timeseries
from ringwatch.services.store import health as health_store
from ringwatch.services.store import webhooks as webhook_store
from ringwatch.services.store.timeseries import Retention
from tests.api_fixtures import REACT_AT_ONCE, api_client, fleet_batch, measurement

# Node names are hostname-like (docs/formats.md), so the quoting is carried by the host;
# the node has the oddest name the alphabet allows.
ODD_NODE = "Rack.7_node-A"

ODD_HOST = 'sched "a"\\b\nsecond line'
OPENMETRICS = "application/openmetrics-text; version=1.0.0"

Samples = dict[str, list[tuple[dict[str, str], float]]]


def parse(body: str, openmetrics: bool = False) -> Samples:
    families = openmetrics_families(body) if openmetrics else text_string_to_metric_families(body)
    out: Samples = {}
    for family in families:
        out.setdefault(family.name, [])
        for s in family.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def scrape(api, openmetrics: bool = False, **headers: str) -> Samples:
    if openmetrics:
        headers["Accept"] = OPENMETRICS
    resp = api.get("/metrics", headers=headers)
    assert resp.status_code == 200, resp.text
    kind = "application/openmetrics-text" if openmetrics else "text/plain"
    assert resp.headers["content-type"].startswith(kind)
    return parse(resp.text, openmetrics)


def fleet(samples: Samples) -> Samples:
    """The fleet's families alone: those read from the database, the same at every scrape
    of one collection (not the process's own requests, CPU and memory)."""
    return {k: v for k, v in samples.items()
            if k.startswith("ringwatch_") and not k.startswith("ringwatch_http_")}


def value(samples: Samples, name: str, **labels: str) -> float:
    found = [v for got, v in samples[name] if got == labels]
    assert len(found) == 1, (name, labels, samples.get(name))
    return found[0]


def odd_batch() -> dict[str, Any]:
    members = [f"{ODD_NODE}/0", f"{ODD_NODE}/1"]
    return {"batch_id": uuid.uuid4().hex, "backend": "gloo",
            "measurements": [measurement(members, 20.0, scope="intra_node")],
            "duty_cycle": {ODD_NODE: 0.25},
            "shipper": {"host": ODD_HOST, "pending": 2, "failed": 1, "rejected": 0}}


@pytest.fixture
def api(clean_db):
    with api_client(clean_db, {**REACT_AT_ONCE, "metrics_cache_s": 0}) as client:
        yield client


@pytest.mark.parametrize("openmetrics", [False, True], ids=["prometheus", "openmetrics"])
def test_quotes_backslashes_and_newlines_in_labels_parse(api, openmetrics) -> None:
    api.post("/v1/measurements", json=odd_batch(), headers=api.h["agent"]).raise_for_status()
    api.post("/v1/measurements", json=fleet_batch(), headers=api.h["agent"]).raise_for_status()
    samples = scrape(api, openmetrics)
    assert value(samples, "ringwatch_node_duty_cycle", node=ODD_NODE) == 0.25
    assert [v for got, v in samples["ringwatch_shipper_batches"]  # per token and host
            if (got["host"], got["state"]) == (ODD_HOST, "failed")] == [1]
    assert value(samples, "ringwatch_link_busbw_bytes_per_second", scope="intra_node",
                 op="allreduce", node=ODD_NODE, gpu="0", peer_node=ODD_NODE,
                 peer_gpu="1") == 20e9
    assert value(samples, "ringwatch_node_healthy", node=ODD_NODE) == 1
    # Each family carries its own samples (none left empty by interleaving).
    for name in ("ringwatch_link_busbw_bytes_per_second", "ringwatch_link_degraded",
                 "ringwatch_link_ratio", "ringwatch_node_duty_cycle",
                 "ringwatch_shipper_batches", "ringwatch_links", "ringwatch_node_healthy",
                 "ringwatch_http_requests_total", "process_cpu_seconds_total"):
        assert samples[name], name
    assert (len(samples["ringwatch_link_busbw_bytes_per_second"])
            == len(samples["ringwatch_link_degraded"]))


def test_values_match_the_database(api, clean_db) -> None:
    admin = api.h["admin"]
    hook = {"url": "http://127.0.0.1:9/hook", "secret": "a-secret-for-the-tests",
            "events": ["health.degraded"]}
    api.post("/v1/webhooks", json=hook, headers=admin).raise_for_status()
    api.post("/v1/measurements", json=fleet_batch(slow_node="node-002"),
             headers=api.h["agent"]).raise_for_status()
    with db.transaction(clean_db) as s:
        assert webhook_store.dispatch_outbox(s) > 0  # the events fan out into deliveries
    # One preflight answered from fresh results, one left waiting for a scheduler.
    nodes = ["node-000", "node-001"]
    assert api.post("/v1/preflight", json={"nodes": nodes},
                    headers=api.h["reader"]).status_code == 200
    old = fleet_batch(nodes=2, prefix="old")
    for m in old["measurements"]:
        m["time"] = (datetime.now(UTC) - timedelta(hours=2)).isoformat()
    api.post("/v1/measurements", json=old, headers=api.h["agent"]).raise_for_status()
    assert api.post("/v1/preflight", json={"nodes": ["old-000", "old-001"], "max_age_s": 60},
                    headers=api.h["reader"]).status_code == 202

    samples = scrape(api)
    with db.transaction(clean_db) as s:
        counts: dict[str, int] = dict(s.execute(text(
            "SELECT status, count(*) FROM link_health GROUP BY status")).all())
        # The per-link families: links read within the last hour (the default window), and
        # those not ok however old; the stale batch's links are ok and two hours old.
        links = s.execute(text("SELECT scope, op, nodes, status, busbw_gbs, ratio "
                               "FROM link_health WHERE updated_at > now() - interval '1 hour' "
                               "OR status <> 'ok'")).all()
        kinds = {(k, sev): n for k, sev, n in s.execute(text(
            "SELECT kind, severity, count(*) FROM findings WHERE status = 'open' "
            "GROUP BY kind, severity")).all()}
        per_node = {(node, k, sev): n for node, k, sev, n in s.execute(text(
            "SELECT node, kind, severity, count(*) FROM findings, unnest(nodes) AS node "
            "WHERE status = 'open' GROUP BY node, kind, severity")).all()}
        nodes_held = s.execute(text("SELECT count(*) FROM nodes")).scalar()
        pending = s.execute(text("SELECT count(*) FROM webhook_deliveries "
                                 "WHERE status = 'pending'")).scalar()
        preflights: dict[str, int] = dict(s.execute(text(
            "SELECT status, count(*) FROM preflight_requests GROUP BY status")).all())
        last = s.execute(text("SELECT max(received_at) FROM probe_runs")).scalar_one()

    # fleet_batch's links: node pairs (inter_node) and each node's two GPUs (intra_node).
    assert len(samples["ringwatch_link_busbw_bytes_per_second"]) == len(links) > 0
    assert any(r.ratio is not None for r in links)
    for r in links:
        labels = {"scope": r.scope, "op": r.op, "node": r.nodes[0], "peer_node": r.nodes[-1]}
        if r.scope == "intra_node":
            labels.update(gpu="0", peer_gpu="1")
        assert value(samples, "ringwatch_link_busbw_bytes_per_second",
                     **labels) == pytest.approx(r.busbw_gbs * 1e9)
        assert value(samples, "ringwatch_link_degraded", **labels) == (r.status == "degraded")
        if r.ratio is not None:
            assert value(samples, "ringwatch_link_ratio", **labels) == pytest.approx(r.ratio)
    assert sum(counts.values()) > len(links) and counts["degraded"] > 0
    assert value(samples, "ringwatch_links", status="degraded") == counts["degraded"]
    assert value(samples, "ringwatch_links", status="ok") == counts["ok"]
    assert kinds and len(samples["ringwatch_open_findings"]) == len(kinds)
    for (kind, severity), n in kinds.items():
        assert value(samples, "ringwatch_open_findings", kind=kind, severity=severity) == n
    assert per_node and len(samples["ringwatch_node_open_findings"]) == len(per_node)
    for (node, kind, severity), n in per_node.items():
        assert value(samples, "ringwatch_node_open_findings", node=node, kind=kind,
                     severity=severity) == n
    assert value(samples, "ringwatch_nodes") == nodes_held == 6
    assert pending and value(samples, "ringwatch_webhook_deliveries_pending") == pending
    assert value(samples, "ringwatch_webhook_oldest_pending_age_seconds") >= 0
    assert value(samples, "ringwatch_webhook_deliveries_failed") == 0
    assert preflights == {"done": 1, "pending": 1}
    for status in ("done", "pending", "running", "failed"):
        assert value(samples, "ringwatch_preflight_requests",
                     status=status) == preflights.get(status, 0)
    assert value(samples, "ringwatch_last_ingest_timestamp_seconds") == pytest.approx(
        last.timestamp())
    assert value(samples, "ringwatch_ingest_lag_seconds") >= 0


def test_per_link_series_cover_recent_links_and_every_degraded_one(clean_db) -> None:
    two_hours_ago = (datetime.now(UTC) - timedelta(hours=2)).isoformat()
    old = fleet_batch(slow_node="old-001", nodes=3, prefix="old")
    for m in old["measurements"]:
        m["time"] = two_hours_ago
    key = "{scope}|{op}|{node}|{peer_node}"
    seen = {}
    for window in (3600, 0):
        with api_client(clean_db, {**REACT_AT_ONCE, "metrics_link_max_age_s": window}) as api:
            if window:
                api.post("/v1/measurements", json=old, headers=api.h["agent"]).raise_for_status()
                api.post("/v1/measurements", json=fleet_batch(nodes=2),
                         headers=api.h["agent"]).raise_for_status()
            samples = scrape(api)
        seen[window] = {key.format(**labels): v == 1
                        for labels, v in samples["ringwatch_link_degraded"]}
        assert len(seen[window]) == len(samples["ringwatch_link_degraded"])
        # The counts are of every link: the stale batch's 3 ok and 3 through old-001, the
        # fresh batch's 3 ok.
        assert value(samples, "ringwatch_links", status="ok") == 6
        assert value(samples, "ringwatch_links", status="degraded") == 3
    assert len(seen[0]) == 9 and sum(seen[0].values()) == 3
    # Within the hour: the fresh batch's links and the stale batch's degraded ones only.
    fresh_or_bad = {k for k, bad in seen[0].items()
                    if bad or not k.split("|")[2].startswith("old")}
    assert len(fresh_or_bad) == 6 and set(seen[3600]) == fresh_or_bad


def test_an_empty_database_scrapes_cleanly_in_both_formats(api) -> None:
    for openmetrics in (False, True):
        samples = scrape(api, openmetrics)
        assert value(samples, "ringwatch_nodes") == 0
        assert value(samples, "ringwatch_links", status="degraded") == 0
        # Nothing ingested yet: the family is described, with no sample.
        assert samples["ringwatch_last_ingest_timestamp_seconds"] == []
        assert samples["ringwatch_node_healthy"] == samples["ringwatch_open_findings"] == []


def test_gzip_when_asked_and_the_same_metrics_either_way(api) -> None:
    api.post("/v1/measurements", json=fleet_batch(), headers=api.h["agent"]).raise_for_status()
    raw = api.get("/metrics", headers={"Accept-Encoding": "identity"})
    assert "content-encoding" not in raw.headers
    with api.stream("GET", "/metrics", headers={"Accept-Encoding": "gzip"}) as zipped:
        assert zipped.headers["content-encoding"] == "gzip"
        wire = b"".join(zipped.iter_raw())
    assert len(wire) < len(raw.content)
    # One gzip member (the fleet's part compressed once, the process's appended to it):
    # what a reader that stops after the first member gets is the whole body.
    member = zlib.decompressobj(16 + zlib.MAX_WBITS)
    body = member.decompress(wire)
    assert member.eof and member.unused_data == b""
    # Timings and ages move between two collections, and the process's own families
    # between two requests; every other sample is the same.
    assert {k: v for k, v in fleet(parse(body.decode())).items() if "seconds" not in k} == {
        k: v for k, v in fleet(parse(raw.text)).items() if "seconds" not in k}
    assert "ringwatch_http_requests_total" in parse(body.decode())


def test_the_token_setting_requires_a_valid_token(clean_db) -> None:
    with api_client(clean_db, {"metrics_token_required": True}) as api:
        refused = api.get("/metrics")
        assert refused.status_code == 401 and refused.json()["error"] == "unauthorized"
        assert api.get("/metrics", headers={"Authorization": "Bearer nope"}).status_code == 401
        for role in ("reader", "agent", "admin"):
            resp = api.get("/metrics", headers=api.h[role])
            assert resp.status_code == 200 and "ringwatch_nodes" in resp.text
        assert api.get("/healthz").status_code == 200
    with api_client(clean_db, {}) as api:
        assert api.get("/metrics").status_code == 200


def test_the_cache_serves_one_collection_within_its_window(clean_db) -> None:
    with api_client(clean_db, {"metrics_cache_s": 3600}) as api:
        api.post("/v1/measurements", json=fleet_batch(nodes=2),
                 headers=api.h["agent"]).raise_for_status()
        first = api.get("/metrics", headers={"Accept-Encoding": "identity"}).text
        api.post("/v1/measurements", json=fleet_batch(nodes=3, prefix="late"),
                 headers=api.h["agent"]).raise_for_status()
        again = api.get("/metrics", headers={"Accept-Encoding": "identity"}).text
        # The fleet's part is the same collection, to the byte; the process's own follows it
        # fresh (the ingest between the scrapes is counted).
        fleet_part = first[:first.index("# HELP process_")]
        assert again.startswith(fleet_part) and again != first
        assert value(parse(again), "ringwatch_nodes") == 2
        assert value(parse(again), "ringwatch_http_requests_total", method="POST",
                     route="/v1/measurements", code="200") == 2
        # Another format in the same window renders the same collection.
        assert value(scrape(api, openmetrics=True), "ringwatch_nodes") == 2
    with api_client(clean_db, {"metrics_cache_s": 0}) as api:
        assert value(scrape(api), "ringwatch_nodes") == 5


def test_ingest_counters_count_stored_batches_and_outlive_retention(api, clean_db) -> None:
    sizes = (2, 3, 4)  # nodes: 1, 3 and 6 node pairs, plus one intra-node group each
    batches = [fleet_batch(nodes=n, prefix=f"b{n}") for n in sizes]
    for batch in batches:
        api.post("/v1/measurements", json=batch, headers=api.h["agent"]).raise_for_status()
    resent = api.post("/v1/measurements", json=batches[0], headers=api.h["agent"])
    assert resent.status_code == 200 and resent.json()["created"] is False
    stored = sum(len(b["measurements"]) for b in batches)
    assert stored == 1 + 2 + 3 + 3 + 6 + 4
    samples = scrape(api)
    assert value(samples, "ringwatch_ingested_batches_total") == 3
    assert value(samples, "ringwatch_ingested_measurements_total") == stored

    # Retention deletes the two older runs; what they counted stays counted.
    with db.transaction(clean_db) as s:
        s.execute(text("UPDATE probe_runs SET received_at = now() - interval '30 days' "
                       "WHERE id IN (SELECT id FROM probe_runs ORDER BY id LIMIT 2)"))
    report = timeseries.maintain(clean_db.kw["bind"], Retention(raw_days=14))
    assert report.deleted["probe_runs"] == 2
    api.post("/v1/measurements", json=fleet_batch(nodes=2, prefix="late"),
             headers=api.h["agent"]).raise_for_status()
    with db.transaction(clean_db) as s:
        assert s.execute(text("SELECT count(*) FROM probe_runs")).scalar() == 2
    samples = scrape(api)
    assert value(samples, "ringwatch_ingested_batches_total") == 4
    assert value(samples, "ringwatch_ingested_measurements_total") == stored + 3
    # Another API process reads the same totals: they are the database's, not a process's.
    with api_client(clean_db, {"metrics_cache_s": 0}) as other:
        again = scrape(other)
    assert value(again, "ringwatch_ingested_batches_total") == 4
    assert value(again, "ringwatch_ingested_measurements_total") == stored + 3


def test_preflight_latency_counts_each_verdict_under_its_bucket(api, clean_db) -> None:
    api.post("/v1/measurements", json=fleet_batch(), headers=api.h["agent"]).raise_for_status()
    # One answered at once from fresh results; one a scheduler answers 45 s after it was
    # asked (its request made to look older: no test waits 45 s).
    assert api.post("/v1/preflight", json={"nodes": ["node-000", "node-001"]},
                    headers=api.h["reader"]).status_code == 200
    old = fleet_batch(nodes=2, prefix="old")
    for m in old["measurements"]:
        m["time"] = (datetime.now(UTC) - timedelta(hours=2)).isoformat()
    api.post("/v1/measurements", json=old, headers=api.h["agent"]).raise_for_status()
    waiting = api.post("/v1/preflight", json={"nodes": ["old-000", "old-001"], "max_age_s": 60},
                       headers=api.h["reader"])
    assert waiting.status_code == 202
    request_id = waiting.json()["id"]
    before = scrape(api, openmetrics=True)
    assert value(before, "ringwatch_preflight_latency_seconds_count", answered="probed") == 0
    claimed = api.post("/v1/preflight/claim", json={"worker": "sched-a"},
                       headers=api.h["agent"]).json()
    assert claimed["id"] == request_id
    with db.transaction(clean_db) as s:
        s.execute(text("UPDATE preflight_requests SET created_at = created_at - "
                       "interval '45 seconds' WHERE id = :id"), {"id": request_id})
    done = api.post(f"/v1/preflight/{request_id}/complete", json={"worker": "sched-a"},
                    headers=api.h["agent"])
    assert done.status_code == 200 and done.json()["status"] == "done", done.text

    # OpenMetrics' parser also checks the buckets are cumulative and end in +Inf = count.
    samples = scrape(api, openmetrics=True)
    name = "ringwatch_preflight_latency_seconds"

    def bucket(answered: str, le: str) -> float:
        return value(samples, f"{name}_bucket", answered=answered, le=le)

    assert value(samples, f"{name}_count", answered="at_once") == 1
    assert bucket("at_once", "+Inf") == 1
    assert value(samples, f"{name}_count", answered="probed") == 1
    assert bucket("probed", "30.0") == 0 and bucket("probed", "120.0") == 1
    assert value(samples, f"{name}_sum", answered="probed") >= 45
    assert value(samples, f"{name}_sum", answered="at_once") < 45


def test_a_node_is_unhealthy_exactly_when_a_preflight_excludes_it(clean_db) -> None:
    """ringwatch_node_healthy is the preflight's own judgement, not a rule beside it: a node
    whose fault the latest cycle found is unhealthy before its incident opens (the default
    hysteresis waits for a second bad cycle), and an incident on a path, which excludes
    neither end, counts as an open finding on both nodes and leaves them healthy."""
    with api_client(clean_db, {"metrics_cache_s": 0}) as api:
        api.post("/v1/measurements", json=fleet_batch(slow_node="node-002"),
                 headers=api.h["agent"]).raise_for_status()
        with db.transaction(clean_db) as s:
            health_store.open_finding(
                s, kind="net_path_degraded", group_key=None, op="allreduce",
                nodes=["node-000", "node-001"], severity="critical",
                detail={"kind": "net_path_degraded", "nodes": ["node-000", "node-001"]})
        samples = scrape(api)
        healthy = {labels["node"]: v for labels, v in samples["ringwatch_node_healthy"]}
        whole = api.post("/v1/preflight", json={"nodes": sorted(healthy)},
                         headers=api.h["reader"]).json()
        alone = {n: api.post("/v1/preflight", json={"nodes": [n]},
                             headers=api.h["reader"]).json()["exclude"] for n in healthy}
    assert healthy == {"node-000": 1, "node-001": 1, "node-002": 0, "node-003": 1}
    assert whole["exclude"] == ["node-002"]
    assert alone == {n: [] if v else [n] for n, v in healthy.items()}
    # No incident is open on node-002 yet; the path's is open on both of its nodes.
    assert {(labels["node"], labels["kind"]) for labels, _ in
            samples["ringwatch_node_open_findings"]} == {("node-000", "net_path_degraded"),
                                                        ("node-001", "net_path_degraded")}


def test_link_series_are_named_by_node_gpu_or_group_key(api, clean_db) -> None:
    """Each link by the labels DCGM exporter's series can be joined on: a node pair by
    ``node``/``peer_node`` even where long host names make its group key a hash, two ranks
    by ``gpu``/``peer_gpu`` as numbers, a group on more nodes by its key; and one series for
    links that label alike (a node's NVLink group before and after it lost a GPU): the
    worse."""
    a, b = (f"rack-{i}-gpu-host-with-a-long-name.cluster.example.internal" for i in (7, 9))
    wide = [f"{n}/{g}" for n in (a, b) for g in range(8)]
    nodes = [f"node-00{i}" for i in range(3)]
    batch = fleet_batch(nodes=3)
    batch["measurements"] = [
        measurement(wide, 12.0),
        measurement(["node-000/2", "node-000/10"], 30.0, scope="gpu_pair"),
        measurement(["node-000/3", "node-001/5"], 9.0),
        measurement([f"{n}/{g}" for n in nodes for g in range(2)], 8.0, scope="world"),
        *(measurement([f"{n}/{g}" for g in range(8)], 5.0 if n == "node-000" else 20.0,
                      scope="intra_node") for n in nodes)]
    api.post("/v1/measurements", json=batch, headers=api.h["agent"]).raise_for_status()
    later = fleet_batch(nodes=3)
    later["measurements"] = [
        measurement([f"node-000/{g}" for g in range(7)], 20.0, scope="intra_node"),
        *(measurement([f"{n}/{g}" for g in range(8)], 20.0, scope="intra_node")
          for n in nodes[1:])]
    api.post("/v1/measurements", json=later, headers=api.h["agent"]).raise_for_status()
    samples = scrape(api)
    bw = "ringwatch_link_busbw_bytes_per_second"
    op = {"op": "allreduce"}

    with db.transaction(clean_db) as s:
        hashed = s.execute(text("SELECT group_key FROM link_health WHERE nodes = :n"),
                           {"n": [a, b]}).scalar_one()
        world = s.execute(text("SELECT group_key FROM link_health WHERE scope = 'world'"))\
            .scalar_one()
        intra = s.execute(text("SELECT busbw_gbs, status, ratio FROM link_health WHERE scope "
                               "= 'intra_node' AND nodes = '{node-000}'")).all()
    assert hashed.startswith("sha256:")
    assert value(samples, bw, scope="inter_node", node=a, peer_node=b, **op) == 12e9
    assert value(samples, bw, scope="gpu_pair", node="node-000", gpu="2",
                 peer_node="node-000", peer_gpu="10", **op) == 30e9
    assert value(samples, bw, scope="inter_node", node="node-000", gpu="3",
                 peer_node="node-001", peer_gpu="5", **op) == 9e9
    assert value(samples, bw, scope="world", group=world, **op) == 8e9
    # Two NVLink groups of node-000 are stored, the older (all eight GPUs) degraded: one
    # series, the degraded one.
    assert sorted((r.busbw_gbs, r.status) for r in intra) == [(5.0, "degraded"), (20.0, "ok")]
    assert value(samples, bw, scope="intra_node", node="node-000", **op) == 5e9
    assert value(samples, "ringwatch_link_degraded", scope="intra_node", node="node-000",
                 **op) == 1
    assert all("members" not in labels for labels, _ in samples[bw])


def fail_unexpectedly() -> None:
    raise RuntimeError("a handler's own bug")


def test_requests_are_counted_by_method_route_template_and_code(api) -> None:
    api.app.add_api_route("/v1/fails", fail_unexpectedly)
    reader = api.h["reader"]
    api.post("/v1/measurements", json=fleet_batch(), headers=api.h["agent"]).raise_for_status()
    answers = [api.get("/v1/nodes/node-000", headers=reader),
               api.get("/v1/nodes/node-001", headers=reader),
               api.get("/v1/nodes/nobody", headers=reader),
               api.get("/v1/nodes"),  # refused before routing
               api.get("/no/such/route", headers=reader),
               api.request("BREW", "/v1/nodes", headers=reader),
               api.get("/ui/")]
    assert [r.status_code for r in answers] == [200, 200, 404, 401, 404, 405, 200]
    with pytest.raises(RuntimeError):
        api.get("/v1/fails", headers=reader)
    samples = scrape(api)

    def requests(method: str, route: str, code: str) -> float:
        return value(samples, "ringwatch_http_requests_total", method=method, route=route,
                     code=code)

    assert requests("GET", "/v1/nodes/{name}", "200") == 2
    assert requests("GET", "/v1/nodes/{name}", "404") == 1
    assert requests("GET", "/v1/nodes", "401") == 1
    assert requests("GET", "unmatched", "404") == 1
    assert requests("other", "/v1/nodes", "405") == 1
    assert requests("GET", "/ui/{path}", "200") == 1
    assert requests("GET", "/v1/fails", "500") == 1
    assert requests("POST", "/v1/measurements", "200") == 1
    assert value(samples, "ringwatch_http_request_exceptions_total", method="GET",
                 route="/v1/fails") == 1
    # No raw path is a label: the names of nodes asked for are not in any.
    routes = {labels["route"] for labels, _ in samples["ringwatch_http_requests_total"]}
    assert not any("node-0" in r or "nobody" in r for r in routes)
    assert value(samples, "ringwatch_http_request_duration_seconds_count", method="GET",
                 route="/v1/nodes/{name}") == 3
    assert value(samples, "ringwatch_http_request_duration_seconds_bucket", method="GET",
                 route="/v1/nodes/{name}", le="+Inf") == 3
    # The process's own, and no _created series beside the counters.
    assert value(samples, "process_resident_memory_bytes") > 0
    assert value(samples, "process_cpu_seconds_total") > 0
    assert not [name for name in samples if name.endswith("_created")]


def test_links_that_label_alike_report_the_worse_whatever_their_order() -> None:
    """The collector alone (no database): of two rows with one label set, the degraded
    one, else the lower ratio, in either order; rows that label apart stay apart."""
    from ringwatch.services.monitor.metrics import FleetCollector, Snapshot
    from ringwatch.services.store import metrics as store

    def row(members: list[str], status: str, busbw: float, ratio: float | None) -> store.LinkRow:
        return store.LinkRow("intra_node", "allreduce", ",".join(members), status, busbw, ratio,
                             ["node-000"], None)

    eight = [f"node-000/{g}" for g in range(8)]
    rows = [row(eight, "degraded", 5.0, 0.9), row(eight[:7], "ok", 20.0, 0.5),
            row(eight[:6], "ok", 19.0, 0.4)]
    now = datetime.now(UTC)
    for order in (rows, rows[::-1]):
        snap = Snapshot({}, order, [], frozenset(), [], [], {}, store.Backlog(0, None, 0), {},
                        {}, store.IngestTotals(0, 0), None, now, 0.0)
        [family] = [f for f in FleetCollector(snap).collect()
                    if f.name == "ringwatch_link_busbw_bytes_per_second"]
        assert [(s.labels, s.value) for s in family.samples] == [
            ({"scope": "intra_node", "op": "allreduce", "node": "node-000"}, 5e9)]
    ok_only = [rows[1], rows[2]]
    for order in (ok_only, ok_only[::-1]):
        snap = Snapshot({}, order, [], frozenset(), [], [], {}, store.Backlog(0, None, 0), {},
                        {}, store.IngestTotals(0, 0), None, now, 0.0)
        [family] = [f for f in FleetCollector(snap).collect()
                    if f.name == "ringwatch_link_ratio"]
        assert [s.value for s in family.samples] == [0.4]


def test_a_cause_with_a_malformed_detail_never_breaks_the_scrape(api, clean_db) -> None:
    """An agent's finding detail is free-form JSON: counters that are not records, a rate
    that is no number, GPUs that are no list are left out of the cause families, and the
    well-formed ones beside them are still reported."""
    from ringwatch.services.store import db
    from ringwatch.services.store.health import open_finding

    with db.transaction(clean_db) as s:
        open_finding(s, kind="nic_errors", group_key=None, op=None, nodes=["node-001"],
                     severity="warning", detail={"counters": ["x", {"device": "mlx5_0",
                     "port": 1, "counter": "symbol_error", "rate_per_s": "fast"},
                     {"device": "mlx5_1", "port": 1, "counter": "link_downed",
                      "rate_per_s": 0.5}]})
        open_finding(s, kind="nic_errors", group_key=None, op=None, nodes=["node-002"],
                     severity="warning", detail={"counters": "many"})
        open_finding(s, kind="transport_fallback", group_key=None, op=None, nodes=["node-003"],
                     severity="critical", detail={"transport": "shm", "gpus": 7,
                                                  "expected_transport": "p2p_nvlink"})
    samples = scrape(api)
    assert samples["ringwatch_nic_error_rate_per_second"] == [
        ({"node": "node-001", "device": "mlx5_1", "port": "1", "counter": "link_downed"}, 0.5)]
    assert samples["ringwatch_transport_fallback"] == [
        ({"node": "node-003", "transport": "shm", "expected": "p2p_nvlink", "gpus": ""}, 1.0)]
