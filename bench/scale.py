"""The service at fleet scale: the real scheduler loop on the sim backend at 1024 x 8
shipping every cycle to the real API process and Postgres, then history, reads and disk.

1. The whole path: ``run_scheduler`` (planner, rotation, shipper, spool) for 20 cycles
   at 1024 x 8 with faults; per batch: measurements, POST time end to end, the API's own
   store/judge split (Server-Timing). Ingest rate, against a raw binary COPY of the same
   rows into a table of the same layout in the same server (the COPY ratio).
2. Flat with history: 200 batches of 128 x 8 cycles (the sim's, re-stamped to now) into a
   fresh database: time per batch, first ten against last ten.
3. Disk: bytes per raw measurement (heap + index), per hourly and daily rollup row, and
   the projected disk for 1024 nodes over 30 days at the default interval and retention.
4. Reads over history: 30 days of one node's links seeded at one probe per 5 minutes and
   rolled up; ``GET /v1/series`` for 30 days (hourly) and 1 day (raw), and a stored-answer
   ``POST /v1/preflight`` of all 1024 nodes: p50 and p99.
5. Scrapes: ``GET /metrics`` after 5 cycles, cold and cached, its body's size and series,
   and a model of the body once the rotation has probed every node pair.

    python -m bench.run scale            # all of it (about 15 minutes on 2 cores)
    python -m bench.run scale --quick    # 256 x 8, 5 cycles, 50 batches of history
"""

from __future__ import annotations

import os
import random
import statistics
import threading
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy import text

from bench import admin_url
from bench.monitoring import scenario
from ringwatch.agents.sim import SimBackend
from ringwatch.services.scheduler.cycle import ProbeOptions, Rotation, run_cycle, run_scheduler
from ringwatch.services.scheduler.shipper import Shipper
from ringwatch.services.settings import Settings
from ringwatch.services.store import db, timeseries
from ringwatch.services.store.measurements import COPY_COLUMNS, COPY_TYPES, storage_bytes
from tests.procs import free_port, start_server, stop_server

TOKEN = "rw_bench_" + uuid.uuid4().hex
INTERVAL_S = Settings().probe_interval_s


class Service:
    """A fresh database and a real `ringwatch serve` on it."""

    def __init__(self, state: Path, **settings: str) -> None:
        self.admin = admin_url()
        self.name = f"rw_scale_{uuid.uuid4().hex[:8]}"
        self.url = db.create_database(self.admin, self.name)
        db.upgrade(self.url)
        self.env = {**os.environ, "RINGWATCH_DATABASE_URL": self.url,
                    "RINGWATCH_BOOTSTRAP_ADMIN_TOKEN": TOKEN, "RINGWATCH_TOKEN": TOKEN,
                    "RINGWATCH_API_URL": f"http://127.0.0.1:{free_port()}",
                    "RINGWATCH_STATE_DIR": str(state), **settings}
        self.proc = start_server(self.env, notifier=False)
        self.api = httpx.Client(base_url=self.env["RINGWATCH_API_URL"], timeout=300,
                                headers={"Authorization": f"Bearer {TOKEN}"})
        self.engine = db.make_engine(self.url)

    def close(self) -> None:
        self.api.close()
        stop_server(self.proc)
        self.engine.dispose()
        db.drop_database(self.admin, self.name)


class TimedShipper(Shipper):
    """The scheduler's shipper, noting each POST's time, size and the API's timing."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.sent: list[dict[str, float]] = []
        post = self.client.post

        def timed(url: str, **kw: Any) -> httpx.Response:
            t0 = time.perf_counter()
            resp = post(url, **kw)
            took = time.perf_counter() - t0
            timing = {k: float(v) / 1000 for k, _, v in (
                p.strip().partition(";dur=") for p in resp.headers.get("server-timing", "").split(",")
                if ";dur=" in p)}
            self.sent.append({"total": took, "bytes": len(kw.get("content", b"")),
                              "status": resp.status_code, **timing,
                              "stored": resp.json().get("stored", 0) if resp.status_code == 200 else 0})
            return resp

        self.client.post = timed  # type: ignore[method-assign]


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def copy_rate(svc: Service, batch: dict[str, Any], repeats: int = 3) -> float:
    """Rows/s of a raw binary COPY of ``batch``'s measurements into a plain table with the
    measurements' columns and index, in the same server."""
    rows = [(datetime.fromisoformat(m["time"]), m["size_bytes"], m["time_us"], m["algbw_gbs"],
             m["busbw_gbs"], m.get("preset_gbs"), i % 5000, 1, m["warmup"], m["iters"], m["wrong"],
             m["op"], "sim", m["dtype"], m.get("redop", "sum"), m.get("timing"))
            for i, m in enumerate(batch["measurements"])]
    rates = []
    with svc.engine.connect() as conn:
        dbapi = conn.connection.driver_connection
        assert dbapi is not None
        for _ in range(repeats):
            with dbapi.cursor() as cur:
                cur.execute("DROP TABLE IF EXISTS copy_probe")
                cur.execute("CREATE TABLE copy_probe (LIKE measurements INCLUDING DEFAULTS)")
                cur.execute("CREATE INDEX ON copy_probe (group_id, op, size_bytes, time)")
            dbapi.commit()
            t0 = time.perf_counter()
            with dbapi.cursor() as cur, cur.copy(
                    f"COPY copy_probe ({', '.join(COPY_COLUMNS)}) FROM STDIN (FORMAT BINARY)") as cp:
                cp.set_types(COPY_TYPES)
                for r in rows:
                    cp.write_row(r)
            dbapi.commit()
            rates.append(len(rows) / (time.perf_counter() - t0))
        with dbapi.cursor() as cur:
            cur.execute("DROP TABLE copy_probe")
        dbapi.commit()
    return statistics.median(rates)


def whole_path(nodes: int, cycles: int, state: Path) -> dict[str, Any]:
    sc = scenario(nodes, random.Random(20261123))
    svc = Service(state / "path")
    shipper = TimedShipper(svc.env["RINGWATCH_API_URL"], TOKEN, state / "path" / "spool")
    backend = SimBackend(sc)
    stop = threading.Event()
    done: list[float] = []
    last: dict[str, Any] = {}

    def progress(msg: str) -> None:
        if msg.startswith("cycle "):
            done.append(time.perf_counter())
            if len(done) >= cycles:
                stop.set()

    original = shipper.ship

    def ship(batch: dict[str, Any]) -> int:
        last.clear()
        last.update(batch)
        return original(batch)

    shipper.ship = ship  # type: ignore[method-assign]
    t0 = time.perf_counter()
    try:
        run_scheduler(backend, shipper, ProbeOptions(), interval_s=0.0, once=False, stop=stop,
                      progress=progress, jitter=0.0, max_duty=1.0,
                      rotation=Rotation())
        wall = time.perf_counter() - t0
        sent = [s for s in shipper.sent if s["status"] == 200]
        copy = copy_rate(svc, last)
        with db.transaction(db.make_session_factory(svc.engine)) as s:
            rows = s.execute(text("SELECT count(*) FROM measurements")).scalar() or 0
            sizes = storage_bytes(s)
            scopes = dict(s.execute(text(
                "SELECT g.scope, count(*) FROM measurements m JOIN groups g ON g.id = m.group_id "
                "GROUP BY 1")).tuples().all())
        # Roll everything up (as of tomorrow, an hour in) to size the rollup rows.
        timeseries.maintain(svc.engine, Settings().retention(),
                            now=timeseries.day_of(datetime.now(UTC)) + timedelta(days=1, hours=1))
        with db.transaction(db.make_session_factory(svc.engine)) as s:
            after = storage_bytes(s)
            hourly_rows = s.execute(text("SELECT count(*) FROM series_1h")).scalar() or 1
            daily_rows = s.execute(text("SELECT count(*) FROM series_1d")).scalar() or 1
        incidents = svc.api.get("/v1/findings", params={"status": "open"}).json()
    finally:
        shipper.close()
        svc.close()
    per_cycle = rows / len(sent)
    first, lastb = sent[0], sent[-1]
    rate = sum(s["stored"] for s in sent) / sum(s["total"] for s in sent)
    store_rate = sum(s["stored"] for s in sent) / sum(s.get("store", 0) for s in sent)
    rows_rate = sum(s["stored"] for s in sent) / sum(s.get("measurements", 0) for s in sent)
    print(f"\n{nodes} x 8, {len(sent)} cycles of the real scheduler loop into the real API "
          f"({wall:.0f} s; {len(incidents)} incident(s) open at the end, "
          f"{len(sc['faults'])} faults injected)")
    print(f"  per batch: {per_cycle:.0f} measurements, {statistics.median(s['bytes'] for s in sent) / 1e6:.1f} MB "
          f"of JSON; POST {statistics.median(s['total'] for s in sent):.2f} s median "
          f"(API store {statistics.median(s.get('store', 0) for s in sent):.2f} s, of which "
          f"the measurements' groups and COPY "
          f"{statistics.median(s.get('measurements', 0) for s in sent):.2f} s; "
          f"judge {statistics.median(s.get('judge', 0) for s in sent):.2f} s, "
          f"the rest parsing JSON and HTTP)")
    print(f"  time per batch: first {first['total']:.2f} s, last {lastb['total']:.2f} s "
          f"(x{lastb['total'] / first['total']:.2f})")
    print(f"  raw COPY of the same rows into the same server: {copy:,.0f} rows/s; in the API: "
          f"measurements (groups + COPY) {rows_rate:,.0f}/s (ratio {rows_rate / copy:.2f}), "
          f"whole storing stage {store_rate:,.0f}/s ({store_rate / copy:.2f}), end to end with "
          f"parsing and judging {rate:,.0f}/s ({rate / copy:.2f})")
    raw_b = sizes["measurements"] / max(rows, 1)
    hourly_b = after["series_1h"] / hourly_rows
    daily_b = after["series_1d"] / daily_rows
    print(f"  disk: {raw_b:.0f} bytes per raw measurement (heap + index), {hourly_b:.0f} per "
          f"hourly row, {daily_b:.0f} per daily row; groups table {sizes['groups'] / 1e6:.1f} MB")
    return {"per_cycle": per_cycle, "scopes": {k: v / len(sent) for k, v in scopes.items()},
            "raw_b": raw_b, "hourly_b": hourly_b, "daily_b": daily_b}


def project(nodes: int, fig: dict[str, Any], days: int = 30, scale: float = 1.0) -> None:
    """Disk for ``days`` and at steady state, at the default interval and retention.
    Intra-node and world groups repeat every cycle (one rollup row per hour or day each);
    node pairs rotate (a new matching every cycle), so for them a rollup row is nearly a
    raw row. ``scale``: the measured fleet's counts times this, for a larger fleet's model
    (measurements per cycle grow with the nodes)."""
    r = Settings().retention()
    per_day = 86400 / INTERVAL_S
    rotating = scale * (fig["scopes"].get("inter_node", 0) + fig["scopes"].get("gpu_pair", 0))
    per_cycle = scale * fig["per_cycle"]
    repeating = per_cycle - rotating
    raw_day = per_cycle * per_day * fig["raw_b"]
    hourly_day = (repeating * 24 + rotating * per_day) * fig["hourly_b"]
    daily_day = (repeating + rotating * per_day) * fig["daily_b"]

    def kept(span: float, daily_days: float) -> float:
        return (raw_day * min(span, r.raw_days) + hourly_day * min(span, r.hourly_days)
                + daily_day * min(span, daily_days))

    what = "model" if scale != 1.0 else "projected"
    print(f"  {what} for {nodes} nodes at one cycle per {INTERVAL_S:.0f} s: {per_cycle:,.0f} "
          f"measurements per cycle ({repeating:,.0f} repeating, {rotating:,.0f} rotating), "
          f"{per_cycle / INTERVAL_S:.0f} rows/s; raw {raw_day / 1e9:.2f} GB/day (kept "
          f"{r.raw_days:.0f} d), hourly {hourly_day / 1e9:.2f} GB/day (kept "
          f"{r.hourly_days:.0f} d), daily {daily_day / 1e9:.2f} GB/day (kept "
          f"{r.daily_days:.0f} d); {days} days: {kept(days, r.daily_days) / 1e9:.1f} GB; "
          f"steady state {kept(1e9, r.daily_days) / 1e9:.0f} GB "
          f"({kept(1e9, 400) / 1e9:.0f} GB with daily rows kept 400 d)")


def history(nodes: int, batches: int, state: Path) -> None:
    """Time per batch as history grows: the sim's cycles re-stamped to now, POSTed in turn."""
    sc = scenario(nodes, random.Random(7))
    sc["faults"] = []
    backend = SimBackend(sc)
    pool = [run_cycle(backend, ProbeOptions(), rotation=i).to_batch() for i in range(10)]
    svc = Service(state / "history")
    times = []
    try:
        for i in range(batches):
            now = datetime.now(UTC).isoformat()
            b = pool[i % len(pool)]
            body = {**b, "batch_id": uuid.uuid4().hex,
                    "measurements": [{**m, "time": now} for m in b["measurements"]]}
            t0 = time.perf_counter()
            r = svc.api.post("/v1/measurements", json=body)
            times.append(time.perf_counter() - t0)
            r.raise_for_status()
        with svc.engine.connect() as conn:
            rows = conn.execute(text("SELECT count(*) FROM measurements")).scalar()
    finally:
        svc.close()
    head, tail = statistics.median(times[:10]), statistics.median(times[-10:])
    print(f"\n{nodes} x 8 history: {batches} batches ({rows:,} measurements stored), "
          f"{len(pool[0]['measurements'])} per batch: time per batch first ten {head:.3f} s, "
          f"last ten {tail:.3f} s (x{tail / head:.2f}; target <= 1.2)")


def reads(nodes: int, state: Path, days: int = 30) -> None:
    """Series over 30 days of history and a stored preflight of every node."""
    sc = scenario(nodes, random.Random(3))
    sc["faults"] = []
    svc = Service(state / "reads")
    shipper = Shipper(svc.env["RINGWATCH_API_URL"], TOKEN, state / "reads" / "spool")
    try:
        cycle = run_cycle(SimBackend(sc), ProbeOptions(), rotation=0)
        shipper.ship(cycle.to_batch())
        # 30 days of node-000's links (intra-node group, its pairs) at one probe per 5 min.
        factory = db.make_session_factory(svc.engine)
        with db.transaction(factory) as s:
            groups = s.execute(text(
                "SELECT id FROM groups WHERE 'node-000' = ANY(nodes) AND scope <> 'world'"
            )).scalars().all()
        start = datetime.now(UTC) - timedelta(days=days)
        steps = int(days * 86400 / INTERVAL_S)
        timeseries.ensure_partitions(svc.engine, [start + timedelta(days=d) for d in range(days + 1)])
        rng = random.Random(1)
        t0 = time.perf_counter()
        n = 0
        with svc.engine.connect() as conn:
            dbapi = conn.connection.driver_connection
            assert dbapi is not None
            with dbapi.cursor() as cur, cur.copy(
                    f"COPY measurements ({', '.join(COPY_COLUMNS)}) FROM STDIN (FORMAT BINARY)") as cp:
                cp.set_types(COPY_TYPES)
                for k in range(steps):
                    t = start + timedelta(seconds=k * INTERVAL_S)
                    for gid in groups:
                        for op in ("allreduce", "alltoall"):
                            for size in (8, 1 << 28):
                                bw = rng.gauss(300, 6)
                                cp.write_row((t, size, size / bw / 1e3, bw / 1.75, bw, None, gid,
                                              1, 5, 20, 0, op, "sim", "float32", "sum", "model"))
                                n += 1
            dbapi.commit()
        seeded = time.perf_counter() - t0
        t0 = time.perf_counter()
        timeseries.maintain(svc.engine, Settings().retention())
        rolled = time.perf_counter() - t0
        intra = ",".join(f"node-000/{g}" for g in range(8))
        month, day, pre = [], [], []
        for _ in range(100):
            t = time.perf_counter()
            r = svc.api.get("/v1/series", params={"members": intra, "op": "allreduce",
                                                  "since": start.isoformat()})
            month.append(time.perf_counter() - t)
            assert r.json()["resolution"] == "1h", r.text[:300]
            t = time.perf_counter()
            r = svc.api.get("/v1/series", params={
                "members": intra, "op": "allreduce",
                "since": (datetime.now(UTC) - timedelta(days=1)).isoformat()})
            day.append(time.perf_counter() - t)
        points = len(r.json()["points"])
        names = [f"node-{i:03d}" for i in range(nodes)]
        for _ in range(30):
            t = time.perf_counter()
            r = svc.api.post("/v1/preflight", json={"nodes": names, "max_age_s": 3 * 86400})
            pre.append(time.perf_counter() - t)
            assert r.status_code == 200, r.text[:300]
    finally:
        shipper.close()
        svc.close()
    print(f"\nreads over {days} days of history ({n:,} rows seeded by COPY in {seeded:.0f} s, "
          f"rolled up in {rolled:.1f} s):")
    print(f"  GET /v1/series, 30 days of one link (hourly): p50 {_pct(month, 0.5) * 1e3:.1f} ms, "
          f"p99 {_pct(month, 0.99) * 1e3:.1f} ms (target p99 < 50 ms)")
    print(f"  GET /v1/series, 1 day raw ({points} points): p50 {_pct(day, 0.5) * 1e3:.1f} ms, "
          f"p99 {_pct(day, 0.99) * 1e3:.1f} ms")
    print(f"  POST /v1/preflight of {nodes} nodes from stored results: p50 "
          f"{_pct(pre, 0.5) * 1e3:.0f} ms, p99 {_pct(pre, 0.99) * 1e3:.0f} ms (target p99 < 500 ms)")


def _scrape(client: httpx.Client, accept_encoding: str) -> tuple[float, bytes]:
    """One GET /metrics: seconds until the last byte, and the bytes as sent."""
    t0 = time.perf_counter()
    with client.stream("GET", "/metrics", headers={"Accept-Encoding": accept_encoding}) as r:
        r.raise_for_status()
        body = b"".join(r.iter_raw())
    return time.perf_counter() - t0, body


def _age_rotation(svc: Service, nodes: int, cycles: int, pairs_per_cycle: int) -> int:
    """Fill ``link_health`` as the rotation leaves it once it has probed every node pair:
    a row per pair and op, each last read when its matching came round (one per cycle,
    older than the ``cycles`` measured ones), degraded as often as the measured pairs.
    Returns the rows now held."""
    with svc.engine.begin() as conn:
        bad = conn.execute(text("SELECT avg((status <> 'ok')::int) FROM link_health "
                                "WHERE scope = 'inter_node'")).scalar() or 0.0
        conn.execute(text("""
            INSERT INTO link_health (group_key, op, scope, members, nodes, status, size_bytes,
                busbw_gbs, expected_gbs, ratio, bad_streak, good_streak, recent, recent_busbw,
                updated_at, changed_at)
            SELECT array_to_string(p.members, ','), o.op, 'inter_node', p.members,
                   ARRAY[p.a, p.b], CASE WHEN p.n % :every = 0 THEN 'degraded' ELSE 'ok' END,
                   268435456, 40.0, 45.0, 0.89, 0, 3, '000', array_fill(40.0::float8, ARRAY[50]),
                   now() - (:first + p.n / :per_cycle) * make_interval(secs => :interval), now()
            FROM (SELECT row_number() OVER () AS n, format('node-%s', lpad(i::text, 3, '0')) AS a,
                         format('node-%s', lpad(j::text, 3, '0')) AS b,
                         ARRAY(SELECT m FROM (
                                   SELECT format('node-%s/%s', lpad(x::text, 3, '0'), k) AS m
                                   FROM unnest(ARRAY[i, j]) x, generate_series(0, 7) k) r
                               ORDER BY m COLLATE "C") AS members
                  FROM generate_series(0, :nodes - 1) i, generate_series(0, :nodes - 1) j
                  WHERE i < j) p,
                 (VALUES ('allreduce'), ('alltoall')) o(op)
            ON CONFLICT (group_key, op) DO NOTHING"""),
            {"every": max(1, round(1 / bad)) if bad else 1 << 40, "first": cycles,
             "per_cycle": pairs_per_cycle, "interval": INTERVAL_S, "nodes": nodes})
        conn.execute(text("ANALYZE link_health"))
        return conn.execute(text("SELECT count(*) FROM link_health")).scalar_one()


def _body(plain: bytes) -> tuple[int, int, float]:
    """Series, of which per-link, and the collection's own seconds, in a plain scrape."""
    lines = [line for line in plain.decode().splitlines() if not line.startswith("#")]
    collect = next(float(line.split()[-1]) for line in lines
                   if line.startswith("ringwatch_metrics_collect_seconds "))
    return len(lines), sum(line.startswith("ringwatch_link_") for line in lines), collect


def scrapes(nodes: int, cycles: int, state: Path, repeats: int = 10) -> None:
    """GET /metrics after ``cycles`` cycles at ``nodes`` x 8: cold (every scrape collects,
    RINGWATCH_METRICS_CACHE_S=0) and cached (a second API process on the same database
    with the cache on), gzipped as Prometheus asks, and the body's size and series. Then
    the same once the rotation has probed every node pair (``link_health`` filled as it
    would be after nodes - 1 cycles): the per-link families keep to the links read within
    RINGWATCH_METRICS_LINK_MAX_AGE_S and the degraded ones; all rows' body is modelled."""
    sc = scenario(nodes, random.Random(11))
    svc = Service(state / "metrics", RINGWATCH_METRICS_CACHE_S="0")
    shipper = Shipper(svc.env["RINGWATCH_API_URL"], TOKEN, state / "metrics" / "spool")
    cached_env = {**svc.env, "RINGWATCH_API_URL": f"http://127.0.0.1:{free_port()}",
                  "RINGWATCH_METRICS_CACHE_S": "3600"}
    cached_proc = None
    link_rows: list[int] = []
    try:
        backend = SimBackend(sc)
        for i in range(cycles):
            assert shipper.ship(run_cycle(backend, ProbeOptions(), rotation=i).to_batch()) == 0
            with svc.engine.connect() as conn:
                link_rows.append(conn.execute(text("SELECT count(*) FROM link_health")).scalar_one())
        cached_proc = start_server(cached_env)
        with httpx.Client(base_url=cached_env["RINGWATCH_API_URL"], timeout=300) as cached:
            first, _ = _scrape(cached, "gzip")
            warm = [_scrape(cached, "gzip")[0] for _ in range(repeats)]
        cold = [_scrape(svc.api, "gzip")[0] for _ in range(repeats)]
        _, zipped = _scrape(svc.api, "gzip")
        _, plain = _scrape(svc.api, "identity")
        growth = (link_rows[-1] - link_rows[0]) / max(cycles - 1, 1)
        full_rows = _age_rotation(svc, nodes, cycles, max(1, round(growth / 2)))
        full_cold = [_scrape(svc.api, "gzip")[0] for _ in range(3)]
        _, full_zipped = _scrape(svc.api, "gzip")
        _, full_plain = _scrape(svc.api, "identity")
    finally:
        if cached_proc is not None:
            stop_server(cached_proc)
        shipper.close()
        svc.close()
    series, per_link, _ = _body(plain)
    full_series, full_per_link, full_collect = _body(full_plain)
    all_series = full_series - full_per_link + per_link / link_rows[-1] * full_rows
    print(f"\nGET /metrics at {nodes} x 8 after {cycles} cycles ({link_rows[-1]:,} link rows, "
          f"+{growth:,.0f} per cycle as the rotation reaches new node pairs):")
    print(f"  cold (every scrape collects): p50 {_pct(cold, 0.5) * 1e3:.0f} ms, max "
          f"{max(cold) * 1e3:.0f} ms; first scrape of a cached process {first * 1e3:.0f} ms, "
          f"then p50 {_pct(warm, 0.5) * 1e3:.1f} ms while cached")
    print(f"  body: {series:,} series, {len(plain) / 1e6:.2f} MB plain, "
          f"{len(zipped) / 1e6:.2f} MB gzipped")
    print(f"  every node pair probed ({full_rows:,} link rows, as after {nodes - 1} cycles): "
          f"cold {_pct(full_cold, 0.5):.2f} s (of which the queries {full_collect:.2f} s); "
          f"{full_series:,} series (links read in the last "
          f"{Settings().metrics_link_max_age_s:.0f} s and the degraded ones), "
          f"{len(full_plain) / 1e6:.1f} MB plain, {len(full_zipped) / 1e6:.2f} MB gzipped; "
          f"every link a series would be ~{all_series:,.0f} series, "
          f"~{len(plain) / series * all_series / 1e6:.0f} MB plain (model)")


def main(flags: list[str]) -> None:
    quick = "--quick" in flags
    state = Path(".ringwatch") / f"bench-scale-{os.getpid()}"
    state.mkdir(parents=True, exist_ok=True)
    nodes = 256 if quick else 1024
    fig = whole_path(nodes, 5 if quick else 20, state)
    project(nodes, fig)
    project(4 * nodes, fig, scale=4.0)
    history(128, 50 if quick else 200, state)
    reads(nodes, state, days=30)
    scrapes(nodes, 3 if quick else 5, state)


if __name__ == "__main__":
    main([])
