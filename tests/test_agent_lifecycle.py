"""Between cycles an agent holds nothing on any GPU: the agent's side at the CUDA seam (no
context until a group or ``prepare``), the backend's ``release`` and ``acquire`` on a real
local Ray cluster under gloo with the nccl path's lifecycle (agents end and start again),
and, on a GPU, NVML's own word that a released agent holds nothing there.

The GPU test runs without Ray (the agent in a child process), so it runs wherever torch
sees CUDA; the Ray tests import Ray only when they run."""

from __future__ import annotations

import datetime
import multiprocessing
import os
import time
import uuid
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import torch

from ringwatch.agents import device
from ringwatch.agents.probe import ProbeAgent
from ringwatch.agents.spec import GroupSpec
from tests.fake_cuda import FakeCuda

if TYPE_CHECKING:
    from ringwatch.services.scheduler.ray_backend import RayBackend

N0 = ("node-000/0", "node-000/1")
N1 = ("node-001/0", "node-001/1")


def _one_rank_group(agent: ProbeAgent, member: str) -> dict[str, Any]:
    """``agent`` runs a world-size-1 group through a store of its own, as a driver would."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=60))
    spec = GroupSpec("intra_node", (member,), ops=("allreduce",), sizes=(1 << 20,), warmup=1,
                     iters=3, deadline_s=60)
    return agent.run_group(spec.to_dict(), 0, "127.0.0.1", store.port, uuid.uuid4().hex[:8])


# ---- the agent, at the CUDA seam ---------------------------------------------------------


def test_an_nccl_agent_makes_no_cuda_context_until_it_prepares(fake_cuda: FakeCuda) -> None:
    """The agents a backend starts (to read identities) and keeps until the first release
    must hold nothing on their GPU: identity and counters bind no device. ``prepare`` does,
    and from then on the agent says it may hold a context, which only its end gives back."""
    agent = ProbeAgent("node-000", 0, backend="nccl", device_index=3)
    agent.identity()
    agent.counters()
    assert fake_cuda.bound == [] and agent.footprint()["cuda_context"] is False
    assert agent.prepare() is None
    assert fake_cuda.bound == [3] and agent.footprint()["cuda_context"] is True


def test_a_group_marks_the_context_and_gloo_never_has_one(fake_cuda: FakeCuda) -> None:
    nccl = ProbeAgent("node-000", 1, backend="nccl")
    assert _one_rank_group(nccl, "node-000/1")["status"] == "ok"
    assert nccl.footprint()["cuda_context"] is True and fake_cuda.bound[0] == 1
    gloo = ProbeAgent("node-000", 0, backend="gloo")
    assert gloo.prepare() is None
    assert _one_rank_group(gloo, "node-000/0")["status"] == "ok"
    assert gloo.footprint()["cuda_context"] is False


def test_prepare_says_why_it_cannot_rather_than_raise(monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank that cannot make its context stays acquired: its group then fails with the
    same error as a probe finding, as before; prepare itself only says why."""
    monkeypatch.setattr(device, "cuda", FakeCuda(available=False))
    agent = ProbeAgent("node-000", 0, backend="nccl")
    why = agent.prepare()
    assert why is not None and "ProbeSetupError" in why and "CUDA is not available" in why
    assert agent.footprint()["cuda_context"] is False


def test_the_footprint_is_this_processes_own() -> None:
    agent = ProbeAgent("node-000", 0, backend="gloo")
    before = agent.footprint()
    sum(i * i for i in range(2_000_000))  # some CPU time of this process
    after = agent.footprint()
    assert before["pid"] == after["pid"] == os.getpid()
    # Resident memory: at least torch's own, which this process has imported.
    assert before["rss_bytes"] is not None and before["rss_bytes"] > 50 << 20
    assert after["cpu_s"] > before["cpu_s"]


# ---- the backend, on a real local Ray cluster under gloo ------------------------------------


@pytest.fixture(scope="module")
def backend(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RayBackend]:
    """2 logical nodes x 2 gloo ranks that end between cycles, as nccl agents do."""
    pytest.importorskip("ray")
    from ringwatch.services.scheduler.ray_backend import RayBackend

    with RayBackend("gloo", local_nodes=2, ranks_per_node=2, hold_between_cycles=False,
                    temp_dir=tmp_path_factory.mktemp("ray")) as b:
        yield b


@pytest.fixture
def released(backend: RayBackend) -> Iterator[RayBackend]:
    """Every test starts and ends with no agent up."""
    backend.release()
    yield backend
    backend.release()


def _pids(backend: RayBackend) -> dict[str, int]:
    return {m: w["pid"] for m, w in backend.placement().items()}


def _gone(pids: set[int], within_s: float = 10.0) -> set[int]:
    """Those of ``pids`` still running after ``within_s`` (a zombie counts as ended)."""
    import psutil

    end = time.monotonic() + within_s
    while True:
        alive = set()
        for pid in pids:
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    alive.add(pid)
            except psutil.NoSuchProcess:
                pass
        if not alive or time.monotonic() > end:
            return alive
        time.sleep(0.1)


def _intra() -> list[GroupSpec]:
    return [GroupSpec("intra_node", n, ops=("allreduce",), sizes=(1 << 16,), warmup=1, iters=3)
            for n in (N0, N1)]


@pytest.mark.ray
def test_release_ends_every_agent_and_a_second_release_does_nothing(
        backend: RayBackend) -> None:
    backend.acquire(["node-000", "node-001"])
    pids = _pids(backend)
    assert sorted(pids) == sorted(N0 + N1) and len(set(pids.values())) == 4
    assert backend.release() > 0
    assert _gone(set(pids.values())) == set()
    assert backend.placement() == {}
    assert backend.release() == 0.0
    # What the ranks said of themselves stays: a cycle lays out its groups before acquire.
    assert [r.member for r in backend.ranks()] == sorted(N0 + N1)
    assert backend.counters() == {}  # gloo has none; nothing is asked of absent agents


@pytest.mark.ray
def test_acquire_brings_the_agents_back_and_rounds_measure(released: RayBackend) -> None:
    b = released
    seen: set[int] = set()
    for _ in range(2):  # two cycles, each with agents of its own
        assert b.acquire(["node-000", "node-001"]) > 0 and b.not_acquired == {}
        pids = _pids(b)
        assert sorted(pids) == sorted(N0 + N1) and not seen & set(pids.values())
        seen |= set(pids.values())
        result = b.run_round(_intra())
        assert result.findings == []
        assert sorted(tuple(m.members) for m in result.measurements) == [N0, N1]
        assert all(m.busbw_gbs > 0 and m.wrong == 0 for m in result.measurements)
        b.release()
    assert _gone(seen) == set()


@pytest.mark.ray
def test_acquire_starts_only_the_nodes_it_is_asked_for(released: RayBackend) -> None:
    b = released
    b.acquire(["node-001", "node-404"])
    assert sorted(b.placement()) == list(N1)
    assert b.not_acquired == {"node-404": "no ranks of this backend there"}
    assert b.run_round([_intra()[1]]).measurements
    # Asked again with both: only node-000's agents start; node-001's are the same ones.
    kept = _pids(b)
    b.acquire(["node-000", "node-001"])
    now = _pids(b)
    assert sorted(now) == sorted(N0 + N1) and {m: now[m] for m in N1} == kept


@pytest.mark.ray
def test_holding_between_cycles_keeps_the_agents(released: RayBackend) -> None:
    """gloo's default: nothing on a GPU to give back, so release keeps the agents."""
    b = released
    b.acquire(["node-000"])
    pids = _pids(b)
    b.hold_between_cycles = True
    try:
        assert b.release() == 0.0 and _pids(b) == pids
    finally:
        b.hold_between_cycles = False


@pytest.mark.ray
def test_a_node_whose_agents_cannot_start_is_not_acquired(
        released: RayBackend, monkeypatch: pytest.MonkeyPatch) -> None:
    """Other work holds node-000's slots: its agents would wait for them. The wait is
    bounded, the node is named as not acquired, the other node goes on, and the agents
    left waiting are stopped, so none takes the slots once the other work lets go."""
    import ray
    from ray._private.state import available_resources_per_node

    from ringwatch.services.scheduler import ray_backend

    b = released
    node_id = b._node_ids()["node-000"]
    slot = ray_backend._node_resource("node-000")

    @ray.remote(num_cpus=0, resources={slot: 2})
    class OtherWork:
        def ready(self) -> bool:
            return True

    other = OtherWork.remote()  # type: ignore[attr-defined]
    try:
        assert ray.get(other.ready.remote(), timeout=60)
        monkeypatch.setattr(ray_backend, "_START_TIMEOUT_S", 5.0)
        b.acquire(["node-000", "node-001"])
        assert list(b.not_acquired) == ["node-000"]
        assert "did not start within 5 s" in b.not_acquired["node-000"]
        assert sorted(b.placement()) == list(N1)
    finally:
        ray.kill(other, no_restart=True)

    def free() -> float:
        return float(available_resources_per_node().get(node_id, {}).get(slot, 0.0))

    _wait_for(lambda: free() == 2.0)
    time.sleep(1.0)  # an agent left pending would be placed by now
    assert free() == 2.0


def _wait_for(ok: Callable[[], bool], within_s: float = 15.0) -> None:
    end = time.monotonic() + within_s
    while not ok() and time.monotonic() < end:
        time.sleep(0.1)
    assert ok()


# ---- on a GPU: NVML's word ------------------------------------------------------------------


GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


def _agent_child(conn: Connection) -> None:
    """An nccl agent's life in a process of its own: identified, then one group on GPU 0,
    then its end, reporting its pid at each step and waiting for the parent in between."""
    agent = ProbeAgent("gpu-node", 0, backend="nccl")
    agent.identity()
    conn.send(("identified", agent.footprint()))
    conn.recv()
    prepared = agent.prepare()
    reply = _one_rank_group(agent, "gpu-node/0")
    conn.send(("probed", {**agent.footprint(), "prepared": prepared,
                          "status": reply["status"], "error": reply.get("error")}))
    conn.recv()  # released: the process ends on return


def _on_gpu0() -> tuple[set[int], int]:
    """The pids NVML lists with a compute context on GPU 0, and its used memory in bytes."""
    import pynvml

    pynvml.nvmlInit()
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        procs = pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
        return {p.pid for p in procs}, int(pynvml.nvmlDeviceGetMemoryInfo(handle).used)
    finally:
        pynvml.nvmlShutdown()


@pytest.mark.gpu
@pytest.mark.skipif(GPUS < 1 or not torch.distributed.is_nccl_available(),
                    reason="needs a CUDA GPU and NCCL")
def test_a_released_nccl_agent_holds_nothing_on_the_gpu() -> None:
    """Identified, the agent holds no context; after a group it does (NVML lists it, or its
    memory shows); once its process has ended, NVML lists nothing of it and the memory is
    back. A container whose pid namespace NVML cannot see is judged by memory alone."""
    baseline_pids, baseline_used = _on_gpu0()
    ctx = multiprocessing.get_context("spawn")  # a fresh process: no CUDA from this one
    parent, child_end = ctx.Pipe()
    child = ctx.Process(target=_agent_child, args=(child_end,), daemon=True)
    child.start()
    try:
        assert parent.poll(120), "the agent did not start"
        step, state = parent.recv()
        assert step == "identified" and state["cuda_context"] is False
        pids, _ = _on_gpu0()
        assert child.pid not in pids, "identity() alone made a CUDA context"
        parent.send("probe")
        assert parent.poll(300), "the group did not finish"
        step, state = parent.recv()
        assert step == "probed" and state["status"] == "ok", state
        assert state["prepared"] is None and state["cuda_context"] is True
        pids, used = _on_gpu0()
        by_pid = child.pid in pids
        # The check below can fail: while the agent holds its context, NVML sees it.
        assert by_pid or used - baseline_used > 64 << 20, (pids, used, baseline_used)
        parent.send("release")
        child.join(60)
        assert child.exitcode == 0
        end = time.monotonic() + 10
        while True:
            pids, used = _on_gpu0()
            if (not pids - baseline_pids and used - baseline_used < 64 << 20) or \
                    time.monotonic() > end:
                break
            time.sleep(0.2)
        assert child.pid not in pids, (pids, baseline_pids)
        assert used - baseline_used < 64 << 20, (used, baseline_used)
    finally:
        if child.is_alive():
            child.kill()


def test_the_gpu_test_needs_nothing_of_ray() -> None:
    """The GPU machine has torch and no Ray: this module, and so its GPU test, must import
    where Ray cannot be imported (Ray is imported only inside the Ray tests' fixtures)."""
    import subprocess
    import sys

    code = "import sys; sys.modules['ray'] = None; import tests.test_agent_lifecycle"
    done = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[1],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
