"""What the alerts read from the API's /metrics, through the real app on a real Postgres: the
fleet's unhealthy share and its threshold, the database's size and its bound, the runbook
page, the interval between batches a scheduler planned (a real scheduler loop's spooled
batch says it), and the background loops' heartbeats (a real notifier loop, real
maintenance passes). Every ringwatch family the API's rules read is one /metrics serves."""

from __future__ import annotations

import json
import re
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import text

from ringwatch.agents.sim import SimBackend
from ringwatch.services.notifier.loop import Notifier
from ringwatch.services.scheduler.cycle import ProbeOptions, run_scheduler
from ringwatch.services.scheduler.shipper import Shipper
from ringwatch.services.settings import Settings
from ringwatch.services.store import db, heartbeats, timeseries
from ringwatch.services.store.timeseries import MAINTENANCE_LOCK, Retention
from tests.api_fixtures import REACT_AT_ONCE, api_client, fleet_batch
from tests.procs import free_port

ROOT = Path(__file__).resolve().parents[1]
RULES = ROOT / "deploy/prometheus/ringwatch-rules.yml"
RUNBOOK = "https://docs.example/ringwatch/v1/docs/operations.md"
SMALL = {"nodes": 4, "gpus_per_node": 2, "gpu": "H100-SXM", "noise": 0.0, "seed": 1, "faults": []}

Samples = dict[str, list[tuple[dict[str, str], float]]]


def scrape(api) -> Samples:
    resp = api.get("/metrics")
    assert resp.status_code == 200, resp.text
    out: Samples = {}
    for family in text_string_to_metric_families(resp.text):
        out.setdefault(family.name, [])  # a family without series is served too
        for s in family.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def value(samples: Samples, name: str, **labels: str) -> float:
    found = [v for got, v in samples.get(name, []) if got == labels]
    assert len(found) == 1, (name, labels, samples.get(name))
    return found[0]


def settings(**more: Any) -> dict[str, Any]:
    return {**REACT_AT_ONCE, "metrics_cache_s": 0, **more}


def read_by_the_api_rules() -> set[str]:
    """The ringwatch families the rules read from the API's /metrics (the scheduler's own
    are tests/test_scheduler_watch.py's)."""
    groups = yaml.safe_load(RULES.read_text())["groups"]
    names = {n for g in groups for r in g["rules"] for n in re.findall(r"ringwatch_\w+", r["expr"])}
    return {n for n in names if not n.startswith("ringwatch_scheduler_")}


def test_every_family_the_api_rules_read_is_served(clean_db) -> None:
    with api_client(clean_db, settings(runbook_url=RUNBOOK)) as api:
        api.post("/v1/measurements", json=fleet_batch(slow_node="node-002"),
                 headers=api.h["agent"]).raise_for_status()
        timeseries.maintain(clean_db.kw["bind"], Retention())
        with db.transaction(clean_db) as s:
            heartbeats.beat(s, heartbeats.NOTIFIER)
        served = set(scrape(api))
    read = read_by_the_api_rules()
    assert {"ringwatch_nodes_unhealthy", "ringwatch_fleet_unhealthy_share_threshold",
            "ringwatch_expected_ingest_interval_seconds", "ringwatch_loop_failures",
            "ringwatch_loop_success_age_seconds", "ringwatch_database_size_bytes",
            "ringwatch_database_size_alert_bytes", "ringwatch_database_up",
            "ringwatch_runbook_info", "ringwatch_http_requests_total"} <= read
    assert read <= served, read - served


def test_the_fleet_share_and_the_bounds_are_the_settings(clean_db) -> None:
    with api_client(clean_db, settings(fleet_unhealthy_share=0.1, runbook_url=RUNBOOK,
                                       database_size_alert_bytes=1 << 20)) as api:
        api.post("/v1/measurements", json=fleet_batch(slow_node="node-002"),
                 headers=api.h["agent"]).raise_for_status()
        got = scrape(api)
        excluded = api.post("/v1/preflight", json={"nodes": [f"node-00{i}" for i in range(4)]},
                            headers=api.h["reader"]).json()["exclude"]
    # The share the rule divides: the nodes a preflight would exclude, over the fleet.
    assert value(got, "ringwatch_nodes_unhealthy") == len(excluded) == 1
    assert value(got, "ringwatch_nodes") == 4
    assert value(got, "ringwatch_fleet_unhealthy_share_threshold") == 0.1
    with db.transaction(clean_db) as s:
        size = s.scalar(text("SELECT pg_database_size(current_database())"))
    # The database's size as Postgres gives it (it grows between the two reads, if at all).
    assert 1 << 20 < value(got, "ringwatch_database_size_bytes") <= size
    assert value(got, "ringwatch_database_size_alert_bytes") == 1 << 20
    assert value(got, "ringwatch_runbook_info", url=RUNBOOK) == 1


def test_an_unset_bound_or_runbook_page_exports_nothing_a_rule_could_misread(clean_db) -> None:
    with api_client(clean_db, settings(database_size_alert_bytes=0)) as api:
        got = scrape(api)
    assert "ringwatch_database_size_alert_bytes" not in got
    assert "ringwatch_runbook_info" not in got
    assert value(got, "ringwatch_fleet_unhealthy_share_threshold") == 0.02  # the default


@pytest.mark.parametrize("url", ["docs.example/ops.md", "https://x.example/ops.md#top",
                                 "https://x.example/a b", 'https://x.example/"', "ftp://x/"])
def test_a_runbook_url_that_would_break_the_links_is_refused(url: str) -> None:
    with pytest.raises(ValueError, match="runbook_url"):
        Settings(runbook_url=url)


def test_the_expected_interval_is_what_the_newest_scheduled_batch_planned(clean_db) -> None:
    with api_client(clean_db, settings(probe_interval_s=120)) as api:
        agent = api.h["agent"]
        # No batch has said: the API's own probe interval.
        assert value(scrape(api), "ringwatch_expected_ingest_interval_seconds") == 120
        planned = {**fleet_batch(), "shipper": {"host": "sched-a", "pending": 0,
                                                "interval_s": 1812.5}}
        api.post("/v1/measurements", json=planned, headers=agent).raise_for_status()
        assert value(scrape(api), "ringwatch_expected_ingest_interval_seconds") == 1812.5
        # A preflight's batch (no interval) after it leaves the scheduler's plan standing.
        api.post("/v1/measurements", json={**fleet_batch(), "shipper": {"host": "sched-a"}},
                 headers=agent).raise_for_status()
        assert value(scrape(api), "ringwatch_expected_ingest_interval_seconds") == 1812.5
        for bad in (0, -5, 31 * 86400, "soon"):
            resp = api.post("/v1/measurements",
                            json={**fleet_batch(), "shipper": {"interval_s": bad}}, headers=agent)
            assert resp.status_code == 422, (bad, resp.text)
            assert "interval_s" in resp.text


def spooled_batch(tmp_path: Path, **loop: Any) -> dict[str, Any]:
    """The batch one scheduled cycle spools for an API that is down."""
    shipper = Shipper(f"http://127.0.0.1:{free_port()}", "t", tmp_path / "spool", timeout_s=1)
    try:
        assert run_scheduler(SimBackend(SMALL), shipper, ProbeOptions(), once=True, jitter=0.0,
                             **loop) == 1
        [path] = shipper.pending()
    finally:
        shipper.close()
    return json.loads(path.read_text())


def test_a_scheduled_cycle_says_the_period_it_plans(tmp_path: Path) -> None:
    batch = spooled_batch(tmp_path / "a", interval_s=600.0, max_duty=1.0)
    shipper = batch["shipper"]
    # Beside what the spool held: the interval and the cycle before it.
    assert {"host", "pending", "failed", "rejected"} <= shipper.keys()
    assert 600.0 <= shipper["interval_s"] < 600.0 + 60
    # A duty cycle that stretches the wait stretches what the batch says.
    stretched = spooled_batch(tmp_path / "b", interval_s=1.0, max_duty=1e-6)["shipper"]
    assert stretched["interval_s"] > 100.0, stretched


def test_a_notifier_loop_beats_and_the_api_reports_it(clean_db) -> None:
    notifier = Notifier(clean_db)
    stop = threading.Event()
    loop = threading.Thread(target=notifier.run_forever, args=(0.05, stop), daemon=True)
    loop.start()
    try:
        deadline = time.monotonic() + 30
        while True:
            with db.transaction(clean_db) as s:
                beats = heartbeats.heartbeats(s)
            if beats or time.monotonic() > deadline:
                break
            time.sleep(0.05)
    finally:
        stop.set()
        loop.join(timeout=30)
        notifier.close()
    assert [b.name for b in beats] == ["notifier"] and beats[0].failures == 0
    with api_client(clean_db, settings()) as api:
        got = scrape(api)
    assert 0 <= value(got, "ringwatch_loop_success_age_seconds", loop="notifier") < 60
    assert value(got, "ringwatch_loop_failures", loop="notifier") == 0
    ok_at = value(got, "ringwatch_loop_last_success_timestamp_seconds", loop="notifier")
    assert abs(ok_at - time.time()) < 60


def test_maintenance_passes_beat_ok_failed_and_skipped(clean_db, monkeypatch) -> None:
    engine = clean_db.kw["bind"]

    def beat() -> heartbeats.HeartbeatRow:
        with db.transaction(clean_db) as s:
            [got] = [b for b in heartbeats.heartbeats(s) if b.name == "maintenance"]
        return got

    timeseries.maintain(engine, Retention())
    ok = beat()
    assert ok.failures == 0 and ok.ok_at is not None and ok.failed_at is None

    def full_disk(*_: Any, **__: Any) -> list[str]:
        raise OSError("No space left on device")

    monkeypatch.setattr(timeseries, "ensure_partitions", full_disk)
    for _ in range(2):
        with pytest.raises(OSError):
            timeseries.maintain(engine, Retention())
    failed = beat()
    assert failed.failures == 2 and failed.ok_at == ok.ok_at and failed.failed_at is not None
    with api_client(clean_db, settings()) as api:
        assert value(scrape(api), "ringwatch_loop_failures", loop="maintenance") == 2
    # A pass another process holds is skipped: no pass, so no beat either way.
    with engine.connect() as holder:
        holder.execute(text("SELECT pg_advisory_lock(:k)"), {"k": MAINTENANCE_LOCK})
        assert timeseries.maintain(engine, Retention()).skipped
        holder.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": MAINTENANCE_LOCK})
        holder.commit()
    assert beat()._replace(since_ok_s=None) == failed._replace(since_ok_s=None)
    monkeypatch.undo()
    timeseries.maintain(engine, Retention())
    mended = beat()
    assert mended.failures == 0 and mended.ok_at is not None and mended.ok_at > ok.ok_at
    with api_client(clean_db, settings()) as api:
        assert value(scrape(api), "ringwatch_loop_failures", loop="maintenance") == 0
