"""Contention: the pure judgement of a group's traffic; the meter that reads it from the
hardware, against a fake of the pynvml calls (the one NVML seam, ``agents.telemetry._nvml``)
and a fake sysfs tree (the root directory); ranks' reports becoming contended measurements;
gloo agents taking their window; and, where a GPU is lent, the real NVML on an idle GPU."""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pynvml
import pytest
import torch

from ringwatch.agents import outcome, telemetry
from ringwatch.agents.contention import (
    UTILIZATION_PERIOD_S,
    Limits,
    Traffic,
    TrafficMeter,
    contention,
)
from ringwatch.agents.nic_counters import read_data_bytes
from ringwatch.agents.probe import ProbeAgent
from ringwatch.agents.spec import GroupSpec
from tests.test_nccl_path import run_agents
from tests.test_nic_counters import write_port

# ---- the judgement --------------------------------------------------------------------


def test_quiet_or_unreadable_links_are_not_contended() -> None:
    quiet = Traffic("n/0", 0.2, nvlink_gbs=0.4, net_gbs=0.1, gpu_util=0.02, processes=0)
    assert contention([quiet, Traffic("n/1", 0.2)]) is None
    assert contention([]) is None


def test_each_limit_is_a_bound_not_a_trigger() -> None:
    at = Limits()
    on_limits = Traffic("n/0", 0.2, nvlink_gbs=at.nvlink_gbs, net_gbs=at.net_gbs,
                        gpu_util=at.gpu_util, processes=at.processes)
    assert contention([on_limits]) is None
    over = Traffic("n/0", 0.2, nvlink_gbs=at.nvlink_gbs + 0.1)
    assert contention([over]) == "other traffic: NVLink 2.1 GB/s at n/0"
    assert contention([over], Limits(nvlink_gbs=5.0)) is None


def test_the_busiest_rank_of_each_kind_is_named() -> None:
    ranks = [Traffic("a/0", 0.2, nvlink_gbs=40.0, net_gbs=3.0, gpu_util=0.3, processes=1),
             Traffic("a/1", 0.2, nvlink_gbs=120.0, gpu_util=0.95),
             Traffic("b/0", 0.2, net_gbs=24.5, processes=2)]
    assert contention(ranks) == (
        "other traffic: GPU 95% busy at a/1; network 24.5 GB/s at b/0; "
        "NVLink 120.0 GB/s at a/1; 2 other process(es) on the GPU at b/0")


def test_traffic_travels_as_a_dict_without_what_was_unreadable() -> None:
    t = Traffic("n/3", 0.2, nvlink_gbs=1.5, processes=0)
    assert t.to_dict() == {"member": "n/3", "window_s": 0.2, "nvlink_gbs": 1.5, "processes": 0}
    assert Traffic.from_dict({**t.to_dict(), "unknown": 1}) == t


# ---- the meter at the NVML seam -------------------------------------------------------


@dataclass
class FakeNvml:
    """The pynvml calls the meter makes: GPUs with ``links`` NVLinks whose data counters
    (KiB, cumulative) move by what ``job`` sends; utilization; compute processes."""

    gpus: int = 2
    links: int = 4
    kib: dict[tuple[int, int, int], int] = field(default_factory=dict)  # (gpu, field, link)
    util: int = 0                     # percent
    pids: list[int] = field(default_factory=list)
    no_throughput: bool = False
    missing_library: bool = False

    NVML_NVLINK_MAX_LINKS = 18
    NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX = pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX
    NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX = pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX

    def job(self, gpu: int, gbs_each_way: float, seconds: float) -> None:
        """A job's traffic through ``gpu``'s NVLinks, spread over them, both ways."""
        per_link = gbs_each_way * 1e9 * seconds / self.links
        for f in (self.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX,
                  self.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX):
            for link in range(self.links):
                self.kib[(gpu, f, link)] = self.kib.get((gpu, f, link), 0) + round(per_link / 1024)

    def nvmlInit(self) -> None:
        if self.missing_library:
            raise pynvml.NVMLError_LibraryNotFound()

    def nvmlShutdown(self) -> None:
        pass

    def nvmlDeviceGetCount(self) -> int:
        return self.gpus

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def nvmlDeviceGetFieldValues(self, h: int, ids: list[tuple[int, int]]) -> list[Any]:
        def value(fid: int, link: int) -> Any:
            if self.no_throughput or link >= self.links:
                return SimpleNamespace(nvmlReturn=pynvml.NVML_ERROR_NOT_SUPPORTED,
                                       value=SimpleNamespace(ullVal=0))
            return SimpleNamespace(nvmlReturn=0, value=SimpleNamespace(
                ullVal=1_000_000 + self.kib.get((h, fid, link), 0)))
        return [value(fid, link) for fid, link in ids]

    def nvmlDeviceGetUtilizationRates(self, h: int) -> Any:
        return SimpleNamespace(gpu=self.util, memory=0)

    def nvmlDeviceGetComputeRunningProcesses(self, h: int) -> list[Any]:
        return [SimpleNamespace(pid=p, usedGpuMemory=1 << 30) for p in self.pids]


@pytest.fixture
def nvml(monkeypatch: pytest.MonkeyPatch) -> FakeNvml:
    fake = FakeNvml()
    monkeypatch.setattr(telemetry, "_nvml", fake)
    return fake


OWN = os.getpid()


def test_nvlink_kib_counters_become_gbs_both_ways(nvml: FakeNvml) -> None:
    meter = TrafficMeter(1, (OWN,))
    before = meter.sample()
    nvml.job(1, gbs_each_way=30.0, seconds=0.5)
    nvml.job(0, gbs_each_way=99.0, seconds=0.5)      # another GPU's links: not this rank's
    t = meter.traffic(before, meter.sample(), 0.5, "n/1")
    assert t.member == "n/1" and t.window_s == 0.5
    assert t.nvlink_gbs == pytest.approx(60.0, rel=1e-6)
    assert "NVLink 60.0 GB/s at n/1" in (contention([t]) or "")


def test_an_idle_gpu_reads_quiet(nvml: FakeNvml) -> None:
    nvml.pids = [OWN]
    meter = TrafficMeter(0, (OWN,))
    t = meter.traffic(meter.sample(), meter.sample(), 0.2, "n/0")
    assert (t.nvlink_gbs, t.gpu_util, t.processes) == (0.0, 0.0, 0)
    assert contention([t]) is None


def test_utilization_is_a_share_and_the_agents_own_process_is_not_counted(
        nvml: FakeNvml) -> None:
    nvml.util, nvml.pids = 37, [OWN, 4242, 4243, 4242]
    meter = TrafficMeter(0, (OWN,))
    t = meter.traffic(meter.sample(), meter.sample(), 0.2, "n/0")
    assert t.gpu_util == pytest.approx(0.37) and t.processes == 2


def test_a_process_seen_at_either_end_of_the_window_counts(nvml: FakeNvml) -> None:
    meter = TrafficMeter(0, (OWN,))
    nvml.pids = [OWN, 777]
    before = meter.sample()
    nvml.pids = [OWN]
    assert meter.traffic(before, meter.sample(), 0.2, "n/0").processes == 1


def test_utilization_is_not_read_while_it_still_covers_the_agents_own_work(
        nvml: FakeNvml) -> None:
    nvml.util = 100
    just_now = TrafficMeter(0, (OWN,), own_gpu_work_at=time.monotonic())
    assert just_now.sample().gpu_util is None
    long_ago = TrafficMeter(0, (OWN,),
                            own_gpu_work_at=time.monotonic() - UTILIZATION_PERIOD_S - 1)
    assert long_ago.sample().gpu_util == 1.0


def test_counters_that_went_back_add_nothing(nvml: FakeNvml) -> None:
    meter = TrafficMeter(0, (OWN,))
    nvml.job(0, gbs_each_way=50.0, seconds=1.0)
    before = meter.sample()
    nvml.kib.clear()                                  # the driver reloaded
    assert meter.traffic(before, meter.sample(), 0.2, "n/0").nvlink_gbs == 0.0


def test_what_nvml_cannot_read_is_none_and_never_an_error(nvml: FakeNvml) -> None:
    nvml.no_throughput = True                         # a GPU without NVLink counters
    t = TrafficMeter(0, (OWN,)).sample()
    assert t.nvlink_kib is None and t.gpu_util == 0.0
    assert TrafficMeter(5, (OWN,)).sample().empty     # no such GPU
    nvml.missing_library = True
    meter = TrafficMeter(0, (OWN,))
    t2 = meter.traffic(meter.sample(), meter.sample(), 0.2, "n/0")
    assert t2 == Traffic("n/0", 0.2)
    assert TrafficMeter(None, (OWN,)).sample().empty  # a gloo rank: no GPU to read


# ---- the meter at the sysfs seam ------------------------------------------------------


def _port(root: Path, device: str, *, ib_words: tuple[int | str, int | str] | None = None,
          efa_bytes: tuple[int, int] | None = None, link_layer: str = "InfiniBand") -> None:
    write_port(root, device, 1, link_layer=link_layer, rate="400 Gb/sec (4X NDR)",
               counters={"port_xmit_data": ib_words[0], "port_rcv_data": ib_words[1],
                         "symbol_error": 0} if ib_words else None,
               hw_counters={"tx_bytes": efa_bytes[0], "rx_bytes": efa_bytes[1],
                            "rx_drops": 0} if efa_bytes else {"out_of_buffer": 0})


def test_ib_and_roce_count_words_and_efa_bytes(tmp_path: Path) -> None:
    _port(tmp_path, "mlx5_0", ib_words=(1000, 500))
    _port(tmp_path, "mlx5_1", ib_words=(7, 3), link_layer="Ethernet")
    _port(tmp_path, "efa_0", efa_bytes=(4000, 96), link_layer="Unknown")
    _port(tmp_path, "mlx5_2", ib_words=("N/A (no PMA)", 5))
    _port(tmp_path, "mlx5_3", ib_words=((1 << 32) - 1, 5))     # a saturated 32-bit PMA
    assert read_data_bytes(tmp_path) == {("mlx5_0", 1): 6000, ("mlx5_1", 1): 40,
                                         ("efa_0", 1): 4096}
    assert read_data_bytes(tmp_path, devices=["efa_0"]) == {("efa_0", 1): 4096}
    assert read_data_bytes(tmp_path / "nothing") == {}


def test_the_nodes_rdma_ports_in_gbs(tmp_path: Path) -> None:
    _port(tmp_path, "mlx5_0", ib_words=(0, 0))
    _port(tmp_path, "efa_0", efa_bytes=(0, 0), link_layer="Unknown")
    meter = TrafficMeter(None, nics=True, sysfs_root=tmp_path)
    before = meter.sample()
    assert before.net_bytes == {("mlx5_0", 1): 0, ("efa_0", 1): 0}
    _port(tmp_path, "mlx5_0", ib_words=(1_000_000_000, 250_000_000))   # 5 GB
    _port(tmp_path, "efa_0", efa_bytes=(2_000_000_000, 3_000_000_000))  # 5 GB
    t = meter.traffic(before, meter.sample(), 2.0, "n/0")
    assert t.net_gbs == pytest.approx(5.0)
    assert (t.nvlink_gbs, t.gpu_util, t.processes) == (None, None, None)
    assert "network 5.0 GB/s at n/0" in (contention([t]) or "")


def test_nics_are_read_only_when_asked_and_present(tmp_path: Path) -> None:
    _port(tmp_path, "mlx5_0", ib_words=(1, 1))
    assert TrafficMeter(None, nics=False, sysfs_root=tmp_path).sample().empty
    assert TrafficMeter(None, nics=True, sysfs_root=tmp_path / "none").sample().empty


# ---- a group's reports to its measurements --------------------------------------------


def _reply(rank: int, traffic: dict[str, Any] | None) -> dict[str, Any]:
    reply: dict[str, Any] = {"rank": rank, "status": "ok", "probes": [
        {"op": "allreduce", "size_requested": size, "size_bytes": size, "count": size // 4,
         "times_s": [1e-4], "wrong": 0, "timing": "wall_clock"} for size in (4096, 65536)]}
    if traffic is not None:
        reply["traffic"] = traffic
    return reply


PAIR = GroupSpec("inter_node", ("a/0", "b/0"), ops=("allreduce",), sizes=(4096, 65536))


def test_one_busy_rank_makes_every_measurement_of_its_group_contended() -> None:
    replies = {0: _reply(0, Traffic("a/0", 0.2, net_gbs=0.0, gpu_util=0.0).to_dict()),
               1: _reply(1, Traffic("b/0", 0.2, net_gbs=12.0, gpu_util=0.9).to_dict())}
    ms = outcome.measurements(PAIR, replies)
    assert len(ms) == 2
    assert {m.contended for m in ms} == {
        "other traffic: GPU 90% busy at b/0; network 12.0 GB/s at b/0"}
    assert all(m.to_dict()["contended"] == ms[0].contended for m in ms)


def test_quiet_or_unread_ranks_leave_measurements_uncontended() -> None:
    quiet = {0: _reply(0, Traffic("a/0", 0.2, net_gbs=0.1).to_dict()), 1: _reply(1, None)}
    ms = outcome.measurements(PAIR, quiet)
    assert len(ms) == 2 and all(m.contended is None for m in ms)
    assert all("contended" not in m.to_dict() for m in ms)
    malformed = {0: _reply(0, {"net_gbs": 50.0}), 1: _reply(1, None)}   # no member: ignored
    assert outcome.contended_of(malformed) is None


# ---- gloo agents take their window ----------------------------------------------------


def _agents(members: tuple[str, ...]) -> list[ProbeAgent]:
    return [ProbeAgent(m.split("/")[0], int(m.split("/")[1]), backend="gloo", host="127.0.0.1")
            for m in members]


def _spec(members: tuple[str, ...]) -> GroupSpec:
    return GroupSpec("inter_node", members, ops=("allreduce",), sizes=(4096,), warmup=1,
                     iters=2, deadline_s=30)


WINDOW_S = 0.0123  # a value nothing else sleeps for


def _watch_sleep(monkeypatch: pytest.MonkeyPatch, during: Any = None) -> list[float]:
    """Every time.sleep the test's threads make, and ``during()`` run inside the window."""
    real, slept = time.sleep, []

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        if seconds == WINDOW_S and during is not None:
            during()
        real(seconds)

    monkeypatch.setattr(time, "sleep", sleep)
    return slept


def test_gloo_ranks_without_rdma_ports_skip_the_window(monkeypatch: pytest.MonkeyPatch,
                                                       tmp_path: Path) -> None:
    monkeypatch.setenv("RINGWATCH_SYSFS_ROOT", str(tmp_path))   # an empty tree: no ports
    slept = _watch_sleep(monkeypatch)
    members = ("a/0", "b/0")
    replies = run_agents(_agents(members), _spec(members), quiet_window_s=WINDOW_S)
    assert [r["status"] for r in replies] == ["ok", "ok"], replies
    assert all("traffic" not in r for r in replies) and WINDOW_S not in slept


def test_a_job_on_a_nodes_nics_makes_the_groups_measurements_contended(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    _port(tmp_path, "mlx5_0", ib_words=(0, 0))
    counter = tmp_path / "sys/class/infiniband/mlx5_0/ports/1/counters/port_xmit_data"
    moved, lock = [0], threading.Lock()

    def job() -> None:
        """Another job's traffic through the port while a rank's window is open: the counter
        replaced whole, so the other rank never reads it half written."""
        with lock:
            moved[0] += 1_000_000_000  # 4 GB: what a port could carry (agents.counter_delta)
            fresh = counter.with_name(".port_xmit_data.new")
            fresh.write_text(f"{moved[0]}\n")
            os.replace(fresh, counter)

    monkeypatch.setenv("RINGWATCH_SYSFS_ROOT", str(tmp_path))
    _watch_sleep(monkeypatch, during=job)
    members = ("a/0", "a/1", "b/0")
    spec = _spec(members)
    replies = run_agents(_agents(members), spec, quiet_window_s=WINDOW_S)
    assert [r["status"] for r in replies] == ["ok"] * 3, replies
    # Each node's first rank in the group reads the node's NICs; a gloo rank has no GPU.
    assert "traffic" not in replies[1]
    read = [Traffic.from_dict(replies[r]["traffic"]) for r in (0, 2)]
    assert [t.member for t in read] == ["a/0", "b/0"]
    assert all(t.window_s >= WINDOW_S and t.net_gbs is not None and t.net_gbs > Limits().net_gbs
               and t.nvlink_gbs is None for t in read)
    ms = outcome.measurements(spec, dict(enumerate(replies)))
    assert ms and all(m.contended and m.contended.startswith("other traffic: network ")
                      for m in ms)


def test_a_group_on_one_node_does_not_read_the_nics(monkeypatch: pytest.MonkeyPatch,
                                                    tmp_path: Path) -> None:
    _port(tmp_path, "mlx5_0", ib_words=(0, 0))
    monkeypatch.setenv("RINGWATCH_SYSFS_ROOT", str(tmp_path))
    slept = _watch_sleep(monkeypatch)
    members = ("a/0", "a/1")
    replies = run_agents(_agents(members), _spec(members), quiet_window_s=WINDOW_S)
    assert [r["status"] for r in replies] == ["ok", "ok"], replies
    assert all("traffic" not in r for r in replies) and WINDOW_S not in slept


# ---- the real NVML ----------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_an_idle_gpu_reads_as_numbers_and_quiet() -> None:
    reading = telemetry.read_gpu_telemetry(0)
    assert reading["available"], reading
    time.sleep(UTILIZATION_PERIOD_S)  # NVML's utilization no longer covers earlier tests' work
    meter = TrafficMeter(0, (OWN,))
    before = meter.sample()
    time.sleep(0.2)
    after = meter.sample()
    t = meter.traffic(before, after, after.at - before.at, "gpu-node/0")
    assert isinstance(t.gpu_util, float) and 0.0 <= t.gpu_util <= 1.0, t
    assert isinstance(t.processes, int), t
    # NVLink data counters exactly where NVML's own reading shows them.
    has_counters = any(link["throughput"] is not None for link in reading["nvlinks"])
    assert (t.nvlink_gbs is not None) == has_counters, (t, reading["nvlinks"])
    assert t.nvlink_gbs is None or t.nvlink_gbs >= 0.0
    assert contention([t]) is None, t
