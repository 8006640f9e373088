"""A busy fleet end to end: the real `ringwatch scheduler` (sim backend, its scenario's jobs
as the occupancy source) -> the real API -> Postgres, at default settings, 256 x 8, 60 % of
the nodes in jobs over cycles 1-4, faults on idle and on busy nodes, 7 cycles
(bench/busy_fleet.py prints the same run's figures at 1024 x 8)."""

from __future__ import annotations

import json
import uuid

import httpx
import pytest

from bench.busy_fleet import (
    AFTER_JOB,
    IDLE_BY,
    JOB_CYCLES,
    bound,
    busy_nodes,
    judge,
    run_fleet,
    scenario,
)
from tests.procs import api_env, start_server, stop_server

pytestmark = pytest.mark.slow
TOKEN = "rw_busy_" + uuid.uuid4().hex
NODES = 256


@pytest.fixture(scope="module")
def fleet_run(admin_url, tmp_path_factory):
    """Seven cycles of the busy fleet on a database of its own, and what the API showed
    after each."""
    from ringwatch.services.store import db

    name = f"rw_busy_{uuid.uuid4().hex[:12]}"
    url = db.create_database(admin_url, name)
    tmp = tmp_path_factory.mktemp("busy")
    sc = scenario(NODES)
    fabric = tmp / "fabric.json"
    fabric.write_text(json.dumps(sc))
    try:
        db.upgrade(url)
        # Every scrape reads the database: each look must see its own cycle.
        env = {**api_env(url, tmp, TOKEN), "RINGWATCH_METRICS_CACHE_S": "0"}
        server = start_server(env)
        try:
            with httpx.Client(base_url=env["RINGWATCH_API_URL"], timeout=120,
                              headers={"Authorization": f"Bearer {TOKEN}"}) as api:
                looks = run_fleet(env, api, fabric)
        finally:
            stop_server(server)
    finally:
        db.drop_database(admin_url, name)
    return sc, looks


def test_no_incident_names_a_healthy_busy_node_and_no_healthy_node_reads_unhealthy(fleet_run):
    sc, looks = fleet_run
    outcome = judge(sc, looks)
    assert outcome.false_busy == []
    assert outcome.healthy_zero == []


def test_idle_faults_open_by_cycle_two_and_busy_faults_within_two_cycles_of_their_job(fleet_run):
    sc, looks = fleet_run
    outcome = judge(sc, looks)
    busy = busy_nodes(sc)
    for i, fault in enumerate(sc["faults"]):
        nodes = [fault["node"]] if "node" in fault else fault["nodes"]
        on_busy = bool(set(nodes) & busy)
        assert bound(fault, sc) == (JOB_CYCLES[1] + AFTER_JOB if on_busy else IDLE_BY)
        assert outcome.opened[i] is not None, f"{fault} never opened"
        assert outcome.opened[i] <= bound(fault, sc), (fault, outcome.opened[i])
        if on_busy:  # not probed, so not found, while its job ran
            assert outcome.opened[i] > JOB_CYCLES[1], (fault, outcome.opened[i])


def test_a_busy_nodes_last_probe_time_stands_still_while_its_job_runs(fleet_run):
    sc, looks = fleet_run
    assert judge(sc, looks).moved == []
    after = looks[JOB_CYCLES[1]]  # the first cycle after the jobs: every node probed
    assert busy_nodes(sc) <= set(after.last_probe)


def test_busy_nodes_are_shown_busy_with_their_job_while_it_runs_and_idle_after(fleet_run):
    sc, looks = fleet_run
    busy = busy_nodes(sc)
    for x in looks:
        if x.cycle <= JOB_CYCLES[1]:
            assert set(x.occupied) == busy and x.skipped == len(busy)
            assert {o["source"] for o in x.occupied.values()} == {"sim"}
            assert {o["job"] for o in x.occupied.values()} == {j["id"] for j in sc["jobs"]}
            assert all(o["since"] for o in x.occupied.values())
        else:
            assert x.occupied == {} and x.skipped == 0
