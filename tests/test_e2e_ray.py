"""End to end on real parts: a local Ray cluster of 2 logical nodes probing with gloo,
results shipped to the real API server process, stored in Postgres, read back over HTTP."""

from __future__ import annotations

import os
import uuid

import httpx
import pytest

from services.scheduler.cycle import ProbeOptions, run_cycle
from services.scheduler.ray_backend import RayBackend
from services.scheduler.shipper import Shipper
from tests.procs import free_port, start_server, stop_server

pytestmark = pytest.mark.ray
TOKEN = "rw_e2e_" + uuid.uuid4().hex


@pytest.fixture(scope="module")
def backend(tmp_path_factory):
    with RayBackend("gloo", local_nodes=2, ranks_per_node=2,
                    temp_dir=tmp_path_factory.mktemp("ray")) as b:
        yield b


@pytest.fixture
def api(database_url, clean_db, tmp_path):
    env = {**os.environ, "RINGWATCH_DATABASE_URL": database_url,
           "RINGWATCH_API_URL": f"http://127.0.0.1:{free_port()}",
           "RINGWATCH_BOOTSTRAP_ADMIN_TOKEN": TOKEN, "RINGWATCH_STATE_DIR": str(tmp_path)}
    proc = start_server(env)
    yield env["RINGWATCH_API_URL"]
    stop_server(proc)


def test_probe_cycle_reaches_postgres_and_reads_back(backend, api, tmp_path) -> None:
    cycle = run_cycle(backend, ProbeOptions(sizes=(1 << 18,), warmup=2, iters=5))
    ops = {(m.op, m.scope) for m in cycle.measurements}
    # With two nodes the node pair is the whole set: no separate world group.
    assert ops == {("allreduce", "intra_node"), ("alltoall", "intra_node"),
                   ("allreduce", "inter_node"), ("alltoall", "inter_node")}
    assert all(m.wrong == 0 and m.busbw_gbs > 0 for m in cycle.measurements)
    assert cycle.findings == []

    shipper = Shipper(api, TOKEN, tmp_path / "spool")
    assert shipper.ship(cycle.to_batch()) == 0
    shipper.close()

    headers = {"Authorization": f"Bearer {TOKEN}"}
    nodes = httpx.get(f"{api}/v1/nodes", headers=headers).json()
    assert [(n["name"], [g["local_index"] for g in n["gpus"]]) for n in nodes] == [
        ("node-000", [0, 1]), ("node-001", [0, 1])]
    links = httpx.get(f"{api}/v1/links", headers=headers).json()
    assert {(x["scope"], x["op"]) for x in links} >= {("intra_node", "allreduce"), ("inter_node", "alltoall")}
    world = next(m for m in cycle.measurements if m.scope == "inter_node" and m.op == "allreduce")
    series = httpx.get(f"{api}/v1/series", headers=headers,
                       params={"members": ",".join(world.members), "op": "allreduce"}).json()
    assert len(series["points"]) == 1
    point = series["points"][0]
    assert point["busbw_gbs"] == pytest.approx(world.busbw_gbs)
    # nccl-tests: allreduce busbw = algbw * 2(n-1)/n, with n = 4 ranks here.
    assert point["busbw_gbs"] == pytest.approx(point["algbw_gbs"] * 2 * 3 / 4)
