"""node retirement and the new-node quota

``nodes.retired_at``: set when an admin retires a node (POST /v1/nodes/retire) or retention
does (not seen for RINGWATCH_NODE_RETENTION_DAYS); a retired node is out of the fleet's
lists, counts and map while its history stays. ``nodes.added_at`` and
``nodes.added_by_token_id``: when a node joined the fleet (created, or back from
retirement) and with which token, what RINGWATCH_MAX_NEW_NODES_PER_TOKEN counts. A node
from before this revision joined when it was first seen, with no token on record. The
downgrade drops the three: a retired node is then in the fleet again.

Revision ID: 0018
Revises: 0017
Create Date: 2026-12-05
"""
import sqlalchemy as sa
from alembic import op

revision = "0018"
down_revision = "0017"
branch_labels = None
depends_on = None

# Only adds to the schema (expand/contract): the ringwatch before it serves on as it did
# (services.store.db.judge_ahead; docs/operations.md, "Upgrades and rollbacks").
ADDITIVE = True


def upgrade() -> None:
    op.add_column("nodes", sa.Column("added_at", sa.TIMESTAMP(timezone=True),
                                     server_default=sa.text("now()"), nullable=False))
    op.add_column("nodes", sa.Column("added_by_token_id", sa.Integer(), nullable=True))
    op.add_column("nodes", sa.Column("retired_at", sa.TIMESTAMP(timezone=True), nullable=True))
    op.execute("UPDATE nodes SET added_at = first_seen_at")
    op.create_index("ix_nodes_added_by", "nodes", ["added_by_token_id", "added_at"])


def downgrade() -> None:
    op.drop_index("ix_nodes_added_by", table_name="nodes")
    op.drop_column("nodes", "retired_at")
    op.drop_column("nodes", "added_by_token_id")
    op.drop_column("nodes", "added_at")
