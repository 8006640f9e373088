"""The migrations are reversible and produce the schema the models describe."""

import uuid

from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import create_engine, inspect

from ringwatch.services.store import db
from ringwatch.services.store.models import EXPRESSION_INDEXES, Base, is_partition


def test_upgrade_matches_models_and_downgrade_empties(admin_url: str) -> None:
    name = f"rw_mig_{uuid.uuid4().hex[:10]}"
    url = db.create_database(admin_url, name)
    try:
        db.upgrade(url)
        engine = create_engine(url)
        with engine.connect() as conn:
            ctx = MigrationContext.configure(conn, opts={
                "include_name": lambda name, type_, _: not (
                    type_ == "table" and (is_partition(name) or name == db.MIGRATIONS_TABLE)
                    or type_ == "index" and name in EXPRESSION_INDEXES),
                "include_object": lambda _obj, name, type_, _reflected, _other: not (
                    type_ == "index" and name in EXPRESSION_INDEXES)})
            diff = compare_metadata(ctx, Base.metadata)
        assert diff == [], f"models and migrations disagree: {diff}"
        assert "measurements" in inspect(engine).get_table_names()
        # What autogenerate cannot compare, the migrations build as the models declare.
        built = {i["name"]: i for i in inspect(engine).get_indexes("link_health")}
        declared = {i.name: i for t in Base.metadata.tables.values() for i in t.indexes}
        for name in EXPRESSION_INDEXES:
            assert name in built and name in declared
            where = built[name]["dialect_options"]["postgresql_where"]
            assert "'inter_node'" in where and "cardinality(nodes) = 2" in where, where
            assert [e.strip("()") for e in built[name]["expressions"]] == ["nodes[1]", "nodes[2]"]

        db.downgrade(url, "base")
        assert set(inspect(engine).get_table_names()) <= {"alembic_version"}
        engine.dispose()
    finally:
        db.drop_database(admin_url, name)


def test_the_preflight_latency_histogram_counts_requests_completed_before_it(
        admin_url: str) -> None:
    from sqlalchemy import text

    from ringwatch.services.store import metrics as metrics_store
    from ringwatch.services.store.preflight import LATENCY_BOUNDS

    name = f"rw_mig_{uuid.uuid4().hex[:10]}"
    url = db.create_database(admin_url, name)
    try:
        db.upgrade(url, "0010")
        engine = create_engine(url)
        with engine.begin() as conn:  # answered at once; probed in 45 s and in 2 h; waiting
            conn.execute(text(
                "INSERT INTO preflight_requests (id, nodes, max_age_s, status, attempts, "
                "created_at, completed_at) VALUES "
                "('a', '{n}', 60, 'done', 0, now(), now()), "
                "('b', '{n}', 60, 'done', 1, now() - interval '45 s', now()), "
                "('c', '{n}', 60, 'failed', 2, now() - interval '2 h', now()), "
                "('d', '{n}', 60, 'pending', 0, now(), NULL)"))
        db.upgrade(url)
        with db.make_session_factory(engine)() as s:
            got = metrics_store.preflight_latency(s)
        engine.dispose()
        assert got["at_once"].total == 1 and got["at_once"].le[0] == 1
        probed = dict(zip(LATENCY_BOUNDS, got["probed"].le, strict=True))
        assert got["probed"].total == 2 and got["probed"].sum_s == 45 + 7200
        assert (probed[30.0], probed[60.0], probed[1800.0]) == (0, 1, 1)
    finally:
        db.drop_database(admin_url, name)


def test_two_upgrades_at_once_both_succeed_and_leave_the_schema_at_head(admin_url: str) -> None:
    """A migration Job retried while its first pod still migrates, or an operator's upgrade
    beside it: the second `ringwatch db upgrade` waits for the first, then finds the
    database at head, and both exit 0."""
    import os
    import subprocess
    import sys

    from sqlalchemy import text

    name = f"rw_mig_{uuid.uuid4().hex[:10]}"
    url = db.create_database(admin_url, name)
    try:
        env = {**os.environ, "RINGWATCH_DATABASE_URL": url}
        upgrades = [subprocess.Popen([sys.executable, "-m", "ringwatch.services.cli.main", "db", "upgrade"],
                                     env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True) for _ in range(2)]
        said = [p.communicate(timeout=300) for p in upgrades]
        assert [p.returncode for p in upgrades] == [0, 0], said
        assert all(out.rstrip().endswith("(head)") for out, _ in said), said
        assert db.current_revision(url) == db.head_revision()
        engine = create_engine(url)
        with engine.connect() as conn:
            assert conn.execute(text("SELECT count(*) FROM alembic_version")).scalar() == 1
        engine.dispose()
    finally:
        db.drop_database(admin_url, name)


def test_an_upgrade_waits_while_another_holds_the_migration_lock(admin_url: str) -> None:
    """The lock is really taken: while a connection holds it, an upgrade waits on it (seen
    in pg_locks) and migrates nothing; once it is released, the upgrade goes on to head."""
    import threading
    import time

    from sqlalchemy import text

    name = f"rw_mig_{uuid.uuid4().hex[:10]}"
    url = db.create_database(admin_url, name)
    engine = create_engine(url)
    try:
        with engine.connect() as holder:
            holder.execute(text("SELECT pg_advisory_lock(:k)"), {"k": db.MIGRATION_LOCK})
            holder.commit()
            failed: list[BaseException] = []

            def upgrade() -> None:
                try:
                    db.upgrade(url)
                except BaseException as exc:  # reported by the test, not lost in the thread
                    failed.append(exc)

            thread = threading.Thread(target=upgrade, daemon=True)
            thread.start()
            # A bigint key shows as classid (high 32 bits), objid (low 32 bits), objsubid 1.
            waiting = text("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' "
                           "AND NOT granted AND objid = :k AND objsubid = 1 AND database = "
                           "(SELECT oid FROM pg_database WHERE datname = current_database())")
            deadline = time.monotonic() + 60
            while not holder.execute(waiting, {"k": db.MIGRATION_LOCK}).scalar():
                holder.commit()
                assert thread.is_alive() and time.monotonic() < deadline, failed or "never waited"
                time.sleep(0.05)
            holder.commit()
            assert thread.is_alive() and db.current_revision(url) is None
            holder.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": db.MIGRATION_LOCK})
            holder.commit()
        thread.join(timeout=120)
        assert not thread.is_alive() and not failed, failed
        assert db.current_revision(url) == db.head_revision()
    finally:
        engine.dispose()
        db.drop_database(admin_url, name)


def test_db_wait_returns_once_another_process_has_migrated(admin_url: str) -> None:
    """What the API's init container runs while the migration Job works: it waits on an
    unmigrated database, returns 0 once it is at head, gives up past --timeout in one line,
    and refuses at once a database a newer ringwatch migrated."""
    import os
    import subprocess
    import sys

    from sqlalchemy import text

    from tests.procs import cli

    name = f"rw_mig_{uuid.uuid4().hex[:10]}"
    url = db.create_database(admin_url, name)
    env = {**os.environ, "RINGWATCH_DATABASE_URL": url}
    try:
        late = cli("db", "wait", "--timeout", "0", env=env, timeout=60)
        assert late.returncode == 2 and len(late.stderr.strip().splitlines()) == 1, late.stderr
        assert "(none)" in late.stderr and "ringwatch db upgrade" in late.stderr

        waiter = subprocess.Popen([sys.executable, "-m", "ringwatch.services.cli.main", "db", "wait",
                                   "--timeout", "120"], env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True)
        try:
            # It has looked and found nothing before the upgrade starts.
            assert "waiting for `ringwatch db upgrade`" in waiter.stderr.readline()
            db.upgrade(url)
            out, _ = waiter.communicate(timeout=60)
        finally:
            waiter.kill()
            waiter.wait()
        assert waiter.returncode == 0 and out.strip().endswith(f"at {db.head_revision()} (head)")

        engine = create_engine(url)
        with engine.begin() as conn:
            conn.execute(text("UPDATE alembic_version SET version_num = 'ffff_newer'"))
        engine.dispose()
        newer = cli("db", "wait", "--timeout", "120", env=env, timeout=60)
        assert newer.returncode == 2 and "ffff_newer" in newer.stderr
        assert "does not have" in newer.stderr
    finally:
        db.drop_database(admin_url, name)
