"""node pair index: the link rows of one node pair, found without a scan

The web page's node x node map (GET /v1/fleet/pairs) is kept up to date from the pairs a
cycle touched; each touched pair's rows (every op and group) are read through this
partial expression index on the pair's two nodes. Built on existing rows.

Revision ID: 0012
Revises: 0011
Create Date: 2026-11-26
"""
from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None

# Only adds to the schema (expand/contract): the ringwatch before it serves on as it did
# (services.store.db.judge_ahead; docs/operations.md, "Upgrades and rollbacks").
ADDITIVE = True


def upgrade() -> None:
    op.execute("CREATE INDEX ix_link_health_pair ON link_health ((nodes[1]), (nodes[2])) "
               "WHERE scope = 'inter_node' AND cardinality(nodes) = 2")


def downgrade() -> None:
    op.drop_index("ix_link_health_pair", table_name="link_health")
