"""fault states: incidents keyed by the localized fault; measurements carry the sender's
hardware-model figure; each link keeps its own recent busbw (its baseline)

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-23
"""
import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

# Does more than add to the schema: it resolves the open incidents, which the code before it would open again its own way.
ADDITIVE = False


def upgrade() -> None:
    op.add_column("measurements", sa.Column("preset_gbs", sa.Float(), nullable=True))
    op.add_column("link_health", sa.Column("recent_busbw", postgresql.ARRAY(sa.Float()),
                                           server_default="{}", nullable=False))
    op.create_table(
        "fault_states",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("key", sa.Text(), nullable=False),
        sa.Column("kind", sa.String(length=32), nullable=False),
        sa.Column("nodes", postgresql.ARRAY(sa.Text()), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("recent", sa.String(length=64), nullable=False),
        sa.Column("good_streak", sa.Integer(), nullable=False),
        sa.Column("detail", postgresql.JSONB(astext_type=sa.Text()), nullable=False),
        sa.Column("finding_id", sa.Integer(), nullable=True),
        sa.Column("updated_at", sa.TIMESTAMP(timezone=True), server_default=sa.text("now()"),
                  nullable=False),
        sa.ForeignKeyConstraint(["finding_id"], ["findings.id"],
                                name=op.f("fk_fault_states_finding_id_findings"),
                                ondelete="SET NULL"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_fault_states")),
        sa.UniqueConstraint("key", name=op.f("uq_fault_states_key")),
    )
    # Incidents of the old kind (one per link and op) are closed: from now on an incident
    # is one localized fault, and the next cycle opens it again where it still holds.
    op.execute("UPDATE findings SET status = 'resolved', resolved_at = now() "
                "WHERE status = 'open' AND group_key IS NOT NULL")


def downgrade() -> None:
    op.drop_table("fault_states")
    op.drop_column("link_health", "recent_busbw")
    op.drop_column("measurements", "preset_gbs")
