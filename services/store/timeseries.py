"""The measurement time series over its life: day partitions, rollups and retention.

Raw measurements live in ``measurements``, partitioned by day; they enter by COPY and
leave a whole partition at a time. Two rollups keep the shape of every series for longer:

- ``series_1h``: per link, op and size and per hour, count, min, median, max and mean
  busbw, median algbw and time, summed wrong elements; computed from the raw rows.
- ``series_1d``: the same per day, computed from the hourly rows (the median is the median
  of the hourly medians; min, max, mean and counts are exact).

``maintain`` does the periodic work: partitions made ahead, the rollups brought up to
date, and retention applied (a raw partition is dropped only once it has been rolled up).
A batch that arrives late (a spool replayed after an outage) marks the hourly rollup dirty
from its oldest measurement; the next pass recomputes from there.

Locking: an ingest takes a KEY SHARE lock on the hourly rollup's state row, a pass takes
FOR UPDATE on it. A pass therefore waits for ingests in flight (and sees their rows), and
an ingest that starts during a pass reads the state the pass committed.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import Engine, text
from sqlalchemy.orm import Session

from ringwatch.services.store import heartbeats, nodes
from ringwatch.services.store.models import is_partition, measurements, series_1d, series_1h

log = logging.getLogger(__name__)

DAY = timedelta(days=1)
HOUR = timedelta(hours=1)
# A bucket is rolled up once it closed this long ago (a batch ships within seconds).
GRACE = timedelta(minutes=5)
# The most raw time one rollup transaction covers (it holds off ingests while it runs).
CHUNK = timedelta(hours=3)
# pg_advisory_lock key of the maintenance pass: one runner at a time across API replicas.
MAINTENANCE_LOCK = 0x72696E67  # "ring"
RESOLUTIONS = ("raw", "1h", "1d")


@dataclass(frozen=True)
class Retention:
    """Days each resolution is kept; and days a node no batch names stays in the fleet
    (0: for good; services.store.nodes.retire_unseen)."""

    raw_days: float = 14.0
    hourly_days: float = 90.0
    daily_days: float = 730.0
    node_days: float = 0.0


def day_of(t: datetime) -> datetime:
    t = t.astimezone(UTC)
    return datetime(t.year, t.month, t.day, tzinfo=UTC)


def hour_of(t: datetime) -> datetime:
    t = t.astimezone(UTC)
    return datetime(t.year, t.month, t.day, t.hour, tzinfo=UTC)


def partition_name(day: datetime) -> str:
    return f"measurements_p{day:%Y%m%d}"


def _day_of_partition(name: str) -> datetime:
    return datetime.strptime(name[len("measurements_p"):], "%Y%m%d").replace(tzinfo=UTC)


# ---------------------------------------------------------------- partitions


def partitions(conn: Any) -> list[str]:
    """The day partitions of ``measurements``, oldest first."""
    rows = conn.execute(text(
        "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid "
        "WHERE i.inhparent = 'measurements'::regclass")).scalars()
    return sorted(n for n in rows if is_partition(n))


def ensure_partitions(engine: Engine, times: Iterable[datetime]) -> list[str]:
    """Make the day partitions ``times`` fall in; return those created.

    Runs in its own short transaction: creating a partition locks the parent table, which
    must not be held for the rest of an ingest. Usually nothing is created here, because
    each maintenance pass makes the coming days ahead.
    """
    names = sorted({partition_name(day_of(t)) for t in times})
    if not names:
        return []
    with engine.connect() as conn:
        missing = list(conn.execute(
            text("SELECT n FROM unnest(CAST(:names AS text[])) AS n WHERE to_regclass(n) IS NULL"),
            {"names": names}).scalars())
    created = []
    for name in missing:
        day = _day_of_partition(name)
        with engine.begin() as conn:
            conn.execute(text(
                f'CREATE TABLE IF NOT EXISTS "{name}" PARTITION OF measurements '
                f"FOR VALUES FROM ('{day.isoformat()}') TO ('{(day + DAY).isoformat()}')"))
        created.append(name)
    if created:
        log.info("created measurement partition(s) %s", ", ".join(created))
    return created


def drop_partitions_before(engine: Engine, cutoff: datetime, rolled_until: datetime | None) -> list[str]:
    """Drop the day partitions that end at or before ``cutoff`` and whose hours have all
    been rolled up (never data that exists nowhere else)."""
    with engine.connect() as conn:
        names = partitions(conn)
    dropped = []
    for name in names:
        end = _day_of_partition(name) + DAY
        if end > cutoff or rolled_until is None or end > rolled_until:
            continue
        with engine.begin() as conn:
            conn.execute(text("SET LOCAL lock_timeout = '10s'"))
            conn.execute(text(f'DROP TABLE IF EXISTS "{name}"'))
        dropped.append(name)
    return dropped


# ---------------------------------------------------------------- ingest side


def note_ingest(session: Session, earliest: datetime) -> None:
    """In an ingest's transaction: hold the hourly rollup's state against a concurrent
    pass, and mark it dirty from ``earliest`` when the batch reaches into rolled hours."""
    rolled = session.execute(text(
        "SELECT rolled_until FROM rollup_state WHERE resolution = '1h' FOR KEY SHARE")).scalar()
    if rolled is not None and earliest < rolled:
        session.execute(text(
            "UPDATE rollup_state SET dirty_from = LEAST(COALESCE(dirty_from, :t), :t) "
            "WHERE resolution = '1h'"), {"t": hour_of(earliest)})


# ---------------------------------------------------------------- rollups

# Both rollups write the same columns and replace a bucket they recompute.
_ROLLUP_COLUMNS = """bucket, group_id, op, size_bytes, count, busbw_min, busbw_median, busbw_max,
                      busbw_mean, algbw_median, time_us_median, wrong"""
_REPLACE = """
ON CONFLICT (group_id, op, size_bytes, bucket) DO UPDATE SET
  count = excluded.count, busbw_min = excluded.busbw_min,
  busbw_median = excluded.busbw_median, busbw_max = excluded.busbw_max,
  busbw_mean = excluded.busbw_mean, algbw_median = excluded.algbw_median,
  time_us_median = excluded.time_us_median, wrong = excluded.wrong
"""

_AGG_FROM_RAW = f"""
INSERT INTO series_1h ({_ROLLUP_COLUMNS})
SELECT date_trunc('hour', time, 'UTC'), group_id, op, size_bytes, count(*), min(busbw_gbs),
       percentile_cont(0.5) WITHIN GROUP (ORDER BY busbw_gbs), max(busbw_gbs), avg(busbw_gbs),
       percentile_cont(0.5) WITHIN GROUP (ORDER BY algbw_gbs),
       percentile_cont(0.5) WITHIN GROUP (ORDER BY time_us), sum(wrong)
FROM measurements WHERE time >= :start AND time < :end AND contended IS NULL
GROUP BY 1, 2, 3, 4
""" + _REPLACE

_AGG_FROM_HOURLY = f"""
INSERT INTO series_1d ({_ROLLUP_COLUMNS})
SELECT date_trunc('day', bucket, 'UTC'), group_id, op, size_bytes, sum(count),
       min(busbw_min), percentile_cont(0.5) WITHIN GROUP (ORDER BY busbw_median),
       max(busbw_max), sum(busbw_mean * count) / sum(count),
       percentile_cont(0.5) WITHIN GROUP (ORDER BY algbw_median),
       percentile_cont(0.5) WITHIN GROUP (ORDER BY time_us_median), sum(wrong)
FROM series_1h WHERE bucket >= :start AND bucket < :end
GROUP BY 1, 2, 3, 4
""" + _REPLACE


@dataclass
class PassReport:
    created: list[str] = field(default_factory=list)
    hourly: list[tuple[datetime, datetime]] = field(default_factory=list)
    daily: list[tuple[datetime, datetime]] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)
    deleted: dict[str, int] = field(default_factory=dict)
    nodes_retired: int = 0
    skipped: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {
            "skipped": self.skipped, "partitions_created": self.created,
            "partitions_dropped": self.dropped, "rows_deleted": self.deleted,
            "nodes_retired": self.nodes_retired,
            "hourly_rolled": [[a.isoformat(), b.isoformat()] for a, b in self.hourly],
            "daily_rolled": [[a.isoformat(), b.isoformat()] for a, b in self.daily],
        }


def _state(conn: Any, resolution: str, lock: bool) -> tuple[datetime | None, datetime | None]:
    conn.execute(text("INSERT INTO rollup_state (resolution) VALUES (:r) ON CONFLICT DO NOTHING"),
                 {"r": resolution})
    row = conn.execute(text(
        "SELECT rolled_until, dirty_from FROM rollup_state WHERE resolution = :r"
        + (" FOR UPDATE" if lock else "")), {"r": resolution}).one()
    return row[0], row[1]


def _span(rolled: datetime | None, dirty: datetime | None, floor: datetime,
          horizon: datetime, step: timedelta) -> tuple[datetime, datetime, bool]:
    """The next span to (re)compute: from the oldest dirty bucket up to where it was rolled
    (``resume``), else onwards from where it was rolled up to ``horizon``; at most ``step``."""
    if dirty is not None and rolled is not None and max(dirty, floor) < rolled:
        start = max(dirty, floor)
        return start, min(start + step, rolled), True
    start = max(rolled or floor, floor)
    return start, min(start + step, horizon), False


def _roll(engine: Engine, resolution: str, now: datetime, floor: datetime | None,
          max_chunks: int) -> list[tuple[datetime, datetime]]:
    """Bring one rollup up to date, one chunk per transaction; return the spans rolled."""
    sql, step = (_AGG_FROM_RAW, CHUNK) if resolution == "1h" else (_AGG_FROM_HOURLY, DAY)
    done: list[tuple[datetime, datetime]] = []
    for _ in range(max_chunks):
        with engine.begin() as conn:
            rolled, dirty = _state(conn, resolution, lock=True)
            horizon: datetime | None
            if resolution == "1h":
                horizon = hour_of(now - GRACE)
            else:  # the days whose hours are all rolled
                hourly, _ = _state(conn, "1h", lock=False)
                horizon = day_of(hourly) if hourly else None
            if floor is None or horizon is None:
                return done
            start, end, resume = _span(rolled, dirty, floor, horizon, step)
            if not resume:  # skip a gap with no data in one step instead of chunk by chunk
                start = max(start, min(_next_data(conn, resolution, start) or horizon, horizon))
                end = min(start + step, horizon)
            if start >= end:
                if dirty is not None:
                    conn.execute(text("UPDATE rollup_state SET dirty_from = NULL "
                                      "WHERE resolution = :r"), {"r": resolution})
                return done
            conn.execute(text(sql), {"start": start, "end": end})
            new_rolled = end if rolled is None else max(rolled, end)
            new_dirty = end if resume and end < new_rolled else None
            conn.execute(text("UPDATE rollup_state SET rolled_until = :u, dirty_from = :d "
                              "WHERE resolution = :r"),
                         {"u": new_rolled, "d": new_dirty, "r": resolution})
            if resolution == "1h":  # the days these hours belong to change in the daily rollup
                conn.execute(text(
                    "UPDATE rollup_state SET dirty_from = LEAST(COALESCE(dirty_from, :t), :t) "
                    "WHERE resolution = '1d' AND rolled_until > :t"), {"t": day_of(start)})
            done.append((start, end))
    return done


def _next_data(conn: Any, resolution: str, start: datetime) -> datetime | None:
    """Where the source of ``resolution`` next has data at or after ``start``."""
    if resolution == "1h":
        days = [_day_of_partition(n) for n in partitions(conn)]
        later = [d for d in days if d + DAY > start]
        return max(later[0], start) if later else None
    t = conn.execute(text("SELECT min(bucket) FROM series_1h WHERE bucket >= :s"),
                     {"s": start}).scalar()
    return day_of(t) if t else None


def _oldest_hour(engine: Engine) -> datetime | None:
    with engine.connect() as conn:
        names = partitions(conn)
    return _day_of_partition(names[0]) if names else None


def _oldest_bucket(engine: Engine) -> datetime | None:
    with engine.connect() as conn:
        t = conn.execute(text("SELECT min(bucket) FROM series_1h")).scalar()
    return day_of(t) if t else None


def maintain(engine: Engine, retention: Retention, now: datetime | None = None,
             max_chunks: int = 200) -> PassReport:
    """One maintenance pass; skipped when another process is running one. A pass that ran
    beats the ``maintenance`` heartbeat, ok or failed (RingwatchMaintenanceFailed reads it);
    a skipped one is no pass."""
    try:
        report = _pass(engine, retention, now or datetime.now(UTC), max_chunks)
    except Exception:
        heartbeats.note(engine, heartbeats.MAINTENANCE, ok=False)
        raise
    if not report.skipped:
        heartbeats.note(engine, heartbeats.MAINTENANCE, ok=True)
    return report


def _pass(engine: Engine, retention: Retention, now: datetime, max_chunks: int) -> PassReport:
    report = PassReport()
    with engine.connect() as lock_conn:
        got = lock_conn.execute(text("SELECT pg_try_advisory_lock(:k)"),
                                {"k": MAINTENANCE_LOCK}).scalar()
        lock_conn.commit()
        if not got:
            report.skipped = True
            return report
        try:
            report.created = ensure_partitions(
                engine, [now - DAY, now, now + DAY, now + 2 * DAY])
            report.hourly = _roll(engine, "1h", now, _oldest_hour(engine), max_chunks)
            report.daily = _roll(engine, "1d", now, _oldest_bucket(engine), max_chunks)
            with engine.connect() as conn:
                hourly_rolled, _ = _state(conn, "1h", lock=False)
                daily_rolled, _ = _state(conn, "1d", lock=False)
                conn.commit()
            report.dropped = drop_partitions_before(
                engine, day_of(now - timedelta(days=retention.raw_days)), hourly_rolled)
            report.deleted = _delete_old(engine, retention, now, daily_rolled)
            report.nodes_retired = nodes.retire_unseen(engine, retention.node_days)
        finally:
            lock_conn.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": MAINTENANCE_LOCK})
            lock_conn.commit()
    return report


_RETIRE_PROBE_RUNS = """
WITH gone AS (DELETE FROM probe_runs WHERE received_at < :t RETURNING measurement_count),
     n AS (SELECT count(*) AS batches, coalesce(sum(measurement_count), 0) AS measurements
           FROM gone),
     kept AS (INSERT INTO ingest_retired (id, batches, measurements)
              SELECT 1, batches, measurements FROM n WHERE batches > 0
              ON CONFLICT (id) DO UPDATE SET
                batches = ingest_retired.batches + excluded.batches,
                measurements = ingest_retired.measurements + excluded.measurements)
SELECT batches FROM n
"""


def _delete_old(engine: Engine, retention: Retention, now: datetime,
                daily_rolled: datetime | None) -> dict[str, int]:
    deleted = {}
    raw_cut = now - timedelta(days=retention.raw_days)
    hourly_cut = hour_of(now - timedelta(days=retention.hourly_days))
    if daily_rolled is not None:  # hours leave only once their day is in the daily rollup
        hourly_cut = min(hourly_cut, daily_rolled)
    else:
        hourly_cut = datetime.min.replace(tzinfo=UTC)
    daily_cut = day_of(now - timedelta(days=retention.daily_days))
    with engine.begin() as conn:
        for name, table, cut in (("series_1h", series_1h, hourly_cut),
                                 ("series_1d", series_1d, daily_cut)):
            deleted[name] = conn.execute(table.delete().where(table.c.bucket < cut)).rowcount
        # A probe run's own record (its findings) goes with its raw measurements; what it
        # counted moves to ingest_retired in the same statement, so the ingest counters
        # (services.store.metrics.ingest_totals) never see it twice or not at all.
        deleted["probe_runs"] = conn.execute(text(_RETIRE_PROBE_RUNS), {"t": raw_cut}).scalar_one()
        deleted["gpu_counters"] = conn.execute(
            text("DELETE FROM gpu_counters WHERE time < :t"), {"t": raw_cut}).rowcount
    return deleted


# ---------------------------------------------------------------- reading


def pick_resolution(asked: str, since: datetime | None, until: datetime | None,
                    retention: Retention, now: datetime | None = None) -> str:
    """``auto``: raw while the range is short and still held raw, hourly up to 90 days,
    daily beyond."""
    if asked != "auto":
        return asked
    if since is None:
        return "raw"
    now = now or datetime.now(UTC)
    span = (until or now) - since
    if span <= timedelta(days=3) and since >= now - timedelta(days=retention.raw_days):
        return "raw"
    if span <= timedelta(days=90) and since >= now - timedelta(days=retention.hourly_days):
        return "1h"
    return "1d"


def points(session: Session, resolution: str, group_id: int, *, op: str | None = None,
           size_bytes: int | None = None, since: datetime | None = None,
           until: datetime | None = None, limit: int = 10_000) -> Sequence[Any]:
    """One group's raw measurements (``raw``) or rollup buckets (``1h``, ``1d``) in time
    order; a bucket is included when it overlaps ``since``."""
    table = ROLLUPS.get(resolution, measurements)
    c = table.c
    at = c.time if table is measurements else c.bucket
    q = table.select().where(c.group_id == group_id)
    if op:
        q = q.where(c.op == op)
    if size_bytes:
        q = q.where(c.size_bytes == size_bytes)
    if since:
        q = q.where(at >= {"raw": since, "1h": hour_of(since)}.get(resolution, day_of(since)))
    if until:
        q = q.where(at <= until)
    return session.execute(q.order_by(at, c.op, c.size_bytes).limit(limit)).all()


ROLLUPS = {"1h": series_1h, "1d": series_1d}
