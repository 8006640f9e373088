"""Alembic environment: runs migrations against the URL services.store.db sets, or, for
`alembic` run by hand, RINGWATCH_DATABASE_URL's."""

from alembic import context
from sqlalchemy import create_engine, pool

from ringwatch.services.store.db import (
    MIGRATION_LOCK_WAIT_S,
    MIGRATIONS_TABLE,
    migration_lock,
    normalize_url,
    record_migrations,
)
from ringwatch.services.store.models import Base, is_partition

config = context.config
target_metadata = Base.metadata


def _database_url() -> str:
    """db.alembic_config's URL; else RINGWATCH_DATABASE_URL, read as every process reads it."""
    url = config.get_main_option("sqlalchemy.url")
    if url:
        return url
    from ringwatch.services.settings import get_settings

    url = get_settings().database_url
    if not url:
        raise SystemExit("alembic: set RINGWATCH_DATABASE_URL to the database to migrate (or run "
                         "`ringwatch db upgrade`, which also finds the embedded one)")
    return normalize_url(url)


def _migrated_objects(name: str | None, type_: str, _parent: object) -> bool:
    """What the migrations build: not the day partitions of the measurements (made at run
    time) nor the record of migrations (db.record_migrations, bookkeeping)."""
    return not (type_ == "table" and name is not None
                and (is_partition(name) or name == MIGRATIONS_TABLE))


def run_migrations_offline() -> None:
    context.configure(url=_database_url(), target_metadata=target_metadata, literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    engine = create_engine(_database_url(), poolclass=pool.NullPool)
    # How long to wait for another upgrade's lock, and where to say so: db.upgrade's.
    wait_s = config.attributes.get("migration_lock_wait_s", MIGRATION_LOCK_WAIT_S)
    say = config.attributes.get("say")
    with engine.connect() as connection, migration_lock(connection, wait_s, say):
        # Configured once the lock is held: the revision alembic starts from is read after
        # any upgrade running beside this one has committed.
        context.configure(connection=connection, target_metadata=target_metadata,
                          include_name=_migrated_objects)
        with context.begin_transaction():
            context.run_migrations()
            # In the same transaction: a database is never at a migration nobody recorded.
            record_migrations(connection, context.script,
                              context.get_context().get_current_revision())
    engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
