"""The migrations are reversible and produce the schema the models describe."""

import uuid

from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import create_engine, inspect

from services.store import db
from services.store.models import Base


def test_upgrade_matches_models_and_downgrade_empties(admin_url: str) -> None:
    name = f"rw_mig_{uuid.uuid4().hex[:10]}"
    url = db.create_database(admin_url, name)
    try:
        db.upgrade(url)
        engine = create_engine(url)
        with engine.connect() as conn:
            diff = compare_metadata(MigrationContext.configure(conn), Base.metadata)
        assert diff == [], f"models and migrations disagree: {diff}"
        assert "measurements" in inspect(engine).get_table_names()

        db.downgrade(url, "base")
        assert set(inspect(engine).get_table_names()) <= {"alembic_version"}
        engine.dispose()
    finally:
        db.drop_database(admin_url, name)
