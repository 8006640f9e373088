"""nodes carry their hardware profile; NVML counter readings kept with their cycle

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-23
"""
import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None

# Only adds to the schema (expand/contract): the ringwatch before it serves on as it did
# (services.store.db.judge_ahead; docs/operations.md, "Upgrades and rollbacks").
ADDITIVE = True


def upgrade() -> None:
    op.add_column("nodes", sa.Column("profile", sa.String(length=64), nullable=True))
    op.create_table(
        "gpu_counters",
        sa.Column("id", sa.BigInteger(), nullable=False),
        sa.Column("time", sa.TIMESTAMP(timezone=True), nullable=False),
        sa.Column("node", sa.String(length=255), nullable=False),
        sa.Column("local_index", sa.Integer(), nullable=False),
        sa.Column("reading", postgresql.JSONB(astext_type=sa.Text()), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_gpu_counters"),
    )
    op.create_index("ix_gpu_counters_rank_time", "gpu_counters", ["node", "local_index", "time"])


def downgrade() -> None:
    op.drop_index("ix_gpu_counters_rank_time", table_name="gpu_counters")
    op.drop_table("gpu_counters")
    op.drop_column("nodes", "profile")
