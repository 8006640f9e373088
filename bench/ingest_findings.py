"""How long one batch's findings hold an ingest slot: 4,000 findings in one batch.

    python -m bench.ingest_findings            # 4,000 findings
    python -m bench.ingest_findings --quick    # 1,000

A fresh database; a 512 x 8 fleet's measurements (each node's NVLink group and a ring of
node pairs) with ``transport_fallback`` findings, one per GPU pair as NCCL's log names
them (agents.transport), each a fault of its own, judged at once (a fact NCCL read). Four
batches in turn: the first opens an incident per finding, the second sees them again, the
third (the fleet's measurements alone) resolves them, the fourth opens them again.
Printed per batch: seconds in ``ingest_batch`` (storing and judging), of which judging,
and the SQL statements it sent through SQLAlchemy (a COPY is one more each). Nothing is
asserted; docs/security.md quotes the figures.
"""

from __future__ import annotations

import sys
import time
import uuid
from datetime import UTC, datetime, timedelta
from itertools import combinations
from typing import Any

from sqlalchemy import event

from bench import admin_url
from ringwatch.agents.transport import transport_finding
from ringwatch.services.analyzer.hysteresis import Policy
from ringwatch.services.monitor.ingest import IngestPolicy, IngestRequest, ingest_batch
from ringwatch.services.store import db
from tests.api_fixtures import measurement

NODES = 512
GPUS = 8


def _measurements(at: datetime) -> list[dict[str, Any]]:
    names = [f"node-{i:04d}" for i in range(NODES)]
    rows = [measurement([f"{n}/{g}" for g in range(GPUS)], 200.0, scope="intra_node", time=at)
            for n in names]
    rows += [measurement([f"{a}/{g}" for a in (names[i], names[(i + 1) % NODES])
                          for g in range(GPUS)], 40.0, time=at) for i, a in enumerate(names)]
    for m in rows:
        m["time"] = at
    return rows


def _findings(count: int) -> list[dict[str, Any]]:
    pairs = list(combinations(range(GPUS), 2))
    return [transport_finding(f"node-{i // len(pairs) % NODES:04d}", "shm", "nvls",
                              "intra_node", gpus=list(pairs[i % len(pairs)])).to_dict()
            for i in range(count)]


def _ingest(factory: Any, count: list[int],
            findings: list[dict[str, Any]]) -> tuple[float, float, int]:
    req = IngestRequest(batch_id=uuid.uuid4().hex, backend="nccl",
                        measurements=_measurements(datetime.now(UTC) - timedelta(seconds=1)),
                        findings=findings,
                        policy=IngestPolicy(hysteresis=Policy(k_bad=1, n_window=1, m_good=1)))
    count[0] = 0
    started = time.perf_counter()
    with db.transaction(factory) as s:
        result = ingest_batch(s, req)
    return time.perf_counter() - started, result.timings["judge"], count[0]


def main(flags: list[str]) -> None:
    findings = _findings(1000 if "--quick" in flags else 4000)
    admin = admin_url()
    name = f"rw_bench_findings_{uuid.uuid4().hex[:8]}"
    url = db.create_database(admin, name)
    engine = db.make_engine(url)
    try:
        db.upgrade(url)
        factory = db.make_session_factory(engine)
        count = [0]
        event.listen(engine, "before_cursor_execute",
                     lambda *_: count.__setitem__(0, count[0] + 1))
        print(f"{len(findings)} transport_fallback findings, {NODES} x {GPUS} fleet, "
              f"{2 * NODES} measurements")
        print(f"{'batch':<32} {'seconds':>8} {'judging':>8} {'statements':>11}")
        for label, batch in (("opens an incident per finding", findings),
                             ("sees them again", findings),
                             ("measurements alone (resolves)", []),
                             ("opens them again", findings)):
            seconds, judging, statements = _ingest(factory, count, batch)
            print(f"{label:<32} {seconds:>8.2f} {judging:>8.2f} {statements:>11}", flush=True)
    finally:
        engine.dispose()
        db.drop_database(admin, name)


if __name__ == "__main__":
    main(sys.argv[1:])
