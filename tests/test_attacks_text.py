"""Text that reaches people, and small process bounds (issue 50, items 7, 8 and 13c-e).

An agent's finding text is rendered for Slack escaped and cut to Slack's limits; every CLI
surface prints agent- or admin-supplied text with its control characters made visible; the
Slurm gate's env file and log refuse links and FIFOs and its drain reason keeps a safe
character set; the notifier's health port binds loopback by default and bounds idle
connections; `ringwatch db upgrade` says what it waits for and gives up after a bound."""

from __future__ import annotations

import os
import re
import socket
import stat
import subprocess
import sys
import threading
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from sqlalchemy import create_engine, text

from ringwatch.services.cli import slurm
from ringwatch.services.cli.errors import CliError
from ringwatch.services.notifier.channels import render_slack
from ringwatch.services.store import db
from tests.api_fixtures import fleet_batch
from tests.procs import cli, running_api

ADMIN = "rw_text_" + uuid.uuid4().hex
# What a terminal acts on: ESC starts CSI/OSC sequences (clear screen, window title, OSC 8
# links), BEL ends an OSC; neither may reach a terminal raw.
RAW = ("\x1b", "\x07", "\x9b")
HOSTILE = ("\x1b[2J\x1b[H\x1b]0;owned\x07\x1b]8;;https://evil.example\x07click\x1b]8;;\x07"
           "\x9b31m")
# What Slack acts on in mrkdwn: mentions, a labelled link, a user ping.
MENTIONS = "<!channel> <!here> <@U024BE7LH> <https://evil.example|click here> & co"


def _raw(text: str) -> list[str]:
    return [c for c in RAW if c in text]


# ---- 7. Slack mrkdwn -------------------------------------------------------------------------


def _texts(obj: Any) -> list[str]:
    """Every string a Slack body carries under a ``text`` key."""
    if isinstance(obj, dict):
        return [v for k, v in obj.items() if k == "text" and isinstance(v, str)] + [
            t for v in obj.values() for t in _texts(v)]
    if isinstance(obj, list):
        return [t for v in obj for t in _texts(v)]
    return []


def _slack_body() -> dict[str, Any]:
    finding = {"kind": "nvlink_degraded", "node": "node-007", "severity": "critical",
               "headline": {"op": "allreduce", "size_bytes": 1 << 28, "busbw_gbs": 12.0,
                            "expected_gbs": 240.0, "ratio": 0.05,
                            "text": f"allreduce 256 MiB: {MENTIONS}"},
               "cause": MENTIONS,
               # 4,257 characters of evidence in one block, as the attack sent.
               "evidence": [f"{MENTIONS} {i:04d}" for i in range(59)]}
    payload = {"finding": finding, "finding_id": 3, "nodes": ["node-007"], "links": [],
               "url": "https://ringwatch.example/v1/findings/3"}
    return render_slack("health.degraded", 12, payload)


def test_slack_text_has_no_live_mention_or_link_and_no_block_over_its_limit() -> None:
    body = _slack_body()
    texts = _texts(body)
    assert texts and len(MENTIONS) * 59 > 4000  # the evidence alone is over Slack's limit
    for t in texts:
        # Slack's control sequences start with < and end with >: none is left to act on.
        assert "<" not in t and ">" not in t, t[:200]
        # & itself is escaped, so no entity is smuggled through as another character.
        assert not re.search(r"&(?!amp;|lt;|gt;)", t), t[:200]
    assert "&lt;!channel&gt;" in body["blocks"][0]["text"]["text"]
    assert "&lt;@U024BE7LH&gt;" in body["blocks"][1]["text"]["text"]
    for block in body["blocks"]:
        if block["type"] == "section":
            assert len(block["text"]["text"]) <= 3000
        if block["type"] == "header":
            assert len(block["text"]["text"]) <= 150
    assert len(body["text"]) <= 3000
    # The long block is cut where it must be, and says so; no entity is cut in half.
    fields = body["blocks"][1]["text"]["text"]
    assert fields.endswith("…") and 2990 <= len(fields) <= 3000
    assert not re.search(r"&[a-z]*$", fields[:-1])
    assert "&amp; co" in body["blocks"][0]["text"]["text"]


def test_the_ordinary_slack_body_is_as_it_was() -> None:
    """A finding with nothing to escape reads as before: the headline ends the first line."""
    payload = {"finding": {"kind": "nic_degraded", "node": "node-011",
                           "headline": {"text": "allreduce 256 MiB: 122 of 238 GB/s (0.51)"}}}
    body = render_slack("health.degraded", 1, payload)
    assert body["text"] == ("[ringwatch] health.degraded: nic_degraded node-011: "
                            "allreduce 256 MiB: 122 of 238 GB/s (0.51)")
    assert "*kind*: nic_degraded" in body["blocks"][1]["text"]["text"]


# ---- 8. terminals ----------------------------------------------------------------------------


@pytest.fixture
def server(database_url, clean_db, tmp_path):
    with running_api(database_url, tmp_path, ADMIN) as env:
        yield env


def _answer_with(factory, verdict: dict[str, Any], stop: threading.Event) -> None:
    """A scheduler that answers every waiting preflight with ``verdict``: the stored result
    the CLI then prints."""
    from ringwatch.services.preflight import service

    while not stop.is_set():
        with db.transaction(factory) as s:
            req = service.claim(s, "hostile-scheduler", 60.0)
            if req is not None:
                service.complete(s, req["id"], "hostile-scheduler", verdict=verdict)
                return
        stop.wait(0.1)


def test_preflight_prints_a_hostile_headline_and_cause_with_control_characters_visible(
        server, clean_db) -> None:
    old = fleet_batch(batch_id="old")
    for m in old["measurements"]:
        # Known nodes, no fresh results: the preflight waits for a scheduler.
        m["time"] = (datetime.now(UTC) - timedelta(days=2)).isoformat()
    httpx.post(f"{server['RINGWATCH_API_URL']}/v1/measurements", json=old,
               headers={"Authorization": f"Bearer {ADMIN}"}).raise_for_status()
    finding = {"kind": "nvlink_degraded", "node": "node-001", "severity": "critical",
               "gpus": [0, 1], "measured_gbs": 1.0, "expected_gbs": 10.0,
               "headline": {"op": "allreduce", "size_bytes": 1 << 20, "busbw_gbs": 1.0,
                            "expected_gbs": 10.0, "ratio": 0.1, "text": f"head {HOSTILE}"},
               "cause": f"cause {HOSTILE}"}
    verdict = {"healthy": False, "backend": "gloo", "nodes_checked": 2, "exclude": ["node-001"],
               "findings": [finding], "rounds": 1, "duration_s": 1.0}
    stop = threading.Event()
    answering = threading.Thread(target=_answer_with, args=(clean_db, verdict, stop), daemon=True)
    answering.start()
    try:
        r = cli("preflight", "--nodes", "node-000,node-001", "--max-age", "60", "--timeout", "60",
                env=server)
    finally:
        stop.set()
        answering.join(10)
    assert r.returncode == 1, r.stderr
    assert not _raw(r.stdout) and not _raw(r.stderr), r.stdout
    assert "head \\x1b[2J" in r.stdout and "cause \\x1b[2J\\x1b[H\\x1b]0;owned\\x07" in r.stdout


def test_token_list_prints_a_hostile_name_with_control_characters_visible(
        database_url, clean_db, tmp_path) -> None:
    from ringwatch.services.store import tokens

    with db.transaction(clean_db) as s:
        tokens.issue(s, "reader", f"ci {HOSTILE}")
    env = {**os.environ, "RINGWATCH_DATABASE_URL": database_url,
           "RINGWATCH_STATE_DIR": str(tmp_path)}
    r = cli("token", "list", env=env)
    assert r.returncode == 0, r.stderr
    assert not _raw(r.stdout), r.stdout
    assert "ci \\x1b[2J" in r.stdout
    revoked = cli("token", "revoke", r.stdout.splitlines()[1].split()[0], env=env)
    assert revoked.returncode == 0 and not _raw(revoked.stdout), revoked.stdout


def test_every_text_surface_shows_control_characters_instead_of_acting_on_them(capsys) -> None:
    """The verdict, the rank-map check, the selftest report, the status table and the
    Slurm decision log, each given hostile strings where an agent or admin supplies them."""
    from ringwatch.services.cli import status
    from ringwatch.services.cli.commands import _print_rankmap
    from ringwatch.services.cli.output import print_verdict

    print_verdict({"healthy": False, "nodes_checked": 1, "backend": "gloo",
                   "exclude": [f"n{HOSTILE}"], "suspects": [HOSTILE], "unprobed": [HOSTILE],
                   "contended": [HOSTILE],
                   "findings": [{"kind": "nvlink_degraded", "node": HOSTILE,
                                 "headline": {"text": HOSTILE}, "cause": HOSTILE,
                                 "severity": HOSTILE},
                                {"kind": "fabric_below_rated", "scope": HOSTILE,
                                 "reason": HOSTILE}]}, as_json=False)
    _print_rankmap({"ok": False, "ranks": 2, "hosts": 1, "skipped": [HOSTILE],
                    "findings": [{"problem": "unknown_host", "node": HOSTILE, "ranks": [0],
                                  "severity": "critical"}]}, as_json=False)
    out = capsys.readouterr()
    assert not _raw(out.out + out.err), out.out

    now = status.datetime.now(status.UTC)
    fleet = status.FleetStatus(
        "http://api", {"status": "degraded", "nodes": 1, "links": {},
                       "tokens_expiring": [{"name": HOSTILE, "role": "reader", "id": 1,
                                            "expires_at": now.isoformat()}]},
        [{"id": 1, "kind": "nvlink_degraded", "severity": "critical", "nodes": [HOSTILE],
          "opened_at": now.isoformat(), "detail": {"headline": {"text": HOSTILE},
                                                   "cause": HOSTILE}}],
        {HOSTILE: now}, {}, now)
    assert not _raw(status.plain(fleet))

    log = slurm.DecisionLog(None, "prolog")
    log(f"job 1 on node-001: no answer ({HOSTILE})")
    assert not _raw(capsys.readouterr().err)


def test_the_selftest_report_shows_control_characters_instead_of_acting_on_them() -> None:
    from ringwatch.agents.spec import Finding
    from ringwatch.services.selftest import report
    from ringwatch.services.selftest.runner import SelftestResult

    result = SelftestResult(node="n0", backend="gloo", worlds=[],
                            gpus=[{"available": False, "reason": HOSTILE}],
                            telemetry_findings=[Finding(kind="probe_error", node="n0", gpu=0,
                                              detail={"error": HOSTILE, "other": HOSTILE})])
    assert not _raw(report.format_text(result, None, HOSTILE))


# ---- 13c. the Slurm gate's files and reason --------------------------------------------------


GOOD_ENV = "RINGWATCH_API_URL=http://rw.test\nRINGWATCH_TOKEN=t\n"


def _no_hang(fn, *args, timeout_s: float = 20.0) -> BaseException | Any:
    """``fn(*args)`` in a thread; its result or exception, failing the test if it hangs."""
    box: list[Any] = []

    def run() -> None:
        try:
            box.append(fn(*args))
        except BaseException as exc:  # noqa: BLE001 (the test looks at it)
            box.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout_s)
    assert box, f"{fn.__name__} hung on its input"
    return box[0]


def test_the_env_file_is_never_read_through_a_link_or_a_fifo(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere.env"
    target.write_text(GOOD_ENV)
    target.chmod(0o600)
    link = tmp_path / "prolog.env"
    link.symlink_to(target)
    got = _no_hang(slurm.read_env_file, link)
    assert isinstance(got, CliError) and "symbolic link" in str(got), got

    fifo = tmp_path / "fifo.env"
    os.mkfifo(fifo, 0o600)
    got = _no_hang(slurm.read_env_file, fifo)  # a FIFO no one writes would block a read
    assert isinstance(got, CliError) and "not a regular file" in str(got), got

    big = tmp_path / "big.env"
    big.write_text(GOOD_ENV + "# " + "x" * (slurm.MAX_ENV_FILE_BYTES + 10) + "\n")
    big.chmod(0o600)
    got = _no_hang(slurm.read_env_file, big)
    assert isinstance(got, CliError) and "larger than" in str(got), got

    fine = tmp_path / "fine.env"
    fine.write_text(GOOD_ENV)
    fine.chmod(0o600)
    assert slurm.read_env_file(fine)["RINGWATCH_TOKEN"] == "t"


def test_the_decision_log_is_never_written_through_a_link_or_into_a_fifo(tmp_path: Path,
                                                                           capsys) -> None:
    outside = tmp_path / "outside"
    outside.write_text("precious\n")
    link = tmp_path / "decisions.log"
    link.symlink_to(outside)
    config = slurm.GateConfig(api_url="http://rw.test", token="t", log_file=str(link))
    _no_hang(slurm.DecisionLog(config, "prolog"), "drained node-001")
    assert outside.read_text() == "precious\n"
    assert "cannot write" in capsys.readouterr().err

    fifo = tmp_path / "fifo.log"
    os.mkfifo(fifo, 0o600)
    config = slurm.GateConfig(api_url="http://rw.test", token="t", log_file=str(fifo))
    _no_hang(slurm.DecisionLog(config, "prolog"), "drained node-001")  # no reader: no hang
    assert "cannot write" in capsys.readouterr().err

    fresh = tmp_path / "fresh.log"
    config = slurm.GateConfig(api_url="http://rw.test", token="t", log_file=str(fresh))
    slurm.DecisionLog(config, "prolog")("drained node-001")
    slurm.DecisionLog(config, "prolog")("drained node-002")
    assert stat.S_IMODE(fresh.stat().st_mode) == 0o600
    assert fresh.read_text().count("drained node-00") == 2


def test_the_drain_reason_keeps_a_safe_character_set() -> None:
    verdict = {"exclude": ["n1"], "findings": [{
        "kind": "probe_error", "node": "n1",
        "headline": {"text": "x $(reboot) `id`; rm -rf / | mail evil@x & <b> \\ {a} 'q' \"q\""}}]}
    reason = slurm.reason_for(verdict, "n1")
    assert reason is not None and reason.startswith("ringwatch: probe_error n1 x")
    assert not set(reason) & set("$`;|&<>\\{}'\"\n\x1b"), reason
    # What ringwatch itself writes survives: the figures, a cause, a count of more.
    ok = {"exclude": ["n1"], "findings": [
        {"kind": "nic_errors", "node": "n1", "severity": "critical",
         "cause": "mlx5_0 port 1 symbol_error +500 in 300 s (1.67/s, threshold 40% of packets)"},
        {"kind": "hang", "node": "n1", "gpu": 1}]}
    assert slurm.reason_for(ok, "n1") == (
        "ringwatch: nic_errors n1 mlx5_0 port 1 symbol_error +500 in 300 s (1.67/s, threshold "
        "40% of packets) (+1 more)")


# ---- 13d. the notifier's health port ---------------------------------------------------------


def test_the_notifier_health_port_binds_loopback_by_default() -> None:
    from ringwatch.services.cli.main import build_parser

    args = build_parser().parse_args(["notifier", "--health-port", "8421"])
    assert args.health_host == "127.0.0.1"


def _notifier_port() -> Any:
    from ringwatch.services.notifier.health import NotifierHealth

    stub = SimpleNamespace(came_round=time.monotonic(), box=None)
    health = NotifierHealth(stub, create_engine("postgresql+psycopg://nobody@unused/none"), 1.0)
    return health.serve("127.0.0.1", 0), "/healthz"


def _scheduler_port() -> Any:
    from ringwatch.services.scheduler.watch import SchedulerWatch

    return SchedulerWatch("a", "sched-a:1", 300.0, host="sched-a").serve("127.0.0.1", 0), "/metrics"


@pytest.mark.parametrize("start", [_notifier_port, _scheduler_port], ids=["notifier", "scheduler"])
def test_idle_connections_do_not_grow_threads_and_healthz_still_answers(start: Any) -> None:
    from ringwatch.services.health_port import MAX_CONNECTIONS

    before = threading.active_count()
    server, path = start()
    port = server.server_address[1]
    idle: list[socket.socket] = []
    try:
        for _ in range(200):  # connect, send nothing, keep the socket
            idle.append(socket.create_connection(("127.0.0.1", port), timeout=10))
        time.sleep(1.0)  # let the server accept what it will
        grown = threading.active_count() - before
        assert grown <= MAX_CONNECTIONS + 2, f"{grown} threads for 200 idle connections"
        r = httpx.get(f"http://127.0.0.1:{port}{path}", timeout=30)
        assert r.status_code == 200
    finally:
        for s in idle:
            s.close()
        server.shutdown()


def test_an_idle_connection_is_closed_after_the_read_timeout(monkeypatch) -> None:
    from ringwatch.services.notifier import health as module

    monkeypatch.setattr(module, "READ_TIMEOUT_S", 0.5)
    stub = SimpleNamespace(came_round=time.monotonic(), box=None)
    health = module.NotifierHealth(stub, create_engine("postgresql+psycopg://x@unused/n"), 1.0)
    server = health.serve("127.0.0.1", 0)
    try:
        s = socket.create_connection(("127.0.0.1", server.server_address[1]), timeout=30)
        s.settimeout(30)
        started = time.monotonic()
        assert s.recv(1) == b""  # the server hung up on it
        assert time.monotonic() - started < 20
        s.close()
    finally:
        server.shutdown()


def test_the_kubelet_probes_a_notifier_that_listens_on_the_pod_address() -> None:
    """A kubelet probes the pod's IP: the manifest names an address other than loopback."""
    import yaml

    from ringwatch.services.cli.main import build_parser

    path = Path(__file__).resolve().parents[1] / "deploy/kubernetes/base/notifier.yaml"
    (c,) = yaml.safe_load(path.read_text())["spec"]["template"]["spec"]["containers"]
    args = build_parser().parse_args(c["args"][1:])
    assert args.health_host == "0.0.0.0" and args.health_port == 8421


# ---- 13e. db upgrade on a held lock ----------------------------------------------------------


def test_db_upgrade_says_who_holds_the_migration_lock_and_gives_up_after_its_bound(
        admin_url: str) -> None:
    name = f"rw_lock_{uuid.uuid4().hex[:10]}"
    url = db.create_database(admin_url, name)
    engine = create_engine(db.normalize_url(url))
    try:
        with engine.connect() as holder:
            holder.execute(text("SET application_name = 'held-by-test'"))
            holder.execute(text("SELECT pg_advisory_lock(:k)"), {"k": db.MIGRATION_LOCK})
            holder.commit()
            pid = holder.execute(text("SELECT pg_backend_pid()")).scalar()
            env = {**os.environ, "RINGWATCH_DATABASE_URL": url}
            started = time.monotonic()
            r = subprocess.run([sys.executable, "-m", "ringwatch.services.cli.main", "db", "upgrade",
                                "--lock-timeout", "2"], env=env, capture_output=True, text=True,
                               timeout=120)
            took = time.monotonic() - started
            assert r.returncode != 0, r.stdout
            lines = r.stderr.strip().splitlines()
            assert len(lines) == 2, r.stderr
            assert "waiting for the migration lock" in lines[0] and f"pid {pid}" in lines[0]
            assert "held-by-test" in lines[0]
            assert "2 s" in lines[1] and f"pid {pid}" in lines[1]
            assert took < 90
            assert db.current_revision(url) is None  # it migrated nothing
            # The setting does what the flag does.
            r = subprocess.run([sys.executable, "-m", "ringwatch.services.cli.main", "db", "upgrade"],
                               env={**env, "RINGWATCH_MIGRATION_LOCK_TIMEOUT_S": "1"},
                               capture_output=True, text=True, timeout=120)
            assert r.returncode != 0 and "after 1 s" in r.stderr, r.stderr
            holder.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": db.MIGRATION_LOCK})
            holder.commit()
        # Released: the same command migrates, silently about the lock.
        r = subprocess.run([sys.executable, "-m", "ringwatch.services.cli.main", "db", "upgrade",
                            "--lock-timeout", "5"], env=env, capture_output=True, text=True,
                           timeout=300)
        assert r.returncode == 0 and "waiting" not in r.stderr, r.stderr
        assert db.current_revision(url) == db.head_revision()
    finally:
        engine.dispose()
        db.drop_database(admin_url, name)
