"""Fold one ingested batch into link health and fault incidents, in the caller's transaction.

The batch is judged by ``services.analyzer.judge`` (the same judgement a preflight makes),
and each place's slow-drift detector (``services.analyzer.drift``) weighs it too: a drift
in alarm that the judgement has not already named is found like any other fault.
Each localized fault (``fault_key``: kind and place) goes through the hysteresis: seen in a
cycle is a bad observation, looked at and not seen a good one, not looked at none. A fault
read from a node's counters (NVML, the NICs' sysfs, NVLink fabric state) was looked at only
where the batch's check read that node's facts before and after (its ``facts``). A fault
opens one incident however many links, ops and sizes show it, and resolves when its
evidence has cleared. Every incident change and its outbox event are written together, so
an event exists exactly when the change it announces does.

Link health (``GET /v1/links``) is kept beside it per link and op, for reading; it opens
no incident of its own.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from sqlalchemy.orm import Session

from ringwatch.agents.groups import group_nodes, series_key
from ringwatch.agents.spec import Finding, RankInfo, split_series_op
from ringwatch.agents.spec import Measurement as ProbeMeasurement
from ringwatch.services.analyzer.assess import HISTORY_WINDOW, Assessment, Thresholds, link_key
from ringwatch.services.analyzer.drift import drift_observations, step_drift, unexplained
from ringwatch.services.analyzer.evidence import CusumPolicy
from ringwatch.services.analyzer.faults import (
    RANK_KINDS,
    Coverage,
    fault_key,
    fault_nodes,
    policy_for,
)
from ringwatch.services.analyzer.hysteresis import DEGRADED, OK, LinkState, Policy, step
from ringwatch.services.analyzer.judge import Judgement, judge
from ringwatch.services.store import drift as drift_store
from ringwatch.services.store import events
from ringwatch.services.store import health as store
from ringwatch.services.store.models import FaultState
from ringwatch.services.store.models import Finding as FindingRow


@dataclass
class HealthChanges:
    degraded: list[dict[str, Any]] = field(default_factory=list)
    recovered: list[dict[str, Any]] = field(default_factory=list)
    probe_findings: list[dict[str, Any]] = field(default_factory=list)
    # Everything the batch's judgement localized.
    findings: list[dict[str, Any]] = field(default_factory=list)


def to_probe_measurement(row: dict[str, Any]) -> ProbeMeasurement:
    """A stored measurement (the dict ``add_measurements`` took) as the analyzer reads it."""
    op, algo = split_series_op(row["op"])
    return ProbeMeasurement(
        op=op, algo=row.get("algo") or algo, scope=row["scope"], members=list(row["members"]),
        size_bytes=row["size_bytes"], dtype=row["dtype"], warmup=row["warmup"],
        iters=row["iters"], time_us=row["time_us"], algbw_gbs=row["algbw_gbs"],
        busbw_gbs=row["busbw_gbs"], wrong=row["wrong"], time=row["time"],
        redop=row.get("redop", "sum"), timing=row.get("timing"),
        preset_gbs=row.get("preset_gbs"), rated_gbs=row.get("rated_gbs"),
    )


def _history(probes: list[ProbeMeasurement], keys: list[str],
             links: dict[tuple[str, str], Any]) -> dict[tuple, list[float]]:
    """Each link's own past busbw, keyed as ``assess`` wants it, from the running values
    kept in its row: the baseline for groups that have no peers (the world group)."""
    out: dict[tuple, list[float]] = {}
    for m, key in zip(probes, keys, strict=True):
        link = links.get((key, m.series))
        if link is not None and link.recent_busbw and link.size_bytes == m.size_bytes:
            out[link_key(m)] = list(link.recent_busbw)
    return out


def apply_round(
    session: Session,
    rows: list[dict[str, Any]],
    probe_findings: list[dict[str, Any]],
    *,
    at: datetime,
    thresholds: Thresholds,
    hysteresis: Policy | None = None,
    drift: CusumPolicy | None = None,
    api_url: str = "",
    ranks: list[RankInfo] | None = None,
    facts: Iterable[str] = (),
) -> HealthChanges:
    policy = hysteresis or Policy()
    changes = HealthChanges()
    probes = [to_probe_measurement(r) for r in rows]
    # Each row's series key, computed once (ingest has usually done it already).
    keys = [r.get("group_key") or series_key(r["members"]) for r in rows]
    links = store.get_links(session, list({(k, m.series) for k, m in zip(keys, probes, strict=True)}))
    j = judge(probes, [Finding.from_dict(f) for f in probe_findings], (), ranks,
              thresholds=thresholds, history=_history(probes, keys, links))
    found = j.findings + _drift(session, j, at, drift or CusumPolicy())
    changes.findings = [f.to_dict() for f in found]
    _link_health(session, j, keys, links, at, policy)
    _faults(session, j.coverage(facts), found, at, policy, api_url, changes)
    return changes


# ---- slow drift: a CUSUM per place --------------------------------------------------------


def _drift(session: Session, j: Judgement, at: datetime, policy: CusumPolicy) -> list[Finding]:
    """Fold the batch into every place's drift detector and store what changed; the drift
    findings in alarm that the judgement has not already made."""
    # The assessments as the judgement localized them: those a fleet-wide shortfall explains
    # are marked so there (``j.assessments`` are as first assessed), and must not count as
    # each place's own loss.
    assessments = [a for v in j.verdicts.values() for items in v.by_op.values() for a in items]
    before = drift_store.drift_states(session)
    after, findings = step_drift(before, drift_observations(assessments), at, policy)
    drift_store.write_drift_states(
        session, {k: s for k, s in after.items() if before.get(k) != s},
        before.keys() - after.keys(), at)
    return unexplained(findings, j.findings)


# ---- incidents: one per localized fault ---------------------------------------------------


def _faults(session: Session, coverage: Coverage, findings: list[Finding], at: datetime,
            policy: Policy, api_url: str, changes: HealthChanges) -> None:
    """Step every fault's hysteresis and write what changed: a few statements however many
    faults the batch names (services.store.health writes them in bulk)."""
    found: dict[str, Finding] = {}
    for f in findings:
        found.setdefault(fault_key(f), f)
    states = store.fault_states(session)
    for key, state in list(states.items()):
        if key not in found and not coverage.covers(Finding.from_dict(state.detail)):
            del states[key]  # not looked at this cycle: no evidence either way
    new = {key: store.new_fault_state(key=key, kind=f.kind, nodes=fault_nodes(f),
                                      detail=f.to_dict())
           for key, f in found.items() if key not in states}
    states.update(new)
    turned: list[tuple[FaultState, str]] = []  # (state, its new status), in order
    seen_again: list[FaultState] = []
    for key, state in states.items():
        seen = key in found
        if seen:
            state.detail = found[key].to_dict()
        before = state.status
        after = step(LinkState(before, tuple(c == "1" for c in state.recent), state.good_streak),
                     seen, policy_for(state.kind, policy, state.detail))
        state.status, state.good_streak = after.status, after.good_streak
        state.recent = "".join("1" if bad else "0" for bad in after.recent)
        state.updated_at = at
        if after.status != before:
            turned.append((state, after.status))
        elif seen and state.finding_id is not None:
            seen_again.append(state)
    _write_turns(session, turned, seen_again, at, api_url, changes)
    # A fault keeps its row while it is open or was seen within its window.
    kept = {key for key, s in states.items() if s.status != OK or "1" in s.recent}
    store.save_fault_states(session, [s for key, s in new.items() if key in kept],
                            [s for key, s in states.items() if key in kept and key not in new],
                            [s for key, s in states.items() if key not in kept and key not in new])


def _write_turns(session: Session, turned: list[tuple[FaultState, str]],
                 seen_again: list[FaultState], at: datetime, api_url: str,
                 changes: HealthChanges) -> None:
    """Open and resolve the incidents of the faults that turned, touch those seen again,
    and write their events in the order the faults turned."""
    incidents = [_incident(s) for s, status in turned if status == DEGRADED]
    opened = iter(zip(store.open_findings(session, incidents), incidents, strict=True))
    held = store.findings_by_id(session, [s.finding_id for s, status in turned
                                          if status == OK and s.finding_id is not None]
                                + [s.finding_id for s in seen_again if s.finding_id is not None])
    payloads: list[events.Payload] = []
    for state, status in turned:
        if status == DEGRADED:
            finding_id, incident = next(opened)
            payloads.append(_opened(state, finding_id, incident["detail"], api_url, changes))
        else:
            payloads.append(_resolved(state, held.get(state.finding_id or 0), at, api_url,
                                      changes))
    for state in seen_again:
        finding = held.get(state.finding_id or 0)
        if finding is not None:
            store.touch_finding(finding, at, state.detail)
    store.save_findings(session, list(held.values()))
    events.emit_many(session, payloads)


def _incident(state: FaultState) -> dict[str, Any]:
    """The incident row a fault opens."""
    detail = {**state.detail, "fault": state.key}
    return {"kind": state.kind, "group_key": None, "op": None, "nodes": list(state.nodes),
            "severity": detail.get("severity", "critical"), "detail": detail}


def _opened(state: FaultState, finding_id: int, detail: dict[str, Any], api_url: str,
            changes: HealthChanges) -> events.Payload:
    state.finding_id = finding_id
    (changes.probe_findings if state.kind in RANK_KINDS else changes.degraded).append(detail)
    return events.incident_opened(state.kind, detail, finding_id, list(state.nodes), api_url)


def _resolved(state: FaultState, finding: FindingRow | None, at: datetime, api_url: str,
              changes: HealthChanges) -> events.Payload:
    detail = dict(finding.detail) if finding is not None else {**state.detail, "fault": state.key}
    if finding is not None:
        store.resolve_finding(finding, at)
    state.finding_id = None
    changes.recovered.append(detail)
    return events.incident_recovered(detail, finding.id if finding is not None else None,
                                     list(state.nodes), api_url)


# ---- link health: per link and op, for reading --------------------------------------------


def _largest_size(assessments: list[Assessment], keys: list[str]
                  ) -> dict[tuple[str, str], Assessment]:
    """A link's health is judged at its largest probed size (small ones are latency).
    ``keys``: each assessment's series key, in the same order."""
    best: dict[tuple[str, str], Assessment] = {}
    for a, group in zip(assessments, keys, strict=True):
        m = a.measurement
        key = (group, m.series)
        if key not in best or m.size_bytes > best[key].measurement.size_bytes:
            best[key] = a
    return best


def _link_health(session: Session, j: Judgement, keys: list[str],
                 links: dict[tuple[str, str], Any], at: datetime, policy: Policy) -> None:
    """Fold the batch into every link's row: new rows inserted, the rest written in one
    bulk update."""
    latest = _largest_size(j.assessments, keys)
    inserts, updates = [], []
    for key, a in sorted(latest.items()):
        link = links.get(key)
        values = _folded(link, a, at, policy, learn=not _leans_slow(j, a, link))
        if link is None:
            m = a.measurement
            inserts.append({"group_key": key[0], "op": key[1], "scope": m.scope,
                            "members": sorted(m.members),
                            "nodes": sorted(group_nodes(tuple(m.members))), **values})
        else:
            updates.append({"id": link.id, **values})
    store.write_links(session, inserts, updates)


def _leans_slow(j: Judgement, a: Assessment, link: Any) -> bool:
    """Whether the judgement found the assessment's group slow for its op, or, once the
    link's baseline holds half its window, leaning slow enough to be looked into
    (``Weighing.follow_up_llr``). A young baseline learns what leans slow: a lucky first
    few values would otherwise freeze it high, and every later value would read slow."""
    m = a.measurement
    x = j.verdicts.get((m.scope, m.group))
    if x is None or m.series not in x.decisions:
        return False
    d = x.decisions[m.series]
    established = link is not None and len(link.recent_busbw or []) >= HISTORY_WINDOW // 2
    return d.degraded or (established and d.llr >= x.weighing.follow_up_llr)


def _folded(link: Any, a: Assessment, at: datetime, policy: Policy, *,
            learn: bool = True) -> dict[str, Any]:
    """One assessment folded into a link (None: a new one) through the hysteresis policy,
    and, with ``learn``, its busbw into the link's running baseline (restarted when the
    judged size changes): the link's new column values. A value the judgement found slow is
    not learnt: a lasting loss must not become the link's normal (after about half the
    window it would, and a group with no peers, the world group, would stop showing it)."""
    m = a.measurement
    same_size = link is not None and link.size_bytes == m.size_bytes
    past = list(link.recent_busbw or []) if same_size else []
    previous = link.status if link is not None else "ok"
    recent = tuple(c == "1" for c in (link.recent or "")) if link is not None else ()
    state = step(LinkState(previous, recent, (link.good_streak or 0) if link is not None else 0),
                 a.bad, policy)
    return {
        "status": state.status, "size_bytes": m.size_bytes, "busbw_gbs": m.busbw_gbs,
        "expected_gbs": a.expected_gbs, "ratio": a.ratio,
        "bad_streak": ((link.bad_streak or 0) if link is not None else 0) + 1 if a.bad else 0,
        "good_streak": state.good_streak,
        "recent": "".join("1" if bad else "0" for bad in state.recent),
        "recent_busbw": ([*past, m.busbw_gbs] if learn else past)[-HISTORY_WINDOW:],
        "updated_at": at,
        "changed_at": at if link is None or state.status != previous else link.changed_at,
    }
