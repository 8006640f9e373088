"""The NCCL path on a real GPU: every op, dtype and reduction at world size 1, timed by a
CUDA graph, the data checked; an injected corrupt rank caught; an error not called a hang.

These run only where torch sees CUDA and NCCL (``pytest -m gpu``); everywhere else they
skip, and tests/test_nccl_path.py runs the same host code through the CUDA seam. NCCL
refuses two ranks on one GPU, so only the two-GPU tests need a bigger machine.
"""

from __future__ import annotations

import os

import pytest
import torch

from ringwatch.agents import outcome
from ringwatch.agents.collectives import DTYPES, OPS
from ringwatch.agents.probe import ProbeAgent
from ringwatch.agents.spec import REDUCING_OPS, GroupSpec
from tests.test_nccl_path import run_agents

pytestmark = pytest.mark.gpu

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
needs_gpu = pytest.mark.skipif(GPUS < 1 or not torch.distributed.is_nccl_available(),
                               reason="needs a CUDA GPU and NCCL")
needs_two = pytest.mark.skipif(GPUS < 2, reason="needs two GPUs (NCCL runs one rank per GPU)")

SIZES = (8, 4096, 1 << 20, 16 << 20)


def _run(n: int, ops: tuple[str, ...], *, dtype: str = "float32", redop: str = "sum",
         faults: list[dict] | None = None, cuda_graph: bool = True) -> tuple[list, list]:
    members = tuple(f"gpu-node/{i}" for i in range(n))
    agents = [ProbeAgent("gpu-node", i, backend="nccl") for i in range(n)]
    for a in agents:
        a.set_injected([f for f in faults or [] if f["gpu"] == a.device_index])
    spec = GroupSpec("intra_node", members, ops=ops, sizes=SIZES, dtype=dtype, redop=redop,
                     warmup=2, iters=10, deadline_s=120)
    calibrate = any(f["kind"] == "slow" for f in faults or [])
    replies = dict(enumerate(run_agents(agents, spec, cuda_graph=cuda_graph,
                                        calibrate=calibrate)))
    return outcome.measurements(spec, replies), outcome.error_findings(spec, replies, {})


@needs_gpu
@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_every_op_and_dtype_is_correct_and_graph_timed(dtype: str) -> None:
    ms, errors = _run(1, tuple(sorted(OPS)), dtype=dtype)
    assert errors == []
    assert len(ms) == len(OPS) * len(SIZES)
    assert all(m.wrong == 0 for m in ms), [(m.op, m.size_bytes) for m in ms if m.wrong]
    assert {m.timing for m in ms} == {"cuda_graph"}
    assert all(m.time_us > 0 for m in ms)


@needs_gpu
@pytest.mark.parametrize("redop", ["sum", "max", "min", "avg"])
def test_every_reduction_is_correct(redop: str) -> None:
    ms, errors = _run(1, tuple(sorted(REDUCING_OPS)), redop=redop)
    assert errors == [] and ms
    assert all(m.wrong == 0 and m.redop == redop for m in ms)


@needs_gpu
def test_eager_event_timing_when_graphs_are_off() -> None:
    ms, _ = _run(1, ("alltoall",), cuda_graph=False)
    assert {m.timing for m in ms} == {"cuda_events"}
    assert all(m.wrong == 0 for m in ms)


@needs_gpu
def test_a_corrupt_rank_is_caught_on_the_gpu() -> None:
    ms, _ = _run(1, ("allreduce", "alltoall"), faults=[{"kind": "corrupt", "node": "gpu-node",
                                                        "gpu": 0}])
    assert all(m.wrong > 0 for m in ms)


@needs_gpu
def test_an_error_on_the_gpu_is_a_probe_error() -> None:
    ms, errors = _run(1, ("allreduce",), faults=[{"kind": "error", "node": "gpu-node", "gpu": 0}])
    assert ms == [] and [f.kind for f in errors] == ["probe_error"]


@needs_gpu
def test_an_injected_slow_rank_still_computes_correctly() -> None:
    """The calibrated spin is queued inside the captured graph; the data must not suffer.
    (How close the slowdown comes to its factor is a figure in `make bench`.)"""
    ms, errors = _run(1, ("allgather",), faults=[{"kind": "slow", "node": "gpu-node", "gpu": 0,
                                                  "factor": 0.5}])
    assert errors == [] and ms and all(m.wrong == 0 for m in ms)


@needs_two
def test_two_gpus_run_every_op_correctly() -> None:
    ms, errors = _run(2, tuple(sorted(OPS)))
    assert errors == [] and len(ms) == len(OPS) * len(SIZES)
    assert all(m.wrong == 0 for m in ms)


@needs_two
def test_an_error_on_one_gpu_blames_it_not_its_peer() -> None:
    _, errors = _run(2, ("allreduce",), faults=[{"kind": "error", "node": "gpu-node", "gpu": 1}])
    assert [(f.kind, f.gpu) for f in errors] == [("probe_error", 1)]


@needs_gpu
def test_allreduce_runs_under_each_nccl_algo_and_the_variable_is_put_back() -> None:
    os.environ.pop("NCCL_ALGO", None)
    agent = ProbeAgent("gpu-node", 0, backend="nccl")
    for algo in ("ring", "tree", None):
        spec = GroupSpec("intra_node", ("gpu-node/0",), ops=("allreduce",), sizes=SIZES,
                         warmup=2, iters=10, deadline_s=120, algo=algo)
        replies = dict(enumerate(run_agents([agent], spec)))
        ms = outcome.measurements(spec, replies)
        assert [r["status"] for r in replies.values()] == ["ok"], replies
        assert len(ms) == len(SIZES) and all(m.wrong == 0 and m.algo == algo for m in ms)
        assert "NCCL_ALGO" not in os.environ


@needs_gpu
def test_the_agent_reads_ncclS_own_log_of_its_group() -> None:
    """The agent's NCCL debug file, as NCCL itself wrote it on this GPU, parsed: the version
    torch links, the network plugin chosen. Run with -s to see the summary (the issue asks
    for a real log parsed on a GPU)."""
    from ringwatch.agents import nccl_log

    agent = ProbeAgent("gpu-node", 0, backend="nccl")
    spec = GroupSpec("intra_node", ("gpu-node/0",), ops=("allreduce",), sizes=(1 << 20,),
                     warmup=1, iters=3, deadline_s=120)
    (reply,) = run_agents([agent], spec)
    assert reply["status"] == "ok", reply
    assert agent._nccl_log is not None, "NCCL_DEBUG set in this environment: nothing recorded"
    folder = agent._nccl_log.path.parent.lstat()  # the agent's private folder
    assert folder.st_mode & 0o777 == 0o700 and folder.st_uid == os.getuid()
    log = nccl_log.parse_nccl_log(agent._nccl_log.path.read_text())
    major, minor, patch = torch.cuda.nccl.version()
    assert any(v.startswith(f"{major}.{minor}.{patch}") for v in log.nccl_versions)
    assert log.processes and log.processes[0].network is not None
    print(nccl_log.summarize(log).to_dict(), log.processes[0])


@needs_two
def test_two_gpus_record_the_transport_nccl_took() -> None:
    ms, errors = _run(2, ("allreduce",))
    assert errors == [] and ms
    taken = {m.transport for m in ms}
    assert len(taken) == 1 and None not in taken
    print("two GPUs took", taken)
    assert set(taken.pop().split(",")) & {"p2p_nvlink", "p2p_pcie", "p2p", "shm"}
