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

from collections.abc import Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy.orm import Session

from ringwatch.agents.groups import node_order
from ringwatch.agents.spec import Finding, utcnow
from ringwatch.services.analyzer.faults import FLEET_KIND
from ringwatch.services.analyzer.verdict import build_verdict, exclude_of
from ringwatch.services.errors import NodeNotFound
from ringwatch.services.monitor.fleet import require_nodes
from ringwatch.services.store import health as health_store
from ringwatch.services.store import preflight as preflight_store


def verdict_from_store(session: Session, nodes: list[str], max_age_s: float) -> dict[str, Any]:
    """The verdict for ``nodes`` from results younger than ``max_age_s`` (404: a node the
    fleet does not hold)."""
    verdict = verdicts_from_store(session, [(nodes, max_age_s)])[0]
    if isinstance(verdict, NodeNotFound):
        raise verdict
    return verdict


def verdicts_from_store(session: Session, asks: Sequence[tuple[Sequence[str], float]],
                        ) -> list[dict[str, Any] | NodeNotFound]:
    """Each ask's verdict (its nodes, its max age), or the 404 naming its nodes the fleet
    does not hold. The store is read once for all of them, in three statements: a big job's
    prologs, a thousand asks of one node each, cost what one ask of a thousand nodes does."""
    union = sorted({n for nodes, _ in asks for n in nodes})
    probes = preflight_store.node_probes(session, union)
    findings, earlier = _judged(session, set(union))
    on, before = _by_node(findings), _by_node(earlier)
    now = utcnow()
    out: list[dict[str, Any] | NodeNotFound] = []
    for nodes, max_age_s in asks:
        wanted = sorted(set(nodes))
        if not probes.keys() >= set(wanted):
            out.append(_not_found(session, wanted))
            continue
        out.append(_verdict(wanted, max_age_s, now, probes, _concerning(findings, on, wanted),
                            _concerning(earlier, before, wanted)))
    return out


def _verdict(wanted: list[str], max_age_s: float, now: datetime,
             probes: Mapping[str, preflight_store.NodeProbe], findings: list[Finding],
             earlier: list[Finding]) -> dict[str, Any]:
    since = now - timedelta(seconds=max_age_s)
    suspects = sorted(set(exclude_of(earlier)) - set(exclude_of(findings)), key=node_order)
    probed = [(p.last_probed_at, p.backend) for n in wanted
              if (p := probes[n]).last_probed_at is not None]
    unprobed = sorted((n for n in wanted
                       if (at := probes[n].last_probed_at) is None or at < since), key=node_order)
    backend = max(probed, key=lambda x: x[0])[1] if probed else None
    verdict = build_verdict(
        backend=backend or "unknown", nodes=wanted, findings=findings, rounds=0, duration_s=0.0,
        extra={"source": "stored", "max_age_s": max_age_s, "unprobed": unprobed,
               "suspects": suspects},
    )
    if unprobed:
        verdict["healthy"] = False
    return verdict


def _not_found(session: Session, wanted: list[str]) -> NodeNotFound:
    """The 404 ``require_nodes`` gives for ``wanted`` (known to hold a node the fleet does
    not): the one wording for it."""
    try:
        require_nodes(session, wanted)
    except NodeNotFound as exc:
        return exc
    return NodeNotFound(f"unknown or retired node(s) among {len(wanted)}")  # retired meanwhile


def _by_node(findings: list[Finding]) -> dict[str, list[int]]:
    """Each node's findings (their places in ``findings``): those that name it."""
    index: dict[str, list[int]] = {}
    for i, f in enumerate(findings):
        for n in {f.node, *(f.nodes or ())} - {None}:
            index.setdefault(str(n), []).append(i)
    return index


def _concerning(findings: list[Finding], index: Mapping[str, list[int]],
                wanted: list[str]) -> list[Finding]:
    """The findings that concern a job on ``wanted``, in their order."""
    places = sorted({i for n in wanted for i in index.get(n, ())})
    names = set(wanted)
    return [findings[i] for i in places if _inside(findings[i], names)]


def excluded_nodes(session: Session) -> set[str]:
    """Every node a preflight naming it would exclude now. A node is blamed only by a
    finding on that node, so the answer is the same whichever other nodes a preflight
    names: this is each node's health as /metrics reports it."""
    return set(exclusions(session))


def exclusions(session: Session) -> dict[str, list[str]]:
    """Every node a preflight naming it would exclude now (``excluded_nodes``), with the
    kinds of the findings that exclude it, critical ones first: what GET /v1/fleet/nodes
    reports as ``excluded_by`` and ``ringwatch kubernetes sync`` taints a node for."""
    findings, _ = _judged(session, None)
    ranked = sorted(findings, key=lambda f: f.severity != "critical")
    out: dict[str, list[str]] = {}
    for f in ranked:
        for node in f.blamed_nodes:
            kinds = out.setdefault(node, [])
            if f.kind not in kinds:
                kinds.append(f.kind)
    return out


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
