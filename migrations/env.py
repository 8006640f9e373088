"""Alembic environment: runs migrations against the URL set by services.store.db."""

from alembic import context
from sqlalchemy import create_engine, pool

from services.store.db import MIGRATION_LOCK_WAIT_S, migration_lock
from services.store.models import Base, is_partition

config = context.config
target_metadata = Base.metadata


def _not_a_partition(name: str | None, type_: str, _parent: object) -> bool:
    """The day partitions of the measurements are made at run time, not by migrations."""
    return not (type_ == "table" and name is not None and is_partition(name))


def run_migrations_offline() -> None:
    context.configure(url=config.get_main_option("sqlalchemy.url"), target_metadata=target_metadata,
                      literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    engine = create_engine(config.get_main_option("sqlalchemy.url"), poolclass=pool.NullPool)
    # How long to wait for another upgrade's lock, and where to say so: db.upgrade's.
    wait_s = config.attributes.get("migration_lock_wait_s", MIGRATION_LOCK_WAIT_S)
    say = config.attributes.get("say")
    with engine.connect() as connection, migration_lock(connection, wait_s, say):
        # Configured once the lock is held: the revision alembic starts from is read after
        # any upgrade running beside this one has committed.
        context.configure(connection=connection, target_metadata=target_metadata,
                          include_name=_not_a_partition)
        with context.begin_transaction():
            context.run_migrations()
    engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
