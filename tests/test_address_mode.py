"""`--address`: the backend joins a Ray cluster it did not start and names nodes by hostname."""

from __future__ import annotations

import socket
import sys
from pathlib import Path

import pytest

from ringwatch.agents.spec import GroupSpec
from ringwatch.services.scheduler.ray_backend import RayBackend, ray_temp_dir

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


def test_auto_names_the_cluster_it_resolved_and_where_from(cluster, monkeypatch) -> None:
    monkeypatch.setenv("RAY_ADDRESS", cluster.address)
    said: list[str] = []
    with RayBackend("gloo", address="auto", ranks_per_node=1, progress=said.append) as backend:
        assert len(backend.ranks()) == 2
    assert f"ray: joined auto ({cluster.address}, from RAY_ADDRESS): 2 ranks" in said


def test_auto_with_nothing_to_resolve_says_where_it_looked(monkeypatch, tmp_path) -> None:
    from ringwatch.agents.spec import ProbeSetupError
    from ringwatch.services.scheduler import ray_backend

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(ray_backend, "RAY_CURRENT_CLUSTER", tmp_path / "ray_current_cluster")
    with pytest.raises(ProbeSetupError, match="RAY_ADDRESS is not set and no head on this "
                                              "machine wrote .*ray_current_cluster"):
        RayBackend("gloo", address="auto", ranks_per_node=1)


def test_a_local_cluster_is_not_left_where_auto_looks(cluster, tmp_path) -> None:
    """ringwatch's own local cluster is its command's alone: while it runs and after, the
    machine's current-cluster record is what it was (here: the cluster of this module)."""
    from ringwatch.services.scheduler.ray_backend import RAY_CURRENT_CLUSTER

    RAY_CURRENT_CLUSTER.write_text(cluster.address)
    with RayBackend("gloo", local_nodes=1, ranks_per_node=1, temp_dir=tmp_path / "ray") as b:
        assert b._cluster is not None and b._cluster.address != cluster.address
        assert RAY_CURRENT_CLUSTER.read_text() == cluster.address
    assert RAY_CURRENT_CLUSTER.read_text() == cluster.address


def test_a_cluster_of_another_ray_version_is_refused_in_one_line(cluster, monkeypatch) -> None:
    """Ray's own check, with this process's Ray version changed at the one call that reports
    it: the refusal names both versions and the install that joins."""
    import ray

    from ringwatch.agents.spec import ProbeSetupError

    real = ray._private.utils.compute_version_info
    monkeypatch.setattr(ray._private.utils, "compute_version_info",
                        lambda: ("2.0.0", real()[1]))
    with pytest.raises(ProbeSetupError) as caught:
        RayBackend("gloo", address=cluster.address, ranks_per_node=1)
    text = str(caught.value)
    assert "\n" not in text
    assert f"runs Ray {ray.__version__}, this environment Ray 2.0.0" in text
    assert f"({sys.executable} -m pip install ray=={ray.__version__})" in text
    assert not ray.is_initialized()


def test_the_ranks_follow_the_nodes_of_the_cluster_joined(tmp_path_factory) -> None:
    """A node whose worker joins after the scheduler started (a new GPU node's DaemonSet pod)
    gets agents at the next refresh and is probed; one that leaves takes its ranks with it
    and the rest go on; no restart of the scheduler either way."""
    import time

    import ray
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "include_dashboard": False,
        "temp_dir": str(ray_temp_dir(tmp_path_factory.mktemp("ray")))})
    said: list[str] = []
    try:
        with RayBackend("gloo", address=c.address, ranks_per_node=1,
                        progress=said.append) as backend:
            (first,) = backend.ranks()
            node = c.add_node(num_cpus=1)
            c.wait_for_nodes()
            backend.refresh_ranks(max_age_s=0)
            ranks = backend.ranks()
            assert len(ranks) == 2 and first in ranks  # the first node kept its name
            assert any("1 rank(s) joined" in line for line in said), said
            result = backend.run_round([GroupSpec("inter_node", tuple(r.member for r in ranks),
                                                  sizes=(1 << 16,), warmup=1, iters=3)])
            assert result.findings == [] and result.measurements

            c.remove_node(node)
            deadline = time.monotonic() + 60
            while any(n["Alive"] for n in ray.nodes() if n["NodeID"] == node.node_id):
                assert time.monotonic() < deadline, "Ray never saw the node go"
                time.sleep(0.2)
            backend.refresh_ranks(max_age_s=0)
            assert backend.ranks() == [first]
            assert any("1 rank(s) left with their node" in line for line in said), said
            result = backend.run_round([GroupSpec("intra_node", (first.member,),
                                                  sizes=(1 << 16,), warmup=1, iters=3)])
            assert result.findings == []
    finally:
        c.shutdown()
