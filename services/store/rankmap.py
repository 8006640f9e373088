"""What a rank-map check asks of the fleet: which hosts it knows, where its GPUs sit,
and what is wrong with them now.

Plain rows rather than model objects: a check reads a few columns and writes nothing.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from sqlalchemy import Text, any_, literal, or_, select
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.orm import Session

from ringwatch.services.store.models import Finding, Gpu, LinkHealth, Node


def _any_of(values: Collection[str]) -> Any:
    """``= ANY(...)`` of one text[] parameter: an IN list binds one parameter a value, and
    Postgres takes at most 65,535 (a rank map may name 262,144 hosts and GPUs)."""
    return any_(literal(sorted(set(values)), ARRAY(Text)))


def nodes_for_hosts(session: Session, hosts: Collection[str]) -> list[tuple[str, str | None]]:
    """(name, hostname) of every node of the fleet whose name or hostname is one of
    ``hosts`` (a retired node is no host a job can run on)."""
    if not hosts:
        return []
    q = select(Node.name, Node.hostname).where(
        or_(Node.name == _any_of(hosts), Node.hostname == _any_of(hosts)),
        Node.retired_at.is_(None)).order_by(Node.name)
    return [(name, hostname) for name, hostname in session.execute(q).tuples()]


def gpus_by_uuid(session: Session, uuids: Collection[str]) -> list[tuple[str, str, int]]:
    """(uuid, node name, local index) of every GPU of the fleet with one of ``uuids``."""
    if not uuids:
        return []
    q = (select(Gpu.uuid, Node.name, Gpu.local_index)
         .join(Node, Gpu.node_id == Node.id)
         .where(Gpu.uuid == _any_of(uuids), Node.retired_at.is_(None)))
    return [(uuid or "", name, index) for uuid, name, index in session.execute(q).tuples()]


def open_findings_on(session: Session, nodes: Collection[str],
                     kinds: Collection[str]) -> list[dict[str, Any]]:
    """Open findings of ``kinds`` that name any of ``nodes``, newest first."""
    if not nodes:
        return []
    q = (select(Finding.id, Finding.kind, Finding.severity, Finding.nodes, Finding.detail,
                Finding.opened_at)
         .where(Finding.status == "open", Finding.kind.in_(set(kinds)),
                Finding.nodes.overlap(list(set(nodes))))
         .order_by(Finding.opened_at.desc(), Finding.id.desc()))
    return [dict(row) for row in session.execute(q).mappings()]


def degraded_links_on(session: Session, nodes: Collection[str],
                      scopes: Collection[str]) -> list[dict[str, Any]]:
    """Degraded links of ``scopes`` that touch any of ``nodes``, most degraded first."""
    if not nodes:
        return []
    q = (select(LinkHealth.scope, LinkHealth.op, LinkHealth.members, LinkHealth.nodes,
                LinkHealth.busbw_gbs, LinkHealth.expected_gbs, LinkHealth.ratio,
                LinkHealth.changed_at)
         .where(LinkHealth.status == "degraded", LinkHealth.scope.in_(set(scopes)),
                LinkHealth.nodes.overlap(list(set(nodes))))
         .order_by(LinkHealth.ratio.asc().nulls_last(), LinkHealth.group_key))
    return [dict(row) for row in session.execute(q).mappings()]
