"""Occupancy sources (services/scheduler/occupancy.py): which nodes other jobs hold.

Slurm from recorded `scontrol --details --oneliner show node` and `squeue` output, and
through real scripts standing in for the commands (one that fails, one that hangs past
the bound); Kubernetes against recorded API answers served by a real HTTP server on
127.0.0.1, so the source's own httpx requests, pagination and token run. No Kubernetes
cluster is involved (tests/data/kubernetes/README.md). The real slurmctld is in
tests/test_slurm.py."""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import pytest

from ringwatch.agents.spec import BackendDefaults, GroupSpec, Occupant, RankInfo, RoundResult
from ringwatch.services.scheduler import occupancy
from ringwatch.services.scheduler.occupancy import (
    BackendOccupancy,
    KubernetesOccupancy,
    NoOccupancy,
    Occupancy,
    SlurmOccupancy,
    read_occupancy,
    source_for,
)

# The tests whose sources run scripts standing in for Slurm's commands start processes, which
# conftest cannot see in their code: they say so themselves, so the fast layer leaves them out.
runs_commands = pytest.mark.slow

DATA = Path(__file__).resolve().parent / "data"
SCONTROL = (DATA / "slurm" / "built-22.05.8-scontrol-details-oneliner-show-node.txt").read_text()
SQUEUE = (DATA / "slurm" / "built-22.05.8-squeue-i-N.txt").read_text()
KUBE = DATA / "kubernetes"


# ---- Slurm, from recorded output --------------------------------------------------------------


def test_slurm_counts_jobs_holding_nodes_and_leaves_drained_and_down_nodes_idle() -> None:
    known, busy = occupancy.slurm_busy(SCONTROL, SQUEUE)
    assert len(known) == 10
    assert set(busy) == {"gpu-001", "gpu-002", "gpu-003", "gpu-004", "gpu-009", "cpu-001"}
    assert busy["gpu-001"] == Occupant("slurm", job="4101", gpus=tuple(range(8)),
                                       state="ALLOCATED")
    # Drained by ringwatch while its job runs: busy until the job ends.
    assert busy["gpu-002"].job == "4101" and busy["gpu-002"].state == "ALLOCATED+DRAIN"
    assert busy["gpu-003"] == Occupant("slurm", job="4102,4103_7", gpus=(0, 2, 5), state="MIXED")
    # Completing: the job's processes may still hold the GPUs.
    assert busy["gpu-004"] == Occupant("slurm", job="4099", gpus=(), state="IDLE+COMPLETING")
    assert busy["gpu-009"].gpus == (6, 7, 8) and busy["gpu-009"].state == "MIXED+COMPLETING"
    # No GPU GRES on the node: which GPUs is unknown, not none.
    assert busy["cpu-001"].gpus is None and busy["cpu-001"].job == "4111"
    # gpu-005 (drained by ringwatch), gpu-006 (down), gpu-007 (idle), gpu-008 (drained by
    # an admin, a reason that reads like fields) hold nothing.
    assert busy["gpu-001"].reason == "job 4101 on GPUs 0-7 (ALLOCATED), per slurm"


def test_the_node_line_fields_are_the_nodes_own_whatever_a_reason_says() -> None:
    nodes = occupancy.parse_scontrol_nodes(SCONTROL)
    assert nodes["gpu-008"] == occupancy.SlurmNode("gpu-008", "IDLE+DRAIN", ())
    assert not nodes["gpu-008"].busy
    assert nodes["gpu-006"].state == "DOWN+NOT_RESPONDING" and not nodes["gpu-006"].busy
    assert occupancy.gpus_used("gpu:h100:4(IDX:0-1,4,6),shard:h100:0(0/8,0/8)") == (0, 1, 4, 6)
    assert occupancy.gpus_used("gpumem:0,mps:0") is None
    assert occupancy.gpus_used("gpu:0(IDX:N/A)") == ()


def test_a_node_squeue_names_a_job_on_is_busy_whatever_its_state_said() -> None:
    # The two commands are read a moment apart: a job that started in between.
    shown = "NodeName=gpu-007 CPUAlloc=0 State=IDLE Partitions=gpu\n"
    known, busy = occupancy.slurm_busy(shown, "4120 gpu-007\n4121 gpu-[010-011]\n")
    assert known == {"gpu-007"}
    assert busy["gpu-007"] == Occupant("slurm", job="4120", state="IDLE")
    assert busy["gpu-010"].job == "4121" and busy["gpu-010"].state is None


def test_names_match_exactly_first_then_by_short_name() -> None:
    known, busy = occupancy.slurm_busy(SCONTROL, SQUEUE)
    ours = ["gpu-001.cluster.example", "GPU-003", "gpu-005.cluster.example", "gpu-010",
            "cpu-001"]
    got = occupancy.vouch(ours, known, busy, "slurm", "not a node of scontrol show node")
    assert got["gpu-001.cluster.example"].job == "4101"
    assert got["GPU-003"].job == "4102,4103_7"
    assert got["cpu-001"].job == "4111"
    assert "gpu-005.cluster.example" not in got  # known to Slurm, idle
    # Not a node Slurm knows: it cannot vouch for it, so it counts as busy.
    assert got["gpu-010"] == Occupant("slurm", state="not a node of scontrol show node",
                                      unknown=True)
    # Two of theirs with one short name: neither is guessed.
    assert occupancy.match_names(["a.x", "b"], ["a.y", "a.z", "b.x"]) == {"b": "b.x"}
    assert occupancy.match_names(["a.y"], ["a.y", "a.z"]) == {"a.y": "a.y"}


def _commands(tmp_path: Path, scontrol: str, squeue: str) -> Path:
    """Scripts named scontrol and squeue in a folder of their own (the source's slurm_bin)."""
    bin_dir = tmp_path / "slurm-bin"
    bin_dir.mkdir()
    for name, body in (("scontrol", scontrol), ("squeue", squeue)):
        path = bin_dir / name
        path.write_text("#!/bin/sh\n" + body)
        path.chmod(0o755)
    return bin_dir


@runs_commands
def test_the_slurm_source_asks_each_command_once_whatever_the_number_of_nodes(tmp_path) -> None:
    calls = tmp_path / "calls"
    (tmp_path / "show.txt").write_text(SCONTROL)
    (tmp_path / "queue.txt").write_text(SQUEUE)
    bin_dir = _commands(tmp_path, f'echo "scontrol $*" >> {calls}\ncat {tmp_path}/show.txt\n',
                        f'echo "squeue $*" >> {calls}\ncat {tmp_path}/queue.txt\n')
    nodes = [f"gpu-{i:03d}" for i in range(1, 11)]
    got = read_occupancy(SlurmOccupancy(slurm_bin=str(bin_dir)), nodes, timeout_s=30)
    assert got.error is None and got.source == "slurm"
    assert sorted(got.busy) == ["gpu-001", "gpu-002", "gpu-003", "gpu-004", "gpu-009", "gpu-010"]
    assert got.busy["gpu-010"].unknown and not got.busy["gpu-001"].unknown
    assert calls.read_text().splitlines() == [
        "scontrol --details --oneliner show node",
        "squeue --noheader --states=R,CG,CF,S --format=%i %N"]
    d = got.to_dict()
    assert d["busy"]["gpu-003"]["gpus"] == [0, 2, 5] and d["busy"]["gpu-003"]["job"] == "4102,4103_7"
    assert json.loads(json.dumps(d)) == d


@runs_commands
def test_a_slurm_command_that_fails_leaves_every_node_unknown_and_busy(tmp_path) -> None:
    bin_dir = _commands(tmp_path, 'echo "slurm_load_node error: Unable to contact slurm '
                                  'controller (connect failure)" >&2\nexit 1\n', "exit 0\n")
    got = read_occupancy(SlurmOccupancy(slurm_bin=str(bin_dir)), ["gpu-001", "gpu-007"])
    assert got.error == ("scontrol exited 1: slurm_load_node error: Unable to contact slurm "
                         "controller (connect failure)")
    assert set(got.busy) == {"gpu-001", "gpu-007"}
    assert all(o.unknown and o.state == got.error for o in got.busy.values())
    assert got.busy["gpu-007"].reason.startswith("occupancy unknown (slurm: scontrol exited 1")
    # Slurm's commands nowhere to be found: the same, with why.
    got = read_occupancy(SlurmOccupancy(slurm_bin=str(tmp_path / "nowhere")), ["gpu-001"])
    assert got.busy["gpu-001"].unknown and "no scontrol in" in str(got.error)


def _pid_alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@runs_commands
def test_a_slurm_command_that_hangs_is_cut_off_at_the_bound_children_and_all(tmp_path) -> None:
    pid_file = tmp_path / "sleeper.pid"
    # A wrapper whose child holds the pipe: killing the wrapper alone would leave the read
    # waiting for the child's 600 s.
    bin_dir = _commands(tmp_path, f"sleep 600 &\necho $! > {pid_file}\nwait\n", "exit 0\n")
    got = read_occupancy(SlurmOccupancy(slurm_bin=str(bin_dir)), ["gpu-001", "gpu-002"],
                         timeout_s=1.0)
    assert got.error is not None and "no answer in 1" in got.error
    assert all(o.unknown for o in got.busy.values()) and set(got.busy) == {"gpu-001", "gpu-002"}
    sleeper = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while _pid_alive(sleeper) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _pid_alive(sleeper), "the hung command's child was left running"


# ---- the protocol, and choosing a source -------------------------------------------------------


class Jobs(BackendDefaults):
    name = "sim"

    def __init__(self, busy: dict[str, Occupant]) -> None:
        self.busy = busy

    def busy_nodes(self) -> dict[str, Occupant]:
        return self.busy

    def ranks(self) -> list[RankInfo]:
        return []

    def run_round(self, groups: list[GroupSpec]) -> RoundResult:
        raise AssertionError("an occupancy source runs no probe")


def test_backend_sources_filter_to_the_nodes_asked_and_none_holds_nothing() -> None:
    held = Occupant("sim", job="scenario-1", gpus=(0, 1))
    backend = Jobs({"node-001": held, "node-009": held})
    got = read_occupancy(BackendOccupancy(backend, "sim"), ["node-000", "node-001"])
    assert got == Occupancy("sim", {"node-001": held}, read_s=got.read_s)
    assert read_occupancy(NoOccupancy(), ["node-000"]).busy == {}


def test_a_source_that_raises_or_never_returns_leaves_every_node_unknown() -> None:
    class Broken:
        name = "ray"

        def read(self, nodes):
            raise RuntimeError("GCS unreachable\nat 10.0.0.1:6379")

    got = read_occupancy(Broken(), ["a", "b"])
    assert got.error == "RuntimeError: GCS unreachable at 10.0.0.1:6379"
    assert got.busy == dict.fromkeys(["a", "b"], Occupant("ray", state=got.error, unknown=True))

    release = threading.Event()

    class Stuck:
        name = "ray"

        def read(self, nodes):
            release.wait(60)
            return {}

    try:
        got = read_occupancy(Stuck(), ["a"], timeout_s=0.2)
    finally:
        release.set()
    assert got.error == "no answer in 0.2 s" and got.busy["a"].unknown


def test_source_for_chooses_by_setting_and_environment(tmp_path) -> None:
    token = tmp_path / "token"
    nccl, sim = Jobs({}), Jobs({})
    nccl.name = "nccl"
    pod = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443"}

    def chosen(setting: str, backend=nccl, environ=None) -> str:
        return source_for(setting, backend, environ=environ or {}, token_path=token).name

    assert chosen("auto", sim, pod) == "sim"
    assert chosen("auto", nccl, pod) == "ray"  # no token: not a pod that may ask the API
    token.write_text("t0k3n")
    assert chosen("auto", nccl, pod) == "kubernetes"
    assert chosen("auto", nccl, {}) == "ray"  # a token file alone is not a pod
    # Slurm is never chosen by itself, installed or not.
    assert {chosen(s) for s in ("slurm", "kubernetes", "ray", "sim", "none")} == {
        "slurm", "kubernetes", "ray", "sim", "none"}
    with pytest.raises(ValueError, match=r"'lsf'.*auto, slurm, kubernetes, ray, sim, none"):
        chosen("lsf")


def test_the_settings_take_only_the_known_sources() -> None:
    from pydantic import ValidationError

    from ringwatch.services.settings import Settings

    assert Settings(occupancy="slurm").occupancy == "slurm"
    defaults = Settings()
    assert (defaults.occupancy, defaults.probe_busy_nodes) == ("auto", False)
    assert defaults.occupancy_timeout_s == occupancy.DEFAULT_TIMEOUT_S
    with pytest.raises(ValidationError, match="occupancy"):
        Settings(occupancy="lsf")  # type: ignore[arg-type]
    with pytest.raises(ValidationError, match="occupancy_timeout_s"):
        Settings(occupancy_timeout_s=0)


# ---- Kubernetes, against recorded answers --------------------------------------------------------

TOKEN = "eyJhbGciOiJSUzI1NiIsImtpZCI6InJ3In0.c2NoZWR1bGVy.c2lnbmF0dXJl"


@dataclass
class KubeApi:
    """A local HTTP server answering as the API server did, recording every request."""

    url: str
    seen: list[tuple[str, dict[str, list[str]], dict[str, str]]] = field(default_factory=list)
    mode: str = "ok"  # ok, 401, 403, hang
    release: threading.Event = field(default_factory=threading.Event)


def _body(name: str) -> bytes:
    return (KUBE / name).read_bytes()


@pytest.fixture
def kube_api() -> Iterator[KubeApi]:
    api = KubeApi(url="")
    page_one = json.loads(_body("built-pods-page-1.json"))
    cont = page_one["metadata"]["continue"]

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

        def do_GET(self) -> None:
            parts = urlsplit(self.path)
            query = parse_qs(parts.query)
            api.seen.append((parts.path, query, {k.lower(): v for k, v in self.headers.items()}))
            if api.mode == "hang":
                api.release.wait(30)
                return
            if api.mode in ("401", "403"):
                return self.answer(int(api.mode), _body(f"built-status-{api.mode}.json"))
            if parts.path == "/api/v1/nodes":
                return self.answer(200, _body("built-nodes-metadata.json"))
            if parts.path == "/api/v1/pods":
                page = "2" if query.get("continue") == [cont] else "1"
                return self.answer(200, _body(f"built-pods-page-{page}.json"))
            self.answer(404, b'{"kind":"Status","code":404,"message":"the server could not '
                             b'find the requested resource"}')

        def answer(self, code: int, body: bytes) -> None:
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    api.url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        yield api
    finally:
        api.release.set()
        server.shutdown()
        server.server_close()


def _source(api: KubeApi, tmp_path: Path, **kw) -> KubernetesOccupancy:
    token = tmp_path / "token"
    token.write_text(TOKEN + "\n")
    return KubernetesOccupancy(api.url, token_path=token, ca_path=tmp_path / "no-ca.crt", **kw)


NODES = [f"gpu-{i:03d}" for i in range(1, 9)]


def test_kubernetes_counts_gpu_pods_bound_to_nodes_that_are_not_ringwatchs(
        kube_api: KubeApi, tmp_path: Path) -> None:
    got = read_occupancy(_source(kube_api, tmp_path), NODES)
    assert got.error is None and got.source == "kubernetes"
    assert got.busy == {
        "gpu-001": Occupant("kubernetes", job="training/llama-70b", state="Running"),
        "gpu-002": Occupant("kubernetes", job="training/llama-70b", state="Running"),
        # A bare pod: its own name; a limit given as a number.
        "gpu-005": Occupant("kubernetes", job="research/debug-alice", state="Running"),
        # Bound and starting (a MIG slice): it holds the node already.
        "gpu-006": Occupant("kubernetes", job="research/sweep-lr-3e-4-0", state="Pending"),
        # Not a node the API lists.
        "gpu-008": Occupant("kubernetes", state="not a node of the Kubernetes API",
                            unknown=True)}
    # gpu-003: a CPU pod and ringwatch's own agent (8 GPUs); gpu-004: a Succeeded pod;
    # gpu-007: nothing. The pending pod without a node holds none.


def test_kubernetes_is_one_paginated_pod_list_and_one_node_list_with_the_token(
        kube_api: KubeApi, tmp_path: Path) -> None:
    read_occupancy(_source(kube_api, tmp_path), NODES)
    paths = [path for path, _, _ in kube_api.seen]
    assert paths == ["/api/v1/nodes", "/api/v1/pods", "/api/v1/pods"]
    cont = json.loads(_body("built-pods-page-1.json"))["metadata"]["continue"]
    (_, nodes_q, nodes_h), (_, first, _), (_, second, _) = kube_api.seen
    assert nodes_q == {"limit": ["500"]}
    assert "as=PartialObjectMetadataList" in nodes_h["accept"]
    assert first == {"fieldSelector": ["status.phase!=Succeeded,status.phase!=Failed"],
                     "limit": ["500"]}
    assert second == {**first, "continue": [cont]}
    assert {h["authorization"] for _, _, h in kube_api.seen} == {f"Bearer {TOKEN}"}


def test_a_refused_or_silent_kubernetes_api_leaves_every_node_unknown(
        kube_api: KubeApi, tmp_path: Path) -> None:
    kube_api.mode = "401"
    got = read_occupancy(_source(kube_api, tmp_path), NODES[:2])
    assert got.error == "GET /api/v1/nodes answered 401: Unauthorized"
    assert all(o.unknown for o in got.busy.values()) and set(got.busy) == set(NODES[:2])
    kube_api.mode = "403"
    got = read_occupancy(_source(kube_api, tmp_path), NODES[:1])
    assert got.error is not None and got.error.startswith(
        'GET /api/v1/nodes answered 403: pods is forbidden: User "system:serviceaccount')
    kube_api.mode = "hang"
    got = read_occupancy(_source(kube_api, tmp_path), NODES[:2], timeout_s=0.5)
    # Cut off by the request's own timeout (the time left) or by the bound, whichever first.
    assert got.error is not None and ("ReadTimeout" in got.error or "no answer" in got.error)
    assert all(o.unknown for o in got.busy.values()) and set(got.busy) == set(NODES[:2])


def test_kubernetes_without_a_token_or_outside_a_pod_says_why(tmp_path: Path) -> None:
    source = KubernetesOccupancy(token_path=tmp_path / "absent", environ={})
    got = read_occupancy(source, ["gpu-001"])
    assert got.error is not None and "KUBERNETES_SERVICE_HOST is not set" in got.error
    source = KubernetesOccupancy(token_path=tmp_path / "absent",
                                 environ={"KUBERNETES_SERVICE_HOST": "fd00::1",
                                          "KUBERNETES_SERVICE_PORT": "6443"})
    assert source.base_url() == "https://[fd00::1]:6443"
    got = read_occupancy(source, ["gpu-001"])
    assert got.error is not None and "cannot read the service account token" in got.error
    assert got.busy["gpu-001"].unknown


def test_the_pod_rules_on_their_own() -> None:
    def pod(**spec) -> dict:
        return {"metadata": {"name": "p", "namespace": "ns"}, "status": {"phase": "Running"},
                "spec": {"nodeName": "n1", **spec}}

    def gpus(**resources) -> dict:
        return pod(containers=[{"name": "c", "resources": resources}])

    assert occupancy.pod_busy([gpus(requests={"nvidia.com/gpu": "0"})]) == {}
    assert occupancy.pod_busy([gpus(limits={"nvidia.com/gpu.shared": "1"})])["n1"].job == "ns/p"
    # A quantity that does not read as a number counts as some GPUs: never guessed idle.
    assert "n1" in occupancy.pod_busy([gpus(limits={"nvidia.com/gpu": "one"})])
    assert occupancy.pod_busy([gpus(limits={"amd.com/gpu": "1", "cpu": "4"})]) == {}
    # Init containers only: not a pod that holds GPUs while it runs.
    assert occupancy.pod_busy([pod(initContainers=[{"resources": {"limits": {
        "nvidia.com/gpu": "1"}}}], containers=[{"name": "c"}])]) == {}
    owned = gpus(limits={"nvidia.com/gpu": "8"})
    owned["metadata"]["ownerReferences"] = [
        {"kind": "ReplicaSet", "name": "rs-1", "controller": False},
        {"kind": "RayCluster", "name": "tune", "controller": True}]
    owned["metadata"]["labels"] = {"app.kubernetes.io/part-of": "other"}
    assert occupancy.pod_busy([owned])["n1"].job == "ns/tune"
    owned["metadata"]["labels"] = {"app.kubernetes.io/part-of": "ringwatch"}
    assert occupancy.pod_busy([owned]) == {}


def test_the_kubernetes_source_reads_a_rotated_token_each_cycle(kube_api: KubeApi,
                                                                tmp_path: Path) -> None:
    source = _source(kube_api, tmp_path)
    read_occupancy(source, NODES[:1])
    (tmp_path / "token").write_text("rotated-token")
    os.utime(tmp_path / "token")
    read_occupancy(source, NODES[:1])
    assert kube_api.seen[-1][2]["authorization"] == "Bearer rotated-token"
    assert kube_api.seen[0][2]["authorization"] == f"Bearer {TOKEN}"
