"""``ringwatch kubernetes``: on Kubernetes, what ``ringwatch slurm`` is on Slurm.

``sync`` is the drain: each cycle it reads every node's health from the API (GET
/v1/fleet/nodes, the Slurm prolog's judgement) and the cluster's nodes from the Kubernetes
API, labels each ``ringwatch.io/health``, taints the ones ringwatch excludes and untaints
them once healthy (``services.kubernetes.remediation`` plans it). It changes nothing unless
``--apply`` is given, and says what it would do. ``check`` is the init container's gate: it
asks about its own node within a bound and, like the prolog, lets the pod start when
ringwatch cannot answer (docs/kubernetes.md, "Remediation" and "Gating a job").

A client command: the standard library, and httpx once a command asks an API.
"""

from __future__ import annotations

import argparse
import logging
import os
import threading
import time
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from ringwatch.services import logs
from ringwatch.services.cli.errors import CliError
from ringwatch.services.cli.output import say, visible
from ringwatch.services.cli.signals import stop_on_signals
from ringwatch.services.kubernetes.remediation import (
    DEFAULT_EFFECT,
    DEFAULT_MAX_AGE_S,
    DEFAULT_MAX_TAINTED_SHARE,
    EFFECTS,
    HEALTH_LABEL,
    TAINT_KEY,
)

if TYPE_CHECKING:
    from ringwatch.services.kubernetes.client import KubernetesApi, ServiceAccount
    from ringwatch.services.kubernetes.remediation import Plan

INTERVAL_S = 60.0
# GPU feature discovery's label, the one deploy/kubernetes/base/gpu-agents.yaml selects by.
NODE_SELECTOR = "nvidia.com/gpu.present=true"
# Each request to either API; a cycle's patches are one request per node that changes.
REQUEST_TIMEOUT_S = 30.0
# The init container's gate: as the Slurm prolog's (services/cli/slurm.py).
CHECK_BOUND_S = 30.0
CHECK_MAX_AGE_S = 900.0


def _share(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a share like 0.05") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{text!r}: a share of the nodes, above 0, at most 1")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0 < value <= 30 * 86400:
        raise argparse.ArgumentTypeError(f"{text!r}: seconds above 0, at most 30 days")
    return value


def add_parser(sub: argparse._SubParsersAction) -> None:
    from ringwatch.services.cli.main import add_api_option

    p = sub.add_parser("kubernetes", help="label and taint Kubernetes nodes by ringwatch's "
                                          "verdicts (the Slurm drain's equivalent), and an "
                                          "init container's gate (docs/kubernetes.md)")
    ksub = p.add_subparsers(dest="kubernetes_command", required=True, parser_class=type(p))
    s = ksub.add_parser("sync", help=f"label every node {HEALTH_LABEL}=healthy|degraded|"
                                     f"unknown, taint the ones ringwatch excludes "
                                     f"{TAINT_KEY}=<kind>, untaint them once healthy; a dry "
                                     "run unless --apply")
    s.add_argument("--apply", action="store_true",
                   help="patch the nodes (default: print what would change, change nothing)")
    s.add_argument("--once", action="store_true",
                   help="one cycle, then exit: 0 done, 1 something left undone (the cap, a "
                        "refused patch), 2 an API could not be read")
    s.add_argument("--interval", type=_seconds, default=INTERVAL_S, metavar="S",
                   help=f"seconds between cycles (default {INTERVAL_S:g})")
    s.add_argument("--taint-effect", choices=EFFECTS, default=DEFAULT_EFFECT,
                   help=f"NoSchedule keeps new pods off (default); NoExecute also evicts the "
                        f"pods there that do not tolerate {TAINT_KEY}")
    s.add_argument("--max-tainted-share", type=_share, default=DEFAULT_MAX_TAINTED_SHARE,
                   metavar="SHARE",
                   help="at most this share of the nodes listed carries the taint at once, "
                        f"at least one node (default {DEFAULT_MAX_TAINTED_SHARE:g})")
    s.add_argument("--node-selector", default=NODE_SELECTOR, metavar="SELECTOR",
                   help=f"the nodes to act on, a label selector (default {NODE_SELECTOR}; "
                        "'' for every node)")
    s.add_argument("--node-name-label", default="", metavar="LABEL",
                   help="match ringwatch's node names to this node label (e.g. "
                        "kubernetes.io/hostname) instead of the node's name")
    s.add_argument("--max-age", type=_seconds, default=DEFAULT_MAX_AGE_S, metavar="S",
                   help="a node whose newest result is older is unknown (default "
                        f"{DEFAULT_MAX_AGE_S:g})")
    add_api_option(s, "the API to read node health from (a reader RINGWATCH_TOKEN)")
    s.epilog = (f"{s.epilog} The Kubernetes API is RINGWATCH_KUBERNETES_API_URL, else the "
                "pod's own (KUBERNETES_SERVICE_HOST), with the pod's service account token.")
    c = ksub.add_parser("check", help="an init container's gate: ask about this node "
                                      "(NODE_NAME); exit 1 with the reason when ringwatch "
                                      "excludes it, 0 when healthy or, by default, when "
                                      "ringwatch cannot answer within the bound")
    c.add_argument("--node", help="the node's name (default: NODE_NAME)")
    c.add_argument("--bound", type=_seconds, default=CHECK_BOUND_S, metavar="S",
                   help=f"seconds the command may take (default {CHECK_BOUND_S:g})")
    c.add_argument("--max-age", type=_seconds, default=CHECK_MAX_AGE_S, metavar="S",
                   help=f"reuse results younger than this (default {CHECK_MAX_AGE_S:g})")
    c.add_argument("--on-error", choices=("open", "closed"), default="open",
                   help="when ringwatch cannot answer (down, 429, 503, no verdict in time): "
                        "open lets the pod start (default), closed exits 1")
    add_api_option(c, "the API to ask (a reader RINGWATCH_TOKEN)")


def cmd_kubernetes(args: argparse.Namespace) -> int:
    if args.kubernetes_command == "check":
        return check(args, time.monotonic())
    from ringwatch.services.kubernetes.client import ServiceAccount
    from ringwatch.services.settings import get_settings

    settings = get_settings()
    if not settings.token:
        raise CliError(f"RINGWATCH_TOKEN is not set: set it to a reader token for the API at "
                       f"{settings.api_url} (ringwatch token create --role reader)")
    sync = Sync(args, settings.api_url, settings.token,
                ServiceAccount(settings.kubernetes_api_url))
    if args.once:
        return sync.cycle()
    stop = threading.Event()
    stop_on_signals(stop)
    while not stop.is_set():
        sync.cycle()
        stop.wait(args.interval)
    return 0


# ---- sync ------------------------------------------------------------------------------------


def _log(line: str, level: int = logging.WARNING) -> None:
    logs.say(visible(f"ringwatch kubernetes sync: {line}"), level=level,
             logger="ringwatch.kubernetes")


class Sync:
    """One cycle at a time: read both APIs, plan, say and (with --apply) patch."""

    def __init__(self, args: argparse.Namespace, api_url: str, token: str,
                 account: ServiceAccount) -> None:
        self.args = args
        self.api_url = api_url
        self.token = token
        self.account = account

    def cycle(self) -> int:
        """0: every change made (or, in a dry run, said); 1: some left undone; 2: an API
        could not be read, and nothing changed."""
        from ringwatch.services.kubernetes.client import KubernetesError

        try:
            states = fleet_states(self.api_url, self.token)
        except CliError as exc:
            _log(f"ringwatch not read ({exc}); no node changed")
            return 2
        try:
            with self.account.open(lambda: REQUEST_TIMEOUT_S) as kube:
                return self._act(kube, states)
        except KubernetesError as exc:
            _log(f"the Kubernetes API not read ({exc}); no node changed")
            return 2

    def _act(self, kube: KubernetesApi, states: Mapping[str, Mapping[str, Any]]) -> int:
        from ringwatch.services.kubernetes.client import NODES_PATH, KubernetesError
        from ringwatch.services.kubernetes.remediation import KubeNode, match_nodes, plan

        a = self.args
        params = {"labelSelector": a.node_selector} if a.node_selector else {}
        nodes = [KubeNode.from_object(o) for o in kube.list_items(NODES_PATH, params)]
        names = match_nodes(nodes, states, a.node_name_label)
        p = plan(nodes, names, states, now=datetime.now(UTC), max_age_s=a.max_age,
                 effect=a.taint_effect, max_tainted_share=a.max_tainted_share)
        failed = 0
        for change in p.changes:
            where = change.node + (f" (ringwatch {change.ringwatch})"
                                   if change.ringwatch not in (None, change.node) else "")
            if not a.apply:
                for line in change.says:
                    say(f"dry run: {where}: would {line}")
                continue
            if change.ops:
                try:
                    kube.patch(f"{NODES_PATH}/{change.node}", change.ops)
                except KubernetesError as exc:
                    failed += 1
                    _log(f"{where}: not changed, read again next cycle: {exc}")
                    continue
            for line in change.says:
                say(f"{where}: {line}")
        self._summary(p, len(nodes))
        return 1 if failed or p.held_back else 0

    def _summary(self, p: Plan, listed: int) -> None:
        a = self.args
        if p.held_back:
            _log(f"the cap holds: {p.cap} of {listed} node(s) may carry the taint "
                 f"(--max-tainted-share {a.max_tainted_share:g}, at least 1), so "
                 f"{len(p.held_back)} excluded node(s) stay untainted: "
                 + ", ".join(p.held_back[:20]) + (" ..." if len(p.held_back) > 20 else ""))
        counts = p.counts()
        say(f"{listed} node(s)" + (f" ({a.node_selector})" if a.node_selector else "") + ": "
            + ", ".join(f"{n} {h}" for h, n in counts.items())
            + f"; {p.tainted} tainted (cap {p.cap})"
            + ("" if a.apply else "; dry run: nothing changed (--apply acts)"))


def fleet_states(api_url: str, token: str) -> dict[str, dict[str, Any]]:
    """ringwatch's nodes by name, as GET /v1/fleet/nodes gives them."""
    import httpx

    try:
        resp = httpx.get(f"{api_url}/v1/fleet/nodes", timeout=REQUEST_TIMEOUT_S,
                         headers={"Authorization": f"Bearer {token}"})
    except httpx.HTTPError as exc:
        raise CliError(f"API at {api_url} unreachable ({type(exc).__name__})") from None
    if resp.status_code != 200:
        try:
            message = str(resp.json().get("message", ""))[:200]
        except ValueError:
            message = resp.text[:200]
        raise CliError(f"GET /v1/fleet/nodes answered {resp.status_code}: {message}")
    return {str(n["name"]): n for n in resp.json()["nodes"]}


# ---- check -----------------------------------------------------------------------------------


def check(args: argparse.Namespace, started: float) -> int:
    """Exit 0: healthy, or no answer (fail-open, with a line on stderr). Exit 1: ringwatch
    excludes the node (the reason on stdout), or no answer with --on-error closed."""
    from ringwatch.services.cli.slurm import GateConfig, ask_within, no_answer_reason, reason_for

    node = args.node or os.environ.get("NODE_NAME")
    if not node:
        raise CliError("NODE_NAME is not set (give the pod's spec.nodeName through the "
                       "downward API); or give --node")
    token = os.environ.get("RINGWATCH_TOKEN", "")
    if not token:
        raise CliError("RINGWATCH_TOKEN is not set (a reader token)")
    api_url = os.environ.get("RINGWATCH_API_URL", "http://127.0.0.1:8420").rstrip("/")
    if not api_url.startswith(("http://", "https://")):
        raise CliError(f"RINGWATCH_API_URL must be an http:// or https:// URL, not {api_url!r}")
    config = GateConfig(api_url=api_url, token=token, bound_s=args.bound, fail_closed=args.on_error == "closed",
                        max_age_s=args.max_age)
    answer = ask_within(config, node, started + config.bound_s)
    if answer.verdict is not None:
        reason = reason_for(answer.verdict, node)
    elif config.fail_closed:
        reason = no_answer_reason(answer.why)
    else:
        logs.say(visible(f"ringwatch kubernetes check: {node}: no answer ({answer.why}); the "
                         "pod may start (fail-open)"), level=logging.WARNING,
                 logger="ringwatch.kubernetes")
        return 0
    if reason is None:
        return 0
    say(reason)
    return 1
