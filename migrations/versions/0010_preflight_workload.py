"""preflight workload: the profile and parallel layout a preflight request asks about

A request with a workload profile (ddp, fsdp, moe, pipeline) and, optionally, the job's
tensor/pipeline/data-parallel degrees is always probed by a scheduler: monitoring does not
run a job's own communicators. Requests made before the upgrade have none.

Revision ID: 0010
Revises: 0009
Create Date: 2026-11-26
"""
import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None

# Only adds to the schema (expand/contract): the ringwatch before it serves on as it did
# (services.store.db.judge_ahead; docs/operations.md, "Upgrades and rollbacks").
ADDITIVE = True


def upgrade() -> None:
    op.add_column("preflight_requests",
                  sa.Column("workload", postgresql.JSONB(astext_type=sa.Text()), nullable=True))


def downgrade() -> None:
    op.drop_column("preflight_requests", "workload")
