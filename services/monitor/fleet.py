"""Read models of the fleet for the API: plain dicts, shaped once here."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy.orm import Session

from agents.spec import split_member
from services.analyzer.assess import Thresholds
from services.errors import BadInput, NodeNotFound, NotFound
from services.store import health as health_store
from services.store import measurements as store
from services.store import timeseries


def nodes(session: Session, *, after: str | None = None,
          limit: int | None = None) -> list[dict[str, Any]]:
    return [
        {"name": n.name, "hostname": n.hostname, "backend": n.backend, "profile": n.profile,
         "duty_cycle": n.duty_cycle, "skipped_reason": n.skipped_reason,
         "last_seen_at": n.last_seen_at,
         "gpus": [{"local_index": g.local_index, "uuid": g.uuid, "pci_bus_id": g.pci_bus_id,
                   "numa_node": g.numa_node, "name": g.name} for g in gpus]}
        for n, gpus in store.list_nodes(session, after=after, limit=limit)
    ]


def require_nodes(session: Session, names: list[str]) -> None:
    unknown = sorted(set(names) - store.known_nodes(session, names))
    if unknown:
        raise NodeNotFound(f"unknown node(s): {', '.join(unknown[:20])}")


def links(session: Session, *, status: str | None, scope: str | None, node: str | None,
          after: tuple[str, ...] | None = None,
          limit: int | None = None) -> list[dict[str, Any]]:
    if node:
        require_nodes(session, [node])
    return [
        {c: getattr(link, c) for c in ("group_key", "scope", "op", "members", "nodes", "status",
                                        "size_bytes",
                                        "busbw_gbs", "expected_gbs", "ratio", "updated_at",
                                        "changed_at")}
        for link in health_store.list_links(session, status=status, scope=scope, node=node,
                                            after=after, limit=limit)
    ]


def baselines(session: Session, *, min_count: int = Thresholds.min_history, after: tuple[str, ...] | None = None,
              limit: int | None = None) -> list[dict[str, Any]]:
    """Links with a running baseline of at least ``min_count`` values."""
    return [{"group_key": r.group_key, "scope": r.scope, "op": r.op, "members": list(r.members),
             "size_bytes": r.size_bytes, "values": list(r.recent_busbw)}
            for r in health_store.list_baselines(session, min_count, after=after, limit=limit)]


def series(session: Session, members: list[str] | None, *, op: str | None,
           size_bytes: int | None, since: datetime | None, until: datetime | None, limit: int,
           group: str | None = None, resolution: str = "auto",
           retention: timeseries.Retention | None = None) -> dict[str, Any]:
    """One link's or group's series, raw or rolled up (``resolution``: raw, 1h, 1d, or auto
    to choose from the range asked)."""
    if since and until and since > until:
        raise BadInput("since is after until")
    found = None
    if members is None:
        found = store.group_by_key(session, group or "")
        if found is None:
            raise NotFound(f"no link or group with key {group!r} (see GET /v1/links)")
        members = list(found.members)
    try:
        node_names = sorted({split_member(m.strip())[0] for m in members})
    except ValueError as exc:
        raise BadInput(str(exc)) from exc
    require_nodes(session, node_names)
    wanted = sorted(m.strip() for m in members)
    resolution = timeseries.pick_resolution(resolution, since, until,
                                            retention or timeseries.Retention())
    out: dict[str, Any] = {"members": wanted, "group_key": store.group_key(wanted),
                           "resolution": resolution, "points": []}
    # NVML readings of the members' GPUs around cycles where a counter rose (up to 64 ranks).
    out["counters"] = [
        {"time": c.time, "node": c.node, "local_index": c.local_index, **c.reading}
        for c in store.counters_of(session, wanted, since, until)] if len(wanted) <= 64 else []
    found = found or store.group_by_key(session, out["group_key"])
    if found is None:
        return out
    rows = timeseries.points(session, resolution, found.id, op=op, size_bytes=size_bytes,
                             since=since, until=until, limit=limit)
    if resolution == "raw":
        out["points"] = [
            {"time": m.time, "op": m.op, "size_bytes": m.size_bytes, "dtype": m.dtype,
             "redop": m.redop, "timing": m.timing, "time_us": m.time_us,
             "algbw_gbs": m.algbw_gbs, "busbw_gbs": m.busbw_gbs, "wrong": m.wrong}
            for m in rows]
    else:
        out["points"] = [
            {"time": r.bucket, "op": r.op, "size_bytes": r.size_bytes, "count": r.count,
             "time_us": r.time_us_median, "algbw_gbs": r.algbw_median,
             "busbw_gbs": r.busbw_median, "busbw_min": r.busbw_min, "busbw_max": r.busbw_max,
             "busbw_mean": r.busbw_mean, "wrong": r.wrong}
            for r in rows]
    return out


def shipper_states(session: Session) -> dict[str, dict[str, Any]]:
    """Each sending host's spool as its newest batch of the last day reported it."""
    return store.shipper_states(session)


def summary(session: Session) -> dict[str, Any]:
    counts = health_store.health_counts(session)
    open_findings = health_store.open_findings_count(session)
    # One judgement: the fleet is degraded exactly when a localized fault has an open
    # incident (what preflight and the webhooks go by), not when some link's own status is.
    if not counts and not open_findings:
        status = "unknown"
    elif open_findings:
        status = "degraded"
    else:
        status = "healthy"
    return {"status": status, "nodes": store.node_count(session), "links": counts,
            "open_findings": open_findings}


def _finding(f) -> dict[str, Any]:
    return {"id": f.id, "kind": f.kind, "status": f.status, "severity": f.severity,
            "nodes": f.nodes, "op": f.op, "detail": f.detail, "opened_at": f.opened_at,
            "resolved_at": f.resolved_at}


def findings(session: Session, *, status: str | None, limit: int = 500,
             before_id: int | None = None) -> list[dict[str, Any]]:
    return [_finding(f) for f in health_store.list_findings(session, status=status, limit=limit,
                                                            before_id=before_id)]


def finding(session: Session, finding_id: int) -> dict[str, Any]:
    found = health_store.get_finding(session, finding_id)
    if found is None:
        raise NotFound(f"no finding {finding_id}")
    return _finding(found)
