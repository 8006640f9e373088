"""ingest integrity: a batch's content digest and sender; stored JSON within bounds

A batch id reused with other content, or by another token, is now a conflict, so each
run records the SHA-256 of its content and the token that sent it (NULL for runs stored
before: a retry of one of those is taken as before).

Ingest now refuses JSON nested deeper than 8 levels; values stored before that (a
telemetry tree 900 levels deep made ``GET /v1/nodes/{node}`` fail for good) have each
subtree below that depth replaced by the text "(removed: nested too deep)". Mistyped finding
fields stored before are read tolerantly (agents.spec.Finding.from_dict) and need no
rewrite. The downgrade drops the two columns; the trimmed subtrees are not restored.

Revision ID: 0013
Revises: 0012
Create Date: 2026-11-25
"""
import json
from typing import Any

import sqlalchemy as sa
from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None

# Does more than add to the schema: the code before it would store again the JSON it trims.
ADDITIVE = False

MAX_DEPTH = 8
REMOVED = "(removed: nested too deep)"
# Columns of JSON that agents sent, with the filter that finds rows worth reading.
COLUMNS = (
    ("gpus", "telemetry", "telemetry <> '{}'::jsonb"),
    ("gpu_counters", "reading", "true"),
    ("findings", "detail", "true"),
    ("fault_states", "detail", "true"),
    ("probe_runs", "findings", "findings <> '[]'::jsonb"),
    ("preflight_requests", "verdict", "verdict IS NOT NULL"),
)


def _trim(value: Any, depth: int = 0) -> tuple[Any, bool]:
    """``value`` with every subtree deeper than MAX_DEPTH replaced; whether it changed."""
    if not isinstance(value, dict | list):
        return value, False
    if depth >= MAX_DEPTH:
        return REMOVED, True
    changed = False
    items = value.items() if isinstance(value, dict) else enumerate(value)
    out: Any = {} if isinstance(value, dict) else []
    for k, v in items:
        v2, c = _trim(v, depth + 1)
        changed |= c
        if isinstance(out, dict):
            out[k] = v2
        else:
            out.append(v2)
    return out, changed


def upgrade() -> None:
    op.add_column("probe_runs", sa.Column("content_sha256", sa.String(64), nullable=True))
    op.add_column("probe_runs", sa.Column("token_id", sa.Integer(), nullable=True))
    bind = op.get_bind()
    for table, column, where in COLUMNS:
        # The text form: Python's json parser goes as deep as the stored tree does.
        rows = bind.execute(sa.text(f"SELECT ctid::text, {column}::text FROM {table} "
                                    f"WHERE {where}"))
        for ctid, raw in rows.fetchall():
            try:
                value = json.loads(raw)
            except RecursionError:
                value = REMOVED
            trimmed, changed = _trim(value) if value != REMOVED else ({}, True)
            if changed:
                bind.execute(sa.text(f"UPDATE {table} SET {column} = CAST(:v AS jsonb) "
                                     "WHERE ctid = CAST(:ctid AS tid)"),
                             {"v": json.dumps(trimmed), "ctid": ctid})


def downgrade() -> None:
    op.drop_column("probe_runs", "token_id")
    op.drop_column("probe_runs", "content_sha256")
