"""/metrics through the real app on a real Postgres: what Prometheus' and OpenMetrics'
parsers read back, checked against the rows the database holds."""

from __future__ import annotations

import gzip
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from prometheus_client.openmetrics.parser import (
    text_string_to_metric_families as openmetrics_families,
)
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import text

from services.store import db, timeseries
from services.store import webhooks as webhook_store
from services.store.timeseries import Retention
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
    assert value(samples, "ringwatch_shipper_batches", host=ODD_HOST, state="failed") == 1
    assert value(samples, "ringwatch_link_busbw_gbs", scope="intra_node", op="allreduce",
                 members=f"{ODD_NODE}/0,{ODD_NODE}/1") == 20.0
    # Each family carries its own samples (none left empty by interleaving).
    for name in ("ringwatch_link_busbw_gbs", "ringwatch_link_degraded", "ringwatch_link_ratio",
                 "ringwatch_node_duty_cycle", "ringwatch_shipper_batches", "ringwatch_links"):
        assert samples[name], name
    assert len(samples["ringwatch_link_busbw_gbs"]) == len(samples["ringwatch_link_degraded"])


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
        links = s.execute(text("SELECT scope, op, group_key, status, busbw_gbs, ratio "
                               "FROM link_health WHERE updated_at > now() - interval '1 hour' "
                               "OR status <> 'ok'")).all()
        kinds: dict[str, int] = dict(s.execute(text(
            "SELECT kind, count(*) FROM findings WHERE status = 'open' GROUP BY kind")).all())
        nodes_held = s.execute(text("SELECT count(*) FROM nodes")).scalar()
        pending = s.execute(text("SELECT count(*) FROM webhook_deliveries "
                                 "WHERE status = 'pending'")).scalar()
        preflights: dict[str, int] = dict(s.execute(text(
            "SELECT status, count(*) FROM preflight_requests GROUP BY status")).all())
        last = s.execute(text("SELECT max(received_at) FROM probe_runs")).scalar_one()

    assert len(samples["ringwatch_link_busbw_gbs"]) == len(links) > 0
    assert any(r.ratio is not None for r in links)
    for r in links:
        labels = {"scope": r.scope, "op": r.op, "members": r.group_key}
        assert value(samples, "ringwatch_link_busbw_gbs", **labels) == pytest.approx(r.busbw_gbs)
        assert value(samples, "ringwatch_link_degraded", **labels) == (r.status == "degraded")
        if r.ratio is not None:
            assert value(samples, "ringwatch_link_ratio", **labels) == pytest.approx(r.ratio)
    assert sum(counts.values()) > len(links) and counts["degraded"] > 0
    assert value(samples, "ringwatch_links", status="degraded") == counts["degraded"]
    assert value(samples, "ringwatch_links", status="ok") == counts["ok"]
    assert kinds and value(samples, "ringwatch_open_findings") == sum(kinds.values())
    for kind, n in kinds.items():
        assert value(samples, "ringwatch_open_findings_by_kind", kind=kind) == n
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
    key = "{scope}|{op}|{members}"
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


def test_gzip_when_asked_and_the_same_metrics_either_way(api) -> None:
    api.post("/v1/measurements", json=fleet_batch(), headers=api.h["agent"]).raise_for_status()
    raw = api.get("/metrics", headers={"Accept-Encoding": "identity"})
    assert "content-encoding" not in raw.headers
    with api.stream("GET", "/metrics", headers={"Accept-Encoding": "gzip"}) as zipped:
        assert zipped.headers["content-encoding"] == "gzip"
        wire = b"".join(zipped.iter_raw())
    assert len(wire) < len(raw.content)
    # Timings and ages move between two collections; every other sample is the same.
    unchanged = {k: v for k, v in parse(raw.text).items() if "seconds" not in k}
    assert {k: v for k, v in parse(gzip.decompress(wire).decode()).items()
            if "seconds" not in k} == unchanged


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
        first = api.get("/metrics", headers={"Accept-Encoding": "identity"}).content
        api.post("/v1/measurements", json=fleet_batch(nodes=3, prefix="late"),
                 headers=api.h["agent"]).raise_for_status()
        again = api.get("/metrics", headers={"Accept-Encoding": "identity"}).content
        assert again == first
        assert value(parse(again.decode()), "ringwatch_nodes") == 2
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
