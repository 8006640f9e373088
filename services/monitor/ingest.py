"""Ingest one batch of probe results: store it once, then update health from it."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Engine
from sqlalchemy.orm import Session

from agents.spec import RankInfo, utcnow
from services.analyzer.assess import Thresholds, thresholds_for
from services.analyzer.evidence import CusumPolicy
from services.analyzer.hysteresis import Policy
from services.errors import BadInput, Forbidden
from services.monitor.health import HealthChanges, apply_round
from services.store import measurements as store
from services.store import timeseries

# How far ahead of the server's clock a measurement's time may be (clock skew); beyond
# it, "latest" would be pinned by a time that has not come. RINGWATCH_MAX_CLOCK_SKEW_S.
MAX_CLOCK_SKEW = timedelta(minutes=10)


def _nodes(members: list[str]) -> list[str]:
    """The nodes of members already validated as NODE/INDEX, in first-seen order."""
    return list(dict.fromkeys(m.rpartition("/")[0] for m in members))


@dataclass
class IngestResult:
    batch_id: str
    created: bool
    run_id: int
    stored: int
    changes: HealthChanges = field(default_factory=HealthChanges)
    # Seconds spent storing (nodes, ranks, groups, COPY), of which on the measurements
    # themselves (their groups and the COPY), and judging (health, incidents).
    timings: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "batch_id": self.batch_id, "created": self.created, "run_id": self.run_id,
            "stored": self.stored, "degraded": self.changes.degraded,
            "recovered": self.changes.recovered, "probe_findings": self.changes.probe_findings,
            "findings": self.changes.findings,
        }


def ingest_batch(
    session: Session,
    *,
    batch_id: str,
    backend: str,
    measurements: list[dict[str, Any]],
    ranks: list[dict[str, Any]] | None = None,
    findings: list[dict[str, Any]] | None = None,
    duty_cycle: dict[str, float] | None = None,
    skipped: dict[str, str] | None = None,
    thresholds: Thresholds | None = None,
    hysteresis: Policy | None = None,
    drift: CusumPolicy | None = None,
    api_url: str = "",
    shipper: dict[str, Any] | None = None,
    counters: list[dict[str, Any]] | None = None,
    max_clock_skew: timedelta = MAX_CLOCK_SKEW,
    max_age: timedelta | None = None,
    allowed_nodes: frozenset[str] | None = None,
) -> IngestResult:
    """Store a batch exactly once (by ``batch_id``) and apply its judgement to link health
    and incidents. ``allowed_nodes``: the sender's token is scoped to these nodes, and a
    batch that reports on any other is refused whole (403)."""
    started = time.perf_counter()
    run = store.claim_batch(session, batch_id, backend)
    if run is None:
        previous = store.find_run(session, batch_id)
        assert previous is not None
        return IngestResult(batch_id, False, previous.id, previous.measurement_count)
    rows = [{**m, "nodes": _nodes(m["members"]), "group_key": store.group_key(m["members"]),
             "time": m["time"] if isinstance(m["time"], datetime)
             else datetime.fromisoformat(m["time"])} for m in measurements]
    now = utcnow()
    if any(r["time"] > now + max_clock_skew for r in rows):
        raise BadInput(f"measurement time more than {max_clock_skew} ahead of the server's "
                       f"clock ({now.isoformat()}): check the agents' clocks "
                       "(RINGWATCH_MAX_CLOCK_SKEW_S)")
    # Older than raw retention keeps, a row would be dropped at the next maintenance pass;
    # and each day named costs a partition, so a batch of made-up dates cannot make tables.
    if max_age is not None and any(r["time"] < now - max_age for r in rows):
        raise BadInput(f"measurement time more than {max_age.days} days old, past what raw "
                       "results are kept (RINGWATCH_RETENTION_RAW_DAYS)")
    seen_at = max((m["time"] for m in rows), default=now)
    node_names = {n for r in rows for n in r["nodes"]} | {r["node"] for r in ranks or []}
    node_names |= {f["node"] for f in findings or [] if f.get("node")}
    node_names |= set(skipped or {})
    if allowed_nodes is not None:
        outside = sorted((node_names | {c["node"] for c in counters or []}) - allowed_nodes)
        if outside:
            raise Forbidden(f"this token reports only on its own nodes; the batch names "
                            f"{len(outside)} other(s): {', '.join(outside[:10])}")
    probed = sorted({n for r in rows for n in r["nodes"]})
    store.upsert_nodes(session, sorted(node_names), backend, seen_at, probed,
                       duty_cycle=duty_cycle, skipped=skipped)
    store.upsert_ranks(session, ranks or [])
    if rows:
        bind = session.get_bind()
        assert isinstance(bind, Engine)
        timeseries.ensure_partitions(bind, {r["time"] for r in rows})
        timeseries.note_ingest(session, min(r["time"] for r in rows))
    copying = time.perf_counter()
    stored = store.add_measurements(session, run, rows)
    copied = time.perf_counter()
    run.findings = list(findings or [])
    run.shipper = shipper
    store.add_counters(session, counters or [], seen_at)
    judging = time.perf_counter()
    changes = apply_round(session, rows, list(findings or []), at=seen_at,
                          thresholds=thresholds or thresholds_for(backend),
                          hysteresis=hysteresis, drift=drift, api_url=api_url,
                          ranks=[RankInfo(**r) for r in ranks or []])
    done = time.perf_counter()
    return IngestResult(batch_id, True, run.id, stored, changes,
                        {"store": judging - started, "measurements": copied - copying,
                         "judge": done - judging})

