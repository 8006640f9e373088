"""one scheduler per fleet: the fleet's lease and its rotation, kept by the database

``fleets``: per fleet (by name), the scheduler holding its lease (``holder``, ``term``,
``lease_expires_at`` on the database's clock), the number of the last cycle started and
the node-pair tournament's ``slots`` (node names, null for a vacant slot), so a standby
that takes over goes on with the next cycle and the same places.

Revision ID: 0016
Revises: 0015
Create Date: 2026-12-04
"""
import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision = "0016"
down_revision = "0015"
branch_labels = None
depends_on = None

# Only adds to the schema (expand/contract): the ringwatch before it serves on as it did
# (services.store.db.judge_ahead; docs/operations.md, "Upgrades and rollbacks").
ADDITIVE = True


def upgrade() -> None:
    op.create_table(
        "fleets",
        sa.Column("name", sa.Text(), nullable=False),
        sa.Column("holder", sa.Text(), nullable=True),
        sa.Column("token_id", sa.Integer(), nullable=True),
        sa.Column("term", sa.BigInteger(), server_default="0", nullable=False),
        sa.Column("lease_expires_at", sa.TIMESTAMP(timezone=True), nullable=True),
        sa.Column("acquired_at", sa.TIMESTAMP(timezone=True), nullable=True),
        sa.Column("renewed_at", sa.TIMESTAMP(timezone=True), nullable=True),
        sa.Column("cycle", sa.BigInteger(), server_default="0", nullable=False),
        sa.Column("slots", JSONB(), server_default=sa.text("'[]'::jsonb"), nullable=False),
        sa.Column("updated_at", sa.TIMESTAMP(timezone=True), server_default=sa.text("now()"),
                  nullable=False),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_fleets")),
    )


def downgrade() -> None:
    op.drop_table("fleets")
