"""A preflight verdict from results already stored: fresh measurements and probe findings."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from sqlalchemy.orm import Session

from agents.spec import Finding, member, utcnow
from services.analyzer.assess import assess
from services.analyzer.fleet import require_nodes
from services.analyzer.health import to_probe_measurement
from services.analyzer.localize import localize
from services.analyzer.verdict import build_verdict
from services.store import measurements as store


def verdict_from_store(session: Session, nodes: list[str], max_age_s: float) -> dict[str, Any]:
    require_nodes(session, nodes)
    since = utcnow() - timedelta(seconds=max_age_s)
    rows = _latest_per_series(store.recent_for_nodes(session, nodes, since))
    wanted = set(nodes)
    findings = [
        f for run in store.runs_since(session, since) for f in _run_findings(run, wanted, rows)
    ]
    measurements = [to_probe_measurement(r) for r in rows]
    probed = {n for r in rows for n in r.nodes} | {f.node for f in findings if f.node}
    unprobed = sorted(wanted - probed)
    verdict = build_verdict(
        backend=rows[-1].backend if rows else "unknown", nodes=sorted(wanted),
        findings=localize(assess(measurements), findings, sorted(wanted)),
        rounds=0, duration_s=0.0, extra={"source": "stored", "max_age_s": max_age_s,
                                         "unprobed": unprobed},
    )
    if unprobed:
        verdict["healthy"] = False
    return verdict


def _latest_per_series(rows):
    latest = {}
    for r in rows:  # rows come in time order: the last one of a series wins
        latest[(r.group_key, r.op, r.size_bytes, r.dtype)] = r
    return sorted(latest.values(), key=lambda r: r.time)


def _run_findings(run, wanted: set[str], rows) -> list[Finding]:
    """A run's probe findings on these nodes, unless a later clean result cleared the rank."""
    out = []
    for d in run.findings or []:
        f = Finding.from_dict(d)
        if f.node not in wanted:
            continue
        rank = member(f.node, f.gpu) if f.gpu is not None else None
        cleared = rank is not None and any(
            r.time > run.received_at and rank in r.members and r.wrong == 0 for r in rows
        )
        if not cleared:
            out.append(f)
    return out
