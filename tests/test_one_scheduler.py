"""One active scheduler per fleet, end to end: two real `ringwatch scheduler` processes
(separate state folders, as on two hosts) against one real API and Postgres; one leads,
the other stands by, and takes over after the leader's kill -9 (docs/operations.md, "One
scheduler per fleet")."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import pytest

from tests.procs import running_api

ADMIN = "rw_one_sched_" + uuid.uuid4().hex
INTERVAL_S = 4
LEASE_S = 6
# A fault seen from the fleet's first cycle: the default hysteresis opens its incident on
# the fleet's second cycle, never on the first (two schedulers' first cycles would have).
FABRIC = {"nodes": 6, "gpus_per_node": 2, "seed": 4, "noise": 0.02,
          "faults": [{"kind": "nic", "node": "node-004", "factor": 0.4}]}


@pytest.fixture
def server(database_url, clean_db, tmp_path):
    with running_api(database_url, tmp_path, ADMIN) as env:
        yield {**env, "factory": clean_db}


def stored_batches(server) -> int:
    from sqlalchemy import text

    from ringwatch.services.store import db

    with db.transaction(server["factory"]) as s:
        return int(s.execute(text("SELECT count(*) FROM probe_runs")).scalar() or 0)


def start(env: dict[str, str], fabric: Path, state: Path, log: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "ringwatch.services.cli.main", "scheduler", "--fabric", str(fabric),
         "--interval", str(INTERVAL_S), "--health-port", "0", "--health-host", "127.0.0.1"],
        env={**env, "RINGWATCH_STATE_DIR": str(state), "RINGWATCH_SCHEDULER_LEASE_S": str(LEASE_S)},
        stdout=subprocess.DEVNULL, stderr=log.open("w"))


def watch_url(log: Path) -> str:
    found = re.search(r"health and metrics at (http://127\.0\.0\.1:\d+)", log.read_text())
    assert found, log.read_text()[-2000:]
    return found[1]


def leader_metric(log: Path) -> float:
    text = httpx.get(f"{watch_url(log)}/metrics").text
    return float(re.search(r'^ringwatch_scheduler_leader\{[^}]*\} (\S+)$', text, re.M)[1])


def cycles_in(log: Path) -> list[int]:
    return [int(n) for n in re.findall(r" cycle (\d+): \d+ rounds", log.read_text())]


def wait_for(ready, timeout: float, why: str) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if ready():
            return
        time.sleep(0.25)
    raise AssertionError(why)


def test_two_schedulers_run_each_cycle_once_and_the_standby_takes_over(server, tmp_path) -> None:
    api, h = server["RINGWATCH_API_URL"], {"Authorization": f"Bearer {ADMIN}"}
    fabric = tmp_path / "fabric.json"
    fabric.write_text(json.dumps(FABRIC))
    logs = [tmp_path / "a.log", tmp_path / "b.log"]
    env = {k: v for k, v in server.items() if k != "factory"}
    procs = [start(env, fabric, tmp_path / f"state-{i}", logs[i]) for i in (0, 1)]
    try:
        # The fleet's first cycle opens nothing: a fault needs two bad cycles of three, and
        # only one scheduler's cycle counts (two schedulers' first cycles would have met it).
        wait_for(lambda: any(cycles_in(x) for x in logs), 60, "no first cycle")
        first = httpx.get(f"{api}/v1/scheduler/fleets", headers=h).json()[0]
        if first["cycle"] == 1:
            assert httpx.get(f"{api}/v1/findings", headers=h).json() == []
        # Three fleet cycles.
        wait_for(lambda: sum(len(cycles_in(x)) for x in logs) >= 3, 90, "no three cycles")
        ran = [cycles_in(x) for x in logs]
        leader = 0 if ran[0] else 1
        standby = 1 - leader
        assert ran[standby] == [], "both schedulers probed"
        assert ran[leader] == list(range(1, len(ran[leader]) + 1))
        assert "standing by" in logs[standby].read_text()
        # Each says what it is where a monitor looks.
        assert (leader_metric(logs[leader]), leader_metric(logs[standby])) == (1.0, 0.0)
        for log in logs:
            assert httpx.get(f"{watch_url(log)}/healthz").status_code == 200
        scrape = httpx.get(f"{watch_url(logs[leader])}/metrics").text
        assert re.search(r'^ringwatch_scheduler_last_ingest_status\{[^}]*\} 200(\.0)?$', scrape, re.M)
        assert re.search(r'^ringwatch_scheduler_nodes\{[^}]*state="probed"[^}]*\} 6(\.0)?$', scrape, re.M)
        # Exactly one batch a cycle: the fleet's counter and the stored batches agree.
        fleets = httpx.get(f"{api}/v1/scheduler/fleets", headers=h).json()
        (fleet,) = fleets
        assert stored_batches(server) in (fleet["cycle"], fleet["cycle"] - 1)  # one in flight
        assert fleet["cycle"] >= len(ran[leader])
        incidents = httpx.get(f"{api}/v1/findings", headers=h).json()
        assert [(x["kind"], x["nodes"]) for x in incidents] == [("nic_degraded", ["node-004"])]

        # kill -9 the leader: the standby runs the fleet's next cycle within two leases
        # (plus one interval and the time a cycle takes here).
        last = max(ran[leader])
        last_now = max(cycles_in(logs[leader]))
        os.kill(procs[leader].pid, signal.SIGKILL)
        procs[leader].wait(10)
        wait_for(lambda: cycles_in(logs[standby]), 2 * LEASE_S + INTERVAL_S + 30,
                 "the standby never took over")
        took = cycles_in(logs[standby])[0]
        assert took in (last_now + 1, last_now + 2) and took > last
        assert "leading" in logs[standby].read_text()
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(30)
                except subprocess.TimeoutExpired:
                    p.kill()


def test_a_clean_stop_hands_the_fleet_over_at_once(server, tmp_path) -> None:
    api, h = server["RINGWATCH_API_URL"], {"Authorization": f"Bearer {ADMIN}"}
    fabric = tmp_path / "fabric.json"
    fabric.write_text(json.dumps(FABRIC))
    env = {k: v for k, v in server.items() if k != "factory"}
    first = start(env, fabric, tmp_path / "s1", tmp_path / "1.log")
    try:
        wait_for(lambda: cycles_in(tmp_path / "1.log"), 60, "no first cycle")
        first.send_signal(signal.SIGTERM)
        assert first.wait(60) == 0
        fleet = httpx.get(f"{api}/v1/scheduler/fleets", headers=h).json()[0]
        assert fleet["holder"] is None  # handed back: the next one need not wait a lease
    finally:
        if first.poll() is None:
            first.kill()
