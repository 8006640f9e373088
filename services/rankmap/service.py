"""The full rank-map check: the table's own checks plus what the fleet knows of its hosts.

A host of the table is a node of the fleet by name or by hostname; a name wins, since
one machine may carry several logical nodes that share its hostname.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy.orm import Session

from ringwatch.agents.spec import EXCLUDING_KINDS, Finding
from ringwatch.services.errors import BadInput
from ringwatch.services.rankmap import checks
from ringwatch.services.rankmap.checks import RankEntry, rank_mapping
from ringwatch.services.store import rankmap as store

# Links that lie inside one node: degraded, they are that node's fault.
NODE_SCOPES = ("intra_node", "gpu_pair")


def check_request(session: Session, ranks: list[dict[str, Any]] | None,
                  hostfile: str | None) -> dict[str, Any]:
    """A check of a table given as entries or as a hostfile's text, one of the two."""
    if (ranks is None) == (hostfile is None):
        raise BadInput('give the rank table as "ranks" or as "hostfile", one of the two')
    entries = checks.parse_hostfile(hostfile) if hostfile is not None else checks.parse_json_table(ranks)
    return check(session, entries)


def check(session: Session, entries: Sequence[RankEntry]) -> dict[str, Any]:
    """The answer of ``POST /v1/rank-maps/check``: every check, nothing skipped."""
    hosts = list(dict.fromkeys(e.host for e in entries))
    nodes = resolve_hosts(session, hosts)
    findings = [*checks.structural_findings(entries), *unknown_hosts(entries, nodes),
                *misplaced_gpus(session, entries, nodes), *unhealthy_hosts(session, hosts, nodes)]
    return checks.report(entries, findings)


def resolve_hosts(session: Session, hosts: Sequence[str]) -> dict[str, list[str]]:
    """Each host's node names in the fleet; an unknown host maps to none."""
    rows = store.nodes_for_hosts(session, hosts)
    names = {name for name, _ in rows}
    by_hostname: dict[str, list[str]] = {}
    for name, hostname in rows:
        if hostname is not None:
            by_hostname.setdefault(hostname, []).append(name)
    return {host: [host] if host in names else by_hostname.get(host, []) for host in hosts}


def unknown_hosts(entries: Sequence[RankEntry], nodes: dict[str, list[str]]) -> list[Finding]:
    ranks: dict[str, list[int]] = {}
    for e in entries:
        if not nodes[e.host]:
            ranks.setdefault(e.host, []).append(e.rank)
    return [rank_mapping("unknown_host", node=host, severity="warning", ranks=sorted(rs))
            for host, rs in ranks.items()]


def misplaced_gpus(session: Session, entries: Sequence[RankEntry],
                   nodes: dict[str, list[str]]) -> list[Finding]:
    """A GPU UUID that the fleet knows on the rank's host, but at another local index."""
    known: dict[tuple[str, str], int] = {
        (uuid, node): index
        for uuid, node, index in store.gpus_by_uuid(
            session, {e.gpu_uuid for e in entries if e.gpu_uuid is not None})
    }
    out = []
    for e in entries:
        if e.gpu_uuid is None:
            continue
        indexes = {known[(e.gpu_uuid, n)] for n in nodes[e.host] if (e.gpu_uuid, n) in known}
        if indexes and e.local_rank not in indexes:
            out.append(rank_mapping("local_rank_mismatch", node=e.host, rank=e.rank,
                                    gpu_uuid=e.gpu_uuid, local_rank=e.local_rank,
                                    fleet_local_index=min(indexes)))
    return out


def unhealthy_hosts(session: Session, hosts: Sequence[str],
                    nodes: dict[str, list[str]]) -> list[Finding]:
    """Hosts with an open finding that blames them or a degraded link inside them, each with
    the reason that counts most: a critical finding first, a finding before a bare link.

    As in preflight's ``exclude``, a degraded path between two nodes blames neither: one
    slow NIC would otherwise mark every host it talks to."""
    names = {n for host in hosts for n in nodes[host]}
    findings = sorted(store.open_findings_on(session, names, EXCLUDING_KINDS),
                      key=lambda f: f["severity"] != "critical")  # stable: newest first within
    links = store.degraded_links_on(session, names, NODE_SCOPES)
    out = []
    for host in hosts:
        mine = set(nodes[host])
        causes = [_because_finding(f) for f in findings if mine & set(f["nodes"])]
        causes += [_because_link(x) for x in links if mine & set(x["nodes"])]
        if causes:
            out.append(rank_mapping("unhealthy_host", node=host, because=causes[0],
                                    causes=len(causes)))
    return out


def _because_finding(f: dict[str, Any]) -> dict[str, Any]:
    return {**f["detail"], "kind": f["kind"], "finding_id": f["id"], "nodes": list(f["nodes"]),
            "severity": f["severity"], "opened_at": f["opened_at"].isoformat()}


def _because_link(link: dict[str, Any]) -> dict[str, Any]:
    return {"kind": "degraded_link", "scope": link["scope"], "op": link["op"],
            "members": list(link["members"]), "nodes": list(link["nodes"]),
            "busbw_gbs": link["busbw_gbs"], "expected_gbs": link["expected_gbs"],
            "ratio": link["ratio"], "since": link["changed_at"].isoformat()}
