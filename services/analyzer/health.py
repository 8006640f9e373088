"""Turn an ingested round into link health: degrade, recover, open and resolve findings.

Every health change and its outbox event are written in the caller's transaction,
so an event exists exactly when the change it announces does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from sqlalchemy.orm import Session

from agents.spec import Measurement as ProbeMeasurement
from services.analyzer.assess import Assessment, Thresholds, assess, link_key
from services.analyzer.hysteresis import LinkState, Policy, step
from services.store import health as store
from services.store import measurements as measurement_store
from services.store.models import Measurement as MeasurementRow

# A degraded link of this scope becomes a finding of this kind; a world group has no
# single link to blame, its health is kept but it opens no finding by itself.
KIND_BY_SCOPE = {
    "intra_node": "nvlink_degraded",
    "gpu_pair": "nvlink_degraded",
    "inter_node": "net_path_degraded",
}


@dataclass
class HealthChanges:
    degraded: list[dict[str, Any]] = field(default_factory=list)
    recovered: list[dict[str, Any]] = field(default_factory=list)
    probe_findings: list[dict[str, Any]] = field(default_factory=list)


def to_probe_measurement(row: MeasurementRow) -> ProbeMeasurement:
    return ProbeMeasurement(
        op=row.op, scope=row.scope, members=list(row.members), size_bytes=row.size_bytes,
        dtype=row.dtype, warmup=row.warmup, iters=row.iters, time_us=row.time_us,
        algbw_gbs=row.algbw_gbs, busbw_gbs=row.busbw_gbs, wrong=row.wrong, time=row.time,
        redop=row.redop,
    )


def _history(session: Session, rows: list[MeasurementRow]) -> dict[tuple, list[float]]:
    """Each link's own past busbw, keyed as ``assess`` wants it: the baseline for groups
    that have no peers in their round (the world group) and a second opinion for the rest."""
    if not rows:
        return {}
    keys = {(r.group_key, r.op, r.size_bytes, r.dtype): r for r in rows}
    past = measurement_store.history(session, list(keys), before_run=rows[0].run_id)
    return {link_key(to_probe_measurement(keys[k])): values for k, values in past.items()}


def _largest_size(assessments: list[Assessment]) -> dict[tuple[str, str], Assessment]:
    """Bandwidth health is judged at each link's largest probed size (small ones are latency)."""
    best: dict[tuple[str, str], Assessment] = {}
    for a in assessments:
        m = a.measurement
        key = (",".join(sorted(m.members)), m.op)
        if key not in best or m.size_bytes > best[key].measurement.size_bytes:
            best[key] = a
    return best


def finding_payload(kind: str, a: Assessment, severity: str) -> dict[str, Any]:
    m = a.measurement
    nodes = sorted({x.split("/")[0] for x in m.members})
    payload: dict[str, Any] = {"kind": kind, "scope": m.scope, "op": m.op, "members": list(m.members),
                               "measured_gbs": round(m.busbw_gbs, 3), "severity": severity}
    if a.expected_gbs is not None:
        payload["expected_gbs"] = round(a.expected_gbs, 3)
    if kind == "net_path_degraded":
        payload["nodes"] = nodes
    else:
        payload["node"] = nodes[0]
    if m.scope == "gpu_pair":
        payload["gpus"] = sorted(int(x.split("/")[1]) for x in m.members)
    return payload


def _severity(a: Assessment, t: Thresholds) -> str:
    return "critical" if a.ratio is not None and a.ratio < t.critical_ratio else "warning"


def apply_round(
    session: Session,
    rows: list[MeasurementRow],
    probe_findings: list[dict[str, Any]],
    *,
    at: datetime,
    thresholds: Thresholds | None = None,
    hysteresis: Policy | None = None,
    api_url: str = "",
) -> HealthChanges:
    t = thresholds or Thresholds()
    h = hysteresis or Policy()
    changes = HealthChanges()
    probes = [to_probe_measurement(r) for r in rows]
    latest = _largest_size(assess(probes, thresholds=t, history=_history(session, rows)))
    links = store.get_links(session, list(latest))
    for key, a in sorted(latest.items()):
        link = links.get(key) or _new_link(session, key, a)
        previous = _update_link(link, a, at, h)
        kind = KIND_BY_SCOPE.get(link.scope)
        if kind is None or link.status == previous:
            continue
        if link.status == "degraded":
            payload = finding_payload(kind, a, _severity(a, t))
            finding = store.open_finding(session, kind=kind, group_key=link.group_key, op=link.op,
                                         nodes=list(link.nodes), severity=payload["severity"],
                                         detail=payload)
            _event(session, "health.degraded", finding.id, payload, link, api_url)
            changes.degraded.append(payload)
        else:
            open_ = store.open_finding_for(session, link.group_key, link.op)
            payload = dict(open_.detail) if open_ else finding_payload(kind, a, "info")
            payload["measured_gbs"] = round(a.measurement.busbw_gbs, 3)
            if open_ is not None:
                store.resolve_finding(session, open_, at)
            _event(session, "health.recovered", open_.id if open_ else None, payload, link, api_url)
            changes.recovered.append(payload)
    _probe_findings(session, rows, probe_findings, at, api_url, changes)
    return changes


def _rank_of(detail: dict[str, Any]) -> str | None:
    node, gpu = detail.get("node"), detail.get("gpu")
    return f"{node}/{gpu}" if node is not None and gpu is not None else None


def _probe_findings(session: Session, rows: list[MeasurementRow], new: list[dict[str, Any]],
                    at: datetime, api_url: str, changes: HealthChanges) -> None:
    """Open hang / wrong-data incidents once; resolve them when their rank probes clean again."""
    open_ = {(f.kind, _rank_of(f.detail) or ",".join(f.nodes)): f
             for f in store.open_probe_findings(session)}
    clean = {m for r in rows if r.wrong == 0 for m in r.members}
    reported = set()
    for pf in new:
        key = (pf["kind"], _rank_of(pf) or ",".join(sorted(pf.get("nodes") or [])))
        if key in open_:
            open_[key].last_seen_at = at  # a repeat of an open incident: no new event
        elif key not in reported:
            # One rank's fault seen by several of its groups in one batch (its node's
            # group, a node pair, the world group) is one incident, not one per group.
            changes.probe_findings.append(_record_probe_finding(session, pf, api_url))
        reported.add(key)
    for key, f in open_.items():
        rank = _rank_of(f.detail)
        if key not in reported and rank is not None and rank in clean:
            store.resolve_finding(session, f, at)
            store.enqueue_event(session, "health.recovered", {
                "finding": f.detail, "finding_id": f.id, "nodes": list(f.nodes), "links": [],
                "url": f"{api_url}/v1/findings/{f.id}"})
            changes.recovered.append(dict(f.detail))


def _new_link(session: Session, key: tuple[str, str], a: Assessment):
    m = a.measurement
    return store.add_link(
        session, group_key=key[0], op=key[1], scope=m.scope, members=sorted(m.members),
        nodes=sorted({x.split("/")[0] for x in m.members}), status="ok", size_bytes=m.size_bytes,
        busbw_gbs=m.busbw_gbs, bad_streak=0, good_streak=0, recent="",
    )


def _update_link(link, a: Assessment, at: datetime, policy: Policy) -> str:
    """Fold one assessment into the link through the hysteresis policy; return its status before."""
    link.size_bytes = a.measurement.size_bytes
    link.busbw_gbs = a.measurement.busbw_gbs
    link.expected_gbs = a.expected_gbs
    link.ratio = a.ratio
    link.updated_at = at
    link.bad_streak = (link.bad_streak or 0) + 1 if a.bad else 0
    previous = link.status
    state = step(LinkState(previous, tuple(c == "1" for c in link.recent or ""), link.good_streak or 0),
                 a.bad, policy)
    link.status, link.good_streak = state.status, state.good_streak
    link.recent = "".join("1" if bad else "0" for bad in state.recent)
    if link.status != previous:
        link.changed_at = at
    return previous


def _event(session: Session, event_type: str, finding_id: int | None, finding: dict[str, Any],
           link, api_url: str) -> None:
    store.enqueue_event(session, event_type, {
        "finding": finding,
        "finding_id": finding_id,
        "group_key": link.group_key,
        "nodes": list(link.nodes),
        "links": [{"scope": link.scope, "members": list(link.members), "op": link.op}],
        "url": f"{api_url}/v1/links?node={link.nodes[0]}" if link.nodes else f"{api_url}/v1/links",
    })


def _record_probe_finding(session: Session, pf: dict[str, Any], api_url: str) -> dict[str, Any]:
    """A hang or wrong data seen by the probes themselves: always an incident and an event."""
    nodes = sorted({pf["node"]} if pf.get("node") else set(pf.get("nodes") or []))
    finding = store.open_finding(session, kind=pf["kind"], group_key=None, op=None, nodes=nodes,
                                 severity=pf.get("severity", "critical"), detail=pf)
    event = {"hang": "probe.hang", "probe_error": "probe.error"}.get(pf["kind"], "health.degraded")
    store.enqueue_event(session, event, {
        "finding": pf, "finding_id": finding.id, "nodes": nodes, "links": [],
        "url": f"{api_url}/v1/findings/{finding.id}",
    })
    return pf
