"""A preflight verdict from what monitoring already knows: the faults its latest looks found
on the nodes, and whether the nodes were probed recently at all.

Every ingested batch is judged by ``services.analyzer.judge``, the judgement a fresh
preflight makes, sequential evidence included: a fault is found only once its evidence
decides it. So this answer excludes what that judgement found in its latest look at each
place, whether or not the hysteresis has opened an incident yet (incidents and webhooks wait
for a second bad cycle so that alerts do not flap; a job gate must not answer healthy about
a fault a fresh check would exclude). A fault found earlier in the hysteresis window but not
in its latest look is a ``suspect``: listed, not excluded (a preflight with ``confirm`` has a
scheduler re-probe it). Nodes with no result younger than ``max_age_s`` are ``unprobed`` and
make the verdict unhealthy.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from sqlalchemy.orm import Session

from agents.groups import node_order
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
    findings, earlier = _judged(session, set(wanted))
    suspects = sorted(set(exclude_of(earlier)) - set(exclude_of(findings)), key=node_order)
    unprobed = sorted(set(wanted) - store.probed_nodes(session, wanted, since), key=node_order)
    backend = store.latest_backend(session, wanted)
    verdict = build_verdict(
        backend=backend or "unknown", nodes=wanted, findings=findings, rounds=0, duration_s=0.0,
        extra={"source": "stored", "max_age_s": max_age_s, "unprobed": unprobed,
               "suspects": suspects},
    )
    if unprobed:
        verdict["healthy"] = False
    return verdict


def excluded_nodes(session: Session) -> set[str]:
    """Every node a preflight naming it would exclude now. A node is blamed only by a
    finding on that node, so the answer is the same whichever other nodes a preflight
    names: this is each node's health as /metrics reports it."""
    findings, _ = _judged(session, None)
    return set(exclude_of(findings))


def _judged(session: Session, wanted: set[str] | None) -> tuple[list[Finding], list[Finding]]:
    """What the stored judgement holds against ``wanted`` (None: the whole fleet): the open
    incidents and the faults its latest look found; and apart, the faults found only
    earlier in the hysteresis window (suspects)."""
    def concerns(f: Finding) -> bool:
        return wanted is None or _inside(f, wanted)

    names = sorted(wanted) if wanted is not None else None
    findings = [f for f in (_finding(x.detail, x.kind)
                            for x in health_store.open_findings_on(session, names))
                if concerns(f)]
    latest: list[Finding] = []
    earlier: list[Finding] = []
    for state in health_store.pending_faults_on(session, names):
        f = _finding(state.detail, state.kind, pending=True)
        if concerns(f):
            (latest if state.recent.endswith("1") else earlier).append(f)
    return findings + latest, earlier


def _finding(detail: dict[str, Any], kind: str, *, pending: bool = False) -> Finding:
    """A stored fault as a verdict's finding; ``pending``: found by the latest look, no
    incident open (yet)."""
    d = {k: v for k, v in detail.items() if k != "fault"}
    d.setdefault("kind", kind)
    if pending:
        d["pending"] = True
    return Finding.from_dict(d)


def _inside(f: Finding, wanted: set[str]) -> bool:
    """A finding concerns the job when its node is one of them, or (a path) both ends are."""
    if f.node is not None:
        return f.node in wanted
    if f.kind == FLEET_KIND:  # the fleet's shortfall concerns a job on any node it reaches
        return bool(set(f.nodes or ()) & wanted)
    return set(f.nodes or ()) <= wanted if f.nodes else False
