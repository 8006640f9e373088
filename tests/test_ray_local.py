"""Local clusters stay local: everything `ringwatch probe --local` starts (its Ray cluster,
the command itself as Ray's driver, the probe agents, their gloo groups and the store each
group meets in) listens on the loopback address alone, seen from outside the command while
it runs; and the store a local group meets in listens only where it is told. A shared cluster
started with Ray's token lets in the scheduler that has it, and refuses in one line the one
that has not."""

from __future__ import annotations

import contextlib
import datetime
import ipaddress
import json
import os
import secrets
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import ray
import torch.distributed as dist
import yaml

from ringwatch.agents.probe import store_server
from ringwatch.services.scheduler.ray_backend import ray_temp_dir, refused
from tests.procs import cli

BASE = Path(__file__).resolve().parents[1] / "deploy" / "kubernetes" / "base"

# (pid, process name, address, port)
Listener = tuple[int, str, str, int]


def listening(processes: list[psutil.Process]) -> set[Listener]:
    """The listening TCP sockets and unconnected UDP sockets of ``processes``."""
    found: set[Listener] = set()
    for proc in processes:
        try:
            name = proc.name()
            sockets = proc.net_connections(kind="inet")
        except psutil.Error:  # ended meanwhile
            continue
        for s in sockets:
            if s.status == psutil.CONN_LISTEN or (s.type == socket.SOCK_DGRAM and not s.raddr):
                found.add((proc.pid, name, s.laddr.ip, s.laddr.port))
    return found


def is_loopback(ip: str) -> bool:
    address = ipaddress.ip_address(ip)
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped  # ::ffff:127.0.0.1, a dual-stack socket's view
    return address.is_loopback


def test_is_loopback_tells_every_interface_from_loopback() -> None:
    assert all(map(is_loopback, ("127.0.0.1", "::1", "::ffff:127.0.0.1")))
    assert not any(map(is_loopback, ("0.0.0.0", "::", "10.1.2.3", "::ffff:10.1.2.3")))


def test_a_local_store_listens_on_loopback_alone() -> None:
    me = psutil.Process()
    before = {(ip, port) for _, _, ip, port in listening([me])}
    store = store_server("127.0.0.1", 10.0, listen_there_only=True)
    client = dist.TCPStore("127.0.0.1", store.port, None, False,
                           timeout=datetime.timedelta(seconds=10))
    client.set("arrived/1", "node-000/1")
    assert store.get("arrived/1") == b"node-000/1"
    now = {(ip, port) for _, _, ip, port in listening([me])}
    assert now - before == {("127.0.0.1", store.port)}


@pytest.mark.ray
def test_probe_local_listens_on_loopback_alone(tmp_path: Path) -> None:
    # A hung rank holds its group, and the group's store, open until its deadline: long
    # enough for the watch below to see what a round listens on, not only the cluster.
    out, err = tmp_path / "stdout", tmp_path / "stderr"
    with out.open("w") as stdout, err.open("w") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-m", "ringwatch.services.cli.main", "probe", "--local", "2",
             "--gpus-per-node", "2", "--json", "--ops", "allreduce", "--sizes", "64K",
             "--iters", "2", "--warmup", "1",
             "--inject", '{"kind": "hang", "node": "node-001", "gpu": 1}'],
            env={**os.environ, "RINGWATCH_STATE_DIR": str(tmp_path / "state")},
            stdout=stdout, stderr=stderr)
    seen: set[Listener] = set()
    try:
        root = psutil.Process(proc.pid)
        until = time.monotonic() + 300
        while proc.poll() is None and time.monotonic() < until:
            # The command may end between poll() and here.
            with contextlib.suppress(psutil.NoSuchProcess):
                seen |= listening([root, *root.children(recursive=True)])
            time.sleep(0.2)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=60)
    assert proc.returncode == 1, err.read_text()[-3000:]
    findings = json.loads(out.read_text())["findings"]
    assert ("hang", "node-001", 1) in {(f["kind"], f["node"], f["gpu"]) for f in findings}

    # The watch saw each kind of process that listens: Ray's GCS and raylets, the agents
    # (their gloo groups), and the driver, which holds Ray's connection and the groups'
    # stores (so more than one port over the run).
    names = {name for _, name, _, _ in seen}
    assert {"gcs_server", "raylet"} <= names, names
    assert any(name.startswith("ray::ProbeAgent") for name in names), names
    assert len({port for pid, _, _, port in seen if pid == proc.pid}) >= 2, seen
    exposed = sorted(entry for entry in seen if not is_loopback(entry[2]))
    assert exposed == []


# A Ray head of the operator's, started with Ray's token authentication on
# (docs/install.md, "Ray's token"): the address on stdout, stopped when stdin closes.
TOKEN_HEAD = """
import sys
from ray.cluster_utils import Cluster
from ringwatch.services.scheduler.ray_backend import _unregistered

head = None
with _unregistered(lambda: head.address if head else None):
    head = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "include_dashboard": False, "temp_dir": sys.argv[1]})
print(head.address, flush=True)
sys.stdin.read()
with _unregistered(lambda: head.address):
    head.shutdown()
"""


def test_a_refusal_says_how_to_give_the_token_or_to_check_it(monkeypatch) -> None:
    message = "Failed to connect to Ray cluster at 10.0.0.5:6379. Reason: timed out."
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    without = refused(message, "10.0.0.5:6379", "start one")
    assert without == ("Ray at --address 10.0.0.5:6379 did not let this process join (Failed "
                       "to connect to Ray cluster at 10.0.0.5:6379): where the cluster asks "
                       "for a token (RAY_AUTH_MODE=token on its nodes), set RAY_AUTH_MODE=token "
                       "and RAY_AUTH_TOKEN to its token here too; else start one")
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    with_mode = refused(message, "10.0.0.5:6379", "start one")
    assert "is RAY_AUTH_TOKEN here the cluster's token" in with_mode
    assert "set RAY_AUTH_MODE=token" not in with_mode


@pytest.mark.ray
@pytest.mark.skipif(not hasattr(ray.exceptions, "AuthenticationError"),
                    reason="Ray before 2.52 has no token authentication")
def test_a_cluster_with_a_token_lets_in_only_who_has_it(tmp_path: Path) -> None:
    token = tmp_path / "ray-token"
    token.write_text(secrets.token_hex(32))
    token.chmod(0o600)
    plain = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH_")}
    plain["RINGWATCH_STATE_DIR"] = str(tmp_path / "state")
    with_token = {**plain, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token)}
    head = subprocess.Popen([sys.executable, "-c", TOKEN_HEAD, str(ray_temp_dir(tmp_path / "ray"))],
                            env=with_token, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    try:
        assert head.stdout is not None
        address = head.stdout.readline().strip()
        assert address, "the head did not start"
        probe = ("probe", "--address", address, "--backend", "gloo", "--gpus-per-node", "1")

        refused = cli(*probe, env=plain, timeout=300)
        assert refused.returncode == 2, refused.stderr
        line = refused.stderr.strip().splitlines()[-1]
        assert f"Ray at --address {address} did not let this process join" in line
        assert "set RAY_AUTH_MODE=token and RAY_AUTH_TOKEN" in line

        joined = cli(*probe, env=with_token, timeout=300)
        assert joined.returncode == 0, joined.stderr
        assert f"ray: joined {address}: 1 ranks" in joined.stderr
    finally:
        head.communicate(timeout=120)  # closes stdin: the head stops


def test_the_manifests_turn_on_rays_token_on_every_ray_process() -> None:
    """The head (with the scheduler, its driver) and the GPU workers present the same
    token, from the Secret docs/kubernetes.md has the operator create."""
    (cluster,) = [d for d in yaml.safe_load_all((BASE / "raycluster.yaml").read_text())
                  if d and d["kind"] == "RayCluster"]
    (workers,) = [d for d in yaml.safe_load_all((BASE / "gpu-agents.yaml").read_text())
                  if d and d["kind"] == "DaemonSet"]
    ray_containers = [cluster["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0],
                      workers["spec"]["template"]["spec"]["containers"][0]]
    assert [c["name"] for c in ray_containers] == ["ray-head", "ray-worker"]
    for c in ray_containers:
        env = {e["name"]: e for e in c["env"]}
        assert env["RAY_AUTH_MODE"] == {"name": "RAY_AUTH_MODE", "value": "token"}, c["name"]
        assert env["RAY_AUTH_TOKEN"]["valueFrom"] == {
            "secretKeyRef": {"name": "ringwatch-ray-token", "key": "token"}}, c["name"]
    docs = (BASE.parents[2] / "docs" / "kubernetes.md").read_text()
    assert "create secret generic ringwatch-ray-token" in docs
