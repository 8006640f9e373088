"""The migrations are reversible and produce the schema the models describe."""

import uuid

from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import create_engine, inspect

from services.store import db
from services.store.models import Base, is_partition


def test_upgrade_matches_models_and_downgrade_empties(admin_url: str) -> None:
    name = f"rw_mig_{uuid.uuid4().hex[:10]}"
    url = db.create_database(admin_url, name)
    try:
        db.upgrade(url)
        engine = create_engine(url)
        with engine.connect() as conn:
            ctx = MigrationContext.configure(conn, opts={"include_name": (
                lambda name, type_, _: not (type_ == "table" and is_partition(name)))})
            diff = compare_metadata(ctx, Base.metadata)
        assert diff == [], f"models and migrations disagree: {diff}"
        assert "measurements" in inspect(engine).get_table_names()

        db.downgrade(url, "base")
        assert set(inspect(engine).get_table_names()) <= {"alembic_version"}
        engine.dispose()
    finally:
        db.drop_database(admin_url, name)
