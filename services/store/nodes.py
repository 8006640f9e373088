"""The node table's bounds and life: who added a node and when (the new-node quota), one
node per name whatever its case, and retirement (an admin's, or retention's), which takes a
node out of the fleet and keeps its history.

The fleet is the nodes with no ``retired_at``; the reads of the fleet in
``services.store.measurements``, ``health`` and ``metrics`` go by that.
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from datetime import datetime
from typing import NamedTuple

from sqlalchemy import Connection, Engine, select, text
from sqlalchemy.orm import Session

from ringwatch.services.store.models import Node

log = logging.getLogger(__name__)


class Added(NamedTuple):
    """The nodes one token added within a window, and how long until the first of them
    leaves it (seconds; None when there are none)."""

    nodes: int
    frees_in_s: float | None


# pg_advisory_xact_lock namespace of a token's node additions ("node").
ADDING_LOCK = 0x6E6F6465


def added_by(session: Session, token_id: int, window_s: float) -> Added:
    """How many nodes ``token_id`` added (created, or brought back from retirement) within
    the last ``window_s`` seconds of the database's clock, retired ones too: retiring a
    flood's nodes does not hand its sender the quota back. Held until the transaction ends,
    so two batches of one token that add nodes are counted one after the other."""
    session.execute(text("SELECT pg_advisory_xact_lock(:ns, :t)"),
                    {"ns": ADDING_LOCK, "t": token_id})
    count, frees_in = session.execute(text("""
        SELECT count(*), extract(epoch FROM min(added_at) + make_interval(secs => :w) - now())
        FROM nodes
        WHERE added_by_token_id = :t AND added_at > now() - make_interval(secs => :w)"""),
        {"t": token_id, "w": window_s}).one()
    return Added(int(count), float(frees_in) if frees_in is not None else None)


def twins_in_fleet(session: Session, names: Collection[str]) -> dict[str, str]:
    """Each of ``names`` that differs only in case from a node in the fleet, with that
    node's name: host names are case-insensitive, so it would be the same host twice."""
    if not names:
        return {}
    rows = session.execute(text("""
        SELECT i.name, n.name FROM unnest(CAST(:names AS text[])) AS i(name)
        JOIN nodes n ON lower(n.name) = lower(i.name) AND n.name <> i.name
        WHERE n.retired_at IS NULL"""), {"names": sorted(set(names))})
    return {asked: known for asked, known in rows}


def retired_state(session: Session, names: Collection[str]) -> dict[str, datetime | None]:
    """Each of ``names`` the table holds, with when it was retired (None: in the fleet)."""
    rows = session.execute(select(Node.name, Node.retired_at).where(Node.name.in_(set(names))))
    return {name: retired_at for name, retired_at in rows}


def retire(session: Session, names: Collection[str]) -> list[str]:
    """Take ``names`` out of the fleet now; the ones that were in it, by name. Their open
    incidents are closed as ``retired`` (``close_retired_incidents``)."""
    if not names:
        return []
    done = sorted(session.execute(text("""
        UPDATE nodes SET retired_at = now()
        WHERE name = ANY(CAST(:names AS text[])) AND retired_at IS NULL RETURNING name"""),
        {"names": sorted(set(names))}).scalars())
    close_retired_incidents(session)
    return done


# An open incident every node of which is retired: the fleet no longer holds its place.
_ALL_RETIRED = """NOT EXISTS (
    SELECT 1 FROM unnest({table}.nodes) AS place(name)
    WHERE NOT EXISTS (SELECT 1 FROM nodes n
                      WHERE n.name = place.name AND n.retired_at IS NOT NULL))"""


def close_retired_incidents(conn: Session | Connection) -> int:
    """Close each open incident whose nodes are all retired, as ``retired`` (not
    ``resolved``: nothing recovered, so no ``health.recovered`` event), and forget its
    fault's hysteresis, so a dead node's incident no longer holds the fleet degraded and a
    node that comes back with the fault open opens it anew. How many were closed."""
    closed = len(conn.execute(text(f"""
        UPDATE findings SET status = 'retired', resolved_at = now()
        WHERE status = 'open' AND cardinality(nodes) > 0
          AND {_ALL_RETIRED.format(table="findings")} RETURNING id""")).all())
    conn.execute(text(f"""
        DELETE FROM fault_states
        WHERE cardinality(nodes) > 0 AND {_ALL_RETIRED.format(table="fault_states")}"""))
    return closed


# Nodes named in the log line when retention retires some (the rest counted).
LOGGED_NAMES = 20


def retire_unseen(engine: Engine, days: float) -> int:
    """Retire every node of the fleet no batch has named for ``days`` (0: none); how many.
    One that reports again comes back (``measurements.upsert_nodes``)."""
    if days <= 0:
        return 0
    with engine.begin() as conn:
        names = sorted(conn.execute(text("""
            UPDATE nodes SET retired_at = now()
            WHERE retired_at IS NULL AND last_seen_at < now() - make_interval(secs => :s)
            RETURNING name"""), {"s": days * 86400.0}).scalars())
        if names:
            close_retired_incidents(conn)
    if names:
        more = f" and {len(names) - LOGGED_NAMES} more" if len(names) > LOGGED_NAMES else ""
        log.warning("retired %d node(s) no batch has named for %g days "
                    "(RINGWATCH_NODE_RETENTION_DAYS): %s%s; each comes back when it reports",
                    len(names), days, ", ".join(names[:LOGGED_NAMES]), more)
    return len(names)
