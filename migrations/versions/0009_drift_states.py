"""drift states: each place's CUSUM of slight, persistent loss across monitoring cycles

A row per place (a node's NVLink, a GPU pair, a node's NIC) while its score is above
zero. The table starts empty: every place begins its accumulation at the first cycle
after the upgrade. A downgrade forgets what was accumulated.

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-25
"""
import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None

# Only adds to the schema (expand/contract): the ringwatch before it serves on as it did
# (services.store.db.judge_ahead; docs/operations.md, "Upgrades and rollbacks").
ADDITIVE = True


def upgrade() -> None:
    op.create_table(
        "drift_states",
        sa.Column("key", sa.Text(), nullable=False),
        sa.Column("score", sa.Float(), nullable=False),
        sa.Column("since", sa.TIMESTAMP(timezone=True), nullable=True),
        sa.Column("cycles", sa.Integer(), nullable=False),
        sa.Column("updated_at", sa.TIMESTAMP(timezone=True), server_default=sa.text("now()"),
                  nullable=False),
        sa.PrimaryKeyConstraint("key", name=op.f("pk_drift_states")),
    )


def downgrade() -> None:
    op.drop_table("drift_states")
