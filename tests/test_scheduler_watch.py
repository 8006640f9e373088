"""The scheduler can be watched: its own /metrics parse as Prometheus text with the values
it was told, its /healthz answers 200 or 503 over real HTTP as its loop comes round, and the
alerts read only families it serves. A refused token is loud (an ERROR naming the token's
prefix, never the token) and loses no batch, against a real API; the spool's bound drops
the oldest batches first, each said and counted, and never one while the queue fits."""

from __future__ import annotations

import json
import logging
import re
from datetime import UTC, datetime
from pathlib import Path

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from ringwatch.services.scheduler.shipper import Shipper
from ringwatch.services.scheduler.watch import SchedulerWatch
from tests.api_fixtures import fleet_batch
from tests.procs import free_port, running_api

ROOT = Path(__file__).resolve().parents[1]
RULES = ROOT / "deploy/prometheus/ringwatch-rules.yml"
NOW = 1_760_000_000.0


class Clock:
    """Unix time that moves only when a test says so."""

    def __init__(self, at: float = NOW) -> None:
        self.at = at

    def __call__(self) -> float:
        return self.at


def samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Every sample of a scrape by name and labels, as Prometheus' own parser reads it."""
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def types(text: str) -> dict[str, str]:
    return {family.name: family.type for family in text_string_to_metric_families(text)}


def labels(**kv: str) -> frozenset[tuple[str, str]]:
    return frozenset(kv.items())


def a_watch_told_everything(clock: Clock, fleet: str = "a") -> SchedulerWatch:
    watch = SchedulerWatch(fleet, "sched-a:41", 300.0, host="sched-a", clock=clock)
    watch.role(True, "sched-a:41", term=7)
    watch.cycle(ended_at=NOW - 20, duration_s=42.5, number=12, probed=1000, busy=24)
    watch.ingest(200)
    watch.spool(3, 21_000_000, 2)
    watch.token(refused=False, prefix="rw_abcde…",
                expires_at=datetime.fromtimestamp(NOW + 3600, UTC))
    return watch


# -- /metrics -----------------------------------------------------------------------------


def test_the_metrics_parse_with_the_values_the_loop_reported() -> None:
    text = a_watch_told_everything(Clock()).render()
    got = samples(text)
    fleet, own = labels(fleet="a"), labels(fleet="a", host="sched-a")
    assert got == {
        ("ringwatch_scheduler_leader", fleet): 1.0,
        ("ringwatch_scheduler_term", fleet): 7.0,
        ("ringwatch_scheduler_interval_seconds", fleet): 300.0,
        ("ringwatch_scheduler_last_cycle_end_timestamp_seconds", fleet): NOW - 20,
        ("ringwatch_scheduler_last_cycle_duration_seconds", fleet): 42.5,
        ("ringwatch_scheduler_cycle", fleet): 12.0,
        ("ringwatch_scheduler_nodes", labels(fleet="a", state="probed")): 1000.0,
        ("ringwatch_scheduler_nodes", labels(fleet="a", state="busy")): 24.0,
        ("ringwatch_scheduler_spool_batches", own): 3.0,
        ("ringwatch_scheduler_spool_bytes", own): 21_000_000.0,
        ("ringwatch_scheduler_spool_dropped_total", own): 2.0,
        ("ringwatch_scheduler_last_ingest_status", own): 200.0,
        ("ringwatch_scheduler_ingest_refused", own): 0.0,
        ("ringwatch_scheduler_token_expires_in_seconds", own): 3600.0,
    }
    assert types(text)["ringwatch_scheduler_spool_dropped"] == "counter"
    assert {t for name, t in types(text).items() if name != "ringwatch_scheduler_spool_dropped"} \
        == {"gauge"}
    # Every family has its HELP and TYPE lines, once each.
    names = {name for name, _ in got}
    for name in names:
        assert text.count(f"# TYPE {name} ") == 1, name
        assert text.count(f"# HELP {name} ") == 1, name


def test_a_standby_and_a_refused_token_read_as_such() -> None:
    clock = Clock()
    watch = SchedulerWatch("a", "sched-b:7", 300.0, host="sched-b", clock=clock)
    # Before anything is known: a leader of nothing yet, no cycle, no ingest, not refused.
    first = samples(watch.render())
    assert first[("ringwatch_scheduler_leader", labels(fleet="a"))] == 1.0
    assert not any(name.startswith("ringwatch_scheduler_last_") for name, _ in first)
    watch.role(False, "sched-a:41", term=3)
    watch.ingest(401)
    got = samples(watch.render())
    own = labels(fleet="a", host="sched-b")
    assert got[("ringwatch_scheduler_leader", labels(fleet="a"))] == 0.0
    assert got[("ringwatch_scheduler_ingest_refused", own)] == 1.0
    assert got[("ringwatch_scheduler_last_ingest_status", own)] == 401.0
    # Unreachable leaves the refusal standing (nothing said otherwise) and reads 0.
    watch.ingest(None)
    got = samples(watch.render())
    assert got[("ringwatch_scheduler_last_ingest_status", own)] == 0.0
    assert got[("ringwatch_scheduler_ingest_refused", own)] == 1.0
    watch.ingest(200)
    assert samples(watch.render())[("ringwatch_scheduler_ingest_refused", own)] == 0.0
    watch.token(refused=True)
    assert samples(watch.render())[("ringwatch_scheduler_ingest_refused", own)] == 1.0


def test_a_fleet_name_with_quotes_and_newlines_is_escaped() -> None:
    fleet = 'rack "7"\\east\nnew'
    text = a_watch_told_everything(Clock(), fleet=fleet).render()
    got = samples(text)
    assert got[("ringwatch_scheduler_cycle", labels(fleet=fleet))] == 12.0
    # One sample a line: the newline in the name did not break one.
    assert all(line.startswith(("# ", "ringwatch_scheduler_")) for line in text.splitlines())


def test_a_stretched_wait_is_the_interval_the_alert_and_health_read() -> None:
    watch = a_watch_told_everything(Clock())
    watch.next_cycle_in(1800.0)
    got = samples(watch.render())
    assert got[("ringwatch_scheduler_interval_seconds", labels(fleet="a"))] == 1800.0
    watch.next_cycle_in(30.0)  # never below the probe interval
    assert samples(watch.render())[("ringwatch_scheduler_interval_seconds",
                                    labels(fleet="a"))] == 300.0


def test_the_alerts_read_only_families_the_scheduler_serves() -> None:
    rules = [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]
    read = {name for r in rules for name in re.findall(r"ringwatch_scheduler_\w+", r["expr"])}
    assert read, "no scheduler rule"
    served = {name for name, _ in samples(a_watch_told_everything(Clock()).render())}
    assert read <= served, read - served
    # Each alert's summary names what it reads in its labels: the fleet, and the host where
    # the family is the process's own.
    got = samples(a_watch_told_everything(Clock()).render())
    for name, labelset in got:
        assert ("fleet", "a") in labelset
        if "spool" in name or "ingest" in name:
            assert ("host", "sched-a") in labelset, name


# -- /healthz over HTTP -------------------------------------------------------------------


@pytest.fixture
def served():
    clock = Clock()
    watch = SchedulerWatch("a", "sched-a:41", 300.0, host="sched-a", clock=clock)
    server = watch.serve("127.0.0.1", 0)
    try:
        yield watch, clock, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def health(base: str) -> tuple[int, dict]:
    resp = httpx.get(f"{base}/healthz", timeout=10)
    return resp.status_code, resp.json()


def test_healthz_follows_the_loop_of_a_leader(served) -> None:
    watch, clock, base = served
    watch.role(True, "sched-a:41", term=1)
    assert health(base)[0] == 200  # the first cycle is under way
    clock.at += 901  # past max(3 x 300 s, 15 min) with no cycle ended
    code, body = health(base)
    assert code == 503 and body["status"] == "unavailable"
    assert "no cycle ended" in body["reason"] and "900" in body["reason"]
    watch.cycle(ended_at=clock.at, duration_s=880.0, number=1, probed=4, busy=0)
    code, body = health(base)
    assert (code, body["status"]) == (200, "ok") and "cycle 1 ended 0 s ago" in body["reason"]
    clock.at += 899
    assert health(base)[0] == 200
    clock.at += 2
    code, body = health(base)
    assert code == 503 and "cycle 1 ended 901 s ago" in body["reason"]
    # A longer interval (or a duty cycle that stretched the wait) allows three of it.
    watch.next_cycle_in(600.0)
    assert health(base)[0] == 200
    clock.at += 900
    assert health(base)[0] == 503


def test_healthz_of_a_standby_follows_its_view_of_the_lease(served) -> None:
    watch, clock, base = served
    watch.role(False, "sched-b:9", term=4)
    code, body = health(base)
    assert code == 200 and "standby" in body["reason"] and "sched-b:9" in body["reason"]
    clock.at += 3600  # it never cycles: renewing its view is what keeps it alive
    watch.role(False, "sched-b:9", term=4)
    assert health(base)[0] == 200
    clock.at += 901
    code, body = health(base)
    assert code == 503 and "view renewed 901 s ago" in body["reason"]
    # Taking over starts the leader's clock afresh: no cycle yet, not dead yet.
    watch.role(True, "sched-a:41", term=5)
    assert health(base)[0] == 200


def test_metrics_and_unknown_paths_over_http(served) -> None:
    watch, _, base = served
    watch.spool(1, 100, 0)
    resp = httpx.get(f"{base}/metrics", timeout=10)
    assert resp.status_code == 200
    assert resp.headers["content-type"].startswith("text/plain; version=0.0.4")
    assert samples(resp.text)[("ringwatch_scheduler_spool_bytes",
                               labels(fleet="a", host="sched-a"))] == 100.0
    missing = httpx.get(f"{base}/nothing", timeout=10)
    assert missing.status_code == 404 and missing.json()["paths"] == ["/healthz", "/metrics"]


# -- the spool's bound --------------------------------------------------------------------


def batch_of(batch_id: str, size: int) -> dict:
    """A batch whose spooled file is exactly ``size`` bytes."""
    body = {"batch_id": batch_id, "measurements": [], "pad": ""}
    body["pad"] = "x" * (size - len(json.dumps(body)))
    assert len(json.dumps(body)) == size
    return body


def unreachable_shipper(spool: Path, max_bytes: int | None) -> Shipper:
    return Shipper(f"http://127.0.0.1:{free_port()}", "rw_never_sent_anywhere", spool,
                   timeout_s=1, max_bytes=max_bytes)


def spooled_ids(shipper: Shipper) -> list[str]:
    return [json.loads(p.read_text())["batch_id"] for p in shipper.pending()]


def test_the_bound_drops_the_oldest_first_and_says_so(tmp_path: Path, caplog) -> None:
    shipper = unreachable_shipper(tmp_path / "spool", max_bytes=3000)
    caplog.set_level(logging.WARNING, logger="ringwatch.services.scheduler.shipper")
    for i in range(3):  # exactly the bound: nothing goes
        shipper.spool(batch_of(f"b{i}", 1000))
    assert shipper.dropped == 0 and spooled_ids(shipper) == ["b0", "b1", "b2"]
    assert shipper.spool_bytes() == 3000 and len(shipper.pending()) == 3
    assert not [r for r in caplog.records if "dropped" in r.getMessage()]
    shipper.spool(batch_of("b3", 1500))  # 4500: b0 and b1 must go, oldest first
    assert spooled_ids(shipper) == ["b2", "b3"]
    assert shipper.dropped == 2 and shipper.spool_bytes() == 2500
    drops = [r for r in caplog.records if "dropped batch" in r.getMessage()]
    assert [r.levelno for r in drops] == [logging.WARNING] * 2
    assert "b0 (1000 bytes)" in drops[0].getMessage()
    assert "b1 (1000 bytes)" in drops[1].getMessage()
    # The batch just written is kept even where it alone passes the bound.
    shipper.spool(batch_of("huge", 5000))
    assert spooled_ids(shipper) == ["huge"] and shipper.dropped == 4
    shipper.close()


def test_without_a_bound_nothing_is_dropped(tmp_path: Path) -> None:
    shipper = unreachable_shipper(tmp_path / "spool", max_bytes=None)
    for i in range(5):
        shipper.spool(batch_of(f"b{i}", 1000))
    assert shipper.dropped == 0 and len(shipper.pending()) == 5
    assert shipper.spool_bytes() == 5000
    shipper.close()


def test_the_bound_counts_the_queue_not_what_was_moved_aside(tmp_path: Path) -> None:
    spool = tmp_path / "spool"
    (spool / "failed").mkdir(parents=True)
    (spool / "failed" / "00000000000000000001-old.json").write_text("x" * 10_000)
    shipper = unreachable_shipper(spool, max_bytes=2000)
    shipper.spool(batch_of("b0", 1000))
    shipper.spool(batch_of("b1", 1000))
    assert spooled_ids(shipper) == ["b0", "b1"] and shipper.dropped == 0
    assert (spool / "failed" / "00000000000000000001-old.json").exists()
    shipper.close()


def test_a_shipped_batch_over_the_bound_keeps_the_newest_while_the_api_is_down(
        tmp_path: Path) -> None:
    shipper = unreachable_shipper(tmp_path / "spool", max_bytes=2500)
    for i in range(4):  # ~1 kB each with the shipper's counts; the API never answers
        left = shipper.ship(batch_of(f"b{i}", 1000))
    assert shipper.last_status is None and not shipper.refused
    assert spooled_ids(shipper) == ["b2", "b3"] and left == 2 and shipper.dropped == 2
    assert shipper.spool_bytes() == sum(p.stat().st_size for p in shipper.pending()) <= 2500
    shipper.close()


# -- a refused token, against a real API --------------------------------------------------

ADMIN = "rw_watch_admin_token_for_tests"


@pytest.fixture
def server(database_url, clean_db, tmp_path):
    with running_api(database_url, tmp_path, ADMIN) as env:
        yield env


def test_a_revoked_token_is_loud_names_its_prefix_only_and_keeps_the_batch(
        server, tmp_path: Path, caplog) -> None:
    api = server["RINGWATCH_API_URL"]
    admin = {"Authorization": f"Bearer {ADMIN}"}
    made = httpx.post(f"{api}/v1/tokens", json={"role": "agent", "name": "sched"},
                      headers=admin, timeout=30)
    assert made.status_code == 201, made.text
    token, token_id = made.json()["token"], made.json()["id"]
    caplog.set_level(logging.INFO, logger="ringwatch.services.scheduler.shipper")
    shipper = Shipper(api, token, tmp_path / "spool", timeout_s=30, max_bytes=1 << 30)
    watch = SchedulerWatch("a", "sched-a:41", 300.0, host="sched-a")

    def report() -> dict:
        watch.ingest(shipper.last_status)
        watch.spool(len(shipper.pending()), shipper.spool_bytes(), shipper.dropped)
        return {name: v for (name, _), v in samples(watch.render()).items()}

    try:
        assert shipper.ship(fleet_batch(prefix="w")) == 0
        assert (shipper.last_status, shipper.refused, shipper.spool_bytes()) == (200, False, 0)
        assert report()["ringwatch_scheduler_ingest_refused"] == 0.0
        assert httpx.delete(f"{api}/v1/tokens/{token_id}", headers=admin,
                            timeout=30).status_code == 204

        kept = fleet_batch(prefix="w")
        assert shipper.ship(kept) == 1
        assert (shipper.last_status, shipper.refused) == (401, True)
        assert spooled_ids(shipper) == [kept["batch_id"]]
        assert shipper.spool_bytes() == shipper.pending()[0].stat().st_size > 0
        got = report()
        assert got["ringwatch_scheduler_ingest_refused"] == 1.0
        assert got["ringwatch_scheduler_last_ingest_status"] == 401.0
        assert got["ringwatch_scheduler_spool_batches"] == 1.0

        errors = [r for r in caplog.records if r.levelno == logging.ERROR]
        assert len(errors) == 1
        said = errors[0].getMessage()
        assert f"{token[:8]}…" in said and "401" in said
        assert "unknown or revoked token" in said  # the API's reason
        assert kept["batch_id"] in said
        # Between cycles the refused shipper does not ask (and log) at every flush...
        assert shipper.flush() == 1
        assert len([r for r in caplog.records if r.levelno == logging.ERROR]) == 1
        # ...but every batch shipped asks again, and every refusal is said again.
        assert shipper.ship(fleet_batch(prefix="w")) == 2
        assert len([r for r in caplog.records if r.levelno == logging.ERROR]) == 2
        # The whole token is in no line logged, at any level.
        assert token not in caplog.text
        assert all(token not in r.getMessage() for r in caplog.records)
    finally:
        shipper.close()


def test_a_token_without_the_right_to_send_is_refused_loudly_too(
        server, tmp_path: Path, caplog) -> None:
    api = server["RINGWATCH_API_URL"]
    admin = {"Authorization": f"Bearer {ADMIN}"}
    reader = httpx.post(f"{api}/v1/tokens", json={"role": "reader", "name": "not-an-agent"},
                        headers=admin, timeout=30).json()["token"]
    caplog.set_level(logging.ERROR, logger="ringwatch.services.scheduler.shipper")
    shipper = Shipper(api, reader, tmp_path / "spool", timeout_s=30)
    try:
        batch = fleet_batch(prefix="r")
        assert shipper.ship(batch) == 1
        assert (shipper.last_status, shipper.refused) == (403, True)
        assert spooled_ids(shipper) == [batch["batch_id"]]
        [error] = caplog.records
        assert f"{reader[:8]}…" in error.getMessage() and "403" in error.getMessage()
        assert reader not in caplog.text
    finally:
        shipper.close()
