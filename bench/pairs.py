"""The node-pair map (``GET /v1/fleet/pairs``) at fleet scale: what one whole-map or tile
request costs the API process that answers it.

A fresh database per fleet: N nodes and one inter-node AllReduce link row for every node
pair (a fleet whose rotation has come round every matching, as ``bench.ui``'s every-pair
fleet), written in one ``INSERT ... SELECT``. Each request is then made in a fresh
process (the real app through a TestClient), so its peak RSS is its own: printed are the
status, the bytes sent, the wall time of the first (cold: the whole map is built) and of a
second request (warm: patched from the pairs updated since), and how far the process's
peak RSS rose over its size after start-up.

    python -m bench.run pairs            # 1024 and 4096 nodes
    python -m bench.run pairs --quick    # 256 and 1024
"""

from __future__ import annotations

import multiprocessing
import resource
import time
import uuid
from concurrent.futures import ProcessPoolExecutor
from typing import Any

from sqlalchemy import text

from bench import admin_url
from ringwatch.services.settings import Settings
from ringwatch.services.store import db

# (label, path, the limit the API runs with; None: its default)
Request = tuple[str, str, int | None]


def seed(url: str, n: int) -> float:
    """N nodes and every node pair's link row; the seconds it took."""
    started = time.monotonic()
    engine = db.make_engine(url)
    try:
        with engine.begin() as conn:
            conn.execute(text(
                "INSERT INTO nodes (name, backend) "
                "SELECT 'node-' || lpad(i::text, 5, '0'), 'sim' FROM generate_series(0, :n - 1) i"),
                {"n": n})
            # About 1 pair in 500 slow (and degraded), the rest at 0.97 to 1.03 of expected;
            # updated over the last day, as a rotation leaves them.
            conn.execute(text("SELECT setseed(0.5)"))
            conn.execute(text("""
                INSERT INTO link_health (group_key, op, scope, members, nodes, status, size_bytes,
                                         busbw_gbs, expected_gbs, ratio, bad_streak,
                                         good_streak, updated_at, changed_at)
                SELECT p.a || '/0,' || p.b || '/0', 'allreduce', 'inter_node',
                       ARRAY[p.a || '/0', p.b || '/0'], ARRAY[p.a, p.b],
                       CASE WHEN p.r < 0.6 THEN 'degraded' ELSE 'ok' END, 1 << 26,
                       45 * p.r, 45, p.r, 0, 0, p.at, p.at
                FROM (SELECT 'node-' || lpad(i::text, 5, '0') AS a,
                             'node-' || lpad(j::text, 5, '0') AS b,
                             CASE WHEN random() < 0.002 THEN 0.4 ELSE 0.97 + 0.06 * random() END AS r,
                             now() - random() * interval '1 day' AS at
                      FROM generate_series(0, :n - 1) i, generate_series(0, :n - 1) j
                      WHERE i < j) p"""), {"n": n})
            conn.execute(text("ANALYZE link_health"))
    finally:
        engine.dispose()
    return time.monotonic() - started


def measure(url: str, path: str, limit: int | None) -> dict[str, Any]:
    """In a fresh process: one request of ``path`` cold, then once more warm."""
    from fastapi.testclient import TestClient

    from ringwatch.api.app import create_app
    from ringwatch.services.store import tokens

    factory = db.make_session_factory(db.make_engine(url))
    with db.transaction(factory) as s:
        token = tokens.create_token(s, "reader")
    extra: dict[str, Any] = {} if limit is None else {"max_pair_map_nodes": limit}
    client = TestClient(create_app(Settings(database_url=url, **extra), factory))
    headers = {"Authorization": f"Bearer {token}"}
    client.get("/v1/health", headers=headers).raise_for_status()  # imports, a connection
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    resp = client.get(path, headers=headers)
    cold = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    size, status = len(resp.content), resp.status_code
    del resp
    t0 = time.perf_counter()
    client.get(path, headers=headers)
    warm = time.perf_counter() - t0
    return {"status": status, "bytes": size, "cold_s": cold, "warm_s": warm,
            "base_mib": before / 1024, "rise_mib": (peak - before) / 1024}


def requests_for(n: int) -> list[Request]:
    """The whole map at the default limit; above 1024 nodes also the map refused at a
    limit of 1024, one 1024 x 1024 tile off the diagonal and the largest tile the default
    allows, the whole square."""
    out: list[Request] = [("whole map", "/v1/fleet/pairs", None)]
    if n > 1024:
        out += [("whole map, limit 1024", "/v1/fleet/pairs", 1024),
                ("tile 1024 x 1024, limit 1024",
                 "/v1/fleet/pairs?row_from=0&row_to=1024&col_from=1024&col_to=2048", 1024),
                (f"tile {n} x {n}", f"/v1/fleet/pairs?row_to={n}&col_to={n}", None)]
    return out


def run_fleet(n: int) -> None:
    admin = admin_url()
    name = f"rw_pairs_{uuid.uuid4().hex[:8]}"
    url = db.create_database(admin, name)
    try:
        db.upgrade(url)
        took = seed(url, n)
        print(f"\n{n} nodes, {n * (n - 1) // 2} node pairs stored ({took:.0f} s to seed)")
        print(f"  {'request':<32}{'status':>7}{'bytes':>12}{'cold ms':>9}{'warm ms':>9}"
              f"{'peak RSS rise MiB':>19}")
        spawn = multiprocessing.get_context("spawn")
        for label, path, limit in requests_for(n):
            with ProcessPoolExecutor(max_workers=1, mp_context=spawn) as pool:
                r = pool.submit(measure, url, path, limit).result()
            print(f"  {label:<32}{r['status']:>7}{r['bytes']:>12}{r['cold_s'] * 1000:>9.0f}"
                  f"{r['warm_s'] * 1000:>9.0f}{r['rise_mib']:>19.1f}"
                  f"  (process at {r['base_mib']:.0f} MiB before)", flush=True)
    finally:
        db.drop_database(admin, name)


def main(flags: list[str]) -> None:
    for n in ((256, 1024) if "--quick" in flags else (1024, 4096)):
        run_fleet(n)


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
