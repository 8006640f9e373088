"""measurement transport: the transports NCCL's own log showed the probe's group took

A comma list of agents.nccl_log's classes (``p2p_nvlink``, ``shm``, ``net_ib``,
``net_socket``, ...; the sim's model names them alike), so a link's series shows when its
traffic moved to another transport.

Revision ID: 0014
Revises: 0013
Create Date: 2026-11-27
"""
import sqlalchemy as sa
from alembic import op

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None

# Only adds to the schema (expand/contract): the ringwatch before it serves on as it did
# (services.store.db.judge_ahead; docs/operations.md, "Upgrades and rollbacks").
ADDITIVE = True


def upgrade() -> None:
    # Nullable: rows stored before this revision, and gloo probes, do not say.
    op.add_column("measurements", sa.Column("transport", sa.String(length=64), nullable=True))


def downgrade() -> None:
    op.drop_column("measurements", "transport")
