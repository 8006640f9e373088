"""The time series over its life: day partitions, hourly and daily rollups checked against
the raw rows, late batches rolled in, retention dropping exactly what it should, the
series read at the resolution its range asks for, and backpressure at the ingest door."""

from __future__ import annotations

import random
import re
import statistics
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import text

from ringwatch.services.monitor.ingest import IngestRequest, ingest_batch
from ringwatch.services.store import db, timeseries
from ringwatch.services.store.models import series_1d, series_1h
from ringwatch.services.store.timeseries import Retention, day_of
from tests.api_fixtures import api_client, measurement

NOW = datetime.now(UTC)
GROUPS = {"a": ["node-000/0", "node-000/1"], "b": ["node-000/0", "node-001/0"]}


def _store(factory, rows: list[dict[str, Any]]) -> None:
    with db.transaction(factory) as s:
        ingest_batch(s, IngestRequest(uuid.uuid4().hex, "gloo", rows))


def _probes(start: datetime, hours: int, per_hour: int, rng: random.Random) -> list[dict[str, Any]]:
    rows = []
    for h in range(hours):
        for i in range(per_hour):
            t = start + timedelta(hours=h, minutes=i * 60 / per_hour + rng.uniform(0, 1))
            for name, members in GROUPS.items():
                scope = "intra_node" if name == "a" else "inter_node"
                rows.append(measurement(members, rng.uniform(5, 25), scope=scope, time=t,
                                        wrong=rng.choice((0, 0, 0, 2))))
    return rows


def _engine(factory):
    return factory.kw["bind"]


def _rollup(factory, table) -> dict[tuple[int, datetime], Any]:
    with db.transaction(factory) as s:
        return {(r.group_id, r.bucket): r for r in s.execute(table.select())}


def _group_ids(factory) -> dict[str, int]:
    with db.transaction(factory) as s:
        ids = dict(s.execute(text("SELECT key, id FROM groups")).tuples().all())
    return {name: ids[",".join(sorted(m))] for name, m in GROUPS.items()}


def _expected(rows: list[dict[str, Any]], bucket_of) -> dict[tuple[str, datetime], list[dict]]:
    out: dict[tuple[str, datetime], list[dict]] = {}
    for r in rows:
        name = next(n for n, m in GROUPS.items() if sorted(m) == sorted(r["members"]))
        out.setdefault((name, bucket_of(datetime.fromisoformat(r["time"]))), []).append(r)
    return out


def test_hourly_and_daily_rollups_agree_with_the_raw_rows(clean_db) -> None:
    rng = random.Random(7)
    start = day_of(NOW - timedelta(days=3)) + timedelta(hours=20)  # crosses midnight
    rows = _probes(start, hours=6, per_hour=5, rng=rng)
    _store(clean_db, rows)
    report = timeseries.maintain(_engine(clean_db), Retention(), now=NOW)
    assert report.hourly and report.daily and not report.dropped
    ids = _group_ids(clean_db)
    hourly = _rollup(clean_db, series_1h)
    expected = _expected(rows, timeseries.hour_of)
    assert len(hourly) == len(expected) == 12
    for (name, bucket), raw in expected.items():
        got = hourly[(ids[name], bucket)]
        bw = [r["busbw_gbs"] for r in raw]
        assert got.count == len(raw)
        assert got.busbw_min == pytest.approx(min(bw)) and got.busbw_max == pytest.approx(max(bw))
        assert got.busbw_median == pytest.approx(statistics.median(bw))
        assert got.busbw_mean == pytest.approx(statistics.fmean(bw))
        assert got.time_us_median == pytest.approx(statistics.median(r["time_us"] for r in raw))
        assert got.wrong == sum(r["wrong"] for r in raw)
    daily = _rollup(clean_db, series_1d)
    by_day = _expected(rows, day_of)
    assert len(daily) == len(by_day) == 4
    for (name, day), raw in by_day.items():
        got = daily[(ids[name], day)]
        bw = [r["busbw_gbs"] for r in raw]
        hours = [h for (gid, b), h in hourly.items() if gid == ids[name] and day_of(b) == day]
        assert got.count == len(raw)
        assert got.busbw_min == pytest.approx(min(bw)) and got.busbw_max == pytest.approx(max(bw))
        assert got.busbw_mean == pytest.approx(statistics.fmean(bw))
        assert got.busbw_median == pytest.approx(statistics.median(h.busbw_median for h in hours))


def test_a_late_batch_is_rolled_into_hours_already_rolled(clean_db) -> None:
    rng = random.Random(3)
    start = day_of(NOW - timedelta(days=2)) + timedelta(hours=5)
    first = _probes(start, hours=2, per_hour=3, rng=rng)
    _store(clean_db, first)
    timeseries.maintain(_engine(clean_db), Retention(), now=NOW)
    ids = _group_ids(clean_db)
    before = _rollup(clean_db, series_1h)[(ids["a"], start)]
    # A spool replayed after an outage: the same hour, long after it was rolled up.
    late = [measurement(GROUPS["a"], 1.0, scope="intra_node", time=start + timedelta(minutes=59))]
    _store(clean_db, late)
    timeseries.maintain(_engine(clean_db), Retention(), now=NOW)
    after = _rollup(clean_db, series_1h)[(ids["a"], start)]
    assert after.count == before.count + 1 and after.busbw_min == pytest.approx(1.0)
    daily = _rollup(clean_db, series_1d)[(ids["a"], day_of(start))]
    assert daily.count == before.count + 3 + 1 and daily.busbw_min == pytest.approx(1.0)
    with db.transaction(clean_db) as s:
        assert s.execute(text("SELECT dirty_from FROM rollup_state")).scalars().all() == [None, None]


def _partition_days(factory) -> set[datetime]:
    with db.transaction(factory) as s:
        names = timeseries.partitions(s.connection())
    return {datetime.strptime(n[-8:], "%Y%m%d").replace(tzinfo=UTC) for n in names}


def test_retention_drops_whole_days_only_once_rolled_up(clean_db) -> None:
    rng = random.Random(5)
    old, mid, new = (day_of(NOW - timedelta(days=d)) + timedelta(hours=3) for d in (40, 20, 2))
    for start in (old, mid, new):
        _store(clean_db, _probes(start, hours=1, per_hour=2, rng=rng))
    engine = _engine(clean_db)
    # Nothing rolled yet: not even a day past retention may go.
    assert timeseries.drop_partitions_before(engine, day_of(NOW), rolled_until=None) == []
    assert {day_of(old), day_of(mid), day_of(new)} <= _partition_days(clean_db)

    report = timeseries.maintain(engine, Retention(raw_days=14, hourly_days=30, daily_days=365),
                                 now=NOW)
    days = _partition_days(clean_db)
    assert day_of(old) not in days and day_of(mid) not in days and day_of(new) in days
    assert set(report.dropped) >= {timeseries.partition_name(day_of(d)) for d in (old, mid)}
    hourly_days = {day_of(b) for _, b in _rollup(clean_db, series_1h)}
    assert hourly_days == {day_of(mid), day_of(new)}  # 40 days > 30 days of hourly rows
    daily_days = {b for _, b in _rollup(clean_db, series_1d)}
    assert daily_days == {day_of(old), day_of(mid), day_of(new)}

    timeseries.maintain(engine, Retention(raw_days=14, hourly_days=30, daily_days=30), now=NOW)
    assert {b for _, b in _rollup(clean_db, series_1d)} == {day_of(mid), day_of(new)}
    # What is left still reads back: the 20-day-old hours from the rollup, not the raw rows.
    with db.transaction(clean_db) as s:
        raw = s.execute(text("SELECT count(*) FROM measurements WHERE time < :t"),
                        {"t": NOW - timedelta(days=14)}).scalar()
    assert raw == 0


def test_the_series_resolution_follows_the_range_asked(clean_db) -> None:
    rng = random.Random(11)
    start = day_of(NOW - timedelta(days=10)) + timedelta(hours=1)
    rows = _probes(start, hours=3, per_hour=4, rng=rng)
    recent = _probes(NOW - timedelta(hours=2), hours=1, per_hour=2, rng=rng)
    _store(clean_db, rows + recent)
    timeseries.maintain(_engine(clean_db), Retention(), now=NOW)
    with api_client(clean_db) as api:
        q = {"members": ",".join(GROUPS["a"])}
        week = api.get("/v1/series", params={**q, "since": (NOW - timedelta(days=12)).isoformat()},
                       headers=api.h["reader"]).json()
        assert week["resolution"] == "1h"
        old = [p for p in week["points"] if p["time"] < (NOW - timedelta(days=5)).isoformat()]
        assert [p["count"] for p in old] == [4, 4, 4]
        assert all(p["busbw_min"] <= p["busbw_gbs"] <= p["busbw_max"] for p in old)
        short = api.get("/v1/series", params={**q, "since": (NOW - timedelta(hours=3)).isoformat()},
                        headers=api.h["reader"]).json()
        assert short["resolution"] == "raw" and len(short["points"]) == 2
        assert all(p["count"] is None and p["dtype"] == "float32" for p in short["points"])
        daily = api.get("/v1/series", params={**q, "resolution": "1d"},
                        headers=api.h["reader"]).json()
        assert [p["count"] for p in daily["points"]][0] == 12
        bad = api.get("/v1/series", params={**q, "resolution": "5m"}, headers=api.h["reader"])
        assert bad.status_code == 422 and bad.json()["error"] == "invalid_input"


def test_a_world_group_of_4096_by_8_ranks_is_stored_once(clean_db) -> None:
    world = [f"node-{n:04d}/{g}" for n in range(4096) for g in range(8)]
    ms = [measurement(world, bw, scope="world", size=size)
          for bw, size in ((30.0, 1 << 20), (40.0, 1 << 28))]
    with api_client(clean_db) as api:
        r = api.post("/v1/measurements", headers=api.h["agent"],
                     json={"batch_id": "world", "backend": "nccl", "measurements": ms})
        assert r.status_code == 200, r.text
        key = api.get("/v1/links", params={"scope": "world"},
                      headers=api.h["reader"]).json()[0]["group_key"]
        got = api.get("/v1/series", params={"group": key}, headers=api.h["reader"]).json()
        assert len(got["members"]) == 32768 and len(got["points"]) == 2
    with db.transaction(clean_db) as s:
        # The members are stored once, in the group; each measurement names it by id.
        assert s.execute(text("SELECT count(*), max(cardinality(members)) FROM groups")).one() == (
            1, 32768)
        assert s.execute(text("SELECT count(DISTINCT group_id) FROM measurements")).scalar() == 1


def test_backpressure_is_a_503_with_retry_after_and_a_413_names_the_limit(clean_db) -> None:
    batch = {"batch_id": "b", "backend": "gloo",
             "measurements": [measurement(GROUPS["a"], 10.0, scope="intra_node")] * 3}
    with api_client(clean_db, settings={"max_concurrent_ingests": 1, "ingest_wait_s": 0,
                                        "max_batch_measurements": 2}) as api:
        r = api.post("/v1/measurements", json=batch, headers=api.h["agent"])
        assert r.status_code == 413 and "limit is 2" in r.json()["message"]
        batch["measurements"] = batch["measurements"][:2]
        slots = api.app.state.ingest_slots
        api.portal.call(slots.acquire)  # another batch is being stored

        async def release() -> None:
            slots.release()

        try:
            r = api.post("/v1/measurements", json=batch, headers=api.h["agent"])
        finally:
            api.portal.call(release)
        assert r.status_code == 503 and r.json()["error"] == "busy"
        assert int(r.headers["Retry-After"]) >= 1
        r = api.post("/v1/measurements", json=batch, headers=api.h["agent"])
        assert r.status_code == 200 and r.json()["stored"] == 2


def test_a_measurement_from_the_future_is_refused(clean_db) -> None:
    ahead = measurement(GROUPS["a"], 10.0, scope="intra_node", time=NOW + timedelta(days=400))
    with api_client(clean_db) as api:
        r = api.post("/v1/measurements", headers=api.h["agent"],
                     json={"batch_id": "f", "backend": "gloo", "measurements": [ahead]})
        assert r.status_code == 422 and "clock" in r.json()["message"]


def test_metrics_count_each_hosts_spooled_and_moved_aside_batches(clean_db) -> None:
    with api_client(clean_db) as api:
        for host, failed in (("sched-a", 0), ("sched-b", 2), ("sched-b", 3)):
            r = api.post("/v1/measurements", headers=api.h["agent"], json={
                "batch_id": uuid.uuid4().hex, "backend": "gloo",
                "measurements": [measurement(GROUPS["a"], 10.0, scope="intra_node")],
                "shipper": {"host": host, "pending": 1, "failed": failed, "rejected": 0}})
            assert r.status_code == 200, r.text
        text_ = api.get("/metrics").text
    # One token's spools, per host it named (docs/security.md, "The shipper's identity").
    token = r'token="\d+"'
    assert re.search(rf'ringwatch_shipper_batches{{host="sched-b",state="failed",{token}}} 3', text_)
    assert re.search(rf'ringwatch_shipper_batches{{host="sched-a",state="failed",{token}}} 0', text_)
