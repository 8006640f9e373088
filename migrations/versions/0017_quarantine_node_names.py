"""quarantine node names (and group members) stored before the strict name rule

A database from before hostname-like node names (agents.groups.NODE_NAME) may hold names
such as ``..``, ``a"b``, ``node-1.``, one with a zero-width space or a trailing newline, or
two that differ only in case, and members such as ``../0``, ``node-1/01`` or ``node-1/0\\n``:
names the code now refuses at every door and /metrics could not label. Each such name is
renamed to ``quarantined-`` and 16 hex digits of its MD5 (a name the rule accepts; of case
twins, all but the node seen first), each such member to its node's new name and its index
(where the rule refuses that too, one from 100000 up: no GPU's), and each group key made of
them to the key of its new members (agents.groups.series_key). Every old value and its new
one are kept in ``quarantined_names``: the history reads on under the new names
(measurements, rollups and counters follow their group or node), and the downgrade puts
every old value back.

Renamed: nodes.name, gpu_counters.node, the node arrays of groups, link_health, findings,
fault_states, api_tokens and preflight_requests, fleets.slots, the members of groups and
link_health, and groups.key, link_health.group_key and findings.group_key. Left as they
were: free text written for people (finding details, webhook payloads, probe_runs' copy of
a batch's findings) and the opaque identities of fault_states and drift_states (never
parsed back into names).

Revision ID: 0017
Revises: 0016
Create Date: 2026-12-05
"""
import sqlalchemy as sa
from alembic import op

revision = "0017"
down_revision = "0016"
branch_labels = None
depends_on = None

# Does more than add to the schema: it renames nodes, which the code before it would create again under the old names.
ADDITIVE = False

# The rule as it stands at this revision (agents.groups.NODE_NAME and LOCAL_INDEX), frozen
# here: a later change to the rule is a migration of its own. Postgres' ``$`` is the end of
# the text (no trailing newline slips through as with Python's).
# (Groups without "?:": a colon before a word is a bind parameter to op.execute.)
NODE = "[A-Za-z0-9]([A-Za-z0-9._-]{0,251}[A-Za-z0-9_-])?"
NODE_OK = f"'^{NODE}$'"
MEMBER_OK = f"'^{NODE}/(0|[1-9][0-9]{{0,5}})$'"
PREFIX = "quarantined-"

# Columns that hold node names: single values, and arrays (order kept).
NODE_COLUMNS = (("nodes", "name"), ("gpu_counters", "node"))
NODE_ARRAYS = (("groups", "nodes"), ("link_health", "nodes"), ("findings", "nodes"),
               ("fault_states", "nodes"), ("api_tokens", "nodes"), ("preflight_requests", "nodes"))
MEMBER_ARRAYS = (("groups", "members"), ("link_health", "members"))
KEY_COLUMNS = (("groups", "key"), ("link_health", "group_key"), ("findings", "group_key"))


def upgrade() -> None:
    op.create_table(
        "quarantined_names",
        sa.Column("kind", sa.String(length=8), nullable=False),
        sa.Column("was", sa.Text(), nullable=False),
        sa.Column("name", sa.Text(), nullable=False),
        sa.Column("quarantined_at", sa.TIMESTAMP(timezone=True), server_default=sa.text("now()"),
                  nullable=False),
        sa.PrimaryKeyConstraint("kind", "was", name=op.f("pk_quarantined_names")),
        sa.UniqueConstraint("kind", "name", name=op.f("uq_quarantined_names_kind")),
    )
    sources = " UNION ".join(
        [f"SELECT {c} FROM {t}" for t, c in NODE_COLUMNS]
        + [f"SELECT unnest({c}) FROM {t}" for t, c in NODE_ARRAYS]
        + [f"SELECT split_part(unnest({c}), '/', 1) FROM {t}" for t, c in MEMBER_ARRAYS]
        + ["SELECT jsonb_array_elements_text(slots) FROM fleets WHERE jsonb_typeof(slots) = 'array'"])
    # A name the rule refuses; and of names that differ only in case (one host twice, which
    # the store now refuses to add), all but the node seen first.
    op.execute(f"""
        INSERT INTO quarantined_names (kind, was, name)
        SELECT 'node', n, '{PREFIX}' || left(md5(n), 16)
        FROM (SELECT s.n, CASE WHEN s.n ~ {NODE_OK} THEN row_number() OVER (
                               PARTITION BY s.n ~ {NODE_OK}, lower(s.n)
                               ORDER BY nd.id NULLS LAST, s.n COLLATE "C") END AS nth
              FROM (SELECT DISTINCT n FROM ({sources}) u(n) WHERE n IS NOT NULL) s(n)
              LEFT JOIN nodes nd ON nd.name = s.n) named
        WHERE nth IS NULL OR nth > 1""")
    # A member: its node renamed (or kept), its index kept where the rule takes it, else one
    # drawn from the member's digest, 100000 and up where no GPU's index is ('01' beside
    # '1', '٣' or '0\n' is no GPU's either).
    members = " UNION ".join(f"SELECT unnest({c}) FROM {t}" for t, c in MEMBER_ARRAYS)
    op.execute(f"""
        INSERT INTO quarantined_names (kind, was, name)
        SELECT 'member', m, coalesce(q.name, split_part(m, '/', 1)) || '/' ||
               CASE WHEN strpos(m, '/') > 0
                         AND substr(m, strpos(m, '/') + 1) ~ '^(0|[1-9][0-9]{{0,5}})$'
                    THEN substr(m, strpos(m, '/') + 1)
                    ELSE (100000 + ('x' || left(md5(m), 5))::bit(20)::int % 900000)::text END
        FROM ({members}) s(m)
        LEFT JOIN quarantined_names q ON q.kind = 'node' AND q.was = split_part(m, '/', 1)
        WHERE m IS NOT NULL AND (m !~ {MEMBER_OK} OR q.name IS NOT NULL)""")
    # A group's key is its members sorted and comma-joined, or sha256: of that past 512
    # characters (agents.groups.series_key); the renamed members are ASCII, so "C" order is
    # Python's.
    op.execute("""
        INSERT INTO quarantined_names (kind, was, name)
        SELECT DISTINCT ON (k) 'key', k,
               CASE WHEN length(c) > 512
                    THEN 'sha256:' || encode(sha256(convert_to(c, 'UTF8')), 'hex') ELSE c END
        FROM (SELECT t.k, (SELECT string_agg(coalesce(q.name, u.m), ','
                                             ORDER BY coalesce(q.name, u.m) COLLATE "C")
                           FROM unnest(t.members) u(m)
                           LEFT JOIN quarantined_names q ON q.kind = 'member' AND q.was = u.m) c
              FROM (SELECT key, members FROM groups
                    UNION ALL SELECT group_key, members FROM link_health) t(k, members)
              WHERE t.members && ARRAY(SELECT was FROM quarantined_names
                                       WHERE kind = 'member')) s
        ORDER BY k""")
    _rename("was", "name")


def downgrade() -> None:
    _rename("name", "was")
    op.drop_table("quarantined_names")


def _rename(old: str, new: str) -> None:
    """Every column that holds a node name, member or group key: each ``old`` value of
    ``quarantined_names`` to its ``new`` one."""
    for kind, columns in (("node", NODE_COLUMNS), ("key", KEY_COLUMNS)):
        for table, col in columns:
            op.execute(f"UPDATE {table} SET {col} = q.{new} FROM quarantined_names q "
                       f"WHERE q.kind = '{kind}' AND {table}.{col} = q.{old}")
    for kind, arrays in (("node", NODE_ARRAYS), ("member", MEMBER_ARRAYS)):
        for table, col in arrays:
            op.execute(f"""
                UPDATE {table} SET {col} = ARRAY(
                    SELECT coalesce(q.{new}, u.v) FROM unnest({col}) WITH ORDINALITY u(v, i)
                    LEFT JOIN quarantined_names q ON q.kind = '{kind}' AND q.{old} = u.v
                    ORDER BY u.i)
                WHERE {col} && ARRAY(SELECT {old} FROM quarantined_names WHERE kind = '{kind}')""")
    op.execute(f"""
        UPDATE fleets SET slots = (
            SELECT coalesce(jsonb_agg(CASE WHEN q.{new} IS NULL THEN e ELSE to_jsonb(q.{new}) END
                                      ORDER BY i), '[]'::jsonb)
            FROM jsonb_array_elements(slots) WITH ORDINALITY s(e, i)
            LEFT JOIN quarantined_names q ON q.kind = 'node' AND jsonb_typeof(e) = 'string'
                                         AND q.{old} = e #>> '{{}}')
        WHERE CASE WHEN jsonb_typeof(slots) = 'array' THEN EXISTS (
            SELECT 1 FROM jsonb_array_elements(slots) e
            JOIN quarantined_names q ON q.kind = 'node' AND jsonb_typeof(e) = 'string'
                                    AND q.{old} = e #>> '{{}}') ELSE false END""")
