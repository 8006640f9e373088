"""heartbeats: when each background loop last came round, succeeded and failed

``heartbeats``: one row per loop (``notifier``, ``maintenance``), on the database's clock:
``ok_at`` the latest success, ``failed_at`` the latest failure, ``failures`` the failures
in a row since that success. Every API replica reports them on /metrics
(``ringwatch_loop_*``), so an alert sees a notifier that stopped or maintenance that fails
wherever those run. Additive: a table of its own, which code before it never reads; the
downgrade drops it, and with it only these timestamps (the next beat writes them again).

Revision ID: 0019
Revises: 0018
Create Date: 2026-12-06
"""
import sqlalchemy as sa
from alembic import op

revision = "0019"
down_revision = "0018"
branch_labels = None
depends_on = None

# Only adds to the schema (expand/contract): the ringwatch before it serves on as it did
# (services.store.db.judge_ahead; docs/operations.md, "Upgrades and rollbacks").
ADDITIVE = True

# Only adds to the schema (expand/contract): the ringwatch before it serves on as it did
# (services.store.db.judge_ahead; docs/operations.md, "Upgrades and rollbacks").
ADDITIVE = True


def upgrade() -> None:
    op.create_table(
        "heartbeats",
        sa.Column("name", sa.Text(), nullable=False),
        sa.Column("ok_at", sa.TIMESTAMP(timezone=True), nullable=True),
        sa.Column("failed_at", sa.TIMESTAMP(timezone=True), nullable=True),
        sa.Column("failures", sa.Integer(), server_default="0", nullable=False),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_heartbeats")),
    )


def downgrade() -> None:
    op.drop_table("heartbeats")
