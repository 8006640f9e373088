"""The migrations are reversible and produce the schema the models describe."""

import uuid

from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import create_engine, inspect

from services.store import db
from services.store.models import EXPRESSION_INDEXES, Base, is_partition


def test_upgrade_matches_models_and_downgrade_empties(admin_url: str) -> None:
    name = f"rw_mig_{uuid.uuid4().hex[:10]}"
    url = db.create_database(admin_url, name)
    try:
        db.upgrade(url)
        engine = create_engine(url)
        with engine.connect() as conn:
            ctx = MigrationContext.configure(conn, opts={
                "include_name": lambda name, type_, _: not (
                    type_ == "table" and is_partition(name)
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

    from services.store import metrics as metrics_store
    from services.store.preflight import LATENCY_BOUNDS

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
