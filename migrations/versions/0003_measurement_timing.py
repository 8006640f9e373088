"""measurement timing: how each probe was timed (cuda_graph, cuda_events, host, model)

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-22
"""
import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

# Only adds to the schema (expand/contract): the ringwatch before it serves on as it did
# (services.store.db.judge_ahead; docs/operations.md, "Upgrades and rollbacks").
ADDITIVE = True


def upgrade() -> None:
    # Nullable: rows stored before this revision do not say how they were timed.
    op.add_column("measurements", sa.Column("timing", sa.String(length=16), nullable=True))


def downgrade() -> None:
    op.drop_column("measurements", "timing")
