"""`--address`: the backend joins a Ray cluster it did not start and names nodes by hostname."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from agents.spec import GroupSpec
from services.scheduler.ray_backend import RayBackend, ray_temp_dir

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    from ray.cluster_utils import Cluster

    Path("/tmp/ray").mkdir(parents=True, exist_ok=True)
    c = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "include_dashboard": False,
        "temp_dir": str(ray_temp_dir(tmp_path_factory.mktemp("ray")))})
    c.add_node(num_cpus=1)
    yield c
    c.shutdown()


def test_join_names_nodes_by_hostname_and_probes(cluster) -> None:
    with RayBackend("gloo", address=cluster.address, ranks_per_node=1) as backend:
        ranks = backend.ranks()
        host = socket.gethostname()
        # Two raylets on one host still get distinct node names.
        assert sorted(r.node for r in ranks) == sorted([host, f"{host}-2"])
        assert all(r.hostname == host for r in ranks)
        where = backend.placement()
        assert len({w["ray_node_id"] for w in where.values()}) == 2
        result = backend.run_round([GroupSpec("inter_node", tuple(r.member for r in ranks),
                                              sizes=(1 << 16,), warmup=1, iters=3)])
        assert result.findings == []
        assert {m.op for m in result.measurements} == {"allreduce", "alltoall"}
        assert all(m.wrong == 0 and m.busbw_gbs > 0 for m in result.measurements)
    # Closing the backend leaves the cluster it joined running.
    assert cluster.head_node is not None and cluster.head_node.remaining_processes_alive()
