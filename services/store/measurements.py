"""Nodes, ranks, probe runs and the measurement time series."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.orm import Session

from services.store.models import Gpu, Measurement, Node, ProbeRun

# Postgres cannot index a btree key over about 2.7 kB (a 100-node group's member list).
MAX_PLAIN_KEY = 512


def group_key(members: Sequence[str]) -> str:
    """The series key of a group: its members, sorted, comma-joined; for a group too large
    to index that way (a world group), ``sha256:`` and the hash of that same text."""
    canonical = ",".join(sorted(members))
    if len(canonical) <= MAX_PLAIN_KEY:
        return canonical
    return "sha256:" + hashlib.sha256(canonical.encode()).hexdigest()


def claim_batch(session: Session, batch_id: str, backend: str) -> ProbeRun | None:
    """Create the run for ``batch_id``; None when that batch was stored before (a retry)."""
    stmt = (
        insert(ProbeRun)
        .values(batch_id=batch_id, backend=backend, measurement_count=0, findings=[])
        .on_conflict_do_nothing(index_elements=["batch_id"])
        .returning(ProbeRun.id)
    )
    run_id = session.scalar(stmt)
    if run_id is None:
        return None
    return session.get(ProbeRun, run_id)


def find_run(session: Session, batch_id: str) -> ProbeRun | None:
    return session.scalar(select(ProbeRun).where(ProbeRun.batch_id == batch_id))


def upsert_nodes(session: Session, names: Sequence[str], backend: str, seen_at: datetime) -> None:
    if not names:
        return
    stmt = insert(Node).values(
        [{"name": n, "backend": backend, "last_seen_at": seen_at} for n in sorted(set(names))]
    )
    stmt = stmt.on_conflict_do_update(
        index_elements=["name"],
        set_={"last_seen_at": func.greatest(Node.last_seen_at, stmt.excluded.last_seen_at),
              "backend": stmt.excluded.backend},
    )
    session.execute(stmt)


def record_scheduling(session: Session, duty_cycle: dict[str, float], skipped: dict[str, str],
                      probed: Sequence[str]) -> None:
    """Store each node's duty cycle and why it was skipped (cleared once it is probed)."""
    names = set(duty_cycle) | set(skipped) | set(probed)
    for node in session.scalars(select(Node).where(Node.name.in_(names))):
        if node.name in duty_cycle:
            node.duty_cycle = duty_cycle[node.name]
        if node.name in skipped:
            node.skipped_reason = skipped[node.name]
        elif node.name in probed:
            node.skipped_reason = None


def upsert_ranks(session: Session, ranks: Sequence[dict[str, Any]]) -> None:
    """Record rank identities (node, local_index, GPU UUID, PCI bus id, telemetry)."""
    if not ranks:
        return
    nodes = {n.name: n for n in session.scalars(
        select(Node).where(Node.name.in_({r["node"] for r in ranks})))}
    for r in ranks:
        node = nodes.get(r["node"])
        if node is not None and r.get("hostname") and node.hostname != r["hostname"]:
            node.hostname = r["hostname"]
    ids = {name: n.id for name, n in nodes.items()}
    rows = [
        {"node_id": ids[r["node"]], "local_index": r["local_index"], "uuid": r.get("gpu_uuid"),
         "pci_bus_id": r.get("pci_bus_id"), "numa_node": r.get("numa_node"),
         "name": r.get("gpu_name"), "telemetry": r.get("telemetry") or {}}
        for r in ranks if r["node"] in ids
    ]
    if not rows:
        return
    stmt = insert(Gpu)
    stmt = stmt.on_conflict_do_update(
        constraint="uq_gpus_node_local",
        set_={c: stmt.excluded[c] for c in ("uuid", "pci_bus_id", "numa_node", "name", "telemetry")}
        | {"updated_at": func.now()},
    )
    # executemany: one statement compiled once, sent in pages (not one giant VALUES list).
    session.execute(stmt, rows)


def add_measurements(session: Session, run: ProbeRun, rows: Sequence[dict[str, Any]]) -> int:
    """Store a batch's measurements: one statement, executemany in pages, no ORM objects."""
    if rows:
        session.execute(insert(Measurement), [
            {**r, "run_id": run.id, "backend": run.backend, "group_key": group_key(r["members"])}
            for r in rows])
    run.measurement_count = len(rows)
    return len(rows)


def known_nodes(session: Session, names: Sequence[str]) -> set[str]:
    return set(session.scalars(select(Node.name).where(Node.name.in_(set(names)))).all())


def list_nodes(session: Session) -> list[tuple[Node, list[Gpu]]]:
    nodes = session.scalars(select(Node).order_by(Node.name)).all()
    gpus = session.scalars(select(Gpu).order_by(Gpu.node_id, Gpu.local_index)).all()
    by_node: dict[int, list[Gpu]] = {}
    for g in gpus:
        by_node.setdefault(g.node_id, []).append(g)
    return [(n, by_node.get(n.id, [])) for n in nodes]


def stream_series(
    session: Session,
    key: str,
    *,
    op: str | None = None,
    size_bytes: int | None = None,
    since: datetime | None = None,
    until: datetime | None = None,
    limit: int = 10_000,
) -> Iterator[Measurement]:
    """One link's or group's measurements in time order, streamed."""
    q = select(Measurement).where(Measurement.group_key == key)
    if op:
        q = q.where(Measurement.op == op)
    if size_bytes:
        q = q.where(Measurement.size_bytes == size_bytes)
    if since:
        q = q.where(Measurement.time >= since)
    if until:
        q = q.where(Measurement.time <= until)
    q = q.order_by(Measurement.time).limit(limit).execution_options(yield_per=500)
    yield from session.scalars(q)


def latest_backend(session: Session, nodes: Sequence[str]) -> str | None:
    """The backend of the newest measurement on any of ``nodes``."""
    return session.scalar(select(Measurement.backend)
                          .where(Measurement.nodes.overlap(list(nodes)))
                          .order_by(Measurement.time.desc()).limit(1))


def probed_nodes(session: Session, nodes: Sequence[str], since: datetime) -> set[str]:
    """Which of ``nodes`` appear in a measurement taken since ``since``."""
    wanted = list(nodes)
    node = func.unnest(Measurement.nodes).label("node")
    inner = (select(node).where(Measurement.time >= since, Measurement.nodes.overlap(wanted))
             .subquery())
    return set(session.scalars(select(inner.c.node).distinct())) & set(wanted)
