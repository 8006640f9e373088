"""``ringwatch``: the command line. Launches the processes and is a client of the API.

Exit codes: 0 healthy / success, 1 unhealthy, 2 bad input or an error (one line on stderr),
3 check-rankmap's table sound but its host checks skipped (no API asked).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
import warnings

from ringwatch.agents.spec import OPS, REDOPS, ProbeSetupError
from ringwatch.services import logs
from ringwatch.services.cli import commands, kubernetes, nodes, slurm
from ringwatch.services.cli.backends import add_backend_args
from ringwatch.services.cli.errors import CliError
from ringwatch.services.cli.extras import missing_extra
from ringwatch.services.cli.output import visible
from ringwatch.services.version import ringwatch_version

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str) -> int:
    """``8``, ``64K``, ``16M``, ``1G`` (binary units, as nccl-tests' -b/-e take them)."""
    t = text.strip().upper().removesuffix("B")
    unit = t[-1:] if t[-1:] in _UNITS else ""
    try:
        value = int(float(t[: len(t) - len(unit)]) * _UNITS[unit])
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size like 64K or 16M") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"size {text!r} must be positive")
    return value


def _sizes(text: str) -> tuple[int, ...]:
    return tuple(parse_size(s) for s in text.split(","))


def _names(text: str) -> list[str]:
    """Node names, comma-separated or as a Slurm host list, each by the rule the API names
    nodes by."""
    from ringwatch.agents.groups import check_node_name
    from ringwatch.services.cli.hostlist import expand_hostlist

    try:
        names = expand_hostlist(text)
        if not names:
            raise argparse.ArgumentTypeError(f"{text!r} names no node")
        return [check_node_name(n) for n in names]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(s) for s in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a list of integers like 1,2,4") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: world sizes must be >= 1")
    return values


def add_profile_option(p: argparse.ArgumentParser) -> None:
    from ringwatch.agents.workloads import WORKLOADS

    p.add_argument("--profile", choices=tuple(WORKLOADS),
                   help="probe what this kind of job runs (docs/workloads.md): its ops join "
                        "the check's, then the job's own groups run at its sizes")
    for name, what in (("tp", "tensor"), ("pp", "pipeline"), ("dp", "data")):
        p.add_argument(f"--{name}", type=int, metavar="N",
                       help=f"with --profile: the job's {what}-parallel degree (default: "
                            + ("the GPUs of one node" if name == "tp" else
                               "1" if name == "pp" else "what the ranks leave") + ")")


# What --ops, --sizes and --repeats default to, as their help says it.
PROBE_DEFAULTS = ("allreduce,alltoall", "one latency size and one bandwidth-bound size for "
                  "the backend, as a preflight probes", "1, 3 on gloo")


def add_probe_options(p: argparse.ArgumentParser,
                      defaults: tuple[str, str, str] = PROBE_DEFAULTS) -> None:
    """The probe's options; ``defaults``: what --ops, --sizes and --repeats default to."""
    p.add_argument("--ops", help=f"comma-separated ops (default: {defaults[0]})")
    p.add_argument("--sizes", type=_sizes,
                   help=f"comma-separated sizes, e.g. 1M,16M (default: {defaults[1]})")
    p.add_argument("--preset", choices=("quick", "full"), help="a size sweep")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--repeats", type=int,
                   help=f"timed loops per probe; time_us is their median (default {defaults[2]})")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--redop", default="sum", choices=REDOPS,
                   help="reduction of allreduce and reducescatter, nccl-tests' -o "
                        "(avg: nccl and sim only, float32)")
    p.add_argument("--cuda-graph", action=argparse.BooleanOptionalAction, default=True,
                   help="nccl: capture each timed loop in one CUDA graph, as nccl-tests -G "
                        "(default on; falls back to events where capture fails)")


def _api_url(text: str) -> str:
    if not text.startswith(("http://", "https://")):
        raise argparse.ArgumentTypeError(f"{text!r} is not an http:// or https:// URL")
    return text.rstrip("/")


# Every command that asks the API says how it finds it and what it presents.
API_EPILOG = ("The API is --api URL, else RINGWATCH_API_URL, else http://127.0.0.1:8420; "
              "requests carry the token in RINGWATCH_TOKEN (ringwatch token create).")


def add_api_option(p: argparse.ArgumentParser, what: str = "the API to ask",
                   default: str = "RINGWATCH_API_URL, else http://127.0.0.1:8420") -> None:
    p.add_argument("--api", type=_api_url, metavar="URL", help=f"{what} (default: {default})")
    p.epilog = API_EPILOG


class _Parser(argparse.ArgumentParser):
    """Usage errors are one line on stderr and exit code 2, like every other CLI error."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: {message} (see --help)\n")


def build_parser() -> argparse.ArgumentParser:
    # Help is plain text on a terminal: the docstring's reST markup stays out of it.
    parser = _Parser(prog="ringwatch", description=__doc__.splitlines()[0].replace("``", ""))
    parser.add_argument("-v", "--verbose", action="store_true")
    parser.add_argument("--version", action="version", version=f"ringwatch {ringwatch_version()}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    p = sub.add_parser("demo", help="the whole path on a local 3x2 gloo cluster, with a verdict")
    p.add_argument("--nodes", type=int, default=3)
    p.add_argument("--gpus-per-node", type=int, default=2)
    p.add_argument("--port", type=int, default=0, help="API port (default: a free one)")

    p = sub.add_parser("serve", help="run the API (and the notifier loop)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8420)
    p.add_argument("--no-notifier", action="store_true")

    p = sub.add_parser("notifier", help="run the webhook notifier loop")
    p.add_argument("--health-port", type=int, metavar="PORT",
                   help="answer GET /healthz (the loop comes round) and /readyz (key set, "
                        "database at this ringwatch's migrations) on this port, for a "
                        "supervisor's probes (default: off)")
    p.add_argument("--health-host", default="127.0.0.1",
                   help="the address --health-port listens on (default: loopback; in a pod, "
                        "0.0.0.0, as a kubelet probes the pod's address)")

    p = sub.add_parser("scheduler", help="probe periodically and send results to the API")
    add_backend_args(p)
    add_probe_options(p)
    add_profile_option(p)
    p.add_argument("--interval", type=float, help="seconds between cycles (RINGWATCH_PROBE_INTERVAL_S)")
    p.add_argument("--once", action="store_true", help="run one cycle and exit")
    p.add_argument("--health-port", type=int, metavar="PORT",
                   help="serve GET /healthz and /metrics (leader or standby, the last cycle, "
                        "nodes probed and busy, the spool, the API's last answer) on this "
                        "port (default: off)")
    p.add_argument("--health-host", default="127.0.0.1",
                   help="the address --health-port listens on (default: loopback; for a "
                        "Prometheus on another host or in a pod, 0.0.0.0)")

    p = sub.add_parser("probe", help="run one probe cycle and print the results")
    add_backend_args(p)
    add_probe_options(p)
    add_profile_option(p)
    p.add_argument("--json", action="store_true")

    p = sub.add_parser("selftest", help="probe this machine's GPUs alone: every op at every "
                       "world size, NVML, nccl-tests side by side; exit 0 ok, 1 not")
    add_probe_options(p, (f"every op: {','.join(OPS)}",
                          "the backend's quick preset, 8 B to 64 KiB and 64 to 256 MiB on nccl",
                          "1"))
    p.set_defaults(ops=",".join(OPS))
    p.add_argument("--backend", choices=("nccl", "gloo"), default="nccl",
                   help="nccl on GPUs (default); gloo checks the harness on CPU")
    p.add_argument("--world-sizes", type=_ints, metavar="N,N,...",
                   help="group sizes to run (default: 1 to the GPUs present; gloo: 1,2)")
    p.add_argument("--nccl-tests", metavar="DIR",
                   help="directory of nccl-tests' *_perf binaries (default: look on PATH)")
    p.add_argument("--deadline", type=float, default=300.0,
                   help="seconds one world size may take before its missing ranks are hangs")
    p.add_argument("--inject", action="append", default=[], metavar="JSON",
                   help='inject a fault into a local rank to see it caught, e.g. '
                        '\'{"kind": "corrupt", "gpu": 1}\' (node defaults to this host)')
    p.add_argument("--json", action="store_true")

    p = sub.add_parser("preflight", help="may a job launch on these nodes? exit 0 healthy, 1 not")
    add_backend_args(p)
    p.add_argument("--nodes", help="the job's nodes, comma-separated or as Slurm compresses "
                   "them (node[001-004,007]); asking the API, required; probing (--local, "
                   "--address, --fabric), default all")
    p.add_argument("--max-age", type=float, default=900.0, help="reuse results younger than this (s)")
    p.add_argument("--timeout", type=float, default=600.0, help="give up waiting after this (s)")
    p.add_argument("--confirm", action="store_true",
                   help="(API) re-probe nodes that fresh results call unhealthy before answering")
    add_profile_option(p)
    add_api_option(p, "without --address/--local/--fabric: the API to ask")
    p.add_argument("--json", action="store_true")

    p = sub.add_parser("status", help="the fleet at a glance from the API: health, incidents, "
                                      "last cycle, duty cycle")
    add_api_option(p)
    p.add_argument("--json", action="store_true")

    p = sub.add_parser("completion", help="print shell completion: eval \"$(ringwatch "
                                          "completion bash)\" in ~/.bashrc")
    p.add_argument("shell", choices=("bash", "zsh"))
    p.set_defaults(build_parser=build_parser)

    p = sub.add_parser("check-rankmap", help="check a job's rank table: exit 0 sound, 1 "
                       "problems, 3 sound but the host checks skipped (no API), 2 an error")
    p.add_argument("file")
    add_api_option(p, "the API whose fleet the table is checked against")
    p.add_argument("--json", action="store_true")

    p = sub.add_parser("token", help="API tokens: straight in the database, or through the "
                                     "API with --api and an admin RINGWATCH_TOKEN")
    tsub = p.add_subparsers(dest="token_command", required=True, parser_class=_Parser)
    t = tsub.add_parser("create", help="create a token and print it as the last word")
    t.add_argument("--role", required=True, choices=("agent", "reader", "admin"))
    t.add_argument("--name", default="")
    t.add_argument("--expires-in-days", type=float, metavar="DAYS",
                   help="days until it expires (default RINGWATCH_TOKEN_TTL_DAYS; 0: never)")
    t.add_argument("--nodes", type=_names, metavar="NODE,NODE,...",
                   help="agent tokens: report and answer preflights for these nodes only "
                        "(comma-separated, or a Slurm host list: node-[000-015])")
    t = tsub.add_parser("list", help="tokens, when each was last used and when it expires")
    t.add_argument("--all", action="store_true", help="revoked ones too")
    t.add_argument("--json", action="store_true")
    t = tsub.add_parser("revoke", help="revoke a token by its id (from token list)")
    t.add_argument("id", type=int)
    for t in tsub.choices.values():
        add_api_option(t, "ask this API, with an admin RINGWATCH_TOKEN",
                       "straight in the database RINGWATCH_DATABASE_URL names, or the embedded one")

    p = sub.add_parser("db", help="database")
    dsub = p.add_subparsers(dest="db_command", required=True)
    p = dsub.add_parser("upgrade", help="apply migrations (one upgrade at a time: a second "
                                        "waits for the first, saying who holds the lock)")
    p.add_argument("--lock-timeout", type=float, metavar="SECONDS",
                   help="give up (exit 2) when another upgrade holds the migration lock this "
                        "long (default RINGWATCH_MIGRATION_LOCK_TIMEOUT_S, 300)")
    p = dsub.add_parser("downgrade", help="undo migrations down to --to, one release back at "
                                          "most (docs/operations.md says what each step gives "
                                          "up); run it with the ringwatch that migrated up")
    p.add_argument("--to", required=True, metavar="REV",
                   help="the migration to go back to (e.g. 0016), or a release's version for "
                        "its migration (e.g. 0.1.0)")
    p.add_argument("--lock-timeout", type=float, metavar="SECONDS",
                   help="give up (exit 2) when an upgrade holds the migration lock this long "
                        "(default RINGWATCH_MIGRATION_LOCK_TIMEOUT_S, 300)")
    p = dsub.add_parser("wait", help="wait until another step (db upgrade, a migration Job) "
                                     "has brought the database to this ringwatch's migrations "
                                     "(or past them by migrations that only add); exit 2 past "
                                     "--timeout")
    p.add_argument("--timeout", type=float, default=300.0, metavar="SECONDS",
                   help="give up after this long (default 300)")
    dsub.add_parser("maintain", help="one maintenance pass: partitions ahead, rollups, "
                                     "retention (serve runs one every minute)")
    dsub.add_parser("stop", help="stop the embedded Postgres (started when no "
                                 "RINGWATCH_DATABASE_URL is set); its data stays")
    slurm.add_parser(sub)
    kubernetes.add_parser(sub)
    nodes.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    started = time.monotonic()
    warnings.filterwarnings("ignore", message="XDG_RUNTIME_DIR")
    args = build_parser().parse_args(argv)
    args.started = started  # a verdict's command_s counts from here (docs/formats.md)
    try:  # RINGWATCH_LOG_FORMAT and RINGWATCH_LOG_LEVEL (docs/operations.md, "Logs")
        logs.configure(verbose=args.verbose)
    except logs.LogSettingError as exc:
        print(f"ringwatch {args.command}: {visible(str(exc))}", file=sys.stderr)
        return 2
    handler = getattr(commands, "cmd_" + args.command.replace("-", "_"))
    if getattr(args, "api", None):  # read where every other setting is, before the first read
        os.environ["RINGWATCH_API_URL"] = args.api
    try:
        code = int(handler(args) or 0)
        commands.progress.end()
        return code
    except (CliError, ProbeSetupError) as exc:
        commands.progress.end()
        # One line, whatever an API's or a node's text inside it holds.
        logs.say(f"ringwatch {args.command}: {visible(str(exc))}", level=logging.ERROR,
                 logger="ringwatch.cli")
        return 2
    except KeyboardInterrupt:
        commands.progress.end()
        return 130
    except Exception as exc:  # an error is exit 2 with one line, never a traceback wall
        commands.progress.end()
        if args.verbose:
            logging.exception("failed")
        # A role's extra not installed here is named with the install that gives it.
        line = missing_extra(exc, args.command) if isinstance(exc, ModuleNotFoundError) else None
        logs.say(f"ringwatch {args.command}: {visible(line or f'{type(exc).__name__}: {exc}')}",
                 level=logging.ERROR, logger="ringwatch.cli")
        return 2


if __name__ == "__main__":
    sys.exit(main())
