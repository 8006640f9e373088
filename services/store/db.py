"""Engines, sessions and the database itself: a given server, or an embedded one.

With ``RINGWATCH_DATABASE_URL`` unset, ringwatch starts an embedded Postgres
(pgserver) with its data under the project's ``.ringwatch/`` folder, so a fresh
machine needs no server.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from sqlalchemy import Connection, Engine, create_engine, make_url, text
from sqlalchemy.exc import OperationalError, SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

log = logging.getLogger(__name__)

MIGRATIONS_DIR = Path(__file__).resolve().parents[2] / "migrations"
# pg_advisory_lock key of migrations ("rwdb"): one upgrade at a time, whoever runs it.
MIGRATION_LOCK = 0x72776462
# Seconds an upgrade waits for another's migration lock before it gives up
# (RINGWATCH_MIGRATION_LOCK_TIMEOUT_S; `ringwatch db upgrade --lock-timeout`).
MIGRATION_LOCK_WAIT_S = 300.0
# Postgres' lock_not_available: lock_timeout ran out.
_LOCK_NOT_AVAILABLE = "55P03"


class MigrationLockBusy(Exception):
    """Another session held the migration lock for longer than an upgrade would wait."""


def normalize_url(url: str) -> str:
    """Accept plain ``postgresql://`` URLs and use the psycopg 3 driver for them."""
    u = make_url(url)
    if u.drivername in ("postgresql", "postgres"):
        u = u.set(drivername="postgresql+psycopg")
    return u.render_as_string(hide_password=False)


def describe_url(url: str) -> str:
    """A database URL fit to print: no password, the socket folder of a local server."""
    u = make_url(url)
    user = f"{u.username}@" if u.username else ""
    if u.host:
        return f"postgresql://{user}{u.host}:{u.port or 5432}/{u.database or ''}"
    socket = u.query.get("host")
    return f"postgresql://{user}/{u.database or ''} (socket in {socket or 'the default folder'})"


def current_revision(url: str) -> str | None:
    """The migration the database is at (None: not migrated, or not reachable)."""
    engine = create_engine(normalize_url(url))
    try:
        return revision_at(engine)
    except Exception:
        return None
    finally:
        engine.dispose()


def revision_at(engine: Engine) -> str | None:
    """The migration the database is at, None where it has none; raises where the database
    cannot be reached."""
    with engine.connect() as conn:
        if conn.execute(text("SELECT to_regclass('alembic_version')")).scalar() is None:
            return None
        return conn.execute(text("SELECT version_num FROM alembic_version")).scalar()


def start_embedded(state_dir: Path) -> str:
    """Start (or reuse) the embedded Postgres under ``state_dir/pg``; return its URL."""
    import pgserver  # imported late: only the embedded path needs it

    state_dir.mkdir(parents=True, exist_ok=True)
    # cleanup_mode=None: keep the server running for the next process (API, scheduler, tests).
    pgserver.get_server(state_dir / "pg", cleanup_mode=None)
    socket_dir = state_dir.resolve() / "pg"
    return f"postgresql+psycopg://postgres@/postgres?host={socket_dir}"


def stop_embedded(state_dir: Path) -> bool:
    """Stop the embedded Postgres under ``state_dir/pg`` if it runs; False if none did.
    Its data stays for the next start."""
    pgdata = state_dir / "pg"
    if not (pgdata / "postmaster.pid").exists():
        return False
    from pgserver import pg_ctl  # type: ignore[attr-defined]  # made at import time

    # The server runs as the user the embedded server made for itself when started as root.
    user = "pgserver" if os.geteuid() == 0 else None
    pg_ctl(["-w", "-m", "fast", "stop"], pgdata=pgdata, user=user, timeout=60)
    return True


def resolve_database_url(database_url: str, state_dir: Path) -> str:
    """The URL to use: ``database_url`` (RINGWATCH_DATABASE_URL), else the embedded
    server's, kept under ``state_dir``."""
    if database_url:
        return normalize_url(database_url)
    url = start_embedded(state_dir)
    # Child processes (API server, scheduler) then find the same server without starting one.
    os.environ.setdefault("RINGWATCH_DATABASE_URL", url)
    return url


def make_engine(url: str) -> Engine:
    return create_engine(normalize_url(url), pool_pre_ping=True, pool_size=10, max_overflow=10)


def make_session_factory(engine: Engine) -> sessionmaker[Session]:
    return sessionmaker(engine, expire_on_commit=False)


@contextmanager
def transaction(factory: sessionmaker[Session]) -> Iterator[Session]:
    """One unit of work: commit on success, roll back on any error."""
    session = factory()
    try:
        yield session
        session.commit()
    except BaseException:
        session.rollback()
        raise
    finally:
        session.close()


def alembic_config(url: str):  # -> alembic.config.Config
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    # ConfigParser interpolates '%': escape it so URLs with encoded characters survive.
    cfg.set_main_option("sqlalchemy.url", normalize_url(url).replace("%", "%%"))
    return cfg


def _scripts():  # -> alembic.script.ScriptDirectory
    from alembic.script import ScriptDirectory

    return ScriptDirectory.from_config(alembic_config("postgresql://unused"))


def head_revision() -> str | None:
    """The migration this code's schema is at (the newest in migrations/versions)."""
    return _scripts().get_current_head()


def known_revision(revision: str) -> bool:
    """Whether ``revision`` is one of this code's migrations (not one a newer ringwatch made)."""
    return revision in {script.revision for script in _scripts().walk_revisions()}


def upgrade(url: str, revision: str = "head", *, lock_wait_s: float = MIGRATION_LOCK_WAIT_S,
            say: Callable[[str], None] | None = None) -> None:
    """Apply migrations up to ``revision``. Two upgrades at once take turns: migrations/env.py
    holds ``migration_lock`` while it migrates, so the second finds the database where the
    first left it; one that waits says so through ``say`` and gives up after
    ``lock_wait_s`` (MigrationLockBusy)."""
    from alembic import command

    cfg = alembic_config(url)
    cfg.attributes["migration_lock_wait_s"] = lock_wait_s
    cfg.attributes["say"] = say
    command.upgrade(cfg, revision)


@contextmanager
def migration_lock(conn: Connection, wait_s: float = MIGRATION_LOCK_WAIT_S,
                   say: Callable[[str], None] | None = None) -> Iterator[None]:
    """Hold the migrations' advisory lock on ``conn``. Where another session holds it, say
    so once (naming the holder where pg_stat_activity shows it) and wait at most ``wait_s``
    seconds, then raise MigrationLockBusy. Session-level, so it outlives the transactions
    alembic commits on ``conn``."""
    if not conn.execute(text("SELECT pg_try_advisory_lock(:k)"), {"k": MIGRATION_LOCK}).scalar():
        holder = lock_holder(conn)
        (say or log.warning)(f"waiting for the migration lock (pg_advisory_lock {MIGRATION_LOCK}) "
                             f"held by {holder}; giving up after {wait_s:g} s")
        # Local to this transaction: alembic's own statements keep the server's lock_timeout.
        conn.execute(text("SELECT set_config('lock_timeout', :t, true)"),
                     {"t": f"{max(1, round(wait_s * 1000))}ms"})
        try:
            conn.execute(text("SELECT pg_advisory_lock(:k)"), {"k": MIGRATION_LOCK})
        except OperationalError as exc:
            if getattr(exc.orig, "sqlstate", None) != _LOCK_NOT_AVAILABLE:
                raise
            conn.rollback()
            raise MigrationLockBusy(
                f"the migration lock (pg_advisory_lock {MIGRATION_LOCK}) is still held by "
                f"{lock_holder(conn)} after {wait_s:g} s: another `ringwatch db upgrade` (a "
                "migration Job) is running, or a session kept the lock; nothing was "
                "migrated") from None
    conn.commit()
    try:
        yield
    finally:
        # A connection that broke took its lock with it.
        with contextlib.suppress(SQLAlchemyError):
            conn.rollback()
            conn.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": MIGRATION_LOCK})
            conn.commit()


def lock_holder(conn: Connection) -> str:
    """Who holds the migration lock, as pg_locks and pg_stat_activity show it: its pid,
    user, application and client ("another session" where they show nothing)."""
    row = conn.execute(text(
        "SELECT a.pid, a.usename, a.application_name, host(a.client_addr) AS addr "
        "FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid "
        "WHERE l.locktype = 'advisory' AND l.granted AND l.classid = :hi AND l.objid = :lo "
        "AND l.objsubid = 1 AND l.database = (SELECT oid FROM pg_database "
        "WHERE datname = current_database()) LIMIT 1"),
        {"hi": MIGRATION_LOCK >> 32, "lo": MIGRATION_LOCK & 0xFFFFFFFF}).first()
    if row is None:
        return "another session"
    about = [f"user {row.usename}" if row.usename else "",
             f"application {row.application_name!r}" if row.application_name else "",
             f"from {row.addr}" if row.addr else ""]
    return f"pid {row.pid}" + (f" ({', '.join(a for a in about if a)})" if any(about) else "")


def downgrade(url: str, revision: str) -> None:
    from alembic import command

    command.downgrade(alembic_config(url), revision)


def create_database(admin_url: str, name: str) -> str:
    """Create database ``name`` on the server of ``admin_url``; return its URL."""
    engine = create_engine(normalize_url(admin_url), isolation_level="AUTOCOMMIT")
    with engine.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    engine.dispose()
    return make_url(normalize_url(admin_url)).set(database=name).render_as_string(
        hide_password=False
    )


def drop_database(admin_url: str, name: str) -> None:
    engine = create_engine(normalize_url(admin_url), isolation_level="AUTOCOMMIT")
    with engine.connect() as conn:
        conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    engine.dispose()
