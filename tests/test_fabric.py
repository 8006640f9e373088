"""NVLink fabric state: read through the NVML seam (the fake of test_telemetry, taught the
fabric calls and filling pynvml's real ctypes structs), and judged per node and per NVLink
domain (agents.nvlink_fabric)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pynvml
import pytest
import torch

from ringwatch.agents import nvlink_fabric, telemetry
from ringwatch.agents.nvlink_fabric import (
    HEALTH_FIELDS,
    STATES,
    decode_health,
    domain_findings,
    fabric_by_node,
    fabric_findings,
)
from ringwatch.agents.telemetry import read_counters, read_gpu_telemetry
from tests.test_telemetry import FakeNvml

RACK = bytes(range(1, 17))  # one NVL72 rack's cluster UUID
RACK_TEXT = "01020304-0506-0708-090a-0b0c0d0e0f10"
OTHER_RACK = bytes(range(101, 117))
NOT_STARTED, IN_PROGRESS, COMPLETED = 1, 2, 3


def mask(**fields: int) -> int:
    """A health mask from field values by name (``route_unhealthy=1``: TRUE)."""
    by_name = {f.name: f for f in HEALTH_FIELDS}
    return sum(value << by_name[name].shift for name, value in fields.items())


HEALTHY = mask(degraded_bandwidth=2, route_recovery=2, route_unhealthy=2,
               access_timeout_recovery=2, incorrect_configuration=1)


@dataclass
class GpuFabric:
    state: int = COMPLETED
    status: int = 0
    cluster: bytes = RACK
    clique: int = 3
    health: int = HEALTHY
    summary: int = 1  # HEALTHY


@dataclass
class FabricNvml(FakeNvml):
    """The fake with NVML's GPU fabric calls. ``structs`` are the versions its driver knows
    (v3 answers both V structs, as a new driver does); ``calls`` the functions its
    library has; ``fabric`` each GPU's state. The structs are pynvml's own."""

    fabric: dict[int, GpuFabric] = field(default_factory=dict)
    structs: tuple[str, ...] = ("v3", "v2")
    calls: tuple[str, ...] = ("V", "v1")
    no_fabric: bool = False
    seen: list[str] = field(default_factory=list)

    c_nvmlGpuFabricInfo_v3_t = pynvml.c_nvmlGpuFabricInfo_v3_t
    c_nvmlGpuFabricInfo_v2_t = pynvml.c_nvmlGpuFabricInfo_v2_t
    c_nvmlGpuFabricInfo_t = pynvml.c_nvmlGpuFabricInfo_t

    def _fill(self, h: int, info: Any, api: str) -> None:
        self.seen.append(api)
        if self.no_fabric:
            raise pynvml.NVMLError_NotSupported()
        f = self.fabric.get(h, GpuFabric())
        info.clusterUuid[:] = list(f.cluster)
        info.status, info.cliqueId = f.status, f.clique
        # The driver writes one byte of state; the rest of pynvml's c_uint is padding.
        info.state = f.state | 0xAB00
        if api != "v1":
            info.healthMask = f.health
        if api == "v3":
            info.healthSummary = f.summary

    def nvmlDeviceGetGpuFabricInfoV(self, h: int, ref: Any) -> int:
        if "V" not in self.calls:
            raise pynvml.NVMLError_FunctionNotFound()
        info = ref._obj  # ctypes.byref's target
        api = {pynvml.nvmlGpuFabricInfo_v3: "v3", pynvml.nvmlGpuFabricInfo_v2: "v2"}[info.version]
        if api not in self.structs:
            raise pynvml.NVMLError_ArgumentVersionMismatch()
        self._fill(h, info, api)
        return 0

    def nvmlDeviceGetGpuFabricInfo(self, h: int, ref: Any) -> int:
        if "v1" not in self.calls:
            raise pynvml.NVMLError_FunctionNotFound()
        self._fill(h, ref._obj, "v1")
        return 0


@pytest.fixture
def nvml(monkeypatch: pytest.MonkeyPatch) -> FabricNvml:
    fake = FabricNvml()
    monkeypatch.setattr(telemetry, "_nvml", fake)
    return fake


def _node(nvml: FabricNvml) -> dict[int, dict[str, Any]]:
    return {g: read_counters(g)["fabric"] for g in range(nvml.gpus)}


# --- reading -------------------------------------------------------------------------------


def test_the_vocabulary_is_nvmls_own() -> None:
    """Every state, summary and health field number is pynvml's (nvml.h's) constant."""
    for value, name in STATES.items():
        assert getattr(pynvml, f"NVML_GPU_FABRIC_STATE_{name}") == value
    for value, name in nvlink_fabric.SUMMARIES.items():
        assert getattr(pynvml, f"NVML_GPU_FABRIC_HEALTH_SUMMARY_{name}") == value
    for f in HEALTH_FIELDS:
        assert getattr(pynvml, f"NVML_GPU_FABRIC_HEALTH_MASK_SHIFT_{f.nvml}") == f.shift
        assert getattr(pynvml, f"NVML_GPU_FABRIC_HEALTH_MASK_WIDTH_{f.nvml}") == f.width
        assert getattr(pynvml, f"NVML_GPU_FABRIC_HEALTH_MASK_{f.nvml}_NOT_SUPPORTED") == 0
        for value, word in f.words.items():
            assert getattr(pynvml, f"NVML_GPU_FABRIC_HEALTH_MASK_{f.nvml}_{word}") == value


def test_a_registered_gpu_reads_its_domain_clique_and_health(nvml: FabricNvml) -> None:
    nvml.fabric[1] = GpuFabric(clique=7, health=HEALTHY | mask(partition_assigned=1))
    r = read_counters(1)
    assert [link["link"] for link in r["nvlinks"]] == [0, 1, 2, 3]  # the existing keys stay
    assert r["fabric"] == {
        "supported": True, "api": "v3", "state": "COMPLETED", "status": "SUCCESS",
        "cluster_uuid": RACK_TEXT, "clique_id": 7,
        "health_mask": HEALTHY | mask(partition_assigned=1),
        "health": {"degraded_bandwidth": "FALSE", "route_recovery": "FALSE",
                   "route_unhealthy": "FALSE", "access_timeout_recovery": "FALSE",
                   "incorrect_configuration": "NONE", "partition_assigned": "TRUE"},
        "health_summary": "HEALTHY"}
    assert read_gpu_telemetry(1)["fabric"] == r["fabric"]


def test_an_older_driver_falls_back_to_v2_then_to_the_unversioned_call(nvml: FabricNvml) -> None:
    nvml.structs = ("v2",)  # knows the V call, not the v3 struct
    r = read_counters(0)["fabric"]
    assert (r["api"], r["health_summary"], r["health"]["route_unhealthy"]) == ("v2", None, "FALSE")
    assert nvml.seen == ["v2"]
    nvml.calls = ("v1",)  # no V call at all
    r = read_counters(0)["fabric"]
    assert (r["api"], r["state"], r["health_mask"], r["health"]) == ("v1", "COMPLETED", None, {})


@pytest.mark.parametrize("setup", ["not_supported_error", "state_not_supported", "no_calls",
                                   "pynvml_without_fabric"])
def test_no_fabric_is_no_finding_and_no_crash(nvml: FabricNvml, setup: str,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    if setup == "not_supported_error":  # an H100 PCIe, a GPU without NVSwitches
        nvml.no_fabric = True
    elif setup == "state_not_supported":
        nvml.fabric = {g: GpuFabric(state=0, cluster=bytes(16), clique=0, health=0, summary=0)
                       for g in range(4)}
    elif setup == "no_calls":  # NVMLError_FunctionNotFound from both
        nvml.calls = ()
    else:  # an nvidia-ml-py older than the fabric calls: neither function nor struct
        monkeypatch.setattr(telemetry, "_nvml", FakeNvml())
    readings = _node(nvml)
    assert all(r["supported"] is False and r["reason"] for r in readings.values())
    if setup == "not_supported_error":
        assert "NotSupported" in readings[0]["reason"] and nvml.seen == ["v3"] * 4  # no retries
    assert read_counters(0)["nvlinks"]  # the rest of the reading is whole
    assert fabric_findings(readings, "node-000") == []
    assert domain_findings({"node-000": readings, "node-001": readings}) == []


def test_an_unregistered_hgx_node_without_a_cluster_is_still_judged(nvml: FabricNvml) -> None:
    """One HGX node's NVSwitches: a zero cluster UUID, nothing to compare cliques with,
    but a GPU that has not registered is as unusable."""
    nvml.fabric = {g: GpuFabric(cluster=bytes(16), clique=0, health=0, summary=0)
                   for g in range(4)}
    assert fabric_findings(_node(nvml), "node-000") == []
    nvml.fabric[2].state = NOT_STARTED
    [f] = fabric_findings(_node(nvml), "node-000")
    assert (f.gpu, f.detail["cluster_uuid"], f.detail["problems"]) == (2, "", ["registration"])


# --- one node ------------------------------------------------------------------------------


def test_all_completed_and_healthy_is_no_finding(nvml: FabricNvml) -> None:
    assert fabric_findings(_node(nvml), "node-000") == []


def test_one_gpu_still_registering_is_one_finding_naming_it(nvml: FabricNvml) -> None:
    nvml.fabric[3] = GpuFabric(state=IN_PROGRESS, status=pynvml.NVML_ERROR_UNKNOWN)
    [f] = fabric_findings(_node(nvml), "node-007")
    assert (f.kind, f.node, f.gpu, f.severity) == ("nvlink_fabric", "node-007", 3, "critical")
    assert f.detail["cause"] == "GPU 3 fabric registration IN_PROGRESS (the other 3 COMPLETED)"
    assert (f.detail["state"], f.detail["problems"], f.detail["source"]) == (
        "IN_PROGRESS", ["registration"], "nvml")
    # The kind's whole wire form: what the API, the CLI and the incidents read.
    d = f.to_dict()
    assert {"kind", "node", "gpu", "severity", "state", "status", "clique_id", "cluster_uuid",
            "expected_clique_id", "health", "cause"} <= set(d)


def test_a_failed_registration_and_a_node_registering_alike(nvml: FabricNvml) -> None:
    nvml.fabric[0] = GpuFabric(status=pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES)
    [f] = fabric_findings(_node(nvml), "node-000")
    assert f.detail["cause"] == "GPU 0 fabric registration failed: ERROR_INSUFFICIENT_RESOURCES"
    nvml.fabric = {g: GpuFabric(state=NOT_STARTED) for g in range(4)}
    found = fabric_findings(_node(nvml), "node-000")
    assert [f.gpu for f in found] == [0, 1, 2, 3]
    assert found[0].detail["cause"] == ("GPU 0 fabric registration NOT_STARTED (all 4 GPUs of "
                                        "the node alike)")


def test_a_clique_the_node_does_not_share(nvml: FabricNvml) -> None:
    nvml.fabric[2] = GpuFabric(clique=7)
    [f] = fabric_findings(_node(nvml), "node-000")
    assert (f.gpu, f.detail["clique_id"], f.detail["expected_clique_id"]) == (2, 7, 3)
    assert f.detail["cause"] == ("GPU 2 in clique 7, the node's other GPUs of cluster 01020304 "
                                 "in clique 3")
    assert fabric_findings(_node(nvml), "node-000", partitioned=True) == []


def test_a_node_split_evenly_flags_every_gpu_and_expects_none(nvml: FabricNvml) -> None:
    nvml.fabric = {0: GpuFabric(clique=3), 1: GpuFabric(clique=3), 2: GpuFabric(clique=7),
                   3: GpuFabric(clique=7)}
    found = fabric_findings(_node(nvml), "node-000")
    assert [(f.gpu, f.detail["expected_clique_id"]) for f in found] == [
        (0, None), (1, None), (2, None), (3, None)]
    assert "split between cliques 3 (2 GPUs) and 7 (2 GPUs)" in found[0].detail["cause"]


def test_a_gpu_in_another_cluster_than_its_node(nvml: FabricNvml) -> None:
    nvml.fabric[1] = GpuFabric(cluster=OTHER_RACK)
    [f] = fabric_findings(_node(nvml), "node-000")
    assert f.gpu == 1 and f.detail["problems"] == ["cluster"]
    assert f.detail["expected_cluster_uuid"] == RACK_TEXT
    assert f.detail["cause"] == ("GPU 1 in cluster 65666768, the rest of the node in cluster "
                                 "01020304")


@pytest.mark.parametrize(("fields", "summary", "names"), [
    ({"route_unhealthy": 1}, 2, ["route_unhealthy", "summary:UNHEALTHY"]),
    ({"degraded_bandwidth": 1}, 3, ["degraded_bandwidth", "summary:LIMITED_CAPACITY"]),
    ({"route_recovery": 1, "access_timeout_recovery": 1}, 2,
     ["route_recovery", "access_timeout_recovery", "summary:UNHEALTHY"]),
    ({"incorrect_configuration": 5}, 2, ["incorrect_configuration:INSUFFICIENT_NVLINKS",
                                         "summary:UNHEALTHY"]),
    ({"degraded_bandwidth": 1}, 0, ["degraded_bandwidth"]),  # a v2 struct: no summary
    ({}, 2, ["summary:UNHEALTHY"]),  # the summary alone (a field newer than this table)
])
def test_health_bits_that_mean_degraded_are_findings(nvml: FabricNvml, fields: dict[str, int],
                                                     summary: int, names: list[str]) -> None:
    healthy = {k: v for k, v in (("degraded_bandwidth", 2), ("route_recovery", 2),
                                 ("route_unhealthy", 2), ("access_timeout_recovery", 2),
                                 ("incorrect_configuration", 1)) if k not in fields}
    nvml.fabric[1] = GpuFabric(health=mask(**healthy, **fields), summary=summary)
    [f] = fabric_findings(_node(nvml), "node-000")
    assert (f.gpu, f.detail["health"], f.detail["problems"]) == (1, names, ["health"])
    assert f.detail["cause"] == f"GPU 1 fabric health: {', '.join(names)}"


def test_recorded_health_fields_are_not_findings(nvml: FabricNvml) -> None:
    nvml.fabric[0] = GpuFabric(health=HEALTHY | mask(partition_assigned=2, gfm_state=2))
    r = read_counters(0)["fabric"]
    assert r["health"]["gfm_state"] == "DISCONNECTED"
    assert fabric_findings(_node(nvml), "node-000") == []
    assert decode_health(None) == {} and decode_health(0) == {}


def test_one_gpu_with_several_faults_is_one_finding(nvml: FabricNvml) -> None:
    nvml.fabric[2] = GpuFabric(clique=9, health=mask(route_unhealthy=1))
    [f] = fabric_findings(_node(nvml), "node-000")
    assert f.detail["problems"] == ["health", "clique"]
    assert f.detail["cause"] == ("GPU 2 fabric health: route_unhealthy; GPU 2 in clique 9, the "
                                 "node's other GPUs of cluster 01020304 in clique 3")


# --- across nodes --------------------------------------------------------------------------


def _tray(clique: int = 3, cluster: bytes = RACK, **by_gpu: GpuFabric) -> dict[int, dict[str, Any]]:
    """A compute tray's four readings, as read_counters gives them."""
    return {g: nvlink_fabric.reading(state=f.state, status="SUCCESS" if f.status == 0 else "ERROR",
                                     cluster_uuid=f.cluster, clique_id=f.clique,
                                     health_mask=f.health, health_summary=f.summary, api="v3")
            for g, f in ((g, by_gpu.get(f"gpu{g}", GpuFabric(clique=clique, cluster=cluster)))
                         for g in range(4))}


def test_a_tray_in_another_clique_than_its_rack() -> None:
    rack = {f"node-{i:03d}": _tray() for i in range(3)} | {"node-003": _tray(clique=7)}
    found = domain_findings(rack)
    assert [(f.node, f.gpu) for f in found] == [("node-003", g) for g in range(4)]
    f = found[0]
    assert (f.detail["clique_id"], f.detail["expected_clique_id"]) == (7, 3)
    assert f.detail["cause"] == ("GPU 0 in clique 7, the rest of cluster 01020304 (12 GPUs on 3 "
                                 "nodes) in clique 3")
    # Each tray alone is consistent: only the domain shows it.
    assert all(fabric_findings(r, n) == [] for n, r in rack.items())
    assert domain_findings(rack, partitioned=True) == []


def test_two_nodes_of_one_cluster_in_two_cliques_are_both_named() -> None:
    found = domain_findings({"node-a": _tray(clique=3), "node-b": _tray(clique=7)})
    assert {(f.node, f.detail["expected_clique_id"]) for f in found} == {
        ("node-a", None), ("node-b", None)}
    assert "split between cliques 3 (4 GPUs) and 7 (4 GPUs)" in found[0].detail["cause"]


def test_racks_are_domains_of_their_own() -> None:
    """Another cluster UUID is another rack: its cliques are not compared with this one's."""
    racks = {"rack1-0": _tray(), "rack1-1": _tray(), "rack2-0": _tray(clique=9, cluster=OTHER_RACK),
             "rack2-1": _tray(clique=9, cluster=OTHER_RACK)}
    assert domain_findings(racks) == []


def test_a_gpu_its_node_set_apart_is_named_once() -> None:
    odd = GpuFabric(clique=7, health=mask(route_unhealthy=1))
    rack = {"node-000": _tray(), "node-001": _tray(gpu1=odd), "node-002": _tray()}
    [f] = domain_findings(rack)
    assert (f.node, f.gpu, f.detail["problems"]) == ("node-001", 1, ["health", "clique"])
    assert "the node's other GPUs" in f.detail["cause"]  # its node's verdict, not repeated


def test_counters_regroup_by_node_for_the_domain_check(nvml: FabricNvml) -> None:
    """The scheduler's counters (member -> read_counters) in, the domain's findings out."""
    nvml.fabric[3] = GpuFabric(state=IN_PROGRESS)
    counters = {f"node-{n:03d}/{g}": read_counters(g) for n in range(2) for g in range(4)}
    counters["node-002/0"] = {"available": False, "reason": "a gloo rank has no GPU"}
    by_node = fabric_by_node(counters)
    assert sorted(by_node) == ["node-000", "node-001"]
    assert sorted(by_node["node-000"]) == [0, 1, 2, 3]
    assert [(f.node, f.gpu) for f in domain_findings(by_node)] == [("node-000", 3), ("node-001", 3)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_real_nvml_fabric_reading() -> None:
    """On a GPU: the real call with pynvml's struct answers, and answers in our words."""
    r = read_counters(0)
    assert r["available"] is True
    fabric = r["fabric"]
    if fabric["supported"]:
        assert fabric["state"] in STATES.values() and isinstance(fabric["status"], str)
        assert isinstance(fabric["clique_id"], int) and fabric["api"] in ("v3", "v2", "v1")
    else:
        assert fabric["reason"]


def test_a_cycle_names_the_gpu_its_fabric_has_not_registered(nvml: FabricNvml) -> None:
    """Through the scheduler's cycle: the ranks' NVML readings (the fake at the NVML call) in,
    nvlink_fabric findings judged on the readings after the cycle, with the reading kept."""
    from ringwatch.agents.sim import SimBackend
    from ringwatch.services.scheduler.cycle import ProbeOptions, run_cycle

    class ReadsNvml(SimBackend):
        def counters(self):
            return {f"node-{n:03d}/{g}": read_counters(g) for n in range(2) for g in range(4)}

    nvml.fabric[3] = GpuFabric(state=IN_PROGRESS)
    with ReadsNvml({"nodes": 2, "gpus_per_node": 4, "seed": 1}) as backend:
        cycle = run_cycle(backend, ProbeOptions())
    fabric = [f for f in cycle.judged if f.kind == "nvlink_fabric"]
    assert [(f.node, f.gpu) for f in fabric] == [("node-000", 3), ("node-001", 3)]
    assert fabric[0].detail["cause"] == "GPU 3 fabric registration IN_PROGRESS (the other 3 COMPLETED)"
    assert all(f in cycle.findings for f in fabric)  # shipped, as NVML's other findings
    kept = [c for c in cycle.counters if c.get("fabric")]
    assert [(c["node"], c["fabric"]["state"]) for c in kept] == [
        ("node-000", "IN_PROGRESS"), ("node-001", "IN_PROGRESS")]


def test_a_rack_partitioned_on_purpose_compares_no_cliques(nvml: FabricNvml) -> None:
    """RINGWATCH_NVLINK_PARTITIONED: two cliques in one cluster are the layout; a GPU not
    registered is still a finding."""
    from ringwatch.agents.sim import SimBackend
    from ringwatch.services.scheduler.cycle import ProbeOptions, run_cycle

    class ReadsNvml(SimBackend):
        def counters(self):
            return {f"node-{n:03d}/{g}": read_counters(g) for n in range(2) for g in range(4)}

    nvml.fabric[2] = GpuFabric(clique=7)
    for partitioned, want in ((False, [("node-000", 2), ("node-001", 2)]), (True, [])):
        with ReadsNvml({"nodes": 2, "gpus_per_node": 4, "seed": 1}) as backend:
            cycle = run_cycle(backend, ProbeOptions(nvlink_partitioned=partitioned))
        assert [(f.node, f.gpu) for f in cycle.judged if f.kind == "nvlink_fabric"] == want
