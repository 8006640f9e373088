"""NVML telemetry against a small fake of the pynvml calls it makes (the one seam,
``agents.telemetry._nvml``), and against the real library where a GPU is present."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pynvml
import pytest
import torch

from ringwatch.agents import telemetry
from ringwatch.agents.probe import ProbeAgent
from ringwatch.agents.telemetry import gpu_identity, read_gpu_telemetry, telemetry_findings


@dataclass
class FakeNvml:
    """Just the pynvml surface telemetry uses: 4 GPUs, 4 NVLinks each, all healthy."""

    gpus: int = 4
    links: int = 4
    down: set[tuple[int, int]] = field(default_factory=set)  # (gpu, link)
    errors: dict[tuple[int, int, int], int] = field(default_factory=dict)  # (gpu, link, counter)
    pcie_only: set[frozenset[int]] = field(default_factory=set)
    missing_library: bool = False

    NVML_NVLINK_MAX_LINKS = 18
    NVML_FEATURE_ENABLED = 1
    NVML_NVLINK_ERROR_DL_REPLAY = 0
    NVML_NVLINK_ERROR_DL_RECOVERY = 1
    NVML_NVLINK_ERROR_DL_CRC_FLIT = 2
    NVML_NVLINK_ERROR_DL_CRC_DATA = 3
    NVML_P2P_CAPS_INDEX_NVLINK = 6
    NVML_P2P_STATUS_OK = 0
    NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX = 138
    NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX = 139

    def nvmlInit(self) -> None:
        if self.missing_library:
            raise pynvml.NVMLError_LibraryNotFound()

    def nvmlShutdown(self) -> None:
        pass

    def nvmlDeviceGetCount(self) -> int:
        return self.gpus

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def nvmlDeviceGetUUID(self, h: int) -> str:
        return f"GPU-fake-{h}"

    def nvmlDeviceGetName(self, h: int) -> bytes:
        return b"NVIDIA H100 80GB HBM3"

    def nvmlDeviceGetPciInfo(self, h: int) -> Any:
        return SimpleNamespace(busId=f"00000000:{0x18 + h:02X}:00.0".encode())

    def nvmlDeviceGetNumaNodeId(self, h: int) -> int:
        return h // 2

    def nvmlDeviceGetNvLinkState(self, h: int, link: int) -> int:
        if link >= self.links:
            raise pynvml.NVMLError_InvalidArgument()
        return 0 if (h, link) in self.down else 1

    def nvmlDeviceGetNvLinkErrorCounter(self, h: int, link: int, counter: int) -> int:
        return self.errors.get((h, link, counter), 0)

    def nvmlDeviceGetNvLinkRemotePciInfo(self, h: int, link: int) -> Any:
        return SimpleNamespace(busId=b"00000000:05:00.0")  # an NVSwitch

    def nvmlDeviceGetFieldValues(self, h: int, ids: list[tuple[int, int]]) -> list[Any]:
        return [SimpleNamespace(nvmlReturn=0, value=SimpleNamespace(ullVal=1000 * (fid + link)))
                for fid, link in ids]

    def nvmlDeviceGetP2PStatus(self, a: int, b: int, cap: int) -> int:
        return 4 if frozenset((a, b)) in self.pcie_only else 0

    def nvmlDeviceGetTopologyCommonAncestor(self, a: int, b: int) -> int:
        return 40  # same NUMA node's host bridge: "NODE"


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeNvml:
    nvml = FakeNvml()
    monkeypatch.setattr(telemetry, "_nvml", nvml)
    return nvml


def test_no_library_reports_unavailable_and_nothing_else(fake: FakeNvml) -> None:
    fake.missing_library = True
    for reading in (read_gpu_telemetry(0), gpu_identity(0)):
        assert reading["available"] is False
        assert "LibraryNotFound" in reading["reason"]
        assert set(reading) == {"available", "reason"}


def test_real_library_absent_here_or_present_and_working() -> None:
    reading = read_gpu_telemetry(0)
    if reading["available"]:
        assert reading["uuid"].startswith(("GPU-", "MIG-"))
    else:
        assert reading["reason"]


def test_reading_has_identity_links_counters_and_p2p(fake: FakeNvml) -> None:
    fake.errors[(1, 2, fake.NVML_NVLINK_ERROR_DL_CRC_FLIT)] = 7
    r = read_gpu_telemetry(1)
    assert (r["uuid"], r["pci_bus_id"], r["numa_node"]) == ("GPU-fake-1", "00000000:19:00.0", 0)
    assert r["name"] == "NVIDIA H100 80GB HBM3"
    assert [link["link"] for link in r["nvlinks"]] == [0, 1, 2, 3]
    assert all(link["active"] for link in r["nvlinks"])
    assert r["nvlinks"][2]["errors"] == {"replay": 0, "recovery": 0, "crc_flit": 7, "crc_data": 0}
    assert r["nvlinks"][0]["throughput"] == {"tx_kib": 138000, "rx_kib": 139000}
    assert set(r["p2p"]) == {"0", "2", "3"}
    assert all(p["nvlink"] and p["link"] == "NVLINK" for p in r["p2p"].values())
    assert r["p2p"]["0"]["pcie_path"] == "NODE"


def test_out_of_range_gpu_is_unavailable(fake: FakeNvml) -> None:
    assert read_gpu_telemetry(9)["available"] is False


def test_rising_errors_and_a_down_link_are_nvlink_degraded(fake: FakeNvml) -> None:
    before = read_gpu_telemetry(2)
    fake.errors[(2, 1, fake.NVML_NVLINK_ERROR_DL_REPLAY)] = 3
    fake.errors[(2, 1, fake.NVML_NVLINK_ERROR_DL_CRC_DATA)] = 12
    fake.down.add((2, 3))
    after = read_gpu_telemetry(2)
    assert after["nvlinks"][3]["active"] is False
    [finding] = telemetry_findings(before, after, "node-004", 2)
    assert (finding.kind, finding.node, finding.gpu) == ("nvlink_degraded", "node-004", 2)
    assert finding.detail["links_down"] == [3]
    assert finding.detail["rising_errors"] == {"1": {"replay": 3, "crc_data": 12}}
    assert finding.severity == "critical"


def test_counters_that_only_rose_are_a_warning(fake: FakeNvml) -> None:
    before = read_gpu_telemetry(0)
    fake.errors[(0, 0, fake.NVML_NVLINK_ERROR_DL_RECOVERY)] = 1
    [finding] = telemetry_findings(before, read_gpu_telemetry(0), "node-000", 0)
    assert finding.severity == "warning"
    assert telemetry_findings(before, before, "node-000", 0) == []


def test_peer_lost_to_pcie_is_topology_mismatch(fake: FakeNvml) -> None:
    before = read_gpu_telemetry(0)
    fake.pcie_only.add(frozenset((0, 1)))
    after = read_gpu_telemetry(0)
    assert after["p2p"]["1"]["link"] == "PCIE"
    [finding] = telemetry_findings(before, after, "node-002", 0)
    assert (finding.kind, finding.gpus) == ("topology_mismatch", [0, 1])


def test_nccl_agent_identity_carries_nvml_facts(fake: FakeNvml, fake_cuda: object) -> None:
    info = ProbeAgent("node-000", 3, backend="nccl").identity()
    assert info["gpu_uuid"] == "GPU-fake-3"
    assert info["pci_bus_id"] == "00000000:1B:00.0"
    assert info["numa_node"] == 1
    assert info["telemetry"]["nvlinks_active"] == 4
    assert set(info["telemetry"]["p2p"]) == {"0", "1", "2"}


def test_gloo_agent_identity_has_no_gpu(fake: FakeNvml) -> None:
    info = ProbeAgent("node-000", 3, backend="gloo").identity()
    assert info["gpu_uuid"] is None and info["telemetry"] == {}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_real_nvml_on_a_gpu() -> None:
    r = read_gpu_telemetry(0)
    assert r["available"] is True
    assert r["uuid"].startswith("GPU-") and r["pci_bus_id"]
    ident = gpu_identity(0)
    assert ident["uuid"] == r["uuid"]
