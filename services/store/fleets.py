"""One scheduler per fleet: the lease its active scheduler holds, and the fleet's rotation
(the number of the last cycle started, the node-pair tournament's slots).

Every time is the database's clock (``clock_timestamp()``), never a caller's: schedulers
whose clocks disagree still agree on who holds the lease, because only the database
decides. Taking the lease is one statement, so two schedulers asking at the same instant
cannot both be granted it.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import text
from sqlalchemy.orm import Session

from ringwatch.agents import matchings as seats
from ringwatch.services.errors import NotLeader

log = logging.getLogger(__name__)

Slots = list[str | None]


@dataclass(frozen=True)
class LeaseState:
    """The fleet's lease after a request for it: ``leader`` when the asker holds it now;
    ``holder`` whoever holds it (the asker, another scheduler, or None)."""

    fleet: str
    holder: str | None
    leader: bool
    term: int
    expires_at: datetime | None
    cycle: int


@dataclass(frozen=True)
class FleetState:
    """A fleet as ``GET /v1/scheduler/fleets`` shows it; ``nodes``: its filled slots."""

    name: str
    holder: str | None
    term: int
    lease_expires_at: datetime | None
    cycle: int
    nodes: int


# Granted where the lease is free (never held, handed back, or run out) or the asker holds
# it. The conflicting row is locked while this runs, so a second asker waits for the first
# to commit and then sees its holder: no two are granted. ``term`` counts holders.
_TAKE = text("""
    INSERT INTO fleets AS f (name, holder, token_id, term, lease_expires_at, acquired_at,
                             renewed_at, updated_at)
    VALUES (:fleet, :holder, :token_id, 1,
            clock_timestamp() + make_interval(secs => :lease_s),
            clock_timestamp(), clock_timestamp(), clock_timestamp())
    ON CONFLICT (name) DO UPDATE SET
        holder = EXCLUDED.holder,
        token_id = EXCLUDED.token_id,
        term = CASE WHEN (f.holder, f.token_id) IS DISTINCT FROM (EXCLUDED.holder, EXCLUDED.token_id)
                    THEN f.term + 1 ELSE f.term END,
        acquired_at = CASE WHEN (f.holder, f.token_id) IS DISTINCT FROM
                                (EXCLUDED.holder, EXCLUDED.token_id)
                           THEN clock_timestamp() ELSE f.acquired_at END,
        lease_expires_at = clock_timestamp() + make_interval(secs => :lease_s),
        renewed_at = clock_timestamp(),
        updated_at = clock_timestamp()
    WHERE f.holder IS NULL
       OR (f.holder = EXCLUDED.holder AND f.token_id IS NOT DISTINCT FROM EXCLUDED.token_id)
       OR f.lease_expires_at IS NULL OR f.lease_expires_at <= clock_timestamp()
    RETURNING holder, term, lease_expires_at, cycle
""")


def take_lease(session: Session, fleet: str, holder: str, lease_s: float,
               token_id: int | None = None) -> LeaseState:
    """Take the fleet's lease for ``lease_s`` seconds, or renew it for its holder (the same
    holder asking with the same token); where another holds it unexpired, the lease as it
    stands (``leader`` false)."""
    got = session.execute(_TAKE, {"fleet": fleet, "holder": holder, "token_id": token_id,
                                  "lease_s": float(lease_s)}).one_or_none()
    if got is not None:
        return LeaseState(fleet, got.holder, True, got.term, got.lease_expires_at, got.cycle)
    row = session.execute(text("SELECT holder, term, lease_expires_at, cycle FROM fleets "
                               "WHERE name = :fleet"), {"fleet": fleet}).one()
    return LeaseState(fleet, row.holder, False, row.term, row.lease_expires_at, row.cycle)


def release_lease(session: Session, fleet: str, holder: str,
                  token_id: int | None = None) -> bool:
    """Hand the lease back (a clean stop), so a standby takes it at its next ask; False
    where ``holder`` (with this token) did not hold it."""
    done = session.execute(text(
        "UPDATE fleets SET holder = NULL, lease_expires_at = NULL, "
        "updated_at = clock_timestamp() WHERE name = :fleet AND holder = :holder "
        "AND token_id IS NOT DISTINCT FROM :token_id RETURNING name"),
        {"fleet": fleet, "holder": holder, "token_id": token_id}).one_or_none()
    return done is not None


def start_cycle(session: Session, fleet: str, holder: str,
                nodes: Iterable[str], token_id: int | None = None) -> tuple[int, Slots]:
    """Start the fleet's next cycle: its number and the tournament's slots reconciled with
    ``nodes`` (``reconcile_slots``). Only the holder of the unexpired lease may (NotLeader
    otherwise); the row is locked meanwhile, so two starts never share a number."""
    row = session.execute(text(
        "SELECT holder, token_id, cycle, slots, lease_expires_at > clock_timestamp() AS live "
        "FROM fleets WHERE name = :fleet FOR UPDATE"), {"fleet": fleet}).one_or_none()
    if row is None or row.holder != holder or row.token_id != token_id or not row.live:
        raise NotLeader(_not_leader(fleet, holder, row, token_id))
    slots, rebuilt = reconcile_slots(row.slots, nodes)
    if rebuilt:
        log.warning("fleet %s: its stored rotation slots were %s; rebuilt them from the "
                    "%d nodes in name order", fleet, rebuilt, sum(s is not None for s in slots))
    cycle = session.execute(text(
        "UPDATE fleets SET cycle = cycle + 1, slots = CAST(:slots AS jsonb), "
        "updated_at = clock_timestamp() WHERE name = :fleet RETURNING cycle"),
        {"fleet": fleet, "slots": json.dumps(slots)}).scalar_one()
    return cycle, slots


def _not_leader(fleet: str, holder: str, row: Any, token_id: int | None) -> str:
    if row is None:
        return f"fleet {fleet!r} has no lease yet: take it (POST /v1/scheduler/lease) first"
    if row.holder is None:
        return f"{holder!r} does not hold fleet {fleet!r}'s lease (it is free): take it first"
    if row.holder == holder and row.token_id != token_id:
        return f"{holder!r} holds fleet {fleet!r}'s lease with another token"
    if row.holder == holder:
        return f"{holder!r}'s lease on fleet {fleet!r} ran out: take it again first"
    return f"{row.holder!r} holds fleet {fleet!r}'s lease, not {holder!r}"


def corrupt(stored: Any) -> str | None:
    """Why stored slots cannot be used as they are (not a list of names and nulls, or a
    name twice), or None where they can."""
    if not isinstance(stored, list):
        return f"not a list ({type(stored).__name__})"
    seen: set[str] = set()
    for s in stored:
        if s is None:
            continue
        if not isinstance(s, str):
            return f"not names and nulls (a {type(s).__name__})"
        if s in seen:
            return "holding a node twice"
        seen.add(s)
    return None


def reconcile_slots(stored: Any, nodes: Iterable[str]) -> tuple[Slots, str | None]:
    """The tournament's slots for the fleet's ``nodes`` now (agents.matchings.reconcile_slots:
    nodes present keep their slots, a node gone leaves a vacancy, a new node takes the lowest
    vacancy), and why the stored ones were rebuilt from the nodes in name order (None where
    they were kept; ``corrupt`` says what is wrong with them)."""
    why = corrupt(stored)
    slots, _ = seats.reconcile_slots(stored if why is None else [], list(nodes))
    return slots, why


def fleet_states(session: Session) -> list[FleetState]:
    """Every fleet by name; its node count is its filled slots, counted in the database (a
    corrupt ``slots`` counts none)."""
    rows = session.execute(text(
        "SELECT name, holder, term, lease_expires_at, cycle, "
        "CASE WHEN jsonb_typeof(slots) = 'array' THEN (SELECT count(*) FROM "
        "jsonb_array_elements(slots) AS s WHERE jsonb_typeof(s) = 'string') ELSE 0 END "
        "FROM fleets ORDER BY name"))
    return [FleetState(*r) for r in rows]
