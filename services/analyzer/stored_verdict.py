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
from services.analyzer.verdict import build_verdict, exclude_of
from services.store import measurements as store
from services.store.models import Measurement as MeasurementRow


def verdict_from_store(session: Session, nodes: list[str], max_age_s: float) -> dict[str, Any]:
    """The verdict from fresh stored results.

    A link is judged by the better of its last two results, so one noisy cycle neither
    excludes a healthy node nor hides a fault that has lasted two cycles. Nodes that only
    the latest cycle calls bad are listed as ``suspects``: a preflight with ``confirm``
    has a scheduler re-probe them before it answers.
    """
    require_nodes(session, nodes)
    since = utcnow() - timedelta(seconds=max_age_s)
    recent = _last_two_per_series(store.recent_for_nodes(session, nodes, since))
    latest = sorted((pair[-1] for pair in recent), key=lambda r: r.time)
    best = [max(pair, key=lambda r: r.busbw_gbs) for pair in recent]
    wanted = sorted(set(nodes))
    findings = [
        f for run in store.runs_since(session, since) for f in _run_findings(run, set(wanted), latest)
    ]
    confirmed = _findings(best, findings, wanted)
    suspects = sorted(set(exclude_of(_findings(latest, findings, wanted))) - set(exclude_of(confirmed)))
    probed = {n for r in latest for n in r.nodes} | {f.node for f in findings if f.node}
    unprobed = sorted(set(wanted) - probed)
    verdict = build_verdict(
        backend=latest[-1].backend if latest else "unknown", nodes=wanted, findings=confirmed,
        rounds=0, duration_s=0.0,
        extra={"source": "stored", "max_age_s": max_age_s, "unprobed": unprobed,
               "suspects": suspects},
    )
    if unprobed:
        verdict["healthy"] = False
    return verdict


def _findings(rows: list[MeasurementRow], probe_findings: list[Finding],
              nodes: list[str]) -> list[Finding]:
    return localize(assess([to_probe_measurement(r) for r in rows]), probe_findings, nodes)


def _last_two_per_series(rows: list[MeasurementRow]) -> list[list[MeasurementRow]]:
    series: dict[tuple[str, str, int, str, str], list[MeasurementRow]] = {}
    for r in rows:  # rows come in time order
        key = (r.group_key, r.op, r.size_bytes, r.dtype, r.redop)
        series[key] = [*series.get(key, [])[-1:], r]
    return list(series.values())


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
