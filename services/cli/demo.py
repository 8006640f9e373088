"""``ringwatch demo``: the whole path on one machine, every part real.

Embedded Postgres, the API and notifier as a real server process, a webhook
receiver, a local Ray cluster of logical nodes probing with gloo: one clean
cycle, two with an injected slow rank (link health degrades on 2 bad cycles of 3, as in
production), then a preflight verdict that names the slow node.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import uuid
from contextlib import ExitStack, closing
from pathlib import Path
from typing import Any

import httpx

from agents.groups import node_order
from agents.spec import InjectedFault
from services.analyzer.hysteresis import Policy
from services.check import CheckBudget
from services.cli import api_process
from services.cli.errors import CliError
from services.cli.output import print_verdict
from services.notifier.receiver import WebhookReceiver
from services.scheduler.cycle import ProbeOptions, run_cycle
from services.scheduler.shipper import Shipper
from services.settings import Settings, get_settings
from services.store import db, tokens

DEMO_SECRET = "ringwatch-demo-secret"
SLOW = {"kind": "slow", "node": "node-001", "gpu": 0, "factor": 0.4}


def step(message: str) -> None:
    print(f"\n== {message}", flush=True)


def note(message: str) -> None:
    print(f"   {message}", flush=True)


def run_demo(args: argparse.Namespace) -> int:
    started = time.monotonic()
    settings = get_settings()
    with ExitStack() as stack:
        step("database")
        url = _demo_database(settings, stack)
        admin, agent = _tokens(url)
        receiver = stack.enter_context(WebhookReceiver(DEMO_SECRET))
        note(f"webhook receiver listening on {receiver.url}")

        step("API and notifier")
        api_url = _start_api(url, args.port or api_process.free_port(), stack)
        client = stack.enter_context(httpx.Client(base_url=api_url, timeout=30))
        hook = client.post("/v1/webhooks", headers=_auth(admin), json={
            "url": receiver.url, "secret": DEMO_SECRET,
            "events": ["health.degraded", "health.recovered", "probe.hang", "probe.error"]})
        hook.raise_for_status()
        note(f"webhook {hook.json()['id']} registered for health.degraded, health.recovered")

        step(f"local Ray cluster: {args.nodes} logical nodes x {args.gpus_per_node} ranks, gloo")
        backend = stack.enter_context(closing(_backend(args, settings)))
        ranks = backend.ranks()
        note(f"{len(ranks)} agents up: {', '.join(r.member for r in ranks)}")
        shipper = Shipper(api_url, agent, settings.state_dir / f"spool-demo-{os.getpid()}")
        stack.callback(shipper.close)
        options = ProbeOptions(ops=("allreduce", "alltoall"), sizes=(1 << 16, 1 << 22), warmup=3, iters=10)

        step("cycle 1: clean")
        _cycle(backend, options, shipper, client, admin, settings)

        fault = InjectedFault.from_dict(SLOW)
        backend.set_injected([fault])
        for n in (2, 3):
            step(f"cycle {n}: INJECTED slow rank {fault.member} at {fault.factor}x bandwidth")
            _cycle(backend, options, shipper, client, admin, settings, table=n == 3)

        step("preflight (fresh results reused through the API)")
        nodes = sorted({r.node for r in ranks}, key=node_order)
        resp = client.post("/v1/preflight", headers=_auth(admin), json={"nodes": nodes})
        resp.raise_for_status()
        verdict = resp.json()
        print_verdict(verdict, as_json=False)

        step("webhooks received")
        # One health.degraded per degraded link; the notifier is woken at commit.
        degraded = client.get("/v1/links", params={"status": "degraded"}, headers=_auth(admin)).json()
        events = receiver.wait_for(max(1, len(degraded)), timeout_s=15)
        for e in events:
            note(f"{e['event']:<16} delivery {e['delivery'][:8]}  signature "
                 f"{'ok' if e['verified'] else 'BAD'}  {_where(e['body'])}")
        if not events:
            note("none yet (the notifier retries; see GET /v1/webhooks/1/deliveries)")

        named = fault.node in verdict.get("exclude", [])
        step(f"done in {time.monotonic() - started:.1f} s: the verdict "
             f"{'names' if named else 'does NOT name'} the slow node {fault.node}")
        note(f"the ringwatch command is {Path(sys.executable).parent / 'ringwatch'}: "
             f"`export PATH={Path(sys.executable).parent}:$PATH` puts it on your PATH")
        return 0 if named and not verdict["healthy"] else 1


def _demo_database(settings: Settings, stack: ExitStack) -> str:
    note("starting embedded Postgres" if not settings.database_url else "using RINGWATCH_DATABASE_URL")
    admin_url = db.resolve_database_url(settings.database_url, settings.state_dir)
    name = f"ringwatch_demo_{uuid.uuid4().hex[:8]}"
    url = db.create_database(admin_url, name)
    stack.callback(db.drop_database, admin_url, name)
    db.upgrade(url)
    note(f"database {name} migrated to head")
    return url


def _tokens(url: str) -> tuple[str, str]:
    factory = db.make_session_factory(db.make_engine(url))
    with db.transaction(factory) as s:
        return tokens.create_token(s, "admin", "demo"), tokens.create_token(s, "agent", "demo")


def _auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def _start_api(url: str, port: int, stack: ExitStack) -> str:
    api_url = f"http://127.0.0.1:{port}"
    # The demo's receiver listens on loopback, which the URL policy refuses unless allowed;
    # in demo mode the webhook secrets' key is generated under the state dir.
    env = {**os.environ, "RINGWATCH_DATABASE_URL": url, "RINGWATCH_API_URL": api_url,
           "RINGWATCH_NOTIFIER_POLL_S": "0.5", "RINGWATCH_DEMO": "1",
           "RINGWATCH_WEBHOOK_ALLOWED_NETWORKS": "127.0.0.1/32"}
    try:
        proc = api_process.start_api(env)
    except api_process.ApiDidNotStart as exc:
        raise CliError(str(exc)) from exc
    stack.callback(api_process.stop, proc)
    note(f"API serving at {api_url} (pid {proc.pid}), notifier running inside it")
    return api_url


def _backend(args: argparse.Namespace, settings: Settings):
    from services.scheduler.ray_backend import RayBackend

    return RayBackend(backend="gloo", local_nodes=args.nodes, ranks_per_node=args.gpus_per_node,
                      address=None, injected=[], temp_dir=settings.state_dir / "ray",
                      progress=lambda m: note(f".. {m}"), repeats=3)


def _cycle(backend, options: ProbeOptions, shipper: Shipper, client: httpx.Client, token: str,
           settings: Settings, table: bool = True) -> None:
    cycle = run_cycle(backend, options, progress=lambda m: note(f".. {m}"),
                      thresholds=settings.thresholds(backend.name),
                      budget=CheckBudget.from_settings(settings))
    left = shipper.ship(cycle.to_batch())
    note(f"{len(cycle.measurements)} measurements in {cycle.rounds} rounds, {cycle.wall_time_s:.1f} s;"
         f" shipped ({left} spooled)")
    for f in cycle.findings:
        note(f"probe finding: {f.to_dict()}")
    if table:
        print_links(client.get("/v1/links", headers=_auth(token)).json(),
                    settings.hysteresis())


def link_legend(policy: Policy) -> str:
    """What the link table's last two columns mean: one is this cycle's, the other the
    link's state over cycles, and they can disagree (a first slow cycle, a first clean one)."""
    return (f"ratio: this cycle's busbw over the link's expectation. status: the link's state "
            f"over cycles (degraded after {policy.k_bad} slow cycles of the last "
            f"{policy.n_window}, ok again after {policy.m_good} clean ones), so a first slow "
            "cycle shows a low ratio beside ok")


def print_links(links: list[dict[str, Any]], policy: Policy | None = None) -> None:
    print(f"   {'scope':<11} {'op':<10} {'nodes (ranks)':<30} {'busbw GB/s':>10} {'expected':>9} "
          f"{'ratio':>6}  status")
    for link in links:
        members = f"{'+'.join(link['nodes'])} ({len(link['members'])})"
        exp = f"{link['expected_gbs']:.3f}" if link["expected_gbs"] is not None else "-"
        ratio = f"{link['ratio']:.2f}" if link["ratio"] is not None else "-"
        flag = "DEGRADED" if link["status"] == "degraded" else link["status"]
        print(f"   {link['scope']:<11} {link['op']:<10} {members:<30} "
              f"{link['busbw_gbs']:>10.3f} {exp:>9} {ratio:>6}  {flag}")
    print(f"   {link_legend(policy or Policy())}")


def _where(body: dict[str, Any]) -> str:
    f = body.get("finding") or {}
    op = f" ({f['op']})" if f.get("op") else ""
    return f"{f.get('kind', '')} {f.get('node') or ','.join(f.get('nodes') or [])}{op}"
