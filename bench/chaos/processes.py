"""Faults of processes and of the database: kill -9 of the API mid-ingest and right after
its answer, of a notifier mid-delivery, of a scheduler mid-preflight; two notifiers with a
slow and a dead receiver; Postgres restarted under load."""

from __future__ import annotations

import inspect
import json
import re
import threading
import time

import httpx

from bench.chaos.harness import (
    HEALTH_EVENTS,
    REACT_AT_ONCE,
    Row,
    SimScheduler,
    Stage,
    count_events,
    deliveries_settled,
    drain,
    flip_fleets,
    kill9,
    results_lost,
    wait_until,
)
from ringwatch.services.cli.api_process import stop
from ringwatch.services.notifier.receiver import WebhookReceiver
from tests.api_fixtures import fleet_batch

SECRET = "chaos-webhook-secret"
# A fleet whose every cycle is a batch of about 200 measurements and 256 ranks: big enough
# that an ingest transaction is open a good part of the time it takes to store.
LOAD_FLEET = {"nodes": 32, "gpus_per_node": 8, "gpu": "H100-SXM", "seed": 7, "faults": []}
# What the API's queries look like while it stores a batch (pg_stat_activity.query).
INGEST_QUERY = r"probe_runs|nodes_in|ranks_in|measurements|link_health|fault_states|outbox_events"


def ingest_open(stage: Stage) -> bool:
    """Whether an API connection is inside a transaction storing a batch right now."""
    return bool(stage.scalar(
        "SELECT count(*) FROM pg_stat_activity WHERE datname = :d AND pid <> pg_backend_pid() "
        "AND state IN ('active', 'idle in transaction') AND query ~* :q",
        d=stage.db_name, q=INGEST_QUERY))


def kill_api_mid_ingest(admin_url: str | None = None, kills: int = 3) -> Row:
    """A sim scheduler ships a batch every half second; the API is killed -9 while a batch's
    transaction is open, ``kills`` times, and restarted a second later. Every measurement the
    scheduler produced must be in the database once."""
    row = Row("kill -9 API mid-ingest", False)
    stage = Stage("kill-api", admin_url)
    try:
        api = stage.start_api()
        sched = SimScheduler(stage, LOAD_FLEET, interval_s=0.5)
        sched.start()
        caught = 0
        for _ in range(kills):
            if not sched.wait_cycles(len(sched.cycles()) + 1, 90):
                row.note = "the scheduler shipped no cycle"
                return row
            caught += bool(wait_until(lambda: ingest_open(stage), 30, every_s=0.005))
            kill9(api)
            time.sleep(1.0)  # cycles spool while nothing listens
            api = stage.start_api()
        survived = sched.alive()
        sched.wait_cycles(len(sched.cycles()) + 2, 90)
        between = sched.stop_between_cycles(90)
        batches, unsent = sched.leftovers()
        if batches:
            drain(stage, sched, sched.env["RINGWATCH_TOKEN"])
        produced = sum(m for m, _ in sched.cycles()) + unsent
        lost, stored = results_lost(stage, produced)
        row.survived = survived and api.poll() is None
        row.results_lost = lost
        row.note = (f"{kills} kills, {caught} with an ingest transaction open; "
                    f"{len(sched.cycles())} cycles (up to {max(n for _, n in sched.cycles())} batches "
                    f"spooled at once), {produced} measurements produced, {stored} stored"
                    + ("" if between else "; scheduler stopped mid-cycle")
                    + (f"; {sched.moved_aside()} batch(es) moved aside" if sched.moved_aside() else ""))
        return row
    finally:
        stage.close(keep_logs=not row.met)


def kill_api_after_ack(admin_url: str | None = None, rounds: int = 8) -> Row:
    """A 2xx means committed. Each round, on a freshly started API: writes read back the
    moment their 2xx arrives (a node only that batch named, a webhook after its 201, a
    token used after its 201 and refused after its revoke's 204); then one more batch, and
    the API killed -9 the moment its 200 arrives, and restarted. Every acknowledged batch
    must then be stored whole, and sending it again must be ``created: false``."""
    row = Row("kill -9 API right after the ack", False)
    stage = Stage("kill-after-ack", admin_url)
    try:
        api = stage.start_api()
        agent_token, reader_token = stage.token("agent"), stage.token("reader")
        acked: list[dict] = []
        misses: list[str] = []
        revoked: list[str] = []
        reads = 0
        for i in range(rounds):
            # Fresh clients each round: the killed API's connections are dead.
            with stage.client(stage.admin) as admin, stage.client(agent_token) as agent, \
                    stage.client(reader_token) as reader:
                reads += _reads_after_ack(stage, admin, agent, reader, f"seen{i}", misses, revoked)
                batch = fleet_batch(prefix=f"ack{i}")
                resp = agent.post("/v1/measurements", json=batch)
                kill9(api)  # the moment the ack is in: nothing after it may be needed
                if resp.status_code != 200:
                    raise RuntimeError(f"batch {i} answered {resp.status_code}: {resp.text[:300]}")
                acked.append(batch)
            api = stage.start_api()
        stored = dict(stage.rows("SELECT batch_id, measurement_count FROM probe_runs "
                                 "WHERE batch_id = ANY(:b)", b=[b["batch_id"] for b in acked]))
        with stage.client(agent_token) as agent:
            again = [agent.post("/v1/measurements", json=b) for b in acked]
        anew = sum(1 for r in again if r.status_code != 200 or r.json().get("created") is not False)
        still_open = sum(1 for t in revoked if _status(stage, t) != 401)
        lost = [b for b in acked if stored.get(b["batch_id"]) != len(b["measurements"])]
        row.results_lost = sum(len(b["measurements"]) - stored.get(b["batch_id"], 0) for b in acked)
        row.survived = bool(not misses and not anew and not still_open and api.poll() is None)
        row.note = (f"{rounds} kills; {len(acked)} batches acknowledged, "
                    f"{len(acked) - len(lost)} found after restart, {len(lost)} lost, "
                    f"{anew} stored anew when resent; {reads} reads right after an ack, "
                    f"{len(misses)} missed"
                    + (f" ({'; '.join(misses[:3])})" if misses else "")
                    + (f"; {still_open} revoked token(s) open again after a restart"
                       if still_open else ""))
        return row
    finally:
        stage.close(keep_logs=not row.met)


def _reads_after_ack(stage: Stage, admin: httpx.Client, agent: httpx.Client,
                     reader: httpx.Client, tag: str, misses: list[str], revoked: list[str]) -> int:
    """Four writes, each followed at once by a request that must see it; what did not is
    added to ``misses``, the revoked token to ``revoked``. Returns the reads made."""
    def must(resp: httpx.Response, code: int, what: str) -> httpx.Response:
        if resp.status_code != code:
            raise RuntimeError(f"{what} answered {resp.status_code}: {resp.text[:300]}")
        return resp

    def expect(code: int, got: int, what: str) -> None:
        if got != code:
            misses.append(f"{what}: {got}, not {code}")

    must(agent.post("/v1/measurements", json=fleet_batch(prefix=tag)), 200, "a batch")
    expect(200, reader.get(f"/v1/nodes/{tag}-000").status_code, f"node {tag}-000 after its batch")
    hook = stage.webhook(admin, "http://127.0.0.1:9/ack", SECRET, HEALTH_EVENTS)
    expect(200, admin.get(f"/v1/webhooks/{hook}").status_code, f"webhook {hook} after its 201")
    made = must(admin.post("/v1/tokens", json={"role": "reader", "name": tag}), 201, "a token").json()
    expect(200, _status(stage, made["token"]), f"token {made['id']} after its 201")
    must(admin.delete(f"/v1/tokens/{made['id']}"), 204, "a revoke")
    expect(401, _status(stage, made["token"]), f"token {made['id']} after its revoke's 204")
    revoked.append(made["token"])
    return 4


def _status(stage: Stage, token: str) -> int:
    with stage.client(token) as c:
        return c.get("/v1/health").status_code


def _notifier_stage(name: str, admin_url: str | None) -> Stage:
    """A stage whose notifiers give up on a request after 1 s (so the claim lease, 3
    timeouts + 5 s, is short) and look for due work every 0.2 s."""
    return Stage(name, admin_url, env={**REACT_AT_ONCE, "RINGWATCH_WEBHOOK_TIMEOUT_S": "1",
                                       "RINGWATCH_NOTIFIER_POLL_S": "0.2"})


def kill_notifier_mid_delivery(admin_url: str | None = None) -> Row:
    """A notifier is killed -9 while its request to a stalled receiver is in flight; a second
    notifier, and more events, follow. Every event arrives once, under its delivery id."""
    row = Row("kill -9 notifier mid-delivery, request unanswered", False)
    stage = _notifier_stage("kill-notifier", admin_url)
    try:
        stage.start_api()
        with WebhookReceiver(SECRET) as rx, stage.client(stage.admin) as admin, \
                stage.client(stage.token("agent")) as agent:
            hook = stage.webhook(admin, rx.url, SECRET, HEALTH_EVENTS)
            rx.delay_s = 30.0  # the first notifier is caught with its request unanswered
            flip_fleets(agent, 3, prefix="a")
            first = stage.spawn("notifier", "notifier")
            in_flight = rx.wait_for_requests(1, timeout_s=60) >= 1
            kill9(first)
            rx.delay_s = 0.0
            second = stage.spawn("notifier", "notifier")
            flip_fleets(agent, 3, prefix="b")  # events that arrive while the claims expire
            settled = wait_until(lambda: deliveries_settled(stage, hook), 90)
            time.sleep(1.0)  # a delivery the receiver recorded is committed a moment later
            c = count_events(stage, rx, hook, HEALTH_EVENTS)
            row.survived = bool(in_flight and settled and second.poll() is None)
            row.events_lost, row.events_doubled = c.lost, c.doubled
            row.note = (f"{c.expected} events, {c.delivered} delivered"
                        + ("" if in_flight else "; no delivery was in flight at the kill")
                        + ("" if settled else f"; {c.pending} still pending")
                        + (f"; {c.unverified} failed signature check" if c.unverified else ""))
            if c.unverified:
                row.survived = False
        return row
    finally:
        stage.close(keep_logs=not row.met)


def kill_notifier_mid_burst(admin_url: str | None = None, fleets: int = 15, kill_after: int = 10) -> Row:
    """A notifier is killed -9 in the middle of a burst to a receiver that answers at once:
    whatever it had in flight may have been answered 2xx but not yet recorded as delivered.
    A second notifier sends those again under the same delivery id (at-least-once: no HTTP
    sender can do better), which a receiver deduplicating on it acts on once; an event sent
    under two ids would be doubled. Nothing may be lost."""
    row = Row("kill -9 notifier mid-burst", False)
    stage = _notifier_stage("kill-notifier-burst", admin_url)
    try:
        stage.start_api()
        with WebhookReceiver(SECRET) as rx, stage.client(stage.admin) as admin, \
                stage.client(stage.token("agent")) as agent:
            hook = stage.webhook(admin, rx.url, SECRET, HEALTH_EVENTS)
            flip_fleets(agent, fleets, prefix="k")
            first = stage.spawn("notifier", "notifier")
            rx.wait_for(kill_after, timeout_s=60)
            kill9(first)
            before_kill = [e["delivery"] for e in rx.events]
            second = stage.spawn("notifier", "notifier")
            settled = wait_until(lambda: deliveries_settled(stage, hook), 90)
            time.sleep(1.0)
            c = count_events(stage, rx, hook, HEALTH_EVENTS)
            again = [e["delivery"] for e in rx.events[len(before_kill):] if e["delivery"] in before_kill]
            row.survived = bool(settled and second.poll() is None and not c.unverified)
            row.events_lost, row.events_doubled = c.lost, c.doubled
            row.note = (f"{c.expected} events, {c.delivered} delivered; killed after {len(before_kill)} "
                        f"were answered; {len(again)} of those sent again under the same delivery "
                        "id (answered 2xx, not yet recorded when the notifier died; deduplicated "
                        "by the id)"
                        + ("" if settled else f"; {c.pending} still pending"))
        return row
    finally:
        stage.close(keep_logs=not row.met)


def kill_scheduler_mid_preflight(admin_url: str | None = None) -> Row:
    """``ringwatch preflight`` waits while the scheduler that claimed its request is killed -9
    with the results of that preflight in flight (the database holds their write back, so
    the kill lands between claim and complete). A second scheduler must answer it once the
    first one's claim lease runs out; the results in flight must be stored."""
    from ringwatch.services.scheduler.cycle import serve_preflight

    lease_s = float(inspect.signature(serve_preflight).parameters["lease_s"].default)
    row = Row("kill -9 scheduler mid-preflight", False)
    stage = Stage("kill-scheduler", admin_url)
    hold = None
    client = None
    try:
        stage.start_api()
        fabric = {"nodes": 4, "gpus_per_node": 2, "seed": 1,
                  "faults": [{"kind": "nic", "node": "node-002", "factor": 0.4}]}
        sched = SimScheduler(stage, fabric, interval_s=3600)
        sched.start()
        if not sched.wait_cycles(1, 90):
            row.note = "the scheduler shipped no cycle"
            return row
        # From here on nothing can store a batch: the first scheduler's preflight results wait.
        hold = stage.engine.connect()
        hold.exec_driver_sql("LOCK TABLE probe_runs IN SHARE ROW EXCLUSIVE MODE")
        nodes = "node-000,node-001,node-002,node-003"
        # Any result is too old for a max age of 1 ms: the request waits for a scheduler.
        client = stage.spawn("preflight", "preflight", "--nodes", nodes, "--max-age", "0.001",
                             "--timeout", str(lease_s * 2 + 300), "--json",
                             env={"RINGWATCH_TOKEN": stage.token("reader")})
        claimed = wait_until(lambda: stage.rows(
            "SELECT id, attempts FROM preflight_requests WHERE status = 'running'"), 60)
        shipping = wait_until(lambda: stage.scalar(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = :d AND wait_event_type = 'Lock'",
            d=stage.db_name), 60, every_s=0.05)
        if not (claimed and shipping):
            row.note = "the scheduler never claimed the request or never shipped its results"
            return row
        kill9(sched.procs[-1])
        in_flight = [json.loads(p.read_text()) for p in sorted(sched.spool.glob("*.json"))]
        hold.rollback()
        hold.close()
        hold = None
        sched.start()
        # The client polls until a verdict; the second scheduler may claim once the lease is out.
        client.wait(timeout=lease_s * 2 + 360)
        out = client.log_path.read_text(errors="replace")  # type: ignore[attr-defined]
        start = re.search(r"^\{", out, re.M)  # the JSON verdict, after the progress lines
        verdict = json.JSONDecoder().raw_decode(out[start.start():])[0] if start else {}
        request_id, _ = claimed[0]
        attempts = stage.scalar("SELECT attempts FROM preflight_requests WHERE id = :i", i=request_id)
        stored = dict(stage.rows("SELECT batch_id, measurement_count FROM probe_runs "
                                 "WHERE batch_id = ANY(:b)", b=[b["batch_id"] for b in in_flight]))
        row.results_lost = sum(len(b["measurements"]) - stored.get(b["batch_id"], 0) for b in in_flight)
        row.survived = (client.returncode in (0, 1) and verdict.get("status") == "done"
                        and verdict.get("exclude") == ["node-002"] and attempts >= 2
                        and sched.alive())
        row.note = (f"verdict {'healthy' if verdict.get('healthy') else 'unhealthy'}, exclude "
                    f"{verdict.get('exclude')}, after {attempts} claims (lease {lease_s:.0f} s); "
                    f"{sum(len(b['measurements']) for b in in_flight)} measurements were in flight")
        if not verdict:
            row.note = f"no verdict (exit {client.returncode}): {out[-300:]}"
        return row
    finally:
        if hold is not None:
            hold.rollback()
            hold.close()
        if client is not None and client.poll() is None:
            stop(client)
        stage.close(keep_logs=not row.met)


def two_notifiers(admin_url: str | None = None, fleets: int = 8, stall_s: float = 30.0) -> Row:
    """Two notifier processes on one database, three webhooks: a healthy receiver, a slow one
    (each request stalls, then is dropped unanswered) and a dead one (a closed port); a
    burst of events. The healthy receiver gets every event once; the slow one, once it
    answers again, gets every event once too; the dead one's deliveries all stay in the log,
    retried, none vanished."""
    row = Row("two notifiers, slow and dead receivers", False)
    stage = Stage("notifiers", admin_url, env={**REACT_AT_ONCE, "RINGWATCH_WEBHOOK_TIMEOUT_S": "2",
                                               "RINGWATCH_NOTIFIER_POLL_S": "0.5"})
    try:
        stage.start_api()
        with WebhookReceiver(SECRET) as healthy, WebhookReceiver(SECRET) as slow, \
                stage.client(stage.admin) as admin, stage.client(stage.token("agent")) as agent:
            dead_url = _closed_port_url()
            slow.delay_s = 1.5  # under the 2 s timeout: each attempt costs the notifier 1.5 s
            hooks = {name: stage.webhook(admin, url, SECRET, HEALTH_EVENTS)
                     for name, url in (("healthy", healthy.url), ("slow", slow.url), ("dead", dead_url))}
            notifiers = [stage.spawn("notifier", "notifier") for _ in range(2)]
            started = time.monotonic()
            flip_fleets(agent, fleets, prefix="n")
            fast = wait_until(lambda: deliveries_settled(stage, hooks["healthy"]), 120)
            # The slow receiver keeps stalling a while: several of its retries in a row, and
            # both notifiers' leases running out under them.
            time.sleep(max(0.0, stall_s - (time.monotonic() - started)))
            slow.delay_s = 0.0  # the slow receiver recovers: its retries must now land
            slow_done = wait_until(lambda: deliveries_settled(stage, hooks["slow"]), 180, every_s=0.5)
            time.sleep(1.0)
            ch = count_events(stage, healthy, hooks["healthy"], HEALTH_EVENTS)
            cs = count_events(stage, slow, hooks["slow"], HEALTH_EVENTS)
            dead = stage.rows("SELECT status, attempts FROM webhook_deliveries WHERE webhook_id = :w",
                              w=hooks["dead"])
            # Not lost: each still in the log, waiting for a retry (or given up on, visibly).
            dead_kept = sum(1 for s, _ in dead if s in ("pending", "failed"))
            dead_tries = sum(a for _, a in dead)
            row.events_lost = ch.lost + cs.lost + (ch.expected - dead_kept)
            row.events_doubled = ch.doubled + cs.doubled
            row.survived = bool(fast and slow_done and all(p.poll() is None for p in notifiers)
                                and not ch.unverified and not cs.unverified)
            row.note = (f"{ch.expected} events; healthy {ch.delivered} (doubled {ch.doubled}), "
                        f"slow {cs.delivered} (doubled {cs.doubled}), dead {dead_kept} kept for retry "
                        f"({dead_tries} attempts so far)"
                        + ("" if fast else "; healthy receiver not served in 120 s")
                        + ("" if slow_done else f"; {cs.pending} slow deliveries still pending"))
        return row
    finally:
        stage.close(keep_logs=not row.met)


def _closed_port_url() -> str:
    from ringwatch.services.cli.api_process import free_port

    return f"http://127.0.0.1:{free_port()}/hook"


def postgres_restart(admin_url: str | None = None, restarts: int = 2) -> Row:
    """A private Postgres cluster, restarted (fast shutdown, 3 s down) ``restarts`` times
    while a sim scheduler ships a batch every half second, health events are raised and
    delivered to a webhook, and a reader polls. Nothing stored is lost, no event is lost or
    sent twice, no request gets a 500, and no process has to be restarted."""
    from bench.chaos.private_pg import PrivatePostgres

    row = Row("Postgres restarted under load", False)
    with PrivatePostgres() as pg:
        stage = Stage("postgres", pg.url, env={**REACT_AT_ONCE, "RINGWATCH_NOTIFIER_POLL_S": "0.5"})
        try:
            api = stage.start_api(notifier=True)
            codes: dict[int, int] = {}
            stop_load = threading.Event()
            with WebhookReceiver(SECRET) as rx, stage.client(stage.admin) as admin, \
                    stage.client(stage.token("agent")) as agent, \
                    stage.client(stage.token("reader"), timeout=10) as reader:
                hook = stage.webhook(admin, rx.url, SECRET, HEALTH_EVENTS)
                sched = SimScheduler(stage, LOAD_FLEET, interval_s=0.5)
                sched.start()
                sent = [0]
                refused: list[str] = []
                events = threading.Thread(target=_flip_until, args=(agent, stop_load, sent, refused))
                reads = threading.Thread(target=_read_until, args=(reader, stop_load, codes))
                events.start()
                reads.start()
                for _ in range(restarts):
                    sched.wait_cycles(len(sched.cycles()) + 2, 90)
                    pg.restart(down_s=3.0)
                sched.wait_cycles(len(sched.cycles()) + 3, 120)
                stop_load.set()
                events.join()
                reads.join()
                survived = sched.alive() and api.poll() is None
                between = sched.stop_between_cycles(90)
                batches, unsent = sched.leftovers()
                if batches:
                    drain(stage, sched, sched.env["RINGWATCH_TOKEN"])
                produced = sum(m for m, _ in sched.cycles()) + unsent + sent[0]
                lost, stored = results_lost(stage, produced)
                settled = wait_until(lambda: deliveries_settled(stage, hook), 120, every_s=0.5)
                time.sleep(1.0)
                c = count_events(stage, rx, hook, HEALTH_EVENTS)
                errors = sum(n for code, n in codes.items() if code >= 500 and code != 503)
                row.survived = bool(survived and settled and not errors and not c.unverified
                                    and not refused)
                row.results_lost, row.events_lost, row.events_doubled = lost, c.lost, c.doubled
                row.note = (f"{restarts} restarts; {produced} measurements produced, {stored} stored; "
                            f"{c.expected} events, {c.delivered} delivered; reader saw "
                            + ", ".join(f"{n}x{code}" for code, n in sorted(codes.items()))
                            + ("" if between else "; scheduler stopped mid-cycle")
                            + ("" if settled else f"; {c.pending} deliveries still pending")
                            + (f"; event batches stopped: {refused[0][:160]}" if refused else ""))
            return row
        finally:
            stage.close(keep_logs=not row.met)


def _flip_until(agent: httpx.Client, stop_load: threading.Event, sent: list[int],
                errors: list[str]) -> None:
    """Health events all through the load: one fleet degraded and recovered at a time."""
    i = 0
    while not stop_load.is_set():
        try:
            sent[0] += flip_fleets(agent, 1, prefix=f"pg{i}-", retry_s=120)
        except RuntimeError as exc:  # a batch refused, or not stored in two minutes
            errors.append(str(exc))
            return
        i += 1
        stop_load.wait(0.5)


def _read_until(reader: httpx.Client, stop_load: threading.Event, codes: dict[int, int]) -> None:
    while not stop_load.is_set():
        try:
            code = reader.get("/v1/links").status_code
        except httpx.HTTPError:
            code = 0  # no answer at all: counted, not an error of the API's
        codes[code] = codes.get(code, 0) + 1
        stop_load.wait(0.2)
