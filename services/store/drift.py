"""Drift states: each place's CUSUM of slight, persistent loss, kept between cycles."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from datetime import datetime
from typing import Any

from sqlalchemy import delete, select
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.orm import Session

from ringwatch.services.store.models import DriftState

# Rows per statement: five parameters each, well inside Postgres' 65535 per statement.
CHUNK = 5000


def drift_states(session: Session) -> dict[str, dict[str, Any]]:
    """Every place's state as ``evidence.Cusum.to_dict`` makes it, locked for this
    transaction: concurrent ingests fold their cycles one after the other."""
    rows = session.execute(
        select(DriftState.key, DriftState.score, DriftState.since, DriftState.cycles)
        .order_by(DriftState.key).with_for_update()
    ).all()
    return {r.key: {"score": r.score, "since": r.since.isoformat() if r.since else None,
                    "cycles": r.cycles} for r in rows}


def write_drift_states(session: Session, changed: Mapping[str, Mapping[str, Any]],
                       dropped: Iterable[str], at: datetime) -> None:
    """Upsert the places whose state changed and delete those back at zero, each in bulk."""
    gone = sorted(dropped)
    for i in range(0, len(gone), CHUNK):
        session.execute(delete(DriftState).where(DriftState.key.in_(gone[i:i + CHUNK])))
    if not changed:
        return
    rows = [{"key": key, "score": float(s["score"]),
             "since": datetime.fromisoformat(s["since"]) if s.get("since") else None,
             "cycles": int(s.get("cycles", 0)), "updated_at": at}
            for key, s in sorted(changed.items())]
    for i in range(0, len(rows), CHUNK):
        stmt = insert(DriftState).values(rows[i:i + CHUNK])
        session.execute(stmt.on_conflict_do_update(
            index_elements=[DriftState.key],
            set_={c: stmt.excluded[c] for c in ("score", "since", "cycles", "updated_at")}))
