"""The ``ringwatch`` subcommands. Each returns the process exit code.

Each imports what it needs inside itself, so starting the CLI stays light: no command
loads torch or Ray unless its backend does (gloo, nccl, --local, --address), nor httpx
unless it asks the API, nor pydantic for a sim check with no RINGWATCH_* variable set."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import sys
import threading
import time
from contextlib import closing
from typing import TYPE_CHECKING, Any

from ringwatch.agents.groups import node_order
from ringwatch.agents.places import node_list
from ringwatch.services import logs
from ringwatch.services.cli.backends import has_backend, make_backend, parse_injected
from ringwatch.services.cli.errors import CliError
from ringwatch.services.cli.output import print_json, print_tokens, print_verdict, say, visible
from ringwatch.services.cli.signals import stop_on_signals
from ringwatch.services.config import settings_in_environment

if TYPE_CHECKING:
    from collections.abc import Callable

    import httpx

    from ringwatch.services.analyzer.assess import Thresholds
    from ringwatch.services.check import CheckBudget
    from ringwatch.services.settings import Settings

# Progress lines that the next one replaces on a terminal: a check's rounds, a wait.
_TRANSIENT = re.compile(r"^(?:\S+ )?(?:\S+ )?(?:job )?round \d+|.*waiting for a scheduler")


class _Progress:
    """Progress on standard error. On a terminal the rounds of a check and the waits for a
    scheduler redraw one live line (elapsed time, the latest round) and the rest stay as
    lines; elsewhere (a log, a pipe) every message is its own line, as it was."""

    def __init__(self) -> None:
        self.started = time.monotonic()
        self.open = False
        # A long-running process (the scheduler) stamps each line with the UTC time, so
        # its log says when each cycle ran.
        self.stamp = False

    def __call__(self, message: str) -> None:
        stream = sys.stderr
        message = visible(message)  # it may quote an API's or a node's text
        if logs.is_json():  # a record with its own time, like every line of the process
            logs.say(message, logger="ringwatch.progress")
            return
        if stream.isatty() and _TRANSIENT.match(message):
            elapsed = time.monotonic() - self.started
            stream.write(f"\r\x1b[K  .. [{elapsed:6.1f} s] {message}")
            self.open = True
        else:
            self.end()
            when = time.strftime("%Y-%m-%dT%H:%M:%SZ ", time.gmtime()) if self.stamp else ""
            stream.write(f"  .. {when}{message}\n")
        stream.flush()

    def end(self) -> None:
        """Close the live line (before other output, and when the command ends)."""
        if self.open:
            sys.stderr.write("\n")
            self.open = False


progress = _Progress()


def _probe_options(args: argparse.Namespace):
    from ringwatch.agents.spec import OPS
    from ringwatch.services.check.shape import DEFAULT_OPS
    from ringwatch.services.scheduler.cycle import ProbeOptions

    ops = tuple(o.strip() for o in (args.ops or ",".join(DEFAULT_OPS)).split(",") if o.strip())
    if getattr(args, "profile", None):
        from ringwatch.agents.workloads import fabric_ops, workload

        ops = fabric_ops(workload(args.profile), ops)

    bad = [o for o in ops if o not in OPS]
    if bad:
        raise CliError(f"unknown op(s) {', '.join(bad)}; choose from {', '.join(OPS)}")
    if args.iters < 1 or args.warmup < 0:
        raise CliError("--iters must be >= 1 and --warmup >= 0")
    sizes = args.sizes or _preset_sizes(args)
    redop = getattr(args, "redop", "sum")
    _check_redop(args, ops, redop)
    return ProbeOptions(ops=ops, sizes=sizes, dtype=args.dtype, warmup=args.warmup, iters=args.iters,
                        redop=redop, profile=getattr(args, "profile", None), job=_job_layout(args))


def _fits(options: Any, backend: Any) -> None:
    """A profile's layout that cannot fit the backend's ranks is refused before a cycle."""
    if options.profile is None:
        return
    from ringwatch.agents.workloads import LayoutError
    from ringwatch.services.check.planner import layout_of
    from ringwatch.services.check.workload import resolve_job

    try:
        resolve_job(options.job, layout_of(backend.ranks(), None))
    except LayoutError as exc:
        raise CliError(str(exc)) from None


def _check_redop(args: argparse.Namespace, ops: tuple[str, ...], redop: str) -> None:
    """A reduction the backend or dtype cannot run (avg on gloo) is bad input, refused
    before any cluster starts."""
    from ringwatch.agents.collectives import check_redop
    from ringwatch.agents.spec import REDUCING_OPS, redop_for
    from ringwatch.services.cli.backends import default_backend

    if redop != "sum" and not any(op in REDUCING_OPS for op in ops):
        raise CliError(f"--redop {redop} needs a reducing op in --ops ({', '.join(REDUCING_OPS)})")
    backend = default_backend(args)
    for op in ops:
        try:
            check_redop(op, redop_for(op, redop), args.dtype, backend=backend)
        except ValueError as exc:
            raise CliError(f"--redop {redop}: {exc}") from None


def _preset_sizes(args: argparse.Namespace) -> tuple[int, ...] | None:
    """The sweep of --preset; None without one: the backend's probe sizes (one latency,
    one bandwidth-bound size), the same a preflight uses."""
    if not args.preset:
        return None
    from ringwatch.agents import collectives

    backend = args.backend or ("sim" if getattr(args, "fabric", None) else "gloo")
    return tuple(collectives.preset_sizes(args.preset, backend))


# -- database and tokens ----------------------------------------------------------------


def cmd_db(args: argparse.Namespace) -> int:
    from ringwatch.services.store import db

    settings = get_settings()
    if args.db_command == "stop":
        where = settings.state_dir / "pg"
        if db.stop_embedded(settings.state_dir):
            print(f"stopped the embedded Postgres (data kept in {where})")
        else:
            print(f"no embedded Postgres is running in {where}")
        return 0
    url = _database_url(settings)
    if args.db_command == "maintain":
        from ringwatch.services.store import timeseries

        engine = db.make_maintenance_engine(url)
        try:
            print_json(timeseries.maintain(engine, settings.retention()).to_dict())
        finally:
            engine.dispose()
        return 0
    if args.db_command == "wait":
        return _wait_for_schema(url, args.timeout)
    wait_s = next(w for w in (args.lock_timeout, settings.migration_lock_timeout_s,
                              db.MIGRATION_LOCK_WAIT_S) if w is not None)
    if not wait_s > 0:
        raise CliError("--lock-timeout must be more than 0 seconds")
    before = db.current_revision(url)
    if args.db_command == "downgrade":
        return _downgrade(url, before, args.to, wait_s)
    if before is not None and not db.known_revision(before):
        # A newer ringwatch migrated it (this image's Job run again after a rollback): left
        # as it is where this code may serve on it.
        _serve_ahead(url, before)
        return 0
    try:
        db.upgrade(url, lock_wait_s=wait_s, say=progress)
    except db.MigrationLockBusy as exc:
        raise CliError(str(exc)) from None
    after = db.current_revision(url)
    moved = f"from {before} to {after}" if before != after else f"already at {after}"
    print(f"database {db.describe_url(url)}: migrated {moved} (head)")
    return 0


def _downgrade(url: str, at: str | None, to: str, wait_s: float) -> int:
    """Undo migrations down to ``to`` (a migration, or a release's version for its
    migration), one release back at most (services.store.db.RELEASES)."""
    from ringwatch.services.store import db

    where, head = db.describe_url(url), db.head_revision()
    floor_release, floor = db.downgrade_floor()
    target = dict(db.RELEASES).get(to, to)
    if at is None:
        raise CliError(f"the database {where} does not answer, or holds no ringwatch schema: "
                       "nothing to downgrade")
    if not db.known_revision(at):
        raise CliError(f"the database {where} is at migration {at}, which this ringwatch does "
                       f"not have (its newest is {head}): downgrade with the ringwatch that "
                       "migrated it")
    if not db.known_revision(target):
        raise CliError(f"--to {to}: no such migration or release; this ringwatch goes "
                       f"back to {floor} (release {floor_release}) at most")
    if target == at:
        print(f"database {where}: already at {at}")
        return 0
    undone = db.revisions_between(at, target)
    if not undone:
        raise CliError(f"--to {to}: migration {target} is not below the database's {at} "
                       "(`ringwatch db upgrade` goes up)")
    if db.revisions_between(floor, target):
        raise CliError(f"--to {to}: a downgrade goes back one release at most, to {floor} "
                       f"(release {floor_release}); an older schema is that release's "
                       "ringwatch's to downgrade")
    try:
        db.downgrade(url, target, lock_wait_s=wait_s, say=progress)
    except db.MigrationLockBusy as exc:
        raise CliError(str(exc)) from None
    print(f"database {where}: downgraded from {at} to {target}, undoing {', '.join(undone)} "
          "(docs/operations.md, \"Upgrades and rollbacks\", says what each gives up)")
    return 0


def _serve_ahead(url: str, at: str) -> None:
    """Leave a database a newer ringwatch migrated as it is where this code may serve on it
    (every migration past this code's only adds); else one line, exit 2."""
    from ringwatch.services.store import db

    engine = db.make_engine(url, pool_size=1, max_overflow=0)
    try:
        state = db.schema_state(engine)
    finally:
        engine.dispose()
    if not state.ok:
        raise CliError(state.why)
    print(f"database {db.describe_url(url)}: at {at}, ahead of this ringwatch's "
          f"{db.head_revision()} by migrations that only add; left as it is")


def _wait_for_schema(url: str, timeout_s: float) -> int:
    """Until the database is at this code's migration head, which another step brings it to
    (on Kubernetes the migration Job, while the API's init container runs this), or ahead of
    it by migrations that only add; past ``timeout_s``, one line saying where it stands."""
    from sqlalchemy import create_engine
    from sqlalchemy.exc import SQLAlchemyError

    from ringwatch.services.store import db

    head, where = db.head_revision(), db.describe_url(url)
    engine = create_engine(db.normalize_url(url), connect_args={"connect_timeout": 10})
    deadline = time.monotonic() + timeout_s
    said = ""
    try:
        while True:
            try:
                at = db.revision_at(engine)
                state = f"at migration {at or '(none)'}, not {head}"
            except SQLAlchemyError as exc:
                cause = getattr(exc, "orig", None) or exc
                at, state = None, f"unreachable ({type(cause).__name__})"
            if at == head:
                print(f"database {where}: at {head} (head)")
                return 0
            if at is not None and not db.known_revision(at):
                # A newer ringwatch's (a rolling upgrade, or a rollback): whether this code
                # may serve on it does not change by waiting.
                ahead = db.schema_state(engine)
                if not ahead.ok:
                    raise CliError(ahead.why)
                print(f"database {where}: at {at}, ahead of this code's {head} by migrations "
                      "that only add")
                return 0
            if time.monotonic() >= deadline:
                raise CliError(f"the database {where} is still {state} after {timeout_s:g} s: "
                               "is `ringwatch db upgrade` (the migration Job) running?")
            if state != said:
                progress(f"database {where} is {state}: waiting for `ringwatch db upgrade`")
                said = state
            time.sleep(min(2.0, max(0.0, deadline - time.monotonic())))
    finally:
        engine.dispose()


def cmd_token(args: argparse.Namespace) -> int:
    """Tokens, straight in the database: whoever runs this can reach it (and can mend an
    install whose every admin token is lost); with ``--api``, through the API as an admin,
    from a client install that has no database driver."""
    if args.token_command == "create":
        if args.nodes is not None and args.role != "agent":
            raise CliError("--nodes scopes agent tokens only")
        if args.expires_in_days is not None and args.expires_in_days < 0:
            raise CliError("--expires-in-days must be 0 (never) or more")
    if args.api:
        return _token_via_api(args)
    from ringwatch.services.errors import RingwatchError
    from ringwatch.services.store import db, tokens

    settings = get_settings()
    factory = db.make_session_factory(db.make_engine(_database_url(settings)))
    with db.transaction(factory) as s:
        if args.token_command == "create":
            ttl = settings.token_ttl_days if args.expires_in_days is None else args.expires_in_days
            try:  # the scope's names as the API takes them (tokens.check_scope)
                row, token = tokens.issue(s, args.role, args.name, expires_at=tokens.expiry(ttl),
                                          nodes=args.nodes)
            except RingwatchError as exc:
                raise CliError(exc.message) from None
            _print_created(_token_info(row), token)
        elif args.token_command == "list":
            rows = tokens.list_tokens(s, limit=1_000_000, include_revoked=args.all)
            print_tokens([_token_info(r) for r in rows], args.json)
        else:
            revoked = tokens.revoke(s, args.id)
            if revoked is None:
                raise CliError(f"no token {args.id} (see ringwatch token list)")
            _print_revoked(_token_info(revoked))
    return 0


def _token_via_api(args: argparse.Namespace) -> int:
    """``token`` through the API's /v1/tokens with an admin token."""
    import httpx

    settings = get_settings()
    if not settings.token:
        raise CliError(f"RINGWATCH_TOKEN is not set: --api needs an admin token for "
                       f"{settings.api_url}")
    with httpx.Client(base_url=settings.api_url, timeout=30,
                      headers={"Authorization": f"Bearer {settings.token}"}) as client:
        if args.token_command == "create":
            body = {"role": args.role, "name": args.name,
                    "expires_in_days": args.expires_in_days, "nodes": args.nodes}
            info = _api_call(client, "POST", "/v1/tokens",
                             json={k: v for k, v in body.items() if v is not None},
                             expect=(201,))
            _print_created(_from_api(info), info["token"])
        elif args.token_command == "list":
            rows: list[dict[str, Any]] = []
            while True:  # every page (the API answers 1000 at most)
                page = _api_call(client, "GET", "/v1/tokens", params={
                    "after": rows[-1]["id"] if rows else 0, "limit": 1000,
                    "include_revoked": args.all})
                rows += page
                if len(page) < 1000:
                    break
            print_tokens([_from_api(r) for r in rows], args.json)
        else:
            listed = _api_call(client, "GET", "/v1/tokens", params={
                "after": args.id - 1, "limit": 1, "include_revoked": True})
            if not listed or listed[0]["id"] != args.id:
                raise CliError(f"no token {args.id} (see ringwatch token list)")
            _api_call(client, "DELETE", f"/v1/tokens/{args.id}", expect=(204,))
            _print_revoked(_from_api(listed[0]))
    return 0


def _from_api(info: dict[str, Any]) -> dict[str, Any]:
    """A token's row from the API, its times as datetimes (as the database gives them)."""
    from datetime import datetime

    times = ("created_at", "expires_at", "last_used_at", "revoked_at")
    return {k: datetime.fromisoformat(v) if k in times and v else v for k, v in info.items()}


def _print_created(info: dict[str, Any], token: str) -> None:
    until = info["expires_at"].isoformat(timespec="seconds") if info["expires_at"] else "never"
    say(f"created {info['role']} token {info['id']} (expires {until}): {token}")


def _print_revoked(info: dict[str, Any]) -> None:
    say(f"revoked token {info['id']} ({info['role']}"
        f"{', ' + info['name'] if info['name'] else ''})")


def _token_info(row) -> dict[str, Any]:
    return {"id": row.id, "role": row.role, "name": row.name, "created_at": row.created_at,
            "expires_at": row.expires_at, "last_used_at": row.last_used_at,
            "revoked_at": row.revoked_at, "nodes": row.nodes}


# -- long-running processes -------------------------------------------------------------


def _notifier(settings):
    from ringwatch.services.notifier.loop import Notifier
    from ringwatch.services.store import db

    factory = db.make_session_factory(db.make_engine(_database_url(settings)))
    return Notifier.from_settings(factory, settings)


def cmd_serve(args: argparse.Namespace) -> int:
    from ringwatch.api.app import create_app
    from ringwatch.services.store import db

    settings = _serving_settings(get_settings(), args.host, args.port)
    settings.check_secrets()
    # Resolved once: with no RINGWATCH_DATABASE_URL this starts (or finds) the embedded server.
    url = _database_url(settings)
    _schema_ready(settings, url)
    app = create_app(settings, db.make_session_factory(db.make_engine(url)))
    stop = threading.Event()
    delivering = None
    if not args.no_notifier:
        notifier = _notifier(settings)
        delivering = threading.Thread(target=notifier.run_forever, daemon=True, name="notifier",
                                      args=(settings.notifier_poll_s, stop))
        delivering.start()
    if settings.maintenance_interval_s > 0:
        threading.Thread(target=_maintain_forever, args=(settings, stop), daemon=True,
                         name="maintenance").start()

    def stopping() -> None:
        # On SIGTERM, before the requests in flight are drained: the waiting preflights are
        # answered as they stand and the notifier finishes its deliveries alongside.
        app.state.preflight_waiters.stop_waiting()
        stop.set()
        if delivering is not None:
            notifier.wake()

    try:
        _listen(app, args, _serve_banner(settings, args, db.describe_url(url)),
                grace_s=settings.shutdown_timeout_s, on_stop=stopping)
    finally:
        stop.set()
        if delivering is not None:  # its own bound: shutdown_timeout_s, then cut and released
            delivering.join(settings.shutdown_timeout_s + 1)
    return 0


def _serving_settings(settings: Settings, host: str, port: int) -> Settings:
    """What ``serve`` runs on: a server of this machine alone (the demo's, the embedded
    database's) with its own secret key and loopback receivers allowed
    (``Settings.with_local_defaults``); and without RINGWATCH_API_URL, the links in its
    webhooks and verdicts pointing where it listens."""
    settings = settings.with_local_defaults()
    if "api_url" in settings.model_fields_set:
        return settings
    return settings.model_copy(update={"api_url": _listening_url(host, port)})


def _listening_url(host: str, port: int) -> str:
    """The URL of ``host:port`` as a client reaches it: a server on every interface by this
    machine's name."""
    import socket

    if host in ("", "0.0.0.0", "::"):
        host = socket.getfqdn()
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _serve_banner(settings: Settings, args: argparse.Namespace, database: str) -> str:
    """The one line ``serve`` says once it listens: where, on which database, where its
    links point, whether it delivers webhooks and, on a server of this machine alone, to
    which receivers and under which key."""
    where = _listening_url(args.host, args.port)
    links = "" if settings.api_url == where else f"; links point at {settings.api_url}"
    notifier = "off (--no-notifier)" if args.no_notifier else "running"
    line = (f"ringwatch serve: API at {where} (OpenAPI at /docs{links}), database {database}, "
            f"webhook notifier {notifier}")
    if settings.local:
        from ringwatch.services.settings import LOCAL_KEY_FILE

        key = settings.state_dir / LOCAL_KEY_FILE
        own = key.exists() and key.read_text().strip() == settings.secret_key.get_secret_value()
        line += (f"; webhooks may reach {', '.join(settings.webhook_allowed_networks)}"
                 + (f", their secrets sealed with the key in {key}" if own else ""))
    return line


def _listen(app: Any, args: argparse.Namespace, banner: str, *, grace_s: float,
            on_stop: Callable[[], None] | None = None) -> None:
    """Run uvicorn; ``banner`` goes to standard error, whole, once the port is bound, after
    (with -v) uvicorn's own start-up lines and never before a bind that fails.

    SIGTERM (or SIGINT) stops taking connections, calls ``on_stop``, gives the requests in
    flight ``grace_s`` and cancels the rest; then this returns (uvicorn would otherwise
    raise the signal again once done, ending the process before the caller's own clean-up)."""
    import math
    import signal

    import uvicorn

    class Server(uvicorn.Server):
        async def startup(self, sockets: Any = None) -> None:
            await super().startup(sockets)
            if self.started:
                logs.say(banner, logger="ringwatch.serve")

        def handle_exit(self, sig: int, frame: Any) -> None:
            if self.should_exit and sig == signal.SIGINT:
                self.force_exit = True
            self.should_exit = True

        async def shutdown(self, sockets: Any = None) -> None:
            for listening in self.servers:  # no new connection meets the answers below
                listening.close()
            if on_stop is not None:
                on_stop()
            await super().shutdown(sockets)

    # uvicorn logs through ringwatch's handler at its level (services/logs.py); its access
    # log is off: api/request_id.py writes ringwatch.access, with the request id, instead.
    server = Server(uvicorn.Config(app, host=args.host, port=args.port, log_config=None,
                                   log_level=None, access_log=False,
                                   timeout_graceful_shutdown=math.ceil(grace_s)))
    with contextlib.suppress(KeyboardInterrupt, SystemExit):  # uvicorn exits where it cannot start
        server.run()
    if not server.started:
        raise CliError(f"nothing is served at {args.host}:{args.port}: the server did not "
                       "start (its reason is on the line above)")


def _schema_ready(settings: Settings, url: str) -> None:
    """Bring the embedded database that ``serve`` started to this code's schema; refuse an
    external one that is not there, in one line (its migrations are its operator's to run,
    in their own step: ``ringwatch db upgrade``)."""
    from ringwatch.services.store import db

    at, head = db.current_revision(url), db.head_revision()
    if at == head:
        return
    if not settings.database_url and (at is None or db.known_revision(at)):
        db.upgrade(url)  # the embedded server: ours to migrate
        return
    engine = db.make_engine(url, pool_size=1, max_overflow=0)
    try:
        ok, why = db.schema_state(engine)  # ahead by migrations that only add: served on
    finally:
        engine.dispose()
    if not ok:
        raise CliError(f"{why} first" if why.endswith("`ringwatch db upgrade`") else why)


def _maintain_forever(settings, stop: threading.Event) -> None:
    """Partitions ahead, rollups and retention, every ``maintenance_interval_s``; one
    replica at a time does the work (an advisory lock), the others skip."""
    import logging

    from ringwatch.services.store import db, timeseries

    log = logging.getLogger("ringwatch.maintenance")
    engine = db.make_maintenance_engine(_database_url(settings))
    while not stop.is_set():
        try:
            report = timeseries.maintain(engine, settings.retention())
            db.OUTAGE.ok()
            if report.dropped or report.created:
                log.info("maintenance: %s", report.to_dict())
        except db.UNAVAILABLE as exc:  # said with the API's own outage lines, not each pass
            db.OUTAGE.failed(exc)
        except Exception:  # the API keeps serving; the next pass tries again
            log.exception("maintenance pass failed")
        stop.wait(settings.maintenance_interval_s)
    engine.dispose()


def cmd_notifier(args: argparse.Namespace) -> int:
    from ringwatch.services.store import db

    # On the embedded database, the key and the receivers of the `serve` beside it.
    settings = get_settings().with_local_defaults()
    notifier = _notifier(settings)
    health, line = None, ""
    if args.health_port is not None:
        from ringwatch.services.notifier.health import PATHS, NotifierHealth

        check = NotifierHealth(notifier, notifier.factory.kw["bind"], settings.notifier_poll_s)
        try:
            health = check.serve(args.health_host, args.health_port)
        except OSError as exc:
            raise CliError(f"cannot answer health checks on {args.health_host}:"
                           f"{args.health_port}: {exc.strerror or exc}") from None
        line = (f"; health at http://{args.health_host}:{health.server_address[1]} "
                f"({', '.join(PATHS)})")
    logs.say(f"ringwatch notifier: delivering webhooks from the outbox of "
             f"{db.describe_url(_database_url(settings))}, polling every "
             f"{settings.notifier_poll_s:g} s{line}", logger="ringwatch.notifier")
    stop = threading.Event()
    # SIGTERM: the deliveries in flight are finished (or, past RINGWATCH_SHUTDOWN_TIMEOUT_S,
    # released to the next notifier) and the process exits 0: a rollout sends nothing twice.
    stop_on_signals(stop, "notifier", then=notifier.wake)
    try:
        notifier.run_forever(settings.notifier_poll_s, stop)
    finally:
        if health is not None:
            health.shutdown()
    return 0


def cmd_scheduler(args: argparse.Namespace) -> int:
    import socket
    from dataclasses import replace

    from ringwatch.services.check import CheckBudget
    from ringwatch.services.scheduler.api_client import SchedulerApi
    from ringwatch.services.scheduler.cycle import Sharing, run_scheduler
    from ringwatch.services.scheduler.occupancy import source_for
    from ringwatch.services.scheduler.shipper import Shipper

    settings = get_settings()
    settings.check_secrets()
    options = replace(_probe_options(args), nvlink_partitioned=settings.nvlink_partitioned)
    if not settings.token:
        raise CliError("set RINGWATCH_TOKEN to an agent token (ringwatch token create --role agent)")
    progress.stamp = True
    shipper = Shipper(settings.api_url, settings.token, settings.spool_dir,
                      max_bytes=settings.spool_max_bytes)
    holder = f"{socket.gethostname()}:{os.getpid()}"
    api = SchedulerApi(settings.api_url, settings.token, worker=holder)
    stop = threading.Event()
    interval_s = args.interval or settings.probe_interval_s
    watch, served = _scheduler_watch(args, settings.fleet, holder, interval_s)
    with closing(make_backend(args, progress)) as backend, closing(shipper), closing(api):
        _fits(options, backend)
        # Set after the backend: Ray installs its own SIGTERM handler (a crash report) when
        # it connects. A stop request ends the loop at its next wait and shuts down cleanly.
        stop_on_signals(stop, "scheduler")
        try:
            source = source_for(settings.occupancy, backend,
                                kubernetes_api_url=settings.kubernetes_api_url,
                                timeout_s=settings.occupancy_timeout_s)
        except ValueError as exc:
            raise CliError(f"RINGWATCH_OCCUPANCY: {exc}") from None
        progress(f"occupancy from {source.name}"
                 + ("; busy nodes are probed anyway (RINGWATCH_PROBE_BUSY_NODES), their "
                    "measurements contended" if settings.probe_busy_nodes else
                    "; scheduled probes touch idle nodes only"))
        try:
            ran = run_scheduler(backend, shipper, options, interval_s=interval_s,
                                once=args.once, api=api, progress=progress, stop=stop,
                                max_duty=settings.max_duty_cycle,
                                thresholds=settings.thresholds(backend.name),
                                budget=CheckBudget.from_settings(settings),
                                sharing=Sharing(source, settings.occupancy_timeout_s,
                                                settings.probe_busy_nodes),
                                fleet=settings.fleet, lease_s=settings.scheduler_lease_s,
                                watch=watch)
        finally:
            if served is not None:
                served.shutdown()
    if args.once and ran == 0 and not stop.is_set():
        raise CliError(f"fleet {settings.fleet} is led by another scheduler: --once ran no "
                       "cycle (RINGWATCH_FLEET names the fleet)")
    if stop.is_set():
        logs.say("ringwatch scheduler: stopped", logger="ringwatch.scheduler")
    return 0


def _scheduler_watch(args: argparse.Namespace, fleet: str, holder: str,
                     interval_s: float) -> tuple[Any, Any]:
    """The scheduler's /healthz and /metrics where --health-port asks for them."""
    if args.health_port is None:
        return None, None
    from ringwatch.services.scheduler.watch import SchedulerWatch

    watch = SchedulerWatch(fleet, holder, interval_s)
    try:
        served = watch.serve(args.health_host, args.health_port)
    except OSError as exc:
        raise CliError(f"cannot serve health and metrics on {args.health_host}:"
                       f"{args.health_port}: {exc.strerror or exc}") from None
    progress(f"health and metrics at http://{args.health_host}:{served.server_address[1]}"
             " (/healthz, /metrics)")
    return watch, served


# -- one-shot probes and checks ---------------------------------------------------------


def cmd_probe(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from ringwatch.services.scheduler.cycle import run_cycle
    from ringwatch.services.scheduler.probe_table import format_table

    settings = _check_settings()
    options = replace(_probe_options(args), nvlink_partitioned=_partitioned(settings))
    with closing(make_backend(args, progress)) as backend:
        _fits(options, backend)
        thresholds, budget = _check_config(settings, backend.name)
        cycle = run_cycle(backend, options, progress=progress, thresholds=thresholds,
                          budget=budget)
    progress.end()
    if args.json:
        print_json({"backend": cycle.backend,
                     "measurements": [m.to_dict() for m in cycle.measurements],
                     "findings": [f.to_dict() for f in cycle.findings],
                     "injected": cycle.injected,
                     **({"workload": cycle.workload} if cycle.workload else {})})
    else:
        for line in format_table(cycle.measurements).splitlines():
            say(line)
        for f in cycle.findings:
            print(f"FINDING {json.dumps(f.to_dict())}")
        for f in (cycle.workload or {}).get("findings", []):
            print(f"WORKLOAD {json.dumps(f)}")
    return 1 if cycle.findings else 0


def cmd_selftest(args: argparse.Namespace) -> int:
    import subprocess

    from ringwatch.agents.collectives import check_redop, preset_sizes
    from ringwatch.agents.spec import OPS, redop_for
    from ringwatch.services.selftest import nccl_tests, report
    from ringwatch.services.selftest.runner import (
        SelftestOptions,
        gpu_count,
        node_name,
        run_selftest,
    )

    ops = tuple(o.strip() for o in args.ops.split(",") if o.strip())
    bad = [o for o in ops if o not in OPS]
    if bad or not ops:
        raise CliError(f"unknown op(s) {', '.join(bad) or '(none)'}; choose from {', '.join(OPS)}")
    if args.iters < 1 or args.warmup < 0 or (args.repeats is not None and args.repeats < 1):
        raise CliError("--iters and --repeats must be >= 1 and --warmup >= 0")
    for op in ops:
        try:
            check_redop(op, redop_for(op, args.redop), args.dtype, backend=args.backend)
        except ValueError as exc:
            raise CliError(f"--redop {args.redop}: {exc}") from None
    # Refuses with one line (exit 2) where this machine has no GPU for nccl.
    gpus = gpu_count(args.backend)
    present = gpus if args.backend == "nccl" else 2
    sizes = args.sizes or preset_sizes(args.preset or "quick", args.backend)
    world_sizes = args.world_sizes or tuple(range(1, present + 1))
    if args.backend == "nccl" and max(world_sizes) > gpus:
        raise CliError(f"--world-sizes {max(world_sizes)} needs {max(world_sizes)} GPUs; this "
                       f"machine has {gpus} (NCCL runs one rank per GPU)")
    binaries: dict = {}
    note = None
    if args.nccl_tests and not os.path.isdir(args.nccl_tests):
        raise CliError(f"--nccl-tests {args.nccl_tests}: not a directory")
    if args.backend == "nccl":
        from pathlib import Path

        binaries = nccl_tests.find_binaries(Path(args.nccl_tests) if args.nccl_tests else None)
        if not binaries:
            note = (f"no *_perf binaries in {args.nccl_tests}" if args.nccl_tests else
                    "no *_perf binaries on PATH (give --nccl-tests DIR for a side-by-side)")
    faults = parse_injected([_with_node(text, node_name()) for text in args.inject])
    beyond = [f for f in faults if f.gpu >= max(world_sizes) or f.node != node_name()]
    if beyond:
        raise CliError(f"--inject names {beyond[0].member}, not a rank of this selftest "
                       f"({node_name()}/0..{max(world_sizes) - 1})")
    options = SelftestOptions(backend=args.backend, world_sizes=world_sizes, ops=ops,
                              sizes=tuple(sizes), dtype=args.dtype, redop=args.redop,
                              warmup=args.warmup, iters=args.iters, repeats=args.repeats or 1,
                              cuda_graph=args.cuda_graph, deadline_s=args.deadline,
                              faults=tuple(faults))
    result = run_selftest(options, progress)
    comparison = None
    if binaries:
        try:
            comparison = report.compare(options, result, binaries, progress)
        except (OSError, RuntimeError, subprocess.TimeoutExpired) as exc:
            note = f"could not run: {exc}"
    if args.json:
        print_json(report.as_json(result, comparison, note))
    else:
        print(report.format_text(result, comparison, note))
    return 0 if report.passed(result) else 1


def _with_node(text: str, node: str) -> str:
    """An --inject JSON object with "node" filled in where it was left out."""
    try:
        d = json.loads(text)
    except json.JSONDecodeError:
        return text  # parse_injected says what is wrong with it
    return json.dumps({"node": node, **d}) if isinstance(d, dict) else text


def cmd_preflight(args: argparse.Namespace) -> int:
    from ringwatch.services.cli.hostlist import expand_hostlist

    try:
        nodes = expand_hostlist(args.nodes) if args.nodes else None
    except ValueError as exc:
        raise CliError(f"--nodes: {exc}") from None
    if args.nodes is not None and not nodes:
        raise CliError("--nodes is empty")
    if has_backend(args):
        from ringwatch.agents.workloads import LayoutError
        from ringwatch.services.check import ProbeSpec, run_check

        settings = _check_settings()
        job = _job_layout(args)
        with closing(make_backend(args, progress)) as backend:
            known = {r.node for r in backend.ranks()}
            unknown = sorted(set(nodes or []) - known, key=node_order)
            if unknown:
                raise CliError(f"unknown node(s): {node_list(unknown)}")
            thresholds, budget = _check_config(settings, backend.name)
            try:
                verdict = run_check(backend, nodes, thresholds=thresholds, budget=budget,
                                    spec=ProbeSpec(nvlink_partitioned=_partitioned(settings)),
                                    profile=args.profile, job=job, progress=progress,
                                    label="preflight round").verdict()
            except LayoutError as exc:
                raise CliError(str(exc)) from None
        # The whole command, the cluster's start and teardown included; the verdict's own
        # wall_s is the check's rounds, what RINGWATCH_CHECK_MAX_WALL_S bounds.
        verdict["command_s"] = round(time.monotonic() - args.started, 3)
    else:
        if not nodes:
            raise CliError("name the job's nodes with --nodes, or probe with --local/--address/--fabric")
        job = _job_layout(args)
        workload = ({"profile": args.profile,
                     **{k: v for k, v in (job.to_dict() if job else {}).items() if v is not None}}
                    if args.profile else {})
        verdict = _api_preflight(nodes, args.max_age, args.timeout, args.confirm, workload)
    progress.end()
    print_verdict(verdict, args.json)
    return 0 if verdict["healthy"] else 1


def get_settings() -> Settings:
    """This process's settings: pydantic loads here, on first use, not with the CLI (a
    check on defaults and ``--help`` never need it)."""
    from ringwatch.services.settings import get_settings as read_once

    return read_once()


def _database_url(settings: Settings) -> str:
    from ringwatch.services.store import db

    return db.resolve_database_url(settings.database_url, settings.state_dir)


def _check_settings() -> Settings | None:
    """Settings for a check run in this process; None where no RINGWATCH_* variable is set,
    so that a check on the defaults does not load pydantic."""
    return get_settings() if settings_in_environment() else None


def _partitioned(settings: Settings | None) -> bool:
    """RINGWATCH_NVLINK_PARTITIONED for a check run in this process: its fabric facts are
    judged as the scheduler's are."""
    return settings is not None and settings.nvlink_partitioned


def _check_config(settings: Settings | None, backend: str) -> tuple[Thresholds, CheckBudget]:
    """The thresholds and budget of a check on ``backend``."""
    from ringwatch.services.analyzer.assess import thresholds_for
    from ringwatch.services.check import CheckBudget

    if settings is None:
        return thresholds_for(backend), CheckBudget()
    return settings.thresholds(backend), CheckBudget.from_settings(settings)


def _job_layout(args: argparse.Namespace):
    """The job's tp/pp/dp from the command line (None: the profile's default layout)."""
    from ringwatch.agents.workloads import JobLayout

    given = {k: getattr(args, k) for k in ("tp", "pp", "dp") if getattr(args, k) is not None}
    if not given:
        return None
    if not args.profile:
        raise CliError("--tp, --pp and --dp describe the job a --profile probes; add --profile")
    bad = [f"--{k} {v}" for k, v in given.items() if v < 1]
    if bad:
        raise CliError(f"{', '.join(bad)}: parallel degrees are >= 1")
    return JobLayout.from_dict(given)


def _require_reader_token(settings: Any) -> None:
    """Commands that ask the API say so when there is no token to ask with (an empty one
    would reach the HTTP library as a malformed header)."""
    if not settings.token:
        raise CliError(f"RINGWATCH_TOKEN is not set: set it to a reader token for the API at "
                       f"{settings.api_url} (ringwatch token create --role reader)")


def _api_preflight(nodes: list[str], max_age: float, timeout_s: float,
                   confirm: bool = False, workload: dict[str, Any] | None = None) -> dict[str, Any]:
    """Ask the API; while a scheduler probes, poll with progress until the verdict is in.
    ``workload``: the profile and the job's tp/pp/dp (a scheduler then always probes)."""
    import httpx

    settings = get_settings()
    _require_reader_token(settings)
    headers = {"Authorization": f"Bearer {settings.token}"}
    deadline = time.monotonic() + timeout_s
    with httpx.Client(base_url=settings.api_url, headers=headers, timeout=60) as client:
        body = _api_call(client, "POST", "/v1/preflight?wait=5",
                         json={"nodes": nodes, "max_age_s": max_age, "confirm": confirm,
                               **(workload or {})})
        while body.get("status") in ("pending", "running"):
            if time.monotonic() > deadline:
                raise CliError(f"no verdict within {timeout_s:.0f} s (request {body['id']} is "
                               f"{body['status']}; is a scheduler running?)")
            progress(f"preflight {body['id'][:8]} {body['status']}: waiting for a scheduler to probe")
            time.sleep(2)
            body = _api_call(client, "GET", f"/v1/preflight/{body['id']}")
    if body.get("status") == "failed":
        raise CliError(f"preflight failed: {body.get('error')}")
    return body


def _api_call(client: httpx.Client, method: str, path: str,
              expect: tuple[int, ...] = (200, 202), **kw: Any) -> Any:
    import httpx

    try:
        resp = client.request(method, path, **kw)
    except httpx.HTTPError as exc:
        raise CliError(f"API at {client.base_url} unreachable: {exc}") from exc
    if resp.status_code not in expect:
        raise CliError(f"API answered {resp.status_code}: {_api_message(resp)}")
    return resp.json() if resp.content else None


def _api_message(resp: httpx.Response) -> str:
    """The API's one-line reason for an error answer."""
    try:
        return str(resp.json().get("message", resp.text))
    except ValueError:
        return resp.text


def cmd_status(args: argparse.Namespace) -> int:
    import httpx

    from ringwatch.services.cli import status

    settings = get_settings()
    _require_reader_token(settings)
    with httpx.Client(base_url=settings.api_url, timeout=30,
                      headers={"Authorization": f"Bearer {settings.token}"}) as client:
        fleet = status.fetch(client)
    if args.json:
        print_json(fleet.to_dict())
    elif sys.stdout.isatty():
        status.render_rich(fleet)
    else:
        print(status.plain(fleet))
    return 0 if fleet.health["status"] != "degraded" else 1


def cmd_completion(args: argparse.Namespace) -> int:
    from ringwatch.services.cli import completion

    # The parser is handed down by the command line (main imports this module, not the
    # other way round).
    print(getattr(completion, args.shell)(args.build_parser()), end="")
    return 0


def cmd_check_rankmap(args: argparse.Namespace) -> int:
    from ringwatch.services.rankmap import checks

    entries = _read_rank_table(args.file)
    result = _api_rankmap_check(entries)
    if result is None:  # no API: what the table shows by itself, said so on stderr
        result = checks.check_offline(entries)
    _print_rankmap(result, args.json)
    if not result["ok"]:
        return 1
    # Sound as far as it was checked: a launcher tells "sound" from "not asked about the
    # fleet" by the exit code (docs/rankmaps.md).
    return RANKMAP_HOSTS_SKIPPED if result.get("skipped") else 0


# check-rankmap's answer when the table is sound as far as it could be checked, but no API
# was asked about its hosts: neither OK (exit 0) nor problems (exit 1) nor an error (exit 2).
HOSTS_SKIPPED = "host checks skipped: no API"
RANKMAP_HOSTS_SKIPPED = 3


def _read_rank_table(path: str) -> list:
    from ringwatch.services.errors import BadInput
    from ringwatch.services.rankmap import checks

    try:
        if path == "-":
            text = sys.stdin.read()
        else:
            with open(path, encoding="utf-8") as f:
                text = f.read()
    except OSError as exc:
        raise CliError(f"cannot read {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise CliError(f"{path} is not a text file") from None
    try:
        return checks.parse_rank_table(text)
    except BadInput as exc:
        raise CliError(f"{path}: {exc.message}") from None


def _api_rankmap_check(entries: list) -> dict[str, Any] | None:
    """The full check from the API at RINGWATCH_API_URL; None when no API answers there."""
    import httpx

    from ringwatch.services.rankmap import checks

    settings = get_settings()
    if not settings.token:
        print(f"ringwatch check-rankmap: RINGWATCH_TOKEN is not set, so the API at "
              f"{settings.api_url} was not asked; skipped the host checks: "
              f"{', '.join(checks.fleet_checks(entries))}", file=sys.stderr)
        return None
    headers = {"Authorization": f"Bearer {settings.token}"}
    # A short connect timeout: a launcher without an API gets its offline answer at once.
    with httpx.Client(base_url=settings.api_url, headers=headers,
                      timeout=httpx.Timeout(60, connect=3)) as client:
        try:
            resp = client.post("/v1/rank-maps/check",
                               json={"ranks": [e.to_dict() for e in entries]})
        except httpx.TransportError as exc:
            print(f"ringwatch check-rankmap: no API answers at {settings.api_url} "
                  f"({type(exc).__name__}); skipped the host checks: "
                  f"{', '.join(checks.fleet_checks(entries))}", file=sys.stderr)
            return None
    if resp.status_code != 200:
        message = _api_message(resp)
        hint = " (set RINGWATCH_TOKEN to a reader token)" if resp.status_code == 401 else ""
        raise CliError(f"API answered {resp.status_code}: {message}{hint}")
    return resp.json()


def _print_rankmap(result: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print_json(result)
        return
    skipped = result.get("skipped")
    state = "PROBLEMS" if not result["ok"] else HOSTS_SKIPPED if skipped else "OK"
    say(f"{state}: {result['ranks']} rank(s) on {result['hosts']} host(s), "
        f"{len(result['findings'])} finding(s)")
    for f in result["findings"]:  # host names come from the launcher's file and the API
        say(f"  {f['problem']:<20} {_describe_rank_finding(f)} [{f.get('severity', '')}]")
    if skipped:
        say(f"{HOSTS_SKIPPED}, not run: {', '.join(skipped)}")


def _few(values: list) -> str:
    shown = ", ".join(str(v) for v in values[:8])
    return shown + (f", ... ({len(values)} in all)" if len(values) > 8 else "")


def _describe_rank_finding(f: dict[str, Any]) -> str:
    problem = f["problem"]
    if problem == "duplicate_rank":
        return f"rank {f['rank']} on " + _few([f"{e['host']}/{e['local_rank']}" for e in f["entries"]])
    if problem == "missing_rank":
        return f"{f['missing_count']} of 0..{f['world_size'] - 1} missing: {_few(f['missing'])}"
    if problem == "duplicate_gpu":
        gpu = f"GPU {f['gpu_uuid']}" if "gpu_uuid" in f else f"{f['node']}/{f['local_rank']}"
        return f"{gpu} holds ranks {_few(f['ranks'])}"
    if problem == "local_rank_mismatch" and "gpu_uuid" in f:
        return (f"rank {f['rank']} puts {f['gpu_uuid']} at {f['node']}/{f['local_rank']}; "
                f"the fleet has it at local index {f['fleet_local_index']}")
    if problem == "local_rank_mismatch":
        return f"{f['node']} has local ranks {_few(f['local_ranks'])}, lacks {_few(f['missing_local_ranks'])}"
    if problem == "non_contiguous":
        return (f"the ring crosses hosts {f['crossings']} times, {f['minimum_crossings']} at "
                f"least; --json gives the suggested order")
    if problem == "unknown_host":
        return f"{f['node']} is not in the fleet (ranks {_few(f['ranks'])})"
    if problem == "unhealthy_host":
        because = f.get("because", {})
        return f"{f['node']}: {because.get('kind', '?')} on {_few(because.get('nodes', []))}"
    return json.dumps(f)


def cmd_demo(args: argparse.Namespace) -> int:
    from ringwatch.services.cli.demo import run_demo

    return run_demo(args)


def cmd_node(args: argparse.Namespace) -> int:
    from ringwatch.services.cli.nodes import cmd_node as run_node

    return run_node(args)


def cmd_slurm(args: argparse.Namespace) -> int:
    from ringwatch.services.cli.slurm import cmd_slurm as run_slurm

    return run_slurm(args)


def cmd_kubernetes(args: argparse.Namespace) -> int:
    from ringwatch.services.cli.kubernetes import cmd_kubernetes as run_kubernetes

    return run_kubernetes(args)
