"""A preflight verdict from what monitoring already knows: its open incidents on the nodes,
and whether the nodes were probed recently at all.

The incidents are the judgement of every ingested batch (``services.analyzer.judge``)
through the hysteresis, so this answer agrees with ``GET /v1/health`` and the webhooks by
construction: a fault that has lasted long enough to open an incident excludes its node; a
fault seen only in the latest cycle is a ``suspect`` (a preflight with ``confirm`` has a
scheduler re-probe it before answering); nodes with no result younger than ``max_age_s``
are ``unprobed`` and make the verdict unhealthy.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from sqlalchemy.orm import Session

from agents.spec import Finding, utcnow
from services.analyzer.faults import FLEET_KIND
from services.analyzer.verdict import build_verdict, exclude_of
from services.monitor.fleet import require_nodes
from services.store import health as health_store
from services.store import measurements as store


def verdict_from_store(session: Session, nodes: list[str], max_age_s: float) -> dict[str, Any]:
    require_nodes(session, nodes)
    wanted = sorted(set(nodes))
    since = utcnow() - timedelta(seconds=max_age_s)
    findings = [_finding(f.detail, f.kind) for f in health_store.open_findings_on(session, wanted)]
    findings = [f for f in findings if _inside(f, set(wanted))]
    pending = [_finding(s.detail, s.kind) for s in health_store.pending_faults_on(session, wanted)]
    suspects = sorted(set(exclude_of([f for f in pending if _inside(f, set(wanted))]))
                      - set(exclude_of(findings)))
    unprobed = sorted(set(wanted) - store.probed_nodes(session, wanted, since))
    backend = store.latest_backend(session, wanted)
    verdict = build_verdict(
        backend=backend or "unknown", nodes=wanted, findings=findings, rounds=0, duration_s=0.0,
        extra={"source": "stored", "max_age_s": max_age_s, "unprobed": unprobed,
               "suspects": suspects},
    )
    if unprobed:
        verdict["healthy"] = False
    return verdict


def _finding(detail: dict[str, Any], kind: str) -> Finding:
    d = {k: v for k, v in detail.items() if k != "fault"}
    d.setdefault("kind", kind)
    return Finding.from_dict(d)


def _inside(f: Finding, wanted: set[str]) -> bool:
    """A finding concerns the job when its node is one of them, or (a path) both ends are."""
    if f.node is not None:
        return f.node in wanted
    if f.kind == FLEET_KIND:  # the fleet's shortfall concerns a job on any node it reaches
        return bool(set(f.nodes or ()) & wanted)
    return set(f.nodes or ()) <= wanted if f.nodes else False
