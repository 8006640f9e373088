"""groups stored once; measurements partitioned by day and keyed by group id; hourly and
daily rollups; nodes remember when they were last probed

Existing measurements are copied into the new layout (one partition per day they cover).

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-23
"""
from datetime import UTC, datetime, timedelta

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None

# Does more than add to the schema: it moves the measurements into a new layout.
ADDITIVE = False

TZ = sa.TIMESTAMP(timezone=True)
# The series key of a group too long to index as text (agents.groups.series_key).
HASHED_KEY = ("CASE WHEN length({c}) > 512 THEN 'sha256:' || "
              "encode(sha256(convert_to({c}, 'UTF8')), 'hex') ELSE {c} END")
COLUMNS = ("time, size_bytes, time_us, algbw_gbs, busbw_gbs, preset_gbs, group_id, run_id, "
           "warmup, iters, wrong, op, backend, dtype, redop, timing")


def _partition(day: datetime) -> None:
    op.execute(f'CREATE TABLE IF NOT EXISTS "measurements_p{day:%Y%m%d}" PARTITION OF measurements '
               f"FOR VALUES FROM ('{day.isoformat()}') TO ('{(day + timedelta(days=1)).isoformat()}')")


def _rollup(name: str) -> None:
    op.create_table(
        name,
        sa.Column("bucket", TZ, nullable=False),
        sa.Column("group_id", sa.Integer(), nullable=False),
        sa.Column("op", sa.String(length=32), nullable=False),
        sa.Column("size_bytes", sa.BigInteger(), nullable=False),
        sa.Column("count", sa.Integer(), nullable=False),
        sa.Column("busbw_min", sa.Float(), nullable=False),
        sa.Column("busbw_median", sa.Float(), nullable=False),
        sa.Column("busbw_max", sa.Float(), nullable=False),
        sa.Column("busbw_mean", sa.Float(), nullable=False),
        sa.Column("algbw_median", sa.Float(), nullable=False),
        sa.Column("time_us_median", sa.Float(), nullable=False),
        sa.Column("wrong", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("group_id", "op", "size_bytes", "bucket", name=f"pk_{name}"),
    )
    op.create_index(f"ix_{name}_bucket", name, ["bucket"])


def upgrade() -> None:
    op.create_table(
        "groups",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("key", sa.Text(), nullable=False),
        sa.Column("scope", sa.String(length=16), nullable=False),
        sa.Column("members", postgresql.ARRAY(sa.Text()), nullable=False),
        sa.Column("nodes", postgresql.ARRAY(sa.Text()), nullable=False),
        sa.Column("first_seen_at", TZ, server_default=sa.text("now()"), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_groups"),
        sa.UniqueConstraint("key", name="uq_groups_key"),
    )
    op.add_column("nodes", sa.Column("last_probed_at", TZ, nullable=True))
    op.add_column("probe_runs", sa.Column("shipper", postgresql.JSONB(), nullable=True))
    op.execute("UPDATE nodes SET last_probed_at = p.t FROM "
               "(SELECT unnest(nodes) AS name, max(time) AS t FROM measurements GROUP BY 1) p "
               "WHERE nodes.name = p.name")
    key = HASHED_KEY.format(c="group_key")
    op.execute(f"INSERT INTO groups (key, scope, members, nodes) SELECT DISTINCT ON (k) k, scope, "
               f"members, nodes FROM (SELECT {key} AS k, scope, members, nodes FROM measurements) g "
               f"ORDER BY k")
    for table in ("link_health", "findings"):
        op.execute(f"UPDATE {table} SET group_key = {key} WHERE length(group_key) > 512")

    op.rename_table("measurements", "measurements_old")
    for ix in ("ix_measurements_time", "ix_measurements_series", "ix_measurements_run_id"):
        op.drop_index(ix, table_name="measurements_old")
    op.execute("""
        CREATE TABLE measurements (
            time TIMESTAMP WITH TIME ZONE NOT NULL,
            size_bytes BIGINT NOT NULL,
            time_us FLOAT NOT NULL,
            algbw_gbs FLOAT NOT NULL,
            busbw_gbs FLOAT NOT NULL,
            preset_gbs FLOAT,
            group_id INTEGER NOT NULL,
            run_id INTEGER NOT NULL,
            warmup INTEGER NOT NULL,
            iters INTEGER NOT NULL,
            wrong INTEGER NOT NULL,
            op VARCHAR(32) NOT NULL,
            backend VARCHAR(16) NOT NULL,
            dtype VARCHAR(16) NOT NULL,
            redop VARCHAR(8) DEFAULT 'sum' NOT NULL,
            timing VARCHAR(16)
        ) PARTITION BY RANGE (time)""")
    op.create_index("ix_measurements_series", "measurements",
                    ["group_id", "op", "size_bytes", "time"])
    conn = op.get_bind()
    days = conn.execute(sa.text(
        "SELECT DISTINCT date_trunc('day', time, 'UTC') FROM measurements_old")).scalars().all()
    today = datetime.now(UTC).replace(hour=0, minute=0, second=0, microsecond=0)
    for day in sorted({d.astimezone(UTC) for d in days} | {today, today + timedelta(days=1)}):
        _partition(day)
    op.execute(f"INSERT INTO measurements ({COLUMNS}) SELECT m.time, m.size_bytes, m.time_us, "
               f"m.algbw_gbs, m.busbw_gbs, m.preset_gbs, g.id, m.run_id, m.warmup, m.iters, "
               f"m.wrong, m.op, m.backend, m.dtype, m.redop, m.timing FROM measurements_old m "
               f"JOIN groups g ON g.key = {HASHED_KEY.format(c='m.group_key')}")
    op.drop_table("measurements_old")

    _rollup("series_1h")
    _rollup("series_1d")
    op.create_table(
        "rollup_state",
        sa.Column("resolution", sa.String(length=8), nullable=False),
        sa.Column("rolled_until", TZ, nullable=True),
        sa.Column("dirty_from", TZ, nullable=True),
        sa.PrimaryKeyConstraint("resolution", name="pk_rollup_state"),
    )
    op.execute("INSERT INTO rollup_state (resolution) VALUES ('1h'), ('1d')")


def downgrade() -> None:
    op.drop_table("rollup_state")
    for name in ("series_1d", "series_1h"):
        op.drop_index(f"ix_{name}_bucket", table_name=name)
        op.drop_table(name)
    op.rename_table("measurements", "measurements_new")
    op.drop_index("ix_measurements_series", table_name="measurements_new")
    op.create_table(
        "measurements",
        sa.Column("id", sa.BigInteger(), nullable=False),
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("time", TZ, nullable=False),
        sa.Column("backend", sa.String(length=16), nullable=False),
        sa.Column("op", sa.String(length=32), nullable=False),
        sa.Column("scope", sa.String(length=16), nullable=False),
        sa.Column("group_key", sa.Text(), nullable=False),
        sa.Column("members", postgresql.ARRAY(sa.Text()), nullable=False),
        sa.Column("nodes", postgresql.ARRAY(sa.Text()), nullable=False),
        sa.Column("size_bytes", sa.BigInteger(), nullable=False),
        sa.Column("dtype", sa.String(length=16), nullable=False),
        sa.Column("warmup", sa.Integer(), nullable=False),
        sa.Column("iters", sa.Integer(), nullable=False),
        sa.Column("time_us", sa.Float(), nullable=False),
        sa.Column("algbw_gbs", sa.Float(), nullable=False),
        sa.Column("busbw_gbs", sa.Float(), nullable=False),
        sa.Column("wrong", sa.Integer(), nullable=False),
        sa.Column("redop", sa.String(length=8), server_default="sum", nullable=False),
        sa.Column("timing", sa.String(length=16), nullable=True),
        sa.Column("preset_gbs", sa.Float(), nullable=True),
        sa.ForeignKeyConstraint(["run_id"], ["probe_runs.id"],
                                name="fk_measurements_run_id_probe_runs", ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name="pk_measurements"),
    )
    op.execute("INSERT INTO measurements (run_id, time, backend, op, scope, group_key, members, "
               "nodes, size_bytes, dtype, warmup, iters, time_us, algbw_gbs, busbw_gbs, wrong, "
               "redop, timing, preset_gbs) SELECT m.run_id, m.time, m.backend, m.op, g.scope, "
               "g.key, g.members, g.nodes, m.size_bytes, m.dtype, m.warmup, m.iters, m.time_us, "
               "m.algbw_gbs, m.busbw_gbs, m.wrong, m.redop, m.timing, m.preset_gbs "
               "FROM measurements_new m JOIN groups g ON g.id = m.group_id "
               "WHERE m.run_id IN (SELECT id FROM probe_runs)")
    op.execute("DROP TABLE measurements_new")  # and with it every day partition
    op.create_index("ix_measurements_run_id", "measurements", ["run_id"])
    op.create_index("ix_measurements_series", "measurements",
                    ["group_key", "op", "size_bytes", "time"])
    op.create_index("ix_measurements_time", "measurements", ["time"])
    op.drop_column("nodes", "last_probed_at")
    op.drop_column("probe_runs", "shipper")
    op.drop_table("groups")
