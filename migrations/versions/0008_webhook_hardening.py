"""webhooks keep a rotated-out secret for a grace period; deliveries name the notifier
holding their claim and when the claim ends

Secrets stored in plain text stay readable (the ``fernet:`` prefix marks encrypted ones),
and the notifier encrypts them once ``RINGWATCH_SECRET_KEY`` is set. A downgrade leaves
secrets as they are: a webhook whose secret is encrypted by then must be registered again
for older code to sign its deliveries.

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-24
"""
import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None

# Does more than add to the schema: secrets it encrypts at rest are unreadable to the code before it.
ADDITIVE = False


def upgrade() -> None:
    op.add_column("webhooks", sa.Column("previous_secret", sa.Text(), nullable=True))
    op.add_column("webhooks", sa.Column("previous_secret_expires_at", sa.TIMESTAMP(timezone=True),
                                        nullable=True))
    op.add_column("webhook_deliveries", sa.Column("claimed_by", sa.Uuid(), nullable=True))
    op.add_column("webhook_deliveries", sa.Column("claim_expires_at", sa.TIMESTAMP(timezone=True),
                                                  nullable=True))
    # Claims from before this revision lived in next_attempt_at alone; they run out as before.


def downgrade() -> None:
    op.drop_column("webhook_deliveries", "claim_expires_at")
    op.drop_column("webhook_deliveries", "claimed_by")
    op.drop_column("webhooks", "previous_secret_expires_at")
    op.drop_column("webhooks", "previous_secret")
