"""Link health, fault states and findings (incidents). The events their changes send
are written by services.store.events, in the same transaction."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from datetime import datetime
from typing import Any

from psycopg.types.json import Jsonb
from sqlalchemy import Integer, Text, any_, bindparam, func, insert, select, text, tuple_
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.orm import Session

from ringwatch.services.store.models import FaultState, Finding, LinkHealth


def get_links(session: Session, keys: Sequence[tuple[str, str]]) -> dict[tuple[str, str], Any]:
    """Current health of (group_key, op) pairs, as rows of what folding a batch reads (not
    the member lists), locked for this transaction."""
    if not keys:
        return {}
    group_keys = {k for k, _ in keys}
    c = LinkHealth
    rows = session.execute(
        select(c.id, c.group_key, c.op, c.status, c.size_bytes, c.bad_streak, c.good_streak,
               c.recent, c.recent_busbw, c.changed_at)
        # One text[] parameter: an IN list binds one a key, past Postgres' 65,535 in a
        # batch of 200,000 measurements.
        .where(c.group_key == any_(bindparam("group_keys", sorted(group_keys),
                                             type_=ARRAY(Text))))
        .with_for_update()
    ).all()
    wanted = set(keys)
    return {(r.group_key, r.op): r for r in rows if (r.group_key, r.op) in wanted}


LINK_COLUMNS = ("status", "size_bytes", "busbw_gbs", "expected_gbs", "ratio", "bad_streak",
                "good_streak", "recent", "recent_busbw", "updated_at", "changed_at")
_LINK_TYPES = ("int4", "text", "int8", "float8", "float8", "float8", "int4", "int4", "text",
               "float8[]", "timestamptz", "timestamptz")


def write_links(session: Session, inserts: Sequence[dict[str, Any]],
                updates: Sequence[dict[str, Any]]) -> None:
    """New link rows by executemany; changed ones by one COPY and one UPDATE ... FROM."""
    if inserts:
        session.execute(insert(LinkHealth.metadata.tables["link_health"]), list(inserts))
    if not updates:
        return
    session.execute(text(
        "CREATE TEMP TABLE IF NOT EXISTS links_in (id int4, status text, size_bytes int8, "
        "busbw_gbs float8, expected_gbs float8, ratio float8, bad_streak int4, "
        "good_streak int4, recent text, recent_busbw float8[], updated_at timestamptz, "
        "changed_at timestamptz) ON COMMIT DELETE ROWS"))
    session.execute(text("TRUNCATE links_in"))
    dbapi = session.connection().connection.driver_connection
    assert dbapi is not None
    with dbapi.cursor() as cur, cur.copy("COPY links_in FROM STDIN (FORMAT BINARY)") as cp:
        cp.set_types(list(_LINK_TYPES))
        for u in updates:
            cp.write_row((u["id"], *(u[c] for c in LINK_COLUMNS)))
    assignments = ", ".join(f"{c} = i.{c}" for c in LINK_COLUMNS)
    session.execute(text(f"UPDATE link_health l SET {assignments} FROM links_in i "
                         "WHERE l.id = i.id"))


def list_links(session: Session, status: str | None = None, scope: str | None = None,
               nodes: Sequence[str] | None = None, *, after: tuple[str, ...] | None = None,
               limit: int | None = None) -> list[LinkHealth]:
    """Links in (scope, group key, op) order, from just past ``after``, at most ``limit``;
    with ``nodes``, those touching any of them."""
    q = select(LinkHealth).order_by(LinkHealth.scope, LinkHealth.group_key, LinkHealth.op)
    if status:
        q = q.where(LinkHealth.status == status)
    if scope:
        q = q.where(LinkHealth.scope == scope)
    if nodes:
        q = q.where(LinkHealth.nodes.overlap(list(nodes)))
    if after is not None:
        q = q.where(tuple_(LinkHealth.scope, LinkHealth.group_key, LinkHealth.op) > tuple_(*after))
    if limit is not None:
        q = q.limit(limit)
    return list(session.scalars(q))


def list_baselines(session: Session, min_count: int, *, after: tuple[str, ...] | None = None,
                   limit: int | None = None) -> list[Any]:
    """Links whose running baseline holds at least ``min_count`` values, in (scope, group
    key, op) order from just past ``after``: what an adaptive check judges against."""
    c = LinkHealth
    q = (select(c.scope, c.group_key, c.op, c.members, c.size_bytes, c.recent_busbw)
         .where(func.coalesce(func.cardinality(c.recent_busbw), 0) >= min_count)
         .order_by(c.scope, c.group_key, c.op))
    if after is not None:
        q = q.where(tuple_(c.scope, c.group_key, c.op) > tuple_(*after))
    if limit is not None:
        q = q.limit(limit)
    return list(session.execute(q).all())


def open_finding(session: Session, *, kind: str, group_key: str | None, op: str | None,
                 nodes: list[str], severity: str, detail: dict[str, Any]) -> Finding:
    finding = Finding(kind=kind, status="open", group_key=group_key, op=op, nodes=nodes,
                      severity=severity, detail=detail)
    session.add(finding)
    session.flush()
    return finding


def get_finding(session: Session, finding_id: int) -> Finding | None:
    return session.get(Finding, finding_id)


# ---- a batch's faults and incidents, written in bulk ----------------------------------------
# One batch may name thousands of faults. They are read once, stepped in Python, and written
# back by a COPY and a statement or two per table: a round trip per fault held an ingest
# slot for seconds at a few thousand findings. The rows read here are detached from the
# session, so only these functions write them.


def fault_states(session: Session) -> dict[str, FaultState]:
    """Every fault being tracked (open, or seen within its window), locked for this
    transaction: concurrent ingests fold them one after the other. Written back by
    ``save_fault_states``."""
    rows = session.scalars(select(FaultState).order_by(FaultState.id).with_for_update()).all()
    for r in rows:
        session.expunge(r)
    return {r.key: r for r in rows}


def new_fault_state(*, key: str, kind: str, nodes: list[str],
                    detail: dict[str, Any]) -> FaultState:
    """A fault seen for the first time; ``save_fault_states`` writes it once its first step
    is known (a fault that needs no row gets none)."""
    return FaultState(key=key, kind=kind, nodes=nodes, detail=detail, status="ok", recent="",
                      good_streak=0, finding_id=None)


FAULT_STATE_COLUMNS = ("status", "recent", "good_streak", "finding_id", "updated_at", "detail")
_FAULT_STATE_TYPES = ("text", "text", "int4", "int4", "timestamptz", "jsonb")


def save_fault_states(session: Session, new: Sequence[FaultState],
                      changed: Sequence[FaultState], gone: Sequence[FaultState]) -> None:
    """Insert ``new`` faults, write ``changed`` ones back and delete ``gone`` ones."""
    _copy(session, f"fault_states (key, kind, nodes, {', '.join(FAULT_STATE_COLUMNS)})",
          ((s.key, s.kind, s.nodes, *_values(s, FAULT_STATE_COLUMNS)) for s in new))
    _update_by_id(session, "fault_states", FAULT_STATE_COLUMNS, _FAULT_STATE_TYPES,
                  [(s.id, *_values(s, FAULT_STATE_COLUMNS)) for s in changed])
    if gone:
        session.execute(text("DELETE FROM fault_states WHERE id = ANY(:ids)"),
                        {"ids": [s.id for s in gone]})


FINDING_COLUMNS = ("kind", "severity", "group_key", "op", "nodes", "detail")


def open_findings(session: Session, rows: Sequence[dict[str, Any]]) -> list[int]:
    """``open_finding`` for many at once (each row its ``FINDING_COLUMNS``): their ids, in
    order, drawn in one query, and the rows written by one COPY."""
    if not rows:
        return []
    ids = sorted(session.scalars(text(
        "SELECT nextval(pg_get_serial_sequence('findings', 'id')) "
        "FROM generate_series(1, :n)"), {"n": len(rows)}))
    _copy(session, f"findings (id, status, {', '.join(FINDING_COLUMNS)})",
          ((finding_id, "open", *(_json(row[c]) for c in FINDING_COLUMNS))
           for finding_id, row in zip(ids, rows, strict=True)))
    return ids


def findings_by_id(session: Session, ids: Iterable[int]) -> dict[int, Finding]:
    """The incidents with these ids, in one query (an array parameter: a fleet's incidents
    may outnumber what one statement can bind). Written back by ``save_findings``."""
    wanted = sorted(set(ids))
    if not wanted:
        return {}
    rows = session.scalars(select(Finding).where(
        Finding.id == any_(bindparam("ids", wanted, type_=ARRAY(Integer))))).all()
    for f in rows:
        session.expunge(f)
    return {f.id: f for f in rows}


# What an incident keeps from the cycle that opened it while it stays open: its headline
# and the figures that are the headline's (docs/analysis.md, "The headline").
OPENING_KEYS = ("headline", "measured_gbs", "expected_gbs")


def touch_finding(finding: Finding, at: datetime, detail: dict[str, Any]) -> None:
    """An open incident seen again: its latest evidence, no new event. Its headline stays
    the one it opened with, the figure its ``health.degraded`` event carried, so every
    surface shows one figure for it however many cycles see it again."""
    finding.last_seen_at = at
    opened = finding.detail
    kept = ({k: opened[k] for k in OPENING_KEYS if k in opened}
            if "headline" in opened else {})
    finding.detail = {**detail, **kept, "fault": opened.get("fault")}


def resolve_finding(finding: Finding, at: datetime) -> None:
    finding.status = "resolved"
    finding.resolved_at = at


_FINDING_CHANGES = ("status", "resolved_at", "last_seen_at", "detail")


def save_findings(session: Session, findings: Sequence[Finding]) -> None:
    """Write back incidents touched or resolved (``findings_by_id``'s)."""
    _update_by_id(session, "findings", _FINDING_CHANGES,
                  ("text", "timestamptz", "timestamptz", "jsonb"),
                  [(f.id, *_values(f, _FINDING_CHANGES)) for f in findings])


def _json(value: Any) -> Any:
    return Jsonb(value) if isinstance(value, dict) else value


def _values(row: Any, columns: Sequence[str]) -> tuple[Any, ...]:
    return tuple(_json(getattr(row, c)) for c in columns)


def _copy(session: Session, target: str, rows: Iterable[tuple[Any, ...]]) -> None:
    """``rows`` into ``target`` (a table and its columns) by one COPY."""
    dbapi = session.connection().connection.driver_connection
    assert dbapi is not None
    with dbapi.cursor() as cur, cur.copy(f"COPY {target} FROM STDIN") as cp:
        for row in rows:
            cp.write_row(row)


def _update_by_id(session: Session, table: str, columns: Sequence[str], types: Sequence[str],
                  rows: Sequence[tuple[Any, ...]]) -> None:
    """Rows (the id, then ``columns``) written by one COPY into a temporary table and one
    UPDATE ... FROM it."""
    if not rows:
        return
    temp = f"{table}_in"
    session.execute(text(
        f"CREATE TEMP TABLE IF NOT EXISTS {temp} (id int4, "
        f"{', '.join(f'{c} {t}' for c, t in zip(columns, types, strict=True))}) "
        "ON COMMIT DELETE ROWS"))
    session.execute(text(f"TRUNCATE {temp}"))
    _copy(session, f"{temp} (id, {', '.join(columns)})", rows)
    session.execute(text(f"UPDATE {table} t SET {', '.join(f'{c} = i.{c}' for c in columns)} "
                         f"FROM {temp} i WHERE t.id = i.id"))


def open_findings_on(session: Session, nodes: Sequence[str] | None) -> list[Finding]:
    """Open incidents that touch any of ``nodes`` (None: every open incident)."""
    q = select(Finding).where(Finding.status == "open")
    if nodes is not None:
        q = q.where(Finding.nodes.overlap(list(nodes)))
    return list(session.scalars(q.order_by(Finding.id)))


def pending_faults_on(session: Session, nodes: Sequence[str] | None) -> list[FaultState]:
    """Faults seen recently that have not (yet) opened an incident, on any of ``nodes``
    (None: on any node)."""
    q = select(FaultState).where(FaultState.status == "ok")
    if nodes is not None:
        q = q.where(FaultState.nodes.overlap(list(nodes)))
    return list(session.scalars(q.order_by(FaultState.id)))


def list_findings(session: Session, status: str | None = None, limit: int = 500,
                  before_id: int | None = None) -> list[Finding]:
    """Findings newest first (by id), older than ``before_id`` when given."""
    q = select(Finding).order_by(Finding.id.desc()).limit(limit)
    if status:
        q = q.where(Finding.status == status)
    if before_id is not None:
        q = q.where(Finding.id < before_id)
    return list(session.scalars(q))


def health_counts(session: Session) -> dict[str, int]:
    rows = session.execute(
        select(LinkHealth.status, func.count()).group_by(LinkHealth.status)
    ).tuples().all()
    return {status: n for status, n in rows}


def open_findings_count(session: Session) -> int:
    return session.scalar(select(func.count()).select_from(Finding).where(Finding.status == "open")) or 0


def node_health(session: Session) -> list[Any]:
    """Per node of the fleet (all of them, by name), over the links that touch it, the world group aside:
    how many and how many degraded, the worst ratio of its own NVLink groups (intra_node,
    gpu_pair), the median ratio of its node pairs (a pair's ratio is shared with the other
    node, so one slow partner must not paint a node), and its open findings."""
    return list(session.execute(text("""
        WITH per_link AS (
            SELECT node, scope, status, ratio
            FROM link_health, unnest(nodes) AS node
            WHERE scope <> 'world'
        ), links AS (
            SELECT node, count(*) AS links, count(*) FILTER (WHERE status <> 'ok') AS degraded,
                   min(ratio) FILTER (WHERE scope IN ('intra_node', 'gpu_pair')) AS nvlink_ratio,
                   percentile_cont(0.5) WITHIN GROUP (ORDER BY ratio)
                       FILTER (WHERE scope = 'inter_node') AS net_ratio
            FROM per_link GROUP BY node
        ), open AS (
            SELECT node, count(*) AS open_findings
            FROM findings, unnest(nodes) AS node WHERE status = 'open' GROUP BY node
        )
        SELECT n.name, n.backend, n.profile, n.last_probed_at, n.skipped_reason, n.occupied,
               coalesce(l.links, 0) AS links, coalesce(l.degraded, 0) AS degraded,
               l.nvlink_ratio, l.net_ratio, coalesce(o.open_findings, 0) AS open_findings
        FROM nodes n LEFT JOIN links l ON l.node = n.name LEFT JOIN open o ON o.node = n.name
        WHERE n.retired_at IS NULL
        ORDER BY n.name""")))


def link_rows_mark(session: Session) -> tuple[int, int]:
    """How many link rows there are and the newest id: either going down means rows were
    removed (or the table emptied) since an earlier look."""
    count, newest = session.execute(text(
        "SELECT count(*), coalesce(max(id), 0) FROM link_health")).one()
    return int(count), int(newest)


# A node pair's rows: an inter-node group of two nodes (ix_link_health_pair covers them).
_PAIR_ROWS = "scope = 'inter_node' AND cardinality(nodes) = 2"
# Pairs come one row per first node, its partners in arrays, streamed a few rows at a
# time: 4096 nodes have 8.4 M pairs, which as one Python row each held 4 GiB at once.
PAIR_ROWS_PER_FETCH = 16


def _pairs_by_first_node(session: Session, pairs_sql: str,
                         params: dict[str, Any]) -> Iterator[Any]:
    """``pairs_sql`` (one row per pair: a, b, ratio, degraded, updated_at) folded into one
    row per first node ``a``: ``bs``, ``ratios`` and ``degraded`` side by side, and the
    newest ``updated_at`` among them."""
    yield from session.execute(text(f"""
        SELECT a, array_agg(b) AS bs, array_agg(ratio) AS ratios,
               array_agg(degraded) AS degraded, max(updated_at) AS updated_at
        FROM ({pairs_sql}) p GROUP BY a""").execution_options(yield_per=PAIR_ROWS_PER_FETCH),
        params)


def node_pairs(session: Session, since: datetime | None = None) -> Iterator[Any]:
    """Each node pair probed as such, grouped by its first node (``_pairs_by_first_node``):
    the worst ratio over its ops, groups and sizes, whether any of them is degraded, and
    when it was last updated. With ``since``, only the pairs with a row updated after it,
    each still judged over all its rows (found by ix_link_health_pair)."""
    if since is None:
        return _pairs_by_first_node(session, f"""
            SELECT nodes[1] AS a, nodes[2] AS b, min(ratio) AS ratio,
                   bool_or(status <> 'ok') AS degraded, max(updated_at) AS updated_at
            FROM link_health WHERE {_PAIR_ROWS}
            GROUP BY nodes[1], nodes[2]""", {})
    return _pairs_by_first_node(session, f"""
        WITH touched AS (
            SELECT DISTINCT nodes[1] AS a, nodes[2] AS b FROM link_health
            WHERE updated_at > :since AND {_PAIR_ROWS})
        SELECT t.a, t.b, min(l.ratio) AS ratio, bool_or(l.status <> 'ok') AS degraded,
               max(l.updated_at) AS updated_at
        FROM touched t JOIN link_health l ON l.nodes[1] = t.a AND l.nodes[2] = t.b
        WHERE l.scope = 'inter_node' AND cardinality(l.nodes) = 2
        GROUP BY t.a, t.b""", {"since": since})


def node_pairs_between(session: Session, rows: tuple[str, str],
                       cols: tuple[str, str]) -> Iterator[Any]:
    """The node pairs (as ``node_pairs``) with one node named within ``rows`` and the other
    within ``cols`` (first and last name, inclusive, in the nodes' name order): one tile of
    the node x node map, read through ix_link_health_pair without scanning the others."""
    return _pairs_by_first_node(session, f"""
        SELECT nodes[1] AS a, nodes[2] AS b, min(ratio) AS ratio,
               bool_or(status <> 'ok') AS degraded, max(updated_at) AS updated_at
        FROM link_health
        WHERE {_PAIR_ROWS}
          AND ((nodes[1] BETWEEN :r0 AND :r1 AND nodes[2] BETWEEN :c0 AND :c1)
               OR (nodes[1] BETWEEN :c0 AND :c1 AND nodes[2] BETWEEN :r0 AND :r1))
        GROUP BY nodes[1], nodes[2]""", {"r0": rows[0], "r1": rows[1], "c0": cols[0], "c1": cols[1]})
