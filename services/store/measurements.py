"""Nodes, ranks, probe runs and the measurement time series."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any, NamedTuple

from sqlalchemy import Integer, Text, any_, func, literal, select, text, tuple_
from sqlalchemy.dialects.postgresql import ARRAY, insert
from sqlalchemy.orm import Session

from ringwatch.agents.groups import group_nodes, series_key, split_member
from ringwatch.agents.spec import series_op
from ringwatch.services.store.models import Gpu, GpuCounters, Group, Node, ProbeRun


def _names(values: Any) -> Any:
    """``= ANY(...)`` of one text[] parameter: an IN list binds one parameter a name, and
    Postgres takes at most 65,535 (a preflight may name 100,000 nodes)."""
    return any_(literal(sorted(set(values)), ARRAY(Text)))


def claim_batch(session: Session, batch_id: str, backend: str, *, digest: str | None = None,
                token_id: int | None = None) -> ProbeRun | None:
    """Create the run for ``batch_id``; None when that id was stored before."""
    stmt = (
        insert(ProbeRun)
        .values(batch_id=batch_id, backend=backend, measurement_count=0, findings=[],
                content_sha256=digest, token_id=token_id)
        .on_conflict_do_nothing(index_elements=["batch_id"])
        .returning(ProbeRun.id)
    )
    run_id = session.scalar(stmt)
    if run_id is None:
        return None
    return session.get(ProbeRun, run_id)


def find_run(session: Session, batch_id: str) -> ProbeRun | None:
    return session.scalar(select(ProbeRun).where(ProbeRun.batch_id == batch_id))


def _copy_into_temp(session: Session, table: str, columns: str, types: Sequence[str],
                    rows: Sequence[Sequence[Any]]) -> None:
    """Binary COPY ``rows`` into a temporary table private to this transaction."""
    session.execute(text(f"CREATE TEMP TABLE IF NOT EXISTS {table} ({columns}) "
                         "ON COMMIT DELETE ROWS"))
    session.execute(text(f"TRUNCATE {table}"))
    dbapi = session.connection().connection.driver_connection
    assert dbapi is not None
    with dbapi.cursor() as cur, cur.copy(f"COPY {table} FROM STDIN (FORMAT BINARY)") as cp:
        cp.set_types(list(types))
        for row in rows:
            cp.write_row(row)


def upsert_nodes(session: Session, names: Sequence[str], backend: str, seen_at: datetime,
                 probed: dict[str, datetime] | None = None,
                 duty_cycle: dict[str, float] | None = None,
                 skipped: dict[str, str] | None = None,
                 occupied: dict[str, dict[str, Any] | None] | None = None,
                 token_id: int | None = None) -> None:
    """Create or touch nodes in one statement: ``probed`` maps a measured node to its own
    newest measurement time; each node's duty cycle, and why it was skipped (cleared once
    it is probed); ``occupied``: what holds each node named (None: idle), its ``since``
    kept while the same job holds it. A node created, or named again after its retirement
    (back in the fleet), is added now by ``token_id`` (the new-node quota's count)."""
    if not names:
        return
    from psycopg.types.json import Jsonb

    was_probed, duty, skip = probed or {}, duty_cycle or {}, skipped or {}
    held = occupied or {}
    rows = [(n, backend, seen_at, was_probed.get(n), duty.get(n),
             skip.get(n), n in skip or n in was_probed,
             Jsonb(held[n]) if held.get(n) is not None else None, n in held)
            for n in sorted(set(names))]
    _copy_into_temp(session, "nodes_in", "name text, backend text, seen_at timestamptz, "
                    "probed_at timestamptz, duty_cycle float8, skipped text, set_skip bool, "
                    "occupied jsonb, set_occupied bool",
                    ("text", "text", "timestamptz", "timestamptz", "float8", "text", "bool",
                     "jsonb", "bool"), rows)
    # greatest() skips NULLs: a node only mentioned keeps its last probe time. (SET reads
    # the row as it was, so the CASEs see retired_at before it is cleared.)
    session.execute(text("""
        INSERT INTO nodes (name, backend, last_seen_at, last_probed_at, duty_cycle,
                           skipped_reason, added_by_token_id)
        SELECT name, backend, seen_at, probed_at, duty_cycle, skipped, CAST(:token AS integer)
        FROM nodes_in
        ON CONFLICT (name) DO UPDATE SET
          last_seen_at = greatest(nodes.last_seen_at, excluded.last_seen_at),
          last_probed_at = greatest(nodes.last_probed_at, excluded.last_probed_at),
          backend = excluded.backend,
          duty_cycle = coalesce(excluded.duty_cycle, nodes.duty_cycle),
          added_at = CASE WHEN nodes.retired_at IS NULL THEN nodes.added_at ELSE now() END,
          added_by_token_id = CASE WHEN nodes.retired_at IS NULL THEN nodes.added_by_token_id
                                   ELSE excluded.added_by_token_id END,
          retired_at = NULL"""), {"token": token_id})
    session.execute(text("""
        UPDATE nodes SET skipped_reason = i.skipped FROM nodes_in i
        WHERE i.set_skip AND nodes.name = i.name
          AND nodes.skipped_reason IS DISTINCT FROM i.skipped"""))
    if held:
        session.execute(text("""
            UPDATE nodes SET occupied = CASE
              WHEN i.occupied IS NULL THEN NULL
              WHEN nodes.occupied->>'source' = i.occupied->>'source'
               AND nodes.occupied->>'job' IS NOT DISTINCT FROM i.occupied->>'job'
               AND nodes.occupied ? 'since'
                THEN i.occupied || jsonb_build_object('since', nodes.occupied->'since')
              ELSE i.occupied || jsonb_build_object('since', to_jsonb(i.seen_at)) END
            FROM nodes_in i
            WHERE i.set_occupied AND nodes.name = i.name
              AND (nodes.occupied IS NOT NULL OR i.occupied IS NOT NULL)"""))


def upsert_ranks(session: Session, ranks: Sequence[dict[str, Any]]) -> None:
    """Record rank identities (node, local_index, GPU UUID, PCI bus id, telemetry) and the
    nodes' hostnames: one COPY and two statements, whatever the fleet's size."""
    if not ranks:
        return
    from psycopg.types.json import Jsonb

    rows = [(r["node"], r["local_index"], r.get("gpu_uuid"), r.get("pci_bus_id"),
             r.get("numa_node"), r.get("gpu_name"), Jsonb(r.get("telemetry") or {}),
             r.get("hostname") or None, r.get("profile")) for r in ranks]
    _copy_into_temp(session, "ranks_in", "node text, local_index int4, uuid text, "
                    "pci_bus_id text, numa_node int4, name text, telemetry jsonb, hostname text, "
                    "profile text",
                    ("text", "int4", "text", "text", "int4", "text", "jsonb", "text", "text"), rows)
    session.execute(text("""
        INSERT INTO gpus (node_id, local_index, uuid, pci_bus_id, numa_node, name, telemetry)
        SELECT n.id, r.local_index, r.uuid, r.pci_bus_id, r.numa_node, r.name, r.telemetry
        FROM ranks_in r JOIN nodes n ON n.name = r.node
        ON CONFLICT ON CONSTRAINT uq_gpus_node_local DO UPDATE SET
          uuid = excluded.uuid, pci_bus_id = excluded.pci_bus_id,
          numa_node = excluded.numa_node, name = excluded.name,
          telemetry = excluded.telemetry, updated_at = now()"""))
    session.execute(text("""
        UPDATE nodes SET hostname = coalesce(r.hostname, nodes.hostname), profile = r.profile
        FROM (SELECT DISTINCT ON (node) node, hostname, profile FROM ranks_in
              ORDER BY node, hostname NULLS LAST) r
        WHERE nodes.name = r.node AND (nodes.hostname IS DISTINCT FROM coalesce(r.hostname,
              nodes.hostname) OR nodes.profile IS DISTINCT FROM r.profile)"""))


def group_ids(session: Session, groups: dict[str, tuple[str, list[str]]]) -> dict[str, int]:
    """The id of each group (key -> (scope, members)), creating those first seen."""
    if not groups:
        return {}
    keys = list(groups)
    ids = {k: i for k, i in session.execute(
        select(Group.key, Group.id).where(Group.key == _names(keys)))}
    new = [k for k in keys if k not in ids]
    if new:
        rows = [{"key": k, "scope": groups[k][0], "members": sorted(groups[k][1]),
                 "nodes": sorted(group_nodes(tuple(groups[k][1])))} for k in new]
        session.execute(insert(Group).on_conflict_do_nothing(index_elements=["key"]), rows)
        # Those a concurrent ingest created first are read back like the rest.
        ids.update({k: i for k, i in session.execute(
            select(Group.key, Group.id).where(Group.key == _names(new)))})
    return ids


COPY_COLUMNS = ("time", "size_bytes", "time_us", "algbw_gbs", "busbw_gbs", "preset_gbs",
                "group_id", "run_id", "warmup", "iters", "wrong", "op", "backend", "dtype",
                "redop", "timing", "transport", "contended")
COPY_TYPES = ("timestamptz", "int8", "float8", "float8", "float8", "float8", "int4", "int4",
              "int4", "int4", "int4", "text", "text", "text", "text", "text", "text", "text")


def _as_time(t: datetime | str) -> datetime:
    return t if isinstance(t, datetime) else datetime.fromisoformat(t)


def add_measurements(session: Session, run: ProbeRun, rows: Sequence[dict[str, Any]]) -> int:
    """Store a batch's measurements by binary COPY into the day partitions, each row naming
    its group by id (the members are stored once, in ``groups``). The partitions must
    exist (``services.store.timeseries.ensure_partitions``). A row pinned to one algorithm
    is stored under its series op (``allreduce:ring``): a series, rollup and link of its
    own."""
    if rows:
        keyed = [r.get("group_key") or series_key(r["members"]) for r in rows]
        ids = group_ids(session, {k: (r["scope"], r["members"]) for k, r in zip(keyed, rows, strict=True)})
        dbapi = session.connection().connection.driver_connection
        assert dbapi is not None
        with dbapi.cursor() as cur, cur.copy(
                f"COPY measurements ({', '.join(COPY_COLUMNS)}) FROM STDIN (FORMAT BINARY)") as cp:
            cp.set_types(COPY_TYPES)
            for k, r in zip(keyed, rows, strict=True):
                cp.write_row((
                    _as_time(r["time"]), r["size_bytes"], r["time_us"], r["algbw_gbs"],
                    r["busbw_gbs"], r.get("preset_gbs"), ids[k], run.id, r.get("warmup", 0),
                    r["iters"], r.get("wrong", 0), series_op(r["op"], r.get("algo")), run.backend,
                    r.get("dtype", "float32"), r.get("redop") or "sum", r.get("timing"),
                    r.get("transport"), r.get("contended")))
    run.measurement_count = len(rows)
    return len(rows)


def known_nodes(session: Session, names: Sequence[str], *,
                include_retired: bool = False) -> set[str]:
    """Which of ``names`` are nodes of the fleet (``include_retired``: or were, their
    history kept)."""
    q = select(Node.name).where(Node.name == _names(names))
    if not include_retired:
        q = q.where(Node.retired_at.is_(None))
    return set(session.scalars(q).all())


def gpu_counts(session: Session, names: Sequence[str]) -> dict[str, int]:
    """How many GPUs (ranks) each of ``names`` reported; nodes with none are left out."""
    rows = session.execute(
        select(Node.name, func.count(Gpu.local_index)).join(Gpu, Gpu.node_id == Node.id)
        .where(Node.name == _names(names)).group_by(Node.name)).tuples()
    return {name: count for name, count in rows}


def list_nodes(session: Session, *, after: str | None = None,
               limit: int | None = None) -> list[tuple[Node, list[Gpu]]]:
    """The fleet's nodes by name (from just past ``after``, at most ``limit``) with their
    GPUs."""
    q = select(Node).where(Node.retired_at.is_(None)).order_by(Node.name)
    if after is not None:
        q = q.where(Node.name > after)
    nodes = session.scalars(q.limit(limit)).all()
    node_ids = literal([n.id for n in nodes], ARRAY(Integer))  # one parameter, as _names
    gpus = session.scalars(select(Gpu).where(Gpu.node_id == any_(node_ids))
                           .order_by(Gpu.node_id, Gpu.local_index)).all()
    by_node: dict[int, list[Gpu]] = {}
    for g in gpus:
        by_node.setdefault(g.node_id, []).append(g)
    return [(n, by_node.get(n.id, [])) for n in nodes]


def node_count(session: Session) -> int:
    """Nodes in the fleet (retired ones left out)."""
    return session.scalar(select(func.count()).select_from(Node)
                          .where(Node.retired_at.is_(None))) or 0


def group_by_key(session: Session, key: str) -> Group | None:
    return session.scalar(select(Group).where(Group.key == key))


def latest_backend(session: Session, nodes: Sequence[str]) -> str | None:
    """The backend of the most recently probed of ``nodes``."""
    return session.scalar(select(Node.backend)
                          .where(Node.name == _names(nodes), Node.last_probed_at.is_not(None))
                          .order_by(Node.last_probed_at.desc()).limit(1))


def probed_nodes(session: Session, nodes: Sequence[str], since: datetime) -> set[str]:
    """Which of ``nodes`` appear in a measurement taken since ``since``."""
    return set(session.scalars(select(Node.name).where(
        Node.name == _names(nodes), Node.last_probed_at >= since)))


def storage_bytes(session: Session) -> dict[str, int]:
    """On-disk bytes (heap, indexes, TOAST) of the measurements and each rollup."""
    sql = text("SELECT coalesce(sum(pg_total_relation_size(c.oid)), 0) FROM pg_inherits i "
               "JOIN pg_class c ON c.oid = i.inhrelid WHERE i.inhparent = 'measurements'::regclass")
    out = {"measurements": int(session.execute(sql).scalar() or 0)}
    for name in ("series_1h", "series_1d", "groups"):
        out[name] = int(session.execute(text(f"SELECT pg_total_relation_size('{name}')")).scalar() or 0)
    return out


# The hosts one token's spool state is kept for: a scheduler and its standbys, not every
# name a batch may claim (docs/security.md, "The shipper's identity").
SHIPPER_HOSTS_PER_TOKEN = 8


class ShipperSpool(NamedTuple):
    """One sender's spool as its newest batch of the last day reported it: the token that
    sent it (its identity), the host it named (informational), its state, and how many
    hosts that token named in all (only the newest ``SHIPPER_HOSTS_PER_TOKEN`` are kept)."""

    token_id: int
    host: str
    state: dict[str, Any]
    hosts: int


def shipper_states(session: Session,
                   hosts_per_token: int = SHIPPER_HOSTS_PER_TOKEN) -> list[ShipperSpool]:
    """Each active token's spools, per host it named, from its newest batch of the last day:
    a token speaks for its own spool only, so a batch naming another scheduler's host
    neither raises nor hides that scheduler's counts; a revoked or expired token's spool
    (one rotated away) is no longer shown."""
    rows = session.execute(text("""
        SELECT token_id, host, shipper, hosts FROM (
            SELECT token_id, host, shipper,
                   row_number() OVER (PARTITION BY token_id ORDER BY received_at DESC, host) nth,
                   count(*) OVER (PARTITION BY token_id) hosts
            FROM (SELECT DISTINCT ON (r.token_id, r.shipper->>'host') r.token_id,
                         coalesce(r.shipper->>'host', '') host, r.shipper, r.received_at
                  FROM probe_runs r JOIN api_tokens t ON t.id = r.token_id
                  WHERE r.shipper IS NOT NULL AND r.received_at > now() - interval '1 day'
                    AND t.revoked_at IS NULL AND (t.expires_at IS NULL OR t.expires_at > now())
                  ORDER BY r.token_id, r.shipper->>'host', r.received_at DESC) newest) ranked
        WHERE nth <= :hosts ORDER BY token_id, host"""), {"hosts": hosts_per_token})
    return [ShipperSpool(*r) for r in rows]


def add_counters(session: Session, snapshots: Sequence[dict[str, Any]], at: datetime) -> None:
    """Store the NVML readings of the GPUs whose counters rose in this cycle."""
    if snapshots:
        session.execute(insert(GpuCounters), [
            {"time": at, "node": c["node"], "local_index": c["local_index"],
             "reading": {k: v for k, v in c.items() if k not in ("node", "local_index")}}
            for c in snapshots])


def counters_of(session: Session, members: Sequence[str], since: datetime | None,
                until: datetime | None, limit: int = 1000) -> list[GpuCounters]:
    """The stored NVML readings of these ranks, oldest first."""
    if not members:
        return []
    ranks = [split_member(m) for m in members]
    q = select(GpuCounters).where(tuple_(GpuCounters.node, GpuCounters.local_index).in_(ranks))
    if since:
        q = q.where(GpuCounters.time >= since)
    if until:
        q = q.where(GpuCounters.time <= until)
    return list(session.scalars(q.order_by(GpuCounters.time).limit(limit)))


def get_node(session: Session, name: str) -> tuple[Node, list[Gpu]] | None:
    """One node with its GPUs (their telemetry too), retired or not, or None."""
    node = session.scalar(select(Node).where(Node.name == name))
    if node is None:
        return None
    gpus = session.scalars(select(Gpu).where(Gpu.node_id == node.id)
                           .order_by(Gpu.local_index)).all()
    return node, list(gpus)


def node_counters(session: Session, node: str, limit: int = 100) -> list[GpuCounters]:
    """The node's newest stored NVML readings, newest first."""
    return list(session.scalars(select(GpuCounters).where(GpuCounters.node == node)
                                .order_by(GpuCounters.time.desc()).limit(limit)))


def node_names(session: Session) -> list[str]:
    """The fleet's node names, in name order."""
    return list(session.scalars(select(Node.name).where(Node.retired_at.is_(None))
                                .order_by(Node.name)))
