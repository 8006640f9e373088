"""The NCCL path's host-side code on a machine without a GPU: the CUDA-only calls go
through the fake at the agents' one seam (tests/fake_cuda.py), and the "NCCL" group is a
real gloo group, so launch, sync points, the graph-timed loop, the fallback to events,
the data check, errors and teardown all run for real. On a GPU the same tests' ``gpu``
twins in test_gpu.py run on the real CUDA seam."""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from ringwatch.agents import outcome
from ringwatch.agents.collectives import DTYPES, OPS, plan
from ringwatch.agents.device import CudaApi, CudaDevice, check_cuda
from ringwatch.agents.probe import ProbeAgent, make_group, run_probe
from ringwatch.agents.spec import GroupSpec, ProbeSetupError
from tests.fake_cuda import FakeCuda
from tests.threads import on_threads

ROOT = Path(__file__).resolve().parents[1]


def on_nccl_path(n: int, fn: Callable[[int, Any, CudaDevice], Any], timeout_s: float = 30.0) -> list[Any]:
    """``fn(rank, pg, device)`` on ``n`` threads, each rank on its own (fake) GPU, in one
    group formed the way an nccl agent forms it."""
    store = dist.PrefixStore(uuid.uuid4().hex, dist.HashStore())

    def rank(r: int) -> Any:
        device = CudaDevice(r)
        return fn(r, make_group("nccl", store, r, n, timeout_s, device=device), device)

    return on_threads(n, rank, timeout_s)


def test_the_fake_has_every_method_of_the_seam() -> None:
    seam = {name for name in vars(CudaApi) if not name.startswith("_")}
    assert seam <= set(dir(FakeCuda))


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("op", sorted(OPS))
@pytest.mark.parametrize("n", [1, 2])
def test_every_op_and_dtype_runs_graph_timed_and_checked(fake_cuda: FakeCuda, op: str, dtype: str,
                                                         n: int) -> None:
    buf = plan(op, 4096, n, dtype)

    def probe(rank: int, pg: Any, device: CudaDevice) -> dict[str, Any]:
        return run_probe(pg, buf, rank, backend="nccl", device=device, warmup=2, iters=3,
                         repeats=2, corrupt=(rank == n - 1))

    results = on_nccl_path(n, probe)
    # The last rank flips one element: the check sees exactly that, on the NCCL path too.
    assert [r["wrong"] for r in results] == [1 if rank == n - 1 else 0 for rank in range(n)]
    assert all(r["timing"] == "cuda_graph" and "timing_note" not in r for r in results)
    assert all(len(r["times_s"]) == 2 and min(r["times_s"]) > 0 for r in results)
    # Each rank captured once, replayed once untimed (a graph's first launch uploads it),
    # then once per repeat; ranks bound their own GPU.
    assert fake_cuda.log.count("capture") == n and fake_cuda.log.count("replay") == 3 * n
    assert sorted(set(fake_cuda.bound)) == list(range(n))


@pytest.mark.parametrize("redop", ["max", "min"])
@pytest.mark.parametrize("op", ["allreduce", "reducescatter"])
def test_reductions_on_the_nccl_path(fake_cuda: FakeCuda, op: str, redop: str) -> None:
    buf = plan(op, 3000, 3, "bfloat16", redop)
    results = on_nccl_path(3, lambda rank, pg, device: run_probe(
        pg, buf, rank, backend="nccl", device=device, warmup=1, iters=2))
    assert [r["wrong"] for r in results] == [0, 0, 0]


def test_a_rank_that_cannot_capture_makes_the_whole_group_time_eagerly(fake_cuda: FakeCuda) -> None:
    fake_cuda.capture_fails_on = frozenset({1})
    buf = plan("alltoall", 4096, 2, "float32")
    results = on_nccl_path(2, lambda rank, pg, device: run_probe(
        pg, buf, rank, backend="nccl", device=device, warmup=1, iters=4))
    assert [r["timing"] for r in results] == ["cuda_events", "cuda_events"]
    assert "capture failed" in results[1]["timing_note"]
    assert "peer" in results[0]["timing_note"]
    assert "replay" not in fake_cuda.log
    assert [r["wrong"] for r in results] == [0, 0]


def test_an_injected_slow_rank_queues_its_delay_on_the_device(fake_cuda: FakeCuda) -> None:
    iters = 5
    buf = plan("allreduce", 4096, 2, "float32")

    def probe(rank: int, pg: Any, device: CudaDevice) -> dict[str, Any]:
        return run_probe(pg, buf, rank, backend="nccl", device=device, warmup=1, iters=iters,
                         repeats=2, slow_factor=0.5 if rank == 1 else None, calibrate=True)

    results = on_nccl_path(2, probe)
    # One delay per iteration, inside the graph: clock calibration (2 sleeps), the check
    # graph at the first guess (its untimed first replay and the check loop), then the
    # corrected delay's graph (its first replay and both repeats).
    delays = fake_cuda.sleeps[2:]
    assert len(delays) == 5 * iters
    check, timed = delays[:2 * iters], delays[2 * iters:]
    assert len(set(check)) == 1 and len(set(timed)) == 1
    assert [r["timing"] for r in results] == ["cuda_graph", "cuda_graph"]
    assert timed[0] > 0
    # Every rank ran the same loops: calibration, check, two repeats; each one replayed,
    # and each of the three graphs replayed once untimed first.
    assert fake_cuda.log.count("replay") == 2 * (3 + 1 + 1 + 2)
    assert [r["wrong"] for r in results] == [0, 0]


# ---- the agent: a real store, the progress keys, errors and teardown ------------------


def run_agents(agents: list[ProbeAgent], spec: GroupSpec, timeout_s: float = 60.0,
               **payload: Any) -> list[dict[str, Any]]:
    """Each agent runs the group in a thread of its own, as the Ray driver calls them;
    ``payload``: the extra keys a driver sends beside the spec (cuda_graph, calibrate)."""
    store = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=timeout_s))
    group_id = uuid.uuid4().hex[:8]
    return on_threads(len(agents), lambda rank: agents[rank].run_group(
        {**spec.to_dict(), **payload}, rank, "127.0.0.1", store.port, group_id), timeout_s)


def test_nccl_agent_runs_a_group_through_the_seam(fake_cuda: FakeCuda) -> None:
    members = ("node-000/0", "node-000/1")
    agents = [ProbeAgent("node-000", i, backend="nccl") for i in range(2)]
    spec = GroupSpec("intra_node", members, ops=tuple(sorted(OPS)), sizes=(8, 65536),
                     warmup=1, iters=3, deadline_s=30)
    replies = run_agents(agents, spec)
    assert [r["status"] for r in replies] == ["ok", "ok"], replies
    ms = outcome.measurements(spec, dict(enumerate(replies)))
    assert len(ms) == len(OPS) * 2
    assert all(m.wrong == 0 and m.timing == "cuda_graph" and m.busbw_gbs >= 0 for m in ms)
    assert fake_cuda.bound[:2] in ([0, 1], [1, 0])


def test_an_exception_in_a_rank_is_a_probe_error_and_its_peer_a_victim(fake_cuda: FakeCuda) -> None:
    members = ("node-000/0", "node-000/1", "node-000/2")
    agents = [ProbeAgent("node-000", i, backend="nccl",
                         injected=[{"kind": "error", "node": "node-000", "gpu": 1}] if i == 1 else [])
              for i in range(3)]
    spec = GroupSpec("intra_node", members, ops=("allreduce",), sizes=(4096,), warmup=1, iters=2,
                     deadline_s=20)
    replies = run_agents(agents, spec)
    assert [r["status"] for r in replies] == ["error"] * 3
    assert replies[1]["origin"] == "local" and "InjectedError" in replies[1]["error"]
    # The peers were inside the collective when rank 1 left: the group broke under them.
    assert replies[0]["origin"] == replies[2]["origin"] == "collective"
    [finding] = outcome.error_findings(spec, dict(enumerate(replies)), {},
                                       injected={("error", "node-000/1")})
    assert (finding.kind, finding.node, finding.gpu) == ("probe_error", "node-000", 1)
    assert finding.detail["stage"] == "allreduce/4096" and finding.detail["injected"] is True
    assert finding.detail["peers_failed"] == ["node-000/0", "node-000/2"]
    assert finding.blamed_nodes == ["node-000"]


def test_nccl_without_cuda_is_a_setup_error_in_one_line(fake_cuda: FakeCuda) -> None:
    fake_cuda._available = False
    with pytest.raises(ProbeSetupError, match="CUDA is not available to this torch") as info:
        ProbeAgent("node-000", 0, backend="nccl").identity()
    assert "\n" not in str(info.value)


def test_a_gpu_index_past_the_count_is_refused(fake_cuda: FakeCuda) -> None:
    fake_cuda.gpus = 1
    check_cuda(0)
    with pytest.raises(ProbeSetupError, match="GPU 1 is not present: CUDA sees 1 GPU"):
        check_cuda(1)


def test_setup_error_reaches_the_reply_with_its_origin(fake_cuda: FakeCuda) -> None:
    fake_cuda._available = False
    store = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=5))
    reply = ProbeAgent("node-000", 0, backend="nccl").run_group(
        GroupSpec("intra_node", ("node-000/0",)).to_dict(), 0, "127.0.0.1", store.port, "g")
    assert (reply["status"], reply["origin"], reply["stage"]) == ("error", "setup", "form")
    assert "CUDA is not available" in reply["error"]


# ---- without Ray ------------------------------------------------------------------------

_NO_RAY = r"""
import sys, threading, uuid, datetime
sys.modules["ray"] = None  # any import of ray now raises ImportError
import torch.distributed as dist
from ringwatch.agents import device
from ringwatch.agents.probe import ProbeAgent
from ringwatch.agents.spec import GroupSpec
from tests.fake_cuda import FakeCuda

device.cuda = FakeCuda()
for backend in ("gloo", "nccl"):
    store = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=30))
    spec = GroupSpec("intra_node", ("n/0", "n/1"), ops=("allreduce", "sendrecv"), sizes=(4096,),
                     warmup=1, iters=2, deadline_s=30).to_dict()
    agents = [ProbeAgent("n", i, backend=backend) for i in range(2)]
    out = [None, None]
    gid = uuid.uuid4().hex[:6]
    def work(r):
        out[r] = agents[r].run_group(spec, r, "127.0.0.1", store.port, gid)
    ts = [threading.Thread(target=work, args=(r,)) for r in range(2)]
    [t.start() for t in ts]; [t.join(60) for t in ts]
    assert all(o["status"] == "ok" for o in out), out
    assert all(p["wrong"] == 0 for o in out for p in o["probes"]), out
    # Its time on the fabric (forming, warm-ups) holds its timed loops.
    assert all(o["held_s"] >= o["timed_s"] > 0 for o in out), out
    print(backend, sorted({p["timing"] for o in out for p in o["probes"]}),
          agents[0].identity()["node"])
print("ray loaded:", sys.modules.get("ray") is not None)
"""


def test_the_agent_layer_runs_without_ray() -> None:
    proc = subprocess.run([sys.executable, "-c", _NO_RAY], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    assert lines == ["gloo ['host'] n", "nccl ['cuda_graph'] n", "ray loaded: False"]


def test_cuda_is_real_here_only_where_torch_has_it() -> None:
    # The seam's default is torch.cuda itself: on this machine it answers for real.
    assert CudaApi().available() == torch.cuda.is_available()
