"""Heartbeats of the background loops: when the notifier's delivery loop and the
maintenance pass last succeeded and failed, on the database's clock, and their failures in a
row since. Kept in the database, so every API replica's /metrics reports them (the
``ringwatch_loop_*`` families) wherever the loop runs: in a replica beside it, in a notifier
Deployment of its own, or in a `ringwatch db maintain` run by cron."""

from __future__ import annotations

import logging
from datetime import datetime
from typing import NamedTuple

from sqlalchemy import Connection, Engine, text
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session

log = logging.getLogger(__name__)

NOTIFIER, MAINTENANCE = "notifier", "maintenance"
# The loops that beat: the ``loop`` label's whole vocabulary.
LOOPS = (NOTIFIER, MAINTENANCE)

_OK = text("INSERT INTO heartbeats (name, ok_at, failures) VALUES (:n, now(), 0) "
           "ON CONFLICT (name) DO UPDATE SET ok_at = excluded.ok_at, failures = 0")
_FAILED = text("INSERT INTO heartbeats (name, failed_at, failures) VALUES (:n, now(), 1) "
               "ON CONFLICT (name) DO UPDATE SET failed_at = excluded.failed_at, "
               "failures = heartbeats.failures + 1")


def beat(conn: Session | Connection, name: str, ok: bool = True) -> None:
    """In the caller's transaction: ``name`` succeeded (its failures in a row back to 0), or
    failed once more."""
    conn.execute(_OK if ok else _FAILED, {"n": name})


def note(engine: Engine, name: str, ok: bool) -> None:
    """``beat`` in a transaction of its own, best effort: a database that cannot take it is
    the database's alert, never the loop's error."""
    try:
        with engine.begin() as conn:
            beat(conn, name, ok)
    except SQLAlchemyError as exc:
        log.debug("heartbeat %s not recorded: %s", name, type(exc).__name__)


class HeartbeatRow(NamedTuple):
    """One loop's heartbeat; ``since_ok_s`` as of the database's clock (None: never ok)."""

    name: str
    ok_at: datetime | None
    since_ok_s: float | None
    failed_at: datetime | None
    failures: int


def heartbeats(session: Session) -> list[HeartbeatRow]:
    """Every loop's heartbeat that has one, by name."""
    rows = session.execute(text(
        "SELECT name, ok_at, extract(epoch FROM now() - ok_at), failed_at, failures "
        "FROM heartbeats ORDER BY name")).tuples()
    return [HeartbeatRow(name, ok_at, float(since) if since is not None else None, failed_at,
                      int(failures)) for name, ok_at, since, failed_at, failures in rows]
