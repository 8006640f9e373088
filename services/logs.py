"""How every ringwatch process logs (docs/operations.md, "Logs"): plain text by default, one
JSON object a line for a log collector (``RINGWATCH_LOG_FORMAT=json``), at
``RINGWATCH_LOG_LEVEL``; the lines of an API request carry its request id and route; and a
dependency's outage is said when it starts, once a minute while it lasts and when it ends.

Both variables are read from the environment here, not through ``services.settings``:
logging is set up before a command runs, and a command on defaults never loads pydantic
(services/config.py). ``Settings`` declares them too, so the settings table lists them."""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Mapping
from contextvars import ContextVar
from typing import Any

from ringwatch.services.config import ENV_PREFIX

FORMATS = ("text", "json")
LEVELS = ("debug", "info", "warning", "error", "critical")
FORMAT_VARIABLE = ENV_PREFIX + "LOG_FORMAT"
LEVEL_VARIABLE = ENV_PREFIX + "LOG_LEVEL"

# Kept at warning unless debug asks for all: httpx says every request it sends at info,
# alembic every plugin it loads.
CHATTY = ("httpx", "httpcore", "alembic.runtime.plugins")
# uvicorn's own loggers log through ours (its access log is off: api/request_id.py writes
# ringwatch.access instead). Its start-up lines carry a coloured copy of the message.
UVICORN = ("uvicorn", "uvicorn.error", "uvicorn.access", "uvicorn.asgi")
NOT_FIELDS = ("color_message", "taskName")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s%(context)s: %(message)s"

# Set by the API's request middleware (api/request_id.py) for the request being served. Each
# request runs in its own task, so its values never reach another request's lines.
request_id: ContextVar[str | None] = ContextVar("ringwatch_request_id", default=None)
route: ContextVar[str | None] = ContextVar("ringwatch_route", default=None)

# The format this process logs in (``configure``); lines that are not records (a banner,
# progress) follow it through ``say``.
_state = {"format": "text"}


class LogSettingError(ValueError):
    """A RINGWATCH_LOG_* value outside its vocabulary."""


def _variable(environ: Mapping[str, str], name: str) -> str:
    # Settings matches RINGWATCH_* in any case; so does this.
    return next((v for k, v in environ.items() if k.upper() == name), "").strip().lower()


def chosen(environ: Mapping[str, str] = os.environ, *, verbose: bool = False) -> tuple[str, int]:
    """The format and level the environment asks for: text unless json is named; the level
    named, else info for json (a collector wants the access log) or with -v, else warning."""
    fmt = _variable(environ, FORMAT_VARIABLE) or "text"
    if fmt not in FORMATS:
        raise LogSettingError(f"{FORMAT_VARIABLE} is {fmt!r}: use one of {', '.join(FORMATS)}")
    level = _variable(environ, LEVEL_VARIABLE)
    if level and level not in LEVELS:
        raise LogSettingError(f"{LEVEL_VARIABLE} is {level!r}: use one of {', '.join(LEVELS)}")
    if not level:
        level = "info" if verbose or fmt == "json" else "warning"
    return fmt, logging.getLevelName(level.upper())


class _RequestContext(logging.Filter):
    """Puts the request id and route of the request being served on its records: as
    fields for JSON (only where there is a request), as ``[id route]`` for text."""

    def __init__(self, as_fields: bool) -> None:
        super().__init__()
        self.as_fields = as_fields

    def filter(self, record: logging.LogRecord) -> bool:
        rid, where = request_id.get(), route.get()
        if self.as_fields:
            if rid is not None:
                record.request_id = rid
            if where is not None:
                record.route = where
        else:
            parts = [p for p in (rid, where) if p]
            record.context = f" [{' '.join(parts)}]" if parts else ""
        return True


def _json_formatter() -> logging.Formatter:
    # Imported here: only a process that logs JSON needs the library.
    from pythonjsonlogger.core import RESERVED_ATTRS
    from pythonjsonlogger.json import JsonFormatter

    # time (UTC, ISO 8601), level, logger, message, then the record's own fields (the
    # request's id and route, an access line's status and duration); a traceback is one
    # field (exc_info) of the same line.
    return JsonFormatter(["levelname", "name", "message"], timestamp="time",
                         rename_fields={"levelname": "level", "name": "logger"},
                         reserved_attrs=[*RESERVED_ATTRS, *NOT_FIELDS])


def configure(*, verbose: bool = False, environ: Mapping[str, str] = os.environ,
              stream: Any = None) -> str:
    """Log to standard error in the format and at the level the environment asks for
    (``chosen``); return the format. Called once by every entry point before it runs.

    Where something else configured the root logger first (a host that embeds ringwatch, a
    test runner), it keeps its handlers, as with ``logging.basicConfig``."""
    fmt, level = chosen(environ, verbose=verbose)
    _state["format"] = fmt
    root = logging.getLogger()
    ours = [h for h in root.handlers if getattr(h, "ringwatch", False)]
    if len(ours) != len(root.handlers):
        return fmt
    for old in ours:
        root.removeHandler(old)
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.ringwatch = True  # type: ignore[attr-defined]
    handler.addFilter(_RequestContext(as_fields=fmt == "json"))
    handler.setFormatter(_json_formatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    root.addHandler(handler)
    root.setLevel(level)
    for name in UVICORN:
        uvicorn_log = logging.getLogger(name)
        uvicorn_log.handlers.clear()
        uvicorn_log.propagate = True
        uvicorn_log.setLevel(logging.NOTSET)
    for name in CHATTY:
        logging.getLogger(name).setLevel(level if level <= logging.DEBUG
                                         else max(level, logging.WARNING))
    return fmt


def is_json() -> bool:
    return _state["format"] == "json"


def say(line: str, *, level: int = logging.INFO, logger: str = "ringwatch") -> None:
    """A line a command says on standard error that is not a log record (the server's
    banner, a check's progress, the one-line error a command exits with): as it is in text,
    a record of ``logger`` at ``level`` in JSON, so every line of the process parses."""
    if is_json():
        logging.getLogger(logger).log(level, line)
        return
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def reason_of(exc: BaseException | str) -> str:
    """An error as one short line: its type and the first line of its text."""
    if isinstance(exc, str):
        text = exc
    else:
        # A wrapped driver error (SQLAlchemy's ``orig``) says it best itself.
        cause = getattr(exc, "orig", None) or exc
        first = next((x for x in str(cause).splitlines() if x.strip()), "")
        text = f"{type(cause).__name__}: {first}" if first else type(cause).__name__
    return text if len(text) <= 300 else text[:297] + "..."


class OutageLog:
    """One dependency's outage said in three kinds of line, never one per failure: when it
    starts (what failed, with no traceback unless asked), once every ``every_s`` while it
    lasts (how long, how many failures), and when it ends.

    It ends at the first success ``settle_s`` or more after the last failure, so a
    dependency that fails and answers by turns (a flapping link, timeouts under load) is
    one outage with its minutes counted, not a start and an end a second. Thread-safe: an
    API's worker threads share one."""

    def __init__(self, logger: logging.Logger, what: str, *, every_s: float = 60.0,
                 settle_s: float = 5.0, clock: Callable[[], float] = time.monotonic,
                 state: str = "unavailable", back: str = "available again") -> None:
        self.log = logger
        self.what = what
        self.state, self.back = state, back
        self.every_s = every_s
        self.settle_s = settle_s
        self.clock = clock
        self._lock = threading.Lock()
        self._since: float | None = None
        self._last_failure = 0.0
        self._said_at = 0.0
        self._failures = 0

    @property
    def down(self) -> bool:
        return self._since is not None

    def failed(self, exc: BaseException | str, *, traceback: bool = False) -> None:
        """Note one failure; say so if it starts an outage or a minute has passed."""
        with self._lock:
            now = self.clock()
            self._failures += 1
            self._last_failure = now
            if self._since is None:
                self._since = self._said_at = now
                self._failures = 1
                message = f"{self.what} {self.state}: {reason_of(exc)}"
            elif now - self._said_at >= self.every_s:
                self._said_at = now
                message = (f"{self.what} still {self.state} after {now - self._since:.0f} s "
                           f"({self._failures} failures): {reason_of(exc)}")
            else:
                return
            fields = self._fields(now)
        exc_info = exc if traceback and isinstance(exc, BaseException) else None
        self.log.warning(message, exc_info=exc_info, extra=fields)

    def ok(self) -> None:
        """Note a success; say the outage is over if one was on and has settled."""
        if self._since is None:  # the usual case, without the lock
            return
        with self._lock:
            now = self.clock()
            if self._since is None or now - self._last_failure < self.settle_s:
                return
            fields = self._fields(self._last_failure)
            message = (f"{self.what} {self.back}: {self.state} for "
                       f"{fields['outage_s']:.0f} s ({self._failures} failures)")
            self._since = None
        self.log.warning(message, extra=fields)

    def _fields(self, until: float) -> dict[str, Any]:
        assert self._since is not None
        return {"dependency": self.what, "outage_s": round(until - self._since, 1),
                "failures": self._failures}
