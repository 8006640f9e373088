"""Inventory and live device counters, through the NVML seam (a fake of the pynvml calls)
and a sysfs tree of our own, end to end to the API's findings, series and events."""

from __future__ import annotations

import os
import threading
import uuid
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pynvml
import pytest
from sqlalchemy import text

from ringwatch.agents import inventory, telemetry
from ringwatch.agents.probe import ProbeAgent
from ringwatch.agents.spec import RankInfo
from ringwatch.services.analyzer.inventory import inventory_findings
from ringwatch.services.check.facts import judge_readings
from ringwatch.services.store import db
from tests.api_fixtures import api_client, measurement
from tests.test_telemetry import FakeNvml


class EventNvml(FakeNvml):
    """The fake with a driver version and XID events queued per GPU."""

    nvmlEventTypeXidCriticalError = 8

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.xids: dict[int, list[int]] = {}

    def nvmlSystemGetDriverVersion(self) -> str:
        return "550.54.15"

    def nvmlEventSetCreate(self) -> dict[str, Any]:
        return {"gpus": []}

    def nvmlDeviceRegisterEvents(self, h: int, types: int, event_set: dict[str, Any]) -> None:
        event_set["gpus"].append(h)

    def nvmlEventSetWait_v2(self, event_set: dict[str, Any], timeout_ms: int) -> Any:
        for h in event_set["gpus"]:
            if self.xids.get(h):
                return SimpleNamespace(eventData=self.xids[h].pop(0), eventType=8)
        raise pynvml.NVMLError_Timeout()

    def nvmlEventSetFree(self, event_set: dict[str, Any]) -> None:
        pass


@pytest.fixture
def nvml(monkeypatch: pytest.MonkeyPatch) -> EventNvml:
    fake = EventNvml(gpus=8, links=18)
    monkeypatch.setattr(telemetry, "_nvml", fake)
    return fake


def _sysfs(root: Path, ports: list[tuple[str, str, str]]) -> Path:
    """(device, rate, state) per port 1, as the kernel lays them out."""
    for dev, rate, state in ports:
        port = root / dev / "ports" / "1"
        port.mkdir(parents=True)
        (port / "rate").write_text(f"{rate} Gb/sec (4X NDR)\n")
        (port / "state").write_text(f"{state}\n")
        (port / "link_layer").write_text("InfiniBand\n")
    return root


def test_nics_are_read_from_the_sysfs_tree(tmp_path: Path) -> None:
    root = _sysfs(tmp_path, [("mlx5_0", "400", "4: ACTIVE"), ("mlx5_1", "200", "4: ACTIVE"),
                             ("efa_0", "100", "1: DOWN")])
    nics = inventory.read_nics(root)
    assert [(n["device"], n["rate_gbps"], n["state"]) for n in nics] == [
        ("efa_0", 100.0, "DOWN"), ("mlx5_0", 400.0, "ACTIVE"), ("mlx5_1", 200.0, "ACTIVE")]
    assert inventory.read_nics(tmp_path / "absent") == []


def test_a_fifo_or_a_crafted_rate_in_the_tree_neither_blocks_nor_raises(tmp_path: Path) -> None:
    """A FIFO planted as a port's state used to block the agent's inventory read for good,
    and a rate of "4..0" or Unicode digits raised or read as a number."""
    root = _sysfs(tmp_path, [("mlx5_0", "400", "4: ACTIVE"), ("mlx5_1", "4..0", "4: ACTIVE"),
                             ("mlx5_2", "\u0664\u0660\u0660", "4: ACTIVE")])
    fifo = root / "mlx5_0" / "ports" / "1" / "state"
    fifo.unlink()
    os.mkfifo(fifo)
    out: list[list[dict]] = []
    reader = threading.Thread(target=lambda: out.append(inventory.read_nics(root)), daemon=True)
    reader.start()
    reader.join(30)  # a guard against the hang, not a measure of speed
    assert out, "the inventory read blocked on a FIFO"
    assert [(n["device"], n["rate_gbps"], n["state"]) for n in out[0]] == [
        ("mlx5_0", 400.0, None), ("mlx5_1", None, "ACTIVE"), ("mlx5_2", None, "ACTIVE")]


def test_an_nccl_agent_reports_its_inventory(nvml: EventNvml, fake_cuda: object, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RINGWATCH_SYSFS_IB", str(_sysfs(tmp_path, [("mlx5_0", "400", "4: ACTIVE")])))
    info = ProbeAgent("node-000", 0, backend="nccl").identity()
    tel = info["telemetry"]
    assert tel["gpu_count"] == 8 and tel["driver"] == "550.54.15" and tel["nvlinks_active"] == 18
    assert [n["device"] for n in tel["nics"]] == ["mlx5_0"]
    assert info["profile"] == "H100-SXM"
    other = ProbeAgent("node-000", 1, backend="nccl").identity()
    assert "nics" not in other["telemetry"]  # read once per node
    dmi = tmp_path / "dmi"
    dmi.mkdir()
    (dmi / "product_name").write_text("p5.48xlarge\n")
    monkeypatch.setenv("RINGWATCH_SYSFS_DMI", str(dmi))
    assert ProbeAgent("node-000", 1, backend="nccl").identity()["profile"] == "p5.48xlarge"


def _ranks(node: str, *, gpus: int = 8, nvlinks: dict[int, int] | None = None,
           nics: list[dict[str, Any]] | None = None, nccl: str = "2.21.5") -> list[RankInfo]:
    out = []
    for g in range(gpus):
        tel: dict[str, Any] = {"gpu_count": gpus, "nvlinks_active": (nvlinks or {}).get(g, 18),
                               "driver": "550.54.15", "cuda": "12.4", "nccl": nccl}
        if g == 0:
            tel["nics"] = nics if nics is not None else [
                {"device": f"mlx5_{i}", "port": "1", "rate_gbps": 400.0, "state": "ACTIVE",
                 "link_layer": "InfiniBand"} for i in range(8)]
        out.append(RankInfo(node=node, local_index=g, hostname=node, gpu_name="NVIDIA H100 80GB HBM3",
                            telemetry=tel, profile="H100-SXM"))
    return out


def test_inventory_against_the_profile_and_the_fleet() -> None:
    slow_nics = [{"device": f"mlx5_{i}", "port": "1", "rate_gbps": 200.0 if i == 3 else 400.0,
                  "state": "DOWN" if i == 5 else "ACTIVE", "link_layer": "InfiniBand"}
                 for i in range(8)]
    ranks = (_ranks("good-0") + _ranks("good-1") + _ranks("seven", gpus=7)
             + _ranks("link", nvlinks={4: 17}) + _ranks("nics", nics=slow_nics)
             + _ranks("old", nccl="2.18.1"))
    got = {(f.node, f.detail["what"], f.gpu): f for f in inventory_findings(ranks)}
    assert set(got) == {("seven", "gpus", None), ("link", "nvlinks", 4), ("nics", "nic_down", None),
                        ("nics", "nic_rate", None), ("old", "nccl", None)}
    assert got[("link", "nvlinks", 4)].blamed_nodes == ["link"]
    assert "7 of the 8 GPUs" in got[("seven", "gpus", None)].detail["reason"]
    # Another NCCL than the fleet's is a warning, not a reason to exclude the node.
    assert got[("old", "nccl", None)].severity == "warning"
    assert got[("old", "nccl", None)].blamed_nodes == []
    assert inventory_findings(_ranks("a") + _ranks("b")) == []


def test_rising_counters_and_xids_are_findings_on_the_gpu(nvml: EventNvml, fake_cuda: object) -> None:
    agents = {f"node-000/{g}": ProbeAgent("node-000", g, backend="nccl") for g in range(3)}
    before = {m: a.counters() for m, a in agents.items()}
    nvml.errors[(1, 7, nvml.NVML_NVLINK_ERROR_DL_CRC_FLIT)] = 12
    nvml.xids[2] = [79]
    after = {m: a.counters() for m, a in agents.items()}
    findings, snapshots = judge_readings(before, after)
    got = {(f.kind, f.gpu): f for f in findings}
    assert set(got) == {("nvlink_degraded", 1), ("gpu_xid", 2)}
    assert got[("nvlink_degraded", 1)].detail["rising_errors"] == {"7": {"crc_flit": 12}}
    assert got[("gpu_xid", 2)].detail["xids"] == [79]
    assert {(s["node"], s["local_index"]) for s in snapshots} == {("node-000", 1), ("node-000", 2)}
    # The next cycle reads again before and after: nothing new, nothing found.
    again = {m: a.counters() for m, a in agents.items()}
    quiet, _ = judge_readings(again, {m: a.counters() for m, a in agents.items()})
    assert quiet == []


def test_inventory_and_counters_reach_the_api_findings_series_and_events(clean_db) -> None:
    ranks = _ranks("node-000") + _ranks("node-001", gpus=7)
    ms = [measurement([f"node-00{n}/{g}" for g in range(7)], 400.0, scope="intra_node")
          for n in range(2)]
    counters = [{"node": "node-000", "local_index": 1,
                 "before": [{"link": 7, "active": True, "errors": {"crc_flit": 0}}],
                 "after": [{"link": 7, "active": True, "errors": {"crc_flit": 12}}],
                 "xid": [], "findings": ["nvlink_degraded"]}]
    nvml_finding = {"kind": "nvlink_degraded", "node": "node-000", "gpu": 1, "severity": "warning",
                    "rising_errors": {"7": {"crc_flit": 12}}, "source": "nvml"}
    batch = {"batch_id": uuid.uuid4().hex, "backend": "nccl", "measurements": ms,
             "ranks": [r.to_dict() for r in ranks], "findings": [nvml_finding],
             "counters": counters}
    with api_client(clean_db, settings={}) as api:  # default hysteresis
        r = api.post("/v1/measurements", json=batch, headers=api.h["agent"])
        assert r.status_code == 200, r.text
        opened = api.get("/v1/findings", params={"status": "open"}, headers=api.h["reader"]).json()
        kinds = {(f["kind"], f["nodes"][0], f["detail"].get("what")) for f in opened}
        # Facts open an incident at once, unlike a bandwidth reading.
        assert kinds == {("inventory_mismatch", "node-001", "gpus"),
                         ("nvlink_degraded", "node-000", None)}
        series = api.get("/v1/series", params={"members": "node-000/1"},
                         headers=api.h["reader"]).json()
        assert [c["after"][0]["errors"]["crc_flit"] for c in series["counters"]] == [12]
        nodes = {n["name"]: n for n in api.get("/v1/nodes", headers=api.h["reader"]).json()}
        assert nodes["node-001"]["profile"] == "H100-SXM"
    with db.transaction(clean_db) as s:
        events = {tuple(e) for e in s.execute(text(
            "SELECT event_type, payload->'finding'->>'kind' FROM outbox_events"))}
    assert ("health.degraded", "inventory_mismatch") in events
