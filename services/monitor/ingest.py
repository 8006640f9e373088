"""Ingest one batch of probe results: store it once, then update health from it."""

from __future__ import annotations

import time
from dataclasses import dataclass, field, fields
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Engine
from sqlalchemy.orm import Session

from ringwatch.agents.groups import case_twins, node_order, nodes_of, series_key
from ringwatch.agents.spec import Occupant, RankInfo, utcnow
from ringwatch.services.analyzer.assess import Thresholds, thresholds_for
from ringwatch.services.analyzer.evidence import CusumPolicy
from ringwatch.services.analyzer.faults import RANK_KINDS
from ringwatch.services.analyzer.hysteresis import Policy
from ringwatch.services.config import MAX_CLOCK_SKEW_S
from ringwatch.services.errors import BadInput, Conflict, Forbidden, TooLarge, TooManyRequests
from ringwatch.services.monitor.health import HealthChanges, apply_round
from ringwatch.services.store import measurements as store
from ringwatch.services.store import nodes as node_store
from ringwatch.services.store import timeseries

# What an Occupant is made of: a stored occupant's other keys (reason, since) are ours.
OCCUPANT_FIELDS = frozenset(f.name for f in fields(Occupant))


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
    max_clock_skew: timedelta = timedelta(seconds=MAX_CLOCK_SKEW_S)
    max_age: timedelta | None = None
    # Nodes one batch may create, and the fleet may hold in all.
    max_new_nodes: int | None = None
    max_nodes: int | None = None
    # Nodes one token may add to the fleet (create, or bring back from retirement) within
    # ``new_nodes_window``.
    max_new_nodes_per_token: int | None = None
    new_nodes_window: timedelta = timedelta(days=1)


@dataclass(frozen=True)
class IngestPolicy:
    """How the server judges and bounds what it stores: the process's settings, passed in."""

    thresholds: Thresholds | None = None  # None: the analyzer's for the batch's backend
    hysteresis: Policy | None = None
    drift: CusumPolicy | None = None
    api_url: str = ""  # where incident links in webhooks point
    limits: IngestLimits = IngestLimits()


@dataclass(frozen=True)
class Sender:
    """Who sent the batch: a token scoped to ``nodes`` (None: any node) and its id."""

    nodes: frozenset[str] | None = None
    token_id: int | None = None


@dataclass(frozen=True)
class IngestRequest:
    """One batch as the API received it (docs/formats.md, "Probe output"), who sent it, and
    the policy to judge it by. ``digest``: of the batch's content, so the same id again
    with other content is told from a retry."""

    batch_id: str
    backend: str
    measurements: list[dict[str, Any]]
    ranks: list[dict[str, Any]] = field(default_factory=list)
    findings: list[dict[str, Any]] = field(default_factory=list)
    duty_cycle: dict[str, float] | None = None
    skipped: dict[str, str] | None = None
    shipper: dict[str, Any] | None = None
    counters: list[dict[str, Any]] = field(default_factory=list)
    # Nodes whose facts (counters, fabric state) the batch's check read before and after;
    # only their counter incidents are judged (None: an older sender, no facts read).
    facts: list[str] | None = None
    # How the scheduler's occupancy source answered (docs/formats.md): its busy nodes are
    # marked occupied, the batch's other nodes idle. None (a preflight's batch): untouched.
    occupancy: dict[str, Any] | None = None
    digest: str | None = None
    sender: Sender = Sender()
    policy: IngestPolicy = IngestPolicy()


def ingest_batch(session: Session, req: IngestRequest) -> IngestResult:
    """Store a batch exactly once (by ``batch_id``) and apply its judgement to link health
    and incidents. A sender scoped to some nodes whose batch names any other node anywhere
    is refused whole (403); the same id again with other content, or from another token,
    is a 409 rather than a silent no-op."""
    started = time.perf_counter()
    rows = [{**m, "nodes": nodes_of(m["members"]), "group_key": series_key(m["members"]),
             "time": m["time"] if isinstance(m["time"], datetime)
             else datetime.fromisoformat(m["time"])} for m in req.measurements]
    node_names = {n for r in rows for n in r["nodes"]} | {r["node"] for r in req.ranks}
    node_names |= {n for f in req.findings for n in _finding_nodes(f)}
    node_names |= set(req.skipped or {})
    busy = (req.occupancy or {}).get("busy") or {}
    node_names |= set(busy)
    named = (node_names | set(req.duty_cycle or {}) | {c["node"] for c in req.counters}
             | set(req.facts or ()))
    if req.sender.nodes is not None:
        outside = sorted(named - req.sender.nodes, key=node_order)
        if outside:
            raise Forbidden(f"this token reports only on its own nodes; the batch names "
                            f"{len(outside)} other(s): {', '.join(outside[:10])}")
    run = store.claim_batch(session, req.batch_id, req.backend, digest=req.digest,
                            token_id=req.sender.token_id)
    if run is None:
        return _stored_before(session, req.batch_id, req.digest, req.sender.token_id)
    now = utcnow()
    _check_times(rows, now, req.policy.limits)
    _check_growth(session, node_names, req.policy.limits, req.sender.token_id)
    seen_at = max((r["time"] for r in rows), default=now)
    # A contended measurement is about the job beside it: stored and shown, never judged, and
    # no sign of the node's health, so it does not make the node's results fresh either.
    judged = [r for r in rows if not r.get("contended")]
    store.upsert_nodes(session, sorted(node_names), req.backend, seen_at,
                       _probed_at(judged, req.findings, seen_at),
                       duty_cycle=req.duty_cycle, skipped=req.skipped,
                       occupied=_occupied(req.occupancy, node_names),
                       token_id=req.sender.token_id)
    store.upsert_ranks(session, req.ranks)
    if rows:
        bind = session.get_bind()
        assert isinstance(bind, Engine)
        timeseries.ensure_partitions(bind, {r["time"] for r in rows})
        timeseries.note_ingest(session, min(r["time"] for r in rows))
    copying = time.perf_counter()
    stored = store.add_measurements(session, run, rows)
    copied = time.perf_counter()
    run.findings = list(req.findings)
    run.shipper = req.shipper
    run.occupancy = _occupancy_summary(req.occupancy)
    store.add_counters(session, req.counters, seen_at)
    judging = time.perf_counter()
    policy = req.policy
    changes = apply_round(session, judged, list(req.findings), at=seen_at,
                          thresholds=policy.thresholds or thresholds_for(req.backend),
                          hysteresis=policy.hysteresis, drift=policy.drift,
                          api_url=policy.api_url, ranks=[RankInfo(**r) for r in req.ranks],
                          facts=req.facts or ())
    done = time.perf_counter()
    return IngestResult(req.batch_id, True, run.id, stored, changes,
                        {"store": judging - started, "measurements": copied - copying,
                         "judge": done - judging})



def _occupied(occupancy: dict[str, Any] | None,
              names: set[str]) -> dict[str, dict[str, Any] | None] | None:
    """Each node's occupant to store (None: idle) where the batch says what held the fleet:
    its busy nodes with their occupant, every other node it names idle."""
    if occupancy is None:
        return None
    busy = occupancy.get("busy") or {}
    return {n: ({**busy[n], "reason": Occupant(**{k: v for k, v in busy[n].items()
                                                  if k in OCCUPANT_FIELDS}).reason}
                if n in busy else None) for n in names}


def _occupancy_summary(occupancy: dict[str, Any] | None) -> dict[str, Any] | None:
    """How the source answered, without the per-node map (kept on the nodes)."""
    if occupancy is None:
        return None
    busy = occupancy.get("busy") or {}
    return {"source": occupancy.get("source"), "error": occupancy.get("error"),
            "read_s": occupancy.get("read_s", 0.0), "busy": len(busy),
            "unknown": sum(1 for o in busy.values() if o.get("unknown"))}


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


def _check_growth(session: Session, names: set[str], limits: IngestLimits,
                  token_id: int | None) -> None:
    """Refuse a batch that would add to the fleet more nodes than one batch, its token
    within its window, or the fleet may hold; or a node the fleet holds under another case.
    A node is new when the fleet does not hold it: never seen, or retired."""
    _check_one_case(names)
    new = names - store.known_nodes(session, sorted(names))
    if not new:
        return
    twins = node_store.twins_in_fleet(session, new)
    if twins:
        shown = ", ".join(f"{a} (the fleet's {b})" for a, b in sorted(twins.items())[:10])
        raise BadInput(f"{len(twins)} node name(s) differ only in case from a node in the "
                       f"fleet (host names ignore case; name each as the fleet does): {shown}")
    if limits.max_new_nodes is not None and len(new) > limits.max_new_nodes:
        raise TooLarge(f"the batch would create {len(new)} nodes; one batch may create at most "
                       f"{limits.max_new_nodes} (RINGWATCH_MAX_NEW_NODES_PER_BATCH)")
    if limits.max_new_nodes_per_token is not None and token_id is not None:
        _check_token_quota(session, len(new), limits, token_id)
    if limits.max_nodes is not None:
        held = store.node_count(session)
        if held + len(new) > limits.max_nodes:
            raise BadInput(f"the fleet holds {held} nodes and the batch would add {len(new)}; it "
                           f"may hold at most {limits.max_nodes} (RINGWATCH_MAX_NODES)")


def _check_one_case(names: set[str]) -> None:
    """Refuse a batch naming one host in two cases (node-000 and NODE-000)."""
    twins = case_twins(names)
    if twins:
        raise BadInput(f"the batch names {len(twins)} host(s) in more than one case (host names "
                       f"ignore case): {'; '.join(' and '.join(t) for t in twins[:10])}")


def _check_token_quota(session: Session, new: int, limits: IngestLimits, token_id: int) -> None:
    """One token adds at most ``max_new_nodes_per_token`` nodes to the fleet in its window:
    a flood of made-up names from one agent stops there, while nodes it added before report
    on and another token's new node still joins. A batch the whole quota cannot hold is a
    422 (it would never fit); one that fits once older additions leave the window, a 429."""
    quota, window_s = limits.max_new_nodes_per_token, limits.new_nodes_window.total_seconds()
    assert quota is not None
    setting = "RINGWATCH_MAX_NEW_NODES_PER_TOKEN per RINGWATCH_NEW_NODES_WINDOW_S"
    if new > quota:
        raise BadInput(f"the batch would add {new} nodes to the fleet; one token may add at most "
                       f"{quota} in {window_s:g} s ({setting}): raise it for a fleet this large")
    added = node_store.added_by(session, token_id, window_s)
    if added.nodes + new > quota:
        raise TooManyRequests(
            f"this token added {added.nodes} nodes to the fleet in the last {window_s:g} s and "
            f"the batch would add {new} more; one token may add at most {quota} ({setting}). "
            "Nodes already in the fleet report on", retry_after_s=added.frees_in_s or window_s)


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
