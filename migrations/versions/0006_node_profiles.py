"""nodes carry their hardware profile

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-23
"""
import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("nodes", sa.Column("profile", sa.String(length=64), nullable=True))


def downgrade() -> None:
    op.drop_column("nodes", "profile")
