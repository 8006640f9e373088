"""metric totals: what keeps the ingest counters and the preflight latency histogram of
/metrics cheap to read and counting up

ingest_retired holds the batches and measurements retention has deleted from probe_runs
(the ingest counters are the runs held plus these); it starts empty. preflight_latency
counts completed preflight requests per way of answering and latency bucket, written with
each verdict; the upgrade counts the requests already completed (those never claimed as
answered at once, the others as probed). A downgrade forgets both.

Revision ID: 0011
Revises: 0010
Create Date: 2026-11-27
"""
import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None

# Does more than add to the schema: the code before it would delete probe runs without counting them, and the ingest counters would go down.
ADDITIVE = False

# The bucket bounds (seconds) of services.store.preflight.LATENCY_BOUNDS at this revision.
BOUNDS = "{0.1,0.5,1,2.5,5,10,30,60,120,300,600,1800}"


def upgrade() -> None:
    op.create_table(
        "ingest_retired",
        sa.Column("id", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("batches", sa.BigInteger(), nullable=False),
        sa.Column("measurements", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_ingest_retired")),
    )
    op.create_table(
        "preflight_latency",
        sa.Column("answered", sa.String(length=16), nullable=False),
        sa.Column("le", sa.Float(), nullable=False),
        sa.Column("count", sa.BigInteger(), nullable=False),
        sa.Column("sum_s", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("answered", "le", name=op.f("pk_preflight_latency")),
    )
    op.execute(f"""
        INSERT INTO preflight_latency (answered, le, count, sum_s)
        SELECT answered, le, count(*), sum(d) FROM (
          SELECT CASE WHEN attempts > 0 THEN 'probed' ELSE 'at_once' END AS answered, d,
                 coalesce((SELECT min(b) FROM unnest('{BOUNDS}'::float8[]) AS b WHERE b >= d),
                          'Infinity'::float8) AS le
          FROM (SELECT attempts,
                       greatest(extract(epoch FROM completed_at - created_at)::float8, 0) AS d
                FROM preflight_requests WHERE completed_at IS NOT NULL) AS done) AS counted
        GROUP BY answered, le
    """)


def downgrade() -> None:
    op.drop_table("preflight_latency")
    op.drop_table("ingest_retired")
