"""Ingest one batch of probe results: store it once, then update health from it."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Engine
from sqlalchemy.orm import Session

from agents.spec import RankInfo, node_order, utcnow
from services.analyzer.assess import Thresholds, thresholds_for
from services.analyzer.evidence import CusumPolicy
from services.analyzer.faults import RANK_KINDS
from services.analyzer.hysteresis import Policy
from services.errors import BadInput, Conflict, Forbidden, TooLarge
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


@dataclass(frozen=True)
class IngestLimits:
    """What one batch may do (each a RINGWATCH_* setting, named in the refusal)."""

    # How far ahead of the server's clock a time may be, and how far back (raw retention).
    max_clock_skew: timedelta = MAX_CLOCK_SKEW
    max_age: timedelta | None = None
    # Nodes one batch may create, and the fleet may hold in all.
    max_new_nodes: int | None = None
    max_nodes: int | None = None


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
    limits: IngestLimits = IngestLimits(),
    allowed_nodes: frozenset[str] | None = None,
    token_id: int | None = None,
    digest: str | None = None,
) -> IngestResult:
    """Store a batch exactly once (by ``batch_id``) and apply its judgement to link health
    and incidents. ``allowed_nodes``: the sender's token is scoped to these nodes, and a
    batch that names any other node anywhere is refused whole (403). ``digest`` (of the
    batch's content) and ``token_id``: the same id again with other content, or from
    another token, is a 409 rather than a silent no-op."""
    started = time.perf_counter()
    rows = [{**m, "nodes": _nodes(m["members"]), "group_key": store.group_key(m["members"]),
             "time": m["time"] if isinstance(m["time"], datetime)
             else datetime.fromisoformat(m["time"])} for m in measurements]
    node_names = {n for r in rows for n in r["nodes"]} | {r["node"] for r in ranks or []}
    node_names |= {n for f in findings or [] for n in _finding_nodes(f)}
    node_names |= set(skipped or {})
    named = node_names | set(duty_cycle or {}) | {c["node"] for c in counters or []}
    if allowed_nodes is not None:
        outside = sorted(named - allowed_nodes, key=node_order)
        if outside:
            raise Forbidden(f"this token reports only on its own nodes; the batch names "
                            f"{len(outside)} other(s): {', '.join(outside[:10])}")
    run = store.claim_batch(session, batch_id, backend, digest=digest, token_id=token_id)
    if run is None:
        return _stored_before(session, batch_id, digest, token_id)
    now = utcnow()
    _check_times(rows, now, limits)
    _check_growth(session, node_names, limits)
    seen_at = max((r["time"] for r in rows), default=now)
    store.upsert_nodes(session, sorted(node_names), backend, seen_at,
                       _probed_at(rows, findings or [], seen_at),
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



def _finding_nodes(finding: dict[str, Any]) -> list[str]:
    """Every node a finding names: where it happened, or the ends of the path it blames."""
    return [n for n in (finding.get("node"), *(finding.get("nodes") or ())) if n]


def _probed_at(rows: list[dict[str, Any]], findings: list[dict[str, Any]],
               at: datetime) -> dict[str, datetime]:
    """Each node's own newest measurement time: a node measured two hours ago in a batch
    whose other nodes were measured now is two hours old, not fresh. A node whose probe
    hung, raised or returned wrong data has no measurement, but was probed: at the batch's
    time, and its finding is the result."""
    newest: dict[str, datetime] = {f["node"]: at for f in findings
                                   if f.get("node") and f["kind"] in RANK_KINDS}
    for r in rows:
        for n in r["nodes"]:
            if n not in newest or r["time"] > newest[n]:
                newest[n] = r["time"]
    return newest


def _check_times(rows: list[dict[str, Any]], now: datetime, limits: IngestLimits) -> None:
    if any(r["time"] > now + limits.max_clock_skew for r in rows):
        raise BadInput(f"measurement time more than {limits.max_clock_skew} ahead of the "
                       f"server's clock ({now.isoformat()}): check the agents' clocks "
                       "(RINGWATCH_MAX_CLOCK_SKEW_S)")
    # Older than raw retention keeps, a row would be dropped at the next maintenance pass;
    # and each day named costs a partition, so a batch of made-up dates cannot make tables.
    if limits.max_age is not None and any(r["time"] < now - limits.max_age for r in rows):
        raise BadInput(f"measurement time more than {limits.max_age.days} days old, past what "
                       "raw results are kept (RINGWATCH_RETENTION_RAW_DAYS)")


def _check_growth(session: Session, names: set[str], limits: IngestLimits) -> None:
    """Refuse a batch that would create more nodes than one batch, or the fleet, may hold."""
    if limits.max_new_nodes is None and limits.max_nodes is None:
        return
    new = len(names) - len(store.known_nodes(session, sorted(names)))
    if limits.max_new_nodes is not None and new > limits.max_new_nodes:
        raise TooLarge(f"the batch would create {new} nodes; one batch may create at most "
                       f"{limits.max_new_nodes} (RINGWATCH_MAX_NEW_NODES_PER_BATCH)")
    if limits.max_nodes is not None and new:
        held = store.node_count(session)
        if held + new > limits.max_nodes:
            raise BadInput(f"the fleet holds {held} nodes and the batch would add {new}; it "
                           f"may hold at most {limits.max_nodes} (RINGWATCH_MAX_NODES)")


def _stored_before(session: Session, batch_id: str, digest: str | None,
                   token_id: int | None) -> IngestResult:
    """A batch id seen before: the same batch again is a no-op; anything else a 409 that
    says which conflict, and nothing of the other batch."""
    previous = store.find_run(session, batch_id)
    assert previous is not None
    if previous.token_id is not None and previous.token_id != token_id:
        raise Conflict(f"batch_id {batch_id!r} was sent by another token; use a new id")
    if digest is not None and previous.content_sha256 not in (None, digest):
        raise Conflict(f"batch_id {batch_id!r} was stored before with other content; a "
                       "retry must send the same batch, new results need a new id")
    return IngestResult(batch_id, False, previous.id, previous.measurement_count)
