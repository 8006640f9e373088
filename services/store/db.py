"""Engines, sessions and the database itself: a given server, or an embedded one.

With ``RINGWATCH_DATABASE_URL`` unset, ringwatch starts an embedded Postgres
(pgserver) with its data under the project's ``.ringwatch/`` folder, so a fresh
machine needs no server.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple

from sqlalchemy import (
    Boolean,
    Column,
    Connection,
    Engine,
    MetaData,
    String,
    Table,
    create_engine,
    func,
    make_url,
    text,
)
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.exc import InterfaceError, OperationalError, SQLAlchemyError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from sqlalchemy.orm import Session, sessionmaker
from sqlalchemy.types import TIMESTAMP

from ringwatch.services.logs import OutageLog

log = logging.getLogger(__name__)

# This process's word on the database being away: every part of it that meets a connection
# or timeout error says so here, and each unit of work that commits ends it, so an outage
# is a line when it starts, one a minute and one when it ends (services/logs.py).
OUTAGE = OutageLog(log, "the database")
# What the database being away (or too slow) raises, as against a fault in the code.
UNAVAILABLE = (OperationalError, InterfaceError, PoolTimeout)

MIGRATIONS_DIR = Path(__file__).resolve().parents[2] / "migrations"
# pg_advisory_lock key of migrations ("rwdb"): one upgrade at a time, whoever runs it.
MIGRATION_LOCK = 0x72776462
# Seconds an upgrade waits for another's migration lock before it gives up
# (RINGWATCH_MIGRATION_LOCK_TIMEOUT_S; `ringwatch db upgrade --lock-timeout`).
MIGRATION_LOCK_WAIT_S = 300.0
# Postgres' lock_not_available: lock_timeout ran out.
_LOCK_NOT_AVAILABLE = "55P03"
# Connections a maintenance pass's engine keeps: the pass holds its advisory lock's and one
# beside it at a time; the third is to spare.
MAINTENANCE_CONNECTIONS = 3
# ringwatch's releases before this code, oldest first: each version and the migration its
# schema ends at. This code (pyproject's version) ends at head_revision();
# `ringwatch db downgrade` goes back as far as the last of these, one release
# (docs/operations.md, "Upgrades and rollbacks").
RELEASES: tuple[tuple[str, str], ...] = (("0.1.0", "0016"),)
# Each upgrade records this code's migrations here (record_migrations, from
# migrations/env.py, in the upgrade's own transaction): what each revises and whether it only
# adds to the schema (its ADDITIVE). An older ringwatch whose database a newer one migrated
# reads it to know whether it may go on serving (expand/contract). Bookkeeping like
# alembic_version, not a model: it is no part of what the migrations build.
MIGRATIONS_TABLE = "ringwatch_migrations"
_migrations = Table(
    MIGRATIONS_TABLE, MetaData(),
    Column("revision", String(64), primary_key=True),
    Column("revises", String(256)),
    Column("additive", Boolean, nullable=False),
    Column("recorded_at", TIMESTAMP(timezone=True), server_default=func.now(), nullable=False),
)


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


class SchemaState(NamedTuple):
    """Whether this code can serve the database's schema, and why not ('' when it can)."""

    ok: bool
    why: str


@functools.cache
def _code_head() -> str | None:
    return head_revision()  # the code does not change while it runs


@functools.cache
def _code_revisions() -> frozenset[str]:
    return frozenset(script.revision for script in _scripts().walk_revisions())


def schema_state(engine: Engine) -> SchemaState:
    """Whether this code can serve the database ``engine`` reaches: it answers, and is at this
    code's migration, or ahead of it by migrations that only add (judge_ahead). Readiness (the
    API's and the notifier's /readyz), ``serve`` and ``db wait`` read it; the reason goes to
    an unauthenticated prober, so it names the error's class, never its text."""
    head = _code_head()
    try:
        at = revision_at(engine)
        if at == head:
            return SchemaState(True, "")
        if at is not None and at not in _code_revisions():
            return judge_ahead(at, head, _code_revisions(), recorded_migrations(engine))
    except SQLAlchemyError as exc:
        cause = getattr(exc, "orig", None) or exc
        return SchemaState(False, f"the database is unreachable ({type(cause).__name__})")
    return SchemaState(False, f"the database is at migration {at or '(none)'}, this code needs "
                              f"{head}: run `ringwatch db upgrade`")


def judge_ahead(at: str, head: str | None, known: frozenset[str],
                recorded: dict[str, tuple[str | None, bool]]) -> SchemaState:
    """Whether this code, at migration ``head``, may serve a database at ``at``, a migration
    it does not have, from what the upgrade that made it recorded (``recorded``: revision ->
    (the one it revises, whether it only adds)). Yes where every migration from ``head`` up to
    ``at`` only adds (expand/contract): this code reads and writes what it always did, and a
    rolling upgrade's old replicas serve on while the new ones start."""
    rev: str | None = at
    seen: set[str] = set()
    while rev != head:
        if rev is None or rev not in recorded or rev in seen or (rev != at and rev in known):
            return SchemaState(False, f"the database is at migration {at}, which this code does "
                                      f"not have (a newer ringwatch migrated it, recording no "
                                      f"way from this code's {head}): run that ringwatch")
        seen.add(rev)
        revises, additive = recorded[rev]
        if not additive:
            return SchemaState(False, f"the database is at migration {at}, ahead of this code's "
                                      f"{head}, and migration {rev} does more than add: run the "
                                      "ringwatch that migrated it, or with it `ringwatch db "
                                      f"downgrade --to {head}`")
        rev = revises
    return SchemaState(True, "")


def recorded_migrations(engine: Engine) -> dict[str, tuple[str | None, bool]]:
    """What upgrades recorded of the migrations they knew: revision -> (the one it revises,
    whether it only adds); empty where none was recorded (a database no ringwatch of this
    kind or newer migrated)."""
    with engine.connect() as conn:
        if conn.execute(text("SELECT to_regclass(:t)"), {"t": MIGRATIONS_TABLE}).scalar() is None:
            return {}
        rows = conn.execute(_migrations.select()).all()
    return {r.revision: (r.revises, r.additive) for r in rows}


def record_migrations(conn: Connection, scripts, at: str | None) -> None:
    """Record what each of ``scripts`` (an alembic ScriptDirectory) revises and whether it
    only adds (its module's ADDITIVE, False where unsaid), on ``conn`` inside the migrating
    transaction; a database downgraded to nothing (``at`` None) keeps no record."""
    if at is None:
        _migrations.drop(conn, checkfirst=True)
        return
    _migrations.create(conn, checkfirst=True)
    rows = [{"revision": s.revision,
             "revises": ",".join(s.down_revision) if isinstance(s.down_revision, tuple)
             else s.down_revision,
             "additive": getattr(s.module, "ADDITIVE", False) is True}
            for s in scripts.walk_revisions()]
    stmt = insert(_migrations).values(rows)
    conn.execute(stmt.on_conflict_do_update(
        index_elements=[_migrations.c.revision],
        set_={"revises": stmt.excluded.revises, "additive": stmt.excluded.additive,
              "recorded_at": func.now()}))


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


def make_engine(url: str, *, pool_size: int | None = None, max_overflow: int | None = None,
                statement_timeout_ms: int | None = None) -> Engine:
    """An engine on the pool and timeouts of the settings (RINGWATCH_DB_POOL_SIZE,
    _MAX_OVERFLOW, _POOL_TIMEOUT_S, _CONNECT_TIMEOUT_S, _STATEMENT_TIMEOUT_MS; sized in
    docs/operations.md, "Database connections"); the keywords for a process that needs
    otherwise (make_maintenance_engine)."""
    from ringwatch.services.settings import get_settings

    settings = get_settings()
    connect_args: dict[str, object] = {"connect_timeout": max(1, round(settings.db_connect_timeout_s))}
    timeout_ms = settings.db_statement_timeout_ms if statement_timeout_ms is None else statement_timeout_ms
    if timeout_ms:
        # Every statement of this engine's sessions, not the migrations' (their own engine).
        connect_args["options"] = f"-c statement_timeout={timeout_ms}"
    return create_engine(
        normalize_url(url), pool_pre_ping=True,
        pool_size=settings.db_pool_size if pool_size is None else pool_size,
        max_overflow=settings.db_max_overflow if max_overflow is None else max_overflow,
        pool_timeout=settings.db_pool_timeout_s, connect_args=connect_args)


def make_maintenance_engine(url: str) -> Engine:
    """The maintenance pass's engine: MAINTENANCE_CONNECTIONS at most (the pass's lock and one
    statement at a time beside it), and no statement timeout: its statements are bounded by
    their chunk (three hours of raw rows), and one cut short would be tried again, and cut
    again, every pass while the raw days it should retire pile up."""
    return make_engine(url, pool_size=MAINTENANCE_CONNECTIONS, max_overflow=0,
                       statement_timeout_ms=0)


def make_session_factory(engine: Engine) -> sessionmaker[Session]:
    return sessionmaker(engine, expire_on_commit=False)


@contextmanager
def transaction(factory: sessionmaker[Session]) -> Iterator[Session]:
    """One unit of work: commit on success, roll back on any error."""
    session = factory()
    try:
        yield session
        session.commit()
        OUTAGE.ok()
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
    return revision in _code_revisions()


def downgrade_floor() -> tuple[str, str]:
    """The release ``ringwatch db downgrade`` goes back to at most, and its migration: the
    one before this code (RELEASES)."""
    return RELEASES[-1]


def revisions_between(newer: str, older: str) -> list[str]:
    """This code's migrations a downgrade from ``newer`` to ``older`` undoes, newest first
    (empty where ``older`` is not below ``newer``)."""
    scripts = _scripts()
    undone: list[str] = []
    rev: str | None = newer
    while rev is not None and rev != older:
        undone.append(rev)
        down = scripts.get_revision(rev).down_revision
        rev = down if isinstance(down, str) or down is None else None  # a merge: not ours
    return undone if rev == older else []


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


def downgrade(url: str, revision: str, *, lock_wait_s: float = MIGRATION_LOCK_WAIT_S,
              say: Callable[[str], None] | None = None) -> None:
    """Undo migrations down to ``revision``, under the migration lock as ``upgrade`` is."""
    from alembic import command

    cfg = alembic_config(url)
    cfg.attributes["migration_lock_wait_s"] = lock_wait_s
    cfg.attributes["say"] = say
    command.downgrade(cfg, revision)


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
