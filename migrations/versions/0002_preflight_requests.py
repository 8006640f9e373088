"""durable preflight requests; hysteresis window; node duty cycle and skips; measurement redop

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-22
"""
import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

# Only adds to the schema (expand/contract): the ringwatch before it serves on as it did
# (services.store.db.judge_ahead; docs/operations.md, "Upgrades and rollbacks").
ADDITIVE = True


def upgrade() -> None:
    op.add_column("nodes", sa.Column("duty_cycle", sa.Float(), nullable=True))
    op.add_column("nodes", sa.Column("skipped_reason", sa.Text(), nullable=True))
    op.add_column("link_health", sa.Column("recent", sa.String(length=64), server_default="",
                                           nullable=False))
    op.add_column("measurements", sa.Column("redop", sa.String(length=8), server_default="sum",
                                            nullable=False))
    op.create_table(
        "preflight_requests",
        sa.Column("id", sa.String(length=36), nullable=False),
        sa.Column("nodes", postgresql.ARRAY(sa.Text()), nullable=False),
        sa.Column("max_age_s", sa.Float(), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("verdict", postgresql.JSONB(astext_type=sa.Text()), nullable=True),
        sa.Column("claimed_by", sa.String(length=255), nullable=True),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("created_at", sa.TIMESTAMP(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.Column("lease_until", sa.TIMESTAMP(timezone=True), nullable=True),
        sa.Column("completed_at", sa.TIMESTAMP(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_preflight_requests")),
    )
    op.create_index("ix_preflight_requests_status_created", "preflight_requests",
                    ["status", "created_at"], unique=False)


def downgrade() -> None:
    op.drop_index("ix_preflight_requests_status_created", table_name="preflight_requests")
    op.drop_table("preflight_requests")
    op.drop_column("measurements", "redop")
    op.drop_column("link_health", "recent")
    op.drop_column("nodes", "skipped_reason")
    op.drop_column("nodes", "duty_cycle")
