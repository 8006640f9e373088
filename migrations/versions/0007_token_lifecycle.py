"""tokens expire, record when they were last used, and agent tokens may be scoped to nodes;
preflight requests remember the token that asked and the token that holds the claim

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-23
"""
import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None

# Does more than add to the schema: the code before it would take tokens it refuses (expired, or scoped to other nodes).
ADDITIVE = False


def upgrade() -> None:
    op.add_column("api_tokens", sa.Column("expires_at", sa.TIMESTAMP(timezone=True), nullable=True))
    op.add_column("api_tokens", sa.Column("last_used_at", sa.TIMESTAMP(timezone=True), nullable=True))
    # An agent token limited to these nodes' results; NULL: any node.
    op.add_column("api_tokens", sa.Column("nodes", postgresql.ARRAY(sa.Text()), nullable=True))
    # Who asked (the per-token cap on waiting requests) and who holds the claim (only that
    # token, under the worker name it claimed with, may complete the request).
    op.add_column("preflight_requests", sa.Column("token_id", sa.Integer(), nullable=True))
    op.add_column("preflight_requests", sa.Column("claim_token_id", sa.Integer(), nullable=True))
    op.create_index("ix_preflight_requests_token_status", "preflight_requests",
                    ["token_id", "status"])
    # /metrics exports the links read lately: without this, a scan of every pair the
    # rotation ever probed (a million rows at 1024 nodes).
    op.create_index("ix_link_health_updated_at", "link_health", ["updated_at"])
    op.create_index("ix_link_health_not_ok", "link_health", ["status"],
                    postgresql_where=sa.text("status <> 'ok'"))


def downgrade() -> None:
    op.drop_index("ix_link_health_not_ok", table_name="link_health")
    op.drop_index("ix_link_health_updated_at", table_name="link_health")
    op.drop_index("ix_preflight_requests_token_status", table_name="preflight_requests")
    op.drop_column("preflight_requests", "claim_token_id")
    op.drop_column("preflight_requests", "token_id")
    op.drop_column("api_tokens", "nodes")
    op.drop_column("api_tokens", "last_used_at")
    op.drop_column("api_tokens", "expires_at")
