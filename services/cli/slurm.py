"""``ringwatch slurm``: a Slurm node asks ringwatch about itself before a job starts on it,
and asks for a probe of itself once a job has left it.

``prolog`` asks the API about this node alone (``SLURMD_NODENAME``) and, when ringwatch
excludes it, drains it with the finding as Slurm's reason; ``check`` asks the same and only
says (LBNL NHC drains by itself); ``resume`` returns the nodes ringwatch drained once a
verdict no longer excludes them, never a node drained for another reason (docs/slurm.md).

``epilog`` runs when a job ends on the node, the moment it is surely idle: it asks for a
preflight of this node alone that only a probe made for it can answer (a max age of
EPILOG_MAX_AGE_S), so a scheduler probes the node ahead of its rotation. The prolog's rules
hold: its own node only, the same env file, done within the bound. When the verdict
excludes the node, it is drained with the prolog's reason (so ``resume`` returns it later);
a healthy node is left as it is, even one ringwatch drained before (returning it is
``resume``'s). It always exits 0, and says in its log why it did nothing where it could not
ask: a failed epilog makes slurmd drain the node with a reason of its own ("Epilog error"),
which names no fault and which ``resume`` would never return.

A client command: the standard library, and httpx once a command asks the API.
"""

from __future__ import annotations

import argparse
import contextlib
import email.utils
import errno
import logging
import os
import re
import shutil
import signal
import socket
import stat
import subprocess
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ringwatch.agents.places import finding_place
from ringwatch.services import logs
from ringwatch.services.cli.errors import CliError
from ringwatch.services.cli.output import visible, with_cause

if TYPE_CHECKING:
    import httpx

# Every reason ringwatch gives Slurm starts so: `resume` returns only the nodes it drained.
REASON_PREFIX = "ringwatch:"
ENV_FILE = "/etc/ringwatch/prolog.env"
BOUND_S = 30.0
MAX_AGE_S = 900.0
# The epilog's max age: the API takes none of 0, and a thousandth of a second leaves no stored
# result fresh, so only a probe made for the request answers it.
EPILOG_MAX_AGE_S = 0.001
# Slurm stores any length, but sinfo and scontrol show reasons on one line.
MAX_REASON = 200
# What a drain reason keeps: what ringwatch writes in one (names, figures, units, a cause's
# "40% of packets" and "+500", a host list's brackets as sinfo prints them). Not $,
# backticks, ;, |, &, quotes, <, >, \, braces, * or ?: a site's script that reads the reason
# back (NHC, a drain hook) must not run any of it. A ";" (headline; cause) reads as a ",".
REASON_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
                         " .,:()[]/+%_-")
# An env file is a few KEY=value lines; anything larger is not one.
MAX_ENV_FILE_BYTES = 64 * 1024
# Where distributions and source installs put Slurm's commands; slurmd gives a prolog no PATH.
SLURM_BIN_DIRS = ("/usr/bin", "/usr/local/bin", "/opt/slurm/bin")
# Answers worth asking again after a pause (Retry-After where the API gives one).
RETRIED = frozenset({429, 502, 503, 504})
RETRY_DEFAULT_S = 2.0
# Pauses before asking again after a refused connection: enough for an API restarting, not so
# many that every job start waits out the bound while it is down.
CONNECT_PAUSES = (0.5, 1.0, 2.0)
# How long the API may hold one request open for a probing scheduler (POST ?wait=).
WAIT_S = 10.0

SETTINGS = {
    "RINGWATCH_API_URL": "the API (http:// or https://)",
    "RINGWATCH_TOKEN": "a reader token",
    "RINGWATCH_SLURM_BOUND_S": f"seconds the whole command may take (default {BOUND_S:g})",
    "RINGWATCH_SLURM_ON_ERROR": "open: a node ringwatch cannot answer about takes the job "
                                "(default); closed: it is drained",
    "RINGWATCH_SLURM_MAX_AGE_S": f"reuse results younger than this (default {MAX_AGE_S:g})",
    "RINGWATCH_SLURM_LOG": "a file each decision is appended to (besides stderr and syslog)",
    "RINGWATCH_SLURM_BIN": "the directory holding scontrol and sinfo (default: found in "
                           + ", ".join(SLURM_BIN_DIRS) + ", then PATH)",
}
_KEY = re.compile(r"^[A-Z][A-Z0-9_]*$")


@dataclass(frozen=True)
class GateConfig:
    """What the slurm commands run with: the env file, the environment over it, flags over both."""

    api_url: str
    token: str
    bound_s: float = BOUND_S
    fail_closed: bool = False
    max_age_s: float = MAX_AGE_S
    log_file: str | None = None
    slurm_bin: str | None = None


def read_env_file(path: Path) -> dict[str, str]:
    """The ``KEY=value`` lines of an env file that only its owner may read: it holds a token.
    Opened without following a link and without blocking (a FIFO planted there would hold
    every job's start), and read only once it is known to be a small regular file."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return {}
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise CliError(f"{path} is a symbolic link: give the file itself") from None
        raise CliError(f"cannot read {path}: {exc.strerror}") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise CliError(f"{path} is not a regular file")
        data = f.read(MAX_ENV_FILE_BYTES + 1)
    if len(data) > MAX_ENV_FILE_BYTES:
        raise CliError(f"{path} is larger than {MAX_ENV_FILE_BYTES // 1024} KiB: not an env file")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise CliError(f"{path} is not UTF-8 text") from None
    if st.st_mode & 0o077:
        raise CliError(f"{path} has mode {stat.S_IMODE(st.st_mode):04o}: it holds a token, so "
                       f"group and others may not read it (chmod 600 {path})")
    if st.st_uid not in (0, os.geteuid()):
        raise CliError(f"{path} belongs to uid {st.st_uid}, neither root nor this user")
    return parse_env(text, str(path))


def parse_env(text: str, where: str) -> dict[str, str]:
    values: dict[str, str] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        key, eq, value = line.removeprefix("export ").partition("=")
        key, value = key.strip(), value.strip()
        if not eq or not _KEY.match(key):
            raise CliError(f"{where}:{number}: not a KEY=value line")
        if key not in SETTINGS:  # a mistyped setting must not pass for a default
            raise CliError(f"{where}:{number}: unknown setting {key} (known: "
                           f"{', '.join(SETTINGS)})")
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        values[key] = value
    return values


def load_config(env_file: str, environ: Mapping[str, str],
                args: argparse.Namespace | None = None) -> GateConfig:
    values = read_env_file(Path(env_file))
    values.update({k: environ[k] for k in SETTINGS if environ.get(k)})
    flags = {"RINGWATCH_SLURM_BOUND_S": getattr(args, "bound", None),
             "RINGWATCH_SLURM_ON_ERROR": getattr(args, "on_error", None),
             "RINGWATCH_SLURM_MAX_AGE_S": getattr(args, "max_age", None)}
    values.update({k: str(v) for k, v in flags.items() if v is not None})
    where = f"in {env_file} or the environment"
    url = values.get("RINGWATCH_API_URL", "").rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise CliError(f"RINGWATCH_API_URL {where} must be an http:// or https:// URL"
                       + (f", not {url!r}" if url else ""))
    if not values.get("RINGWATCH_TOKEN"):
        raise CliError(f"RINGWATCH_TOKEN is not set {where} (a reader token)")
    on_error = values.get("RINGWATCH_SLURM_ON_ERROR", "open")
    if on_error not in ("open", "closed"):
        raise CliError(f"RINGWATCH_SLURM_ON_ERROR is open or closed, not {on_error!r}")
    return GateConfig(api_url=url, token=values["RINGWATCH_TOKEN"],
                      bound_s=_seconds(values, "RINGWATCH_SLURM_BOUND_S", BOUND_S),
                      fail_closed=on_error == "closed",
                      max_age_s=_seconds(values, "RINGWATCH_SLURM_MAX_AGE_S", MAX_AGE_S),
                      log_file=values.get("RINGWATCH_SLURM_LOG") or None,
                      slurm_bin=values.get("RINGWATCH_SLURM_BIN") or None)


def _seconds(values: Mapping[str, str], key: str, default: float) -> float:
    try:
        value = float(values.get(key, default))
    except ValueError:
        raise CliError(f"{key} is a number of seconds, not {values[key]!r}") from None
    if not 0 < value < 86400:
        raise CliError(f"{key} must be between 0 and 86400 seconds, not {value:g}")
    return value


def slurm_command(config: GateConfig, name: str) -> str:
    """The absolute path of Slurm's ``name`` (scontrol, sinfo)."""
    try:
        return find_slurm_command(name, config.slurm_bin)
    except CliError as exc:
        raise CliError(f"{exc} (set RINGWATCH_SLURM_BIN)") from None


def find_slurm_command(name: str, slurm_bin: str | None = None) -> str:
    """The absolute path of Slurm's ``name``: in ``slurm_bin`` alone where given, else in
    SLURM_BIN_DIRS, then on PATH (the scheduler's occupancy source looks there too)."""
    dirs = (slurm_bin,) if slurm_bin else SLURM_BIN_DIRS
    for d in dirs:
        path = Path(d) / name
        if os.access(path, os.X_OK):
            return str(path)
    found = None if slurm_bin else shutil.which(name)
    if found is None:
        raise CliError(f"no {name} in {', '.join(dirs)}" + ("" if slurm_bin else " or on PATH"))
    return found


# ---- the log -------------------------------------------------------------------------------


class DecisionLog:
    """Each decision as one line on stderr (slurmd logs a failed prolog's output), in syslog
    and in RINGWATCH_SLURM_LOG where set: a prolog that lets a job start is otherwise silent."""

    def __init__(self, config: GateConfig | None, command: str) -> None:
        self.path = config.log_file if config else None
        self.command = command

    def __call__(self, line: str) -> None:
        import syslog

        # The API's answer and scontrol's output are quoted: one line, nothing a terminal
        # or a log viewer acts on.
        text = visible(f"ringwatch slurm {self.command}: {line}")
        logs.say(text, level=logging.WARNING, logger="ringwatch.slurm")
        syslog.openlog("ringwatch", syslog.LOG_PID, syslog.LOG_DAEMON)
        syslog.syslog(syslog.LOG_WARNING, text)
        if self.path:
            stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
            try:
                append_line(self.path, f"{stamp} {text}\n")
            except OSError as exc:
                logs.say(visible(f"ringwatch slurm: cannot write {self.path}: {exc.strerror}"),
                         level=logging.WARNING, logger="ringwatch.slurm")


def append_line(path: str, line: str) -> None:
    """Append ``line`` to the regular file at ``path`` (made 0600 where missing), never
    through a link planted there and never blocking on a FIFO (no reader: ENXIO)."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK
                 | os.O_CLOEXEC, 0o600)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file")
        os.write(fd, line.encode("utf-8", "replace"))
    finally:
        os.close(fd)


# ---- asking the API ------------------------------------------------------------------------


@dataclass(frozen=True)
class Answer:
    """The API's verdict about a node, or why none came."""

    verdict: dict[str, Any] | None
    why: str = ""


def retry_after_s(value: str | None, now: float | None = None) -> float:
    """Seconds a Retry-After header asks to wait: delta-seconds or an HTTP date."""
    if not value:
        return RETRY_DEFAULT_S
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value).timestamp()
    except (TypeError, ValueError):
        return RETRY_DEFAULT_S
    return max(0.0, when - (time.time() if now is None else now))


def ask(config: GateConfig, node: str, deadline: float, *,
        max_age_s: float | None = None,
        transport: httpx.BaseTransport | None = None,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.monotonic) -> Answer:
    """The verdict about ``node`` alone, from results younger than ``max_age_s`` (default:
    the config's), or why none came before ``deadline`` (a ``clock`` time). A 429, 502, 503
    or 504 is asked again after its Retry-After, and an unreachable API after each of
    CONNECT_PAUSES, only where the wait ends before the deadline."""
    import httpx

    pauses, request_id = iter(CONNECT_PAUSES), None
    body = {"nodes": [node], "max_age_s": config.max_age_s if max_age_s is None else max_age_s}
    headers = {"Authorization": f"Bearer {config.token}"}
    with httpx.Client(base_url=config.api_url, headers=headers, transport=transport) as client:
        while True:
            left = deadline - clock()
            try:
                if request_id is None:
                    wait = max(0.0, min(WAIT_S, left - 2.0))
                    resp = client.post(f"/v1/preflight?wait={wait:.1f}", json=body,
                                       timeout=max(left, 0.1))
                else:
                    resp = client.get(f"/v1/preflight/{request_id}", timeout=max(left, 0.1))
            except httpx.HTTPError as exc:
                what = "did not answer" if isinstance(exc, httpx.TimeoutException) else "unreachable"
                why = f"API at {config.api_url} {what} ({type(exc).__name__})"
                pause = next(pauses, None)
                if pause is None:
                    return Answer(None, f"{why}, {len(CONNECT_PAUSES) + 1} tries")
                delay = pause
            else:
                code = resp.status_code
                if code in (200, 202):
                    out = resp.json()
                    if out.get("status") == "done":
                        return Answer(out)
                    if out.get("status") == "failed":
                        return Answer(None, f"preflight {out.get('id')} failed: {out.get('error')}")
                    request_id = out["id"]
                    why = (f"no verdict yet (request {request_id} {out.get('status')}: is a "
                           "scheduler probing?)")
                    delay = 1.0
                elif code in RETRIED:
                    delay = retry_after_s(resp.headers.get("retry-after"))
                    why = f"API answered {code}: {_message(resp)}"
                else:
                    return Answer(None, f"API answered {code}: {_message(resp)}")
            if clock() + delay >= deadline:
                return Answer(None, f"{why}; nothing more within the bound of "
                                    f"{config.bound_s:g} s")
            sleep(delay)


def _message(resp: httpx.Response) -> str:
    try:
        return str(resp.json().get("message", resp.text))[:200]
    except (ValueError, AttributeError):
        return resp.text[:200]


def ask_within(config: GateConfig, node: str, deadline: float, *,
               max_age_s: float | None = None) -> Answer:
    """``ask``, cut off at ``deadline`` however the API behaves (one that accepts and never
    answers, one that trickles bytes): the caller decides on time, the thread is left behind."""
    box: list[Answer] = []

    def run() -> None:
        try:
            box.append(ask(config, node, deadline, max_age_s=max_age_s))
        except Exception as exc:  # an answer that is not a verdict is no answer
            box.append(Answer(None, f"{type(exc).__name__}: {exc}"[:200]))

    worker = threading.Thread(target=run, name="ringwatch-ask", daemon=True)
    worker.start()
    worker.join(max(0.0, deadline - time.monotonic()))
    return box[0] if box else Answer(None, f"no answer within the bound of {config.bound_s:g} s")


# ---- the reason ----------------------------------------------------------------------------


def reason_for(verdict: Mapping[str, Any], node: str) -> str | None:
    """Slurm's drain reason when ``verdict`` excludes ``node``, else None:
    ``ringwatch: <kind> <where> <figure>``, from the finding that names the node (its
    headline's text where it has one)."""
    if node not in (verdict.get("exclude") or ()):
        return None
    mine = sorted((f for f in verdict.get("findings") or () if _names(f, node)),
                  key=lambda f: (f.get("node") != node, f.get("severity") != "critical"))
    if not mine:
        return clean_reason(f"{REASON_PREFIX} excluded {node}")
    first = mine[0]
    more = f"(+{len(mine) - 1} more)" if len(mine) > 1 else ""
    return clean_reason(" ".join(p for p in (REASON_PREFIX, str(first.get("kind", "finding")),
                                             finding_place(first), _figure(first), more) if p))


def _names(finding: Mapping[str, Any], node: str) -> bool:
    return finding.get("node") == node or node in (finding.get("nodes") or ())




def _figure(f: Mapping[str, Any]) -> str:
    """The headline's text, and the cause beside it where one is known (docs/transport.md)."""
    headline = f.get("headline")
    measured, expected = f.get("measured_gbs"), f.get("expected_gbs")
    if isinstance(headline, Mapping) and headline.get("text"):
        figure = str(headline["text"])
    elif isinstance(measured, int | float) and isinstance(expected, int | float):
        figure = f"{measured:.3g} of {expected:.3g} GB/s"
    else:
        figure = ""
    return with_cause(figure, f)


def clean_reason(text: str) -> str:
    """One line of REASON_CHARS (anything else a space), at most MAX_REASON characters."""
    text = text.replace(";", ",")
    text = " ".join("".join(c if c in REASON_CHARS else " " for c in text).split())
    return text if len(text) <= MAX_REASON else text[: MAX_REASON - 3] + "..."


def no_answer_reason(why: str) -> str:
    return clean_reason(f"{REASON_PREFIX} no answer: {why}")


# ---- Slurm ---------------------------------------------------------------------------------


def run_bounded(argv: list[str], timeout: float,
                env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``argv``'s exit and output, or exit 124 once ``timeout`` seconds have passed. It runs
    in a session of its own, killed whole at the bound: a wrapper script's children cannot
    hold its pipes open past it (``subprocess.run`` kills the child alone, then waits for
    the pipes)."""
    try:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                stdin=subprocess.DEVNULL, text=True, start_new_session=True,
                                env=dict(env) if env is not None else None)
    except OSError as exc:
        return subprocess.CompletedProcess(argv, 127, "", f"cannot run {argv[0]}: {exc.strerror}")
    try:
        out, err = proc.communicate(timeout=max(timeout, 0.01))
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):  # the whole group ended meanwhile
            os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return subprocess.CompletedProcess(argv, 124, "", f"no answer in {timeout:.3g} s")
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def _run(argv: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    return run_bounded(argv, max(timeout, 1.0))


def set_node_state(config: GateConfig, node: str, state: str, reason: str | None,
                   timeout: float) -> str | None:
    """``scontrol update NodeName=node State=state [Reason=reason]``; None, or why it failed."""
    argv = [slurm_command(config, "scontrol"), "update", f"NodeName={node}", f"State={state}"]
    r = _run(argv + ([f"Reason={reason}"] if reason else []), timeout)
    return None if r.returncode == 0 else (r.stderr or r.stdout).strip() or f"exit {r.returncode}"


def drained_nodes(config: GateConfig, nodes: list[str] | None = None,
                  timeout: float = 30.0) -> dict[str, str]:
    """Drained (or draining) nodes and their reasons, as sinfo lists them."""
    argv = [slurm_command(config, "sinfo"), "-h", "-N", "-R", "-o", "%N|%T|%E"]
    r = _run(argv + (["-n", ",".join(nodes)] if nodes else []), timeout)
    if r.returncode != 0:
        raise CliError(f"sinfo failed: {(r.stderr or r.stdout).strip() or r.returncode}")
    out: dict[str, str] = {}
    for line in r.stdout.splitlines():
        node, _, rest = line.partition("|")
        state, _, reason = rest.partition("|")
        if "drain" in state:
            out[node.strip()] = reason.strip()
    return out


# ---- the commands --------------------------------------------------------------------------


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("slurm", help="a Slurm prolog that drains this node when ringwatch "
                                     "excludes it, an epilog that has it probed once a job "
                                     "leaves it, an NHC check, and resume (docs/slurm.md)")
    ssub = p.add_subparsers(dest="slurm_command", required=True, parser_class=type(p))
    prolog = ssub.add_parser("prolog", help="ask about this node (SLURMD_NODENAME); drain it "
                                            "and exit 1 when ringwatch excludes it")
    epilog = ssub.add_parser("epilog", help="a job has left this node (SLURMD_NODENAME): have "
                                            "it probed now, ahead of the rotation, and drain "
                                            "it when ringwatch excludes it; always exit 0")
    check = ssub.add_parser("check", help="ask about this node and print the reason when "
                                          "ringwatch excludes it (exit 1); drains nothing")
    resume = ssub.add_parser("resume", help="return nodes that ringwatch drained once it no "
                                            "longer excludes them; others stay as they are")
    for q in (prolog, epilog, check):
        q.add_argument("--node", help="the Slurm node name (default: SLURMD_NODENAME"
                                      + (", else the short host name)" if q is check else ")"))
    resume.add_argument("--nodes", help="only these of ringwatch's drained nodes (a Slurm "
                                        "host list); default: all of them")
    epilog.add_argument("--env-file", default=ENV_FILE,
                        help=f"KEY=value settings, mode 0600 (default {ENV_FILE}); the "
                             "environment's RINGWATCH_* variables override it")
    epilog.add_argument("--bound", type=float, metavar="S",
                        help=f"seconds the command may take (default {BOUND_S:g})")
    epilog.epilog = ("Fail-open whatever RINGWATCH_SLURM_ON_ERROR says, and asks for a fresh "
                     "probe whatever RINGWATCH_SLURM_MAX_AGE_S says. Settings: "
                     + "; ".join(f"{k}: {v}" for k, v in SETTINGS.items()))
    for q in (prolog, check, resume):
        q.add_argument("--env-file", default=ENV_FILE,
                       help=f"KEY=value settings, mode 0600 (default {ENV_FILE}); the "
                            "environment's RINGWATCH_* variables override it")
        q.add_argument("--bound", type=float, metavar="S",
                       help=f"seconds the command may take (default {BOUND_S:g}; resume: "
                            "per node)")
        q.add_argument("--max-age", type=float, metavar="S",
                       help=f"reuse results younger than this (default {MAX_AGE_S:g})")
        if q is not resume:  # resume returns a node only on a verdict, whatever this says
            q.add_argument("--on-error", choices=("open", "closed"),
                           help="when ringwatch cannot answer (down, 429, 503, no verdict in "
                                "time): open lets the job start (default), closed drains")
        q.epilog = "Settings: " + "; ".join(f"{k}: {v}" for k, v in SETTINGS.items())


def cmd_slurm(args: argparse.Namespace) -> int:
    started = time.monotonic()
    if args.slurm_command == "epilog":
        return epilog_command(args, started)
    config = load_config(args.env_file, os.environ, args)
    if args.slurm_command == "resume":
        return resume(config, args.nodes)
    node = args.node or os.environ.get("SLURMD_NODENAME")
    if not node and args.slurm_command == "check":
        node = socket.gethostname().split(".")[0]
    if not node:
        raise CliError("SLURMD_NODENAME is not set (slurmd sets it for a prolog); or give --node")
    if args.slurm_command == "prolog":
        return prolog(config, node, started)
    return check(config, node, started)


def prolog(config: GateConfig, node: str, started: float) -> int:
    """Exit 0: the job may start here. Exit 1: this node is drained with ringwatch's reason
    and the job's launch fails here (Slurm keeps the reason a draining node has already)."""
    scontrol = slurm_command(config, "scontrol")  # missing: exit 2, before any job starts
    log = DecisionLog(config, "prolog")
    end = started + config.bound_s
    # The API gets the bound less the time scontrol may need to drain the node.
    answer = ask_within(config, node, end - min(5.0, config.bound_s / 4))
    job = os.environ.get("SLURM_JOB_ID", "?")
    if answer.verdict is not None:
        reason = reason_for(answer.verdict, node)
        if reason is None:
            return 0
    elif not config.fail_closed:
        log(f"job {job} on {node}: no answer ({answer.why}); the job may start (fail-open)")
        return 0
    else:
        reason = no_answer_reason(answer.why)
    failed = set_node_state(config, node, "DRAIN", reason, end - time.monotonic())
    log(f"job {job} on {node}: " + (f"drained: {reason}" if failed is None else
                                     f"{reason}; {scontrol} update failed: {failed}"))
    return 1


def epilog_command(args: argparse.Namespace, started: float) -> int:
    """``epilog``: exit 0 whatever happens, with a line in the log where it could not ask."""
    try:
        config = load_config(args.env_file, os.environ, args)
    except CliError as exc:
        DecisionLog(None, "epilog")(f"not asked: {exc}; the node is left as it is")
        return 0
    log = DecisionLog(config, "epilog")
    node = args.node or os.environ.get("SLURMD_NODENAME")
    if not node:
        log("not asked: SLURMD_NODENAME is not set (slurmd sets it for an epilog); or give "
            "--node; the node is left as it is")
        return 0
    try:
        return epilog(config, node, started)
    except Exception as exc:  # fail-open: an epilog that fails drains the node as Slurm's
        log(f"{node}: {type(exc).__name__}: {exc}; the node is left as it is (fail-open)")
        return 0


def epilog(config: GateConfig, node: str, started: float) -> int:
    """Ask for a probe of ``node`` made now; drain it with ringwatch's reason when the
    verdict excludes it. Exit 0 always (module docstring)."""
    log = DecisionLog(config, "epilog")
    end = started + config.bound_s
    # As the prolog: the API gets the bound less the time scontrol may need to drain.
    answer = ask_within(config, node, end - min(5.0, config.bound_s / 4),
                        max_age_s=EPILOG_MAX_AGE_S)
    job = os.environ.get("SLURM_JOB_ID", "?")
    if answer.verdict is None:
        log(f"after job {job} on {node}: no answer ({answer.why}); the node is left as it is "
            "(fail-open)")
        return 0
    reason = reason_for(answer.verdict, node)
    if reason is None:
        return 0
    try:
        failed = set_node_state(config, node, "DRAIN", reason, end - time.monotonic())
    except CliError as exc:  # no scontrol where it was looked for
        failed = str(exc)
    log(f"after job {job} on {node}: " + (f"drained: {reason}" if failed is None else
                                           f"{reason}; scontrol update failed: {failed}"))
    return 0


def check(config: GateConfig, node: str, started: float) -> int:
    """Exit 0 healthy (or no answer, fail-open); exit 1 with the reason on stdout."""
    answer = ask_within(config, node, started + config.bound_s)
    if answer.verdict is not None:
        reason = reason_for(answer.verdict, node)
    elif config.fail_closed:
        reason = no_answer_reason(answer.why)
    else:
        DecisionLog(config, "check")(f"{node}: no answer ({answer.why}); healthy (fail-open)")
        return 0
    if reason is None:
        return 0
    print(reason)
    return 1


def resume(config: GateConfig, nodes_arg: str | None) -> int:
    """Exit 0 when every node ringwatch drained is back (or there was none), 1 when some
    stay drained: ringwatch still excludes them, or could not say."""
    from ringwatch.services.cli.hostlist import expand_hostlist

    try:
        wanted = expand_hostlist(nodes_arg) if nodes_arg else None
    except ValueError as exc:
        raise CliError(f"--nodes: {exc}") from None
    log = DecisionLog(config, "resume")
    ours = {n: r for n, r in drained_nodes(config, wanted).items()
            if r.startswith(REASON_PREFIX)}
    kept = 0
    for node, was in ours.items():
        started = time.monotonic()
        answer = ask_within(config, node, started + config.bound_s)
        still = (reason_for(answer.verdict, node) if answer.verdict is not None
                 else no_answer_reason(answer.why))
        now = drained_nodes(config, [node]).get(node, "")
        if still is None and now.startswith(REASON_PREFIX):
            failed = set_node_state(config, node, "RESUME", None, config.bound_s)
            if failed is None:
                log(f"{node}: resumed (was: {was})")
                continue
            still = f"scontrol update failed: {failed}"
        elif still is None:  # resumed meanwhile, or drained again for another reason
            log(f"{node}: left as it is: " + (f"drained for {now!r} now" if now else
                                               "no longer drained"))
            continue
        kept += 1
        log(f"{node}: still drained: {still}")
    return 1 if kept else 0
