"""occupancy and contention: what holds a node besides ringwatch, and probes that met it

``nodes.occupied``: the job holding the node as the scheduler's occupancy source last said
(source, job, gpus, state, reason, since), NULL while idle; ``probe_runs.occupancy``: how
that source answered for the batch (source, error, seconds, busy and unknown counts);
``measurements.contended``: the other traffic a probe's links carried while it ran, in one
line, NULL where they were quiet (such a measurement is stored and shown, never judged).

Revision ID: 0015
Revises: 0014
Create Date: 2026-11-27
"""
import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None

# Only adds to the schema (expand/contract): the ringwatch before it serves on as it did
# (services.store.db.judge_ahead; docs/operations.md, "Upgrades and rollbacks").
ADDITIVE = True


def upgrade() -> None:
    op.add_column("measurements", sa.Column("contended", sa.Text(), nullable=True))
    op.add_column("nodes", sa.Column("occupied", JSONB(), nullable=True))
    op.add_column("probe_runs", sa.Column("occupancy", JSONB(), nullable=True))


def downgrade() -> None:
    op.drop_column("probe_runs", "occupancy")
    op.drop_column("nodes", "occupied")
    op.drop_column("measurements", "contended")
