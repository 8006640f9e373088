"""Hardware profiles and the absolute floor: a fleet slow everywhere alike is found, in a
probe, a preflight, the monitoring cycles and the API's stored answer alike."""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path

import pytest

from ringwatch.agents import profiles
from ringwatch.agents.sim import SimBackend
from ringwatch.agents.spec import Measurement
from ringwatch.services.analyzer.assess import PREFLIGHT_THRESHOLDS, assess
from ringwatch.services.check import run_check
from ringwatch.services.scheduler.cycle import ProbeOptions, run_cycle
from tests.api_fixtures import api_client
from tests.procs import cli

# The two fleets: a network at a quarter of 400G (sockets, no GPUDirect RDMA) and
# NVLink at 25 GB/s; both built on H100 SXM, whose profile rates them far higher.
SLOW_NETWORK = {"nodes": 64, "gpus_per_node": 8, "gpu": "H100-SXM", "net_gbs": 12.5,
                "noise": 0.03, "seed": 1, "faults": []}
SLOW_NVLINK = {"nodes": 16, "gpus_per_node": 8, "gpu": "H100-SXM", "nvlink_gbs": 25,
               "noise": 0.03, "seed": 2, "faults": []}
HEALTHY = {"nodes": 16, "gpus_per_node": 8, "gpu": "H100-SXM", "noise": 0.03, "seed": 3,
           "faults": []}


def _m(members: list[str], busbw: float, size: int = 1 << 28, rated: float | None = None,
       op: str = "allreduce") -> Measurement:
    return Measurement(op=op, scope="intra_node", members=members, size_bytes=size,
                       dtype="float32", warmup=1, iters=5, time_us=1.0, algbw_gbs=busbw,
                       busbw_gbs=busbw, wrong=0, rated_gbs=rated)


def test_builtin_profiles_and_a_site_file(tmp_path: Path, monkeypatch) -> None:
    built = profiles.load()
    assert {"H100-SXM", "H200", "A100", "p5.48xlarge"} <= set(built)
    h100 = built["H100-SXM"]
    assert h100.rated("nvlink", "allreduce") == 450.0 and h100.network_gbs_per_gpu == 50.0
    assert built["p5.48xlarge"].network_gbs_per_gpu == 50.0  # 32 x 100 Gb/s EFA over 8 GPUs
    site = tmp_path / "profiles.json"
    site.write_text(json.dumps({
        "H100-SXM": {"network_busbw": {"allreduce": 40.0}},
        "MI300X": {"gpu_match": ["MI300X"], "gpus_per_node": 8, "nvlinks_per_gpu": 7,
                   "nics_per_node": 8, "nic_gbps": 400, "nvlink_busbw": {"allreduce": 300.0}}}))
    mine = profiles.load(site)
    assert mine["H100-SXM"].rated("network", "allreduce") == 40.0
    assert mine["H100-SXM"].rated("nvlink", "allreduce") == 450.0  # untouched
    assert profiles.detect("AMD Instinct MI300X", profiles=mine) == "MI300X"
    site.write_text(json.dumps({"X": {"colour": "red"}}))
    with pytest.raises(ValueError, match="unknown fields"):
        profiles.load(site)
    site.write_text("{not json")
    with pytest.raises(ValueError, match="profiles file"):
        profiles.load(site)


def test_detection_by_gpu_name_instance_or_setting(monkeypatch) -> None:
    monkeypatch.delenv("RINGWATCH_PROFILE", raising=False)
    assert profiles.detect("NVIDIA H100 80GB HBM3") == "H100-SXM"
    assert profiles.detect("NVIDIA H200") == "H200"
    # A Grace Hopper superchip is no H200 board: no profile rather than the wrong one.
    assert profiles.detect("NVIDIA GH200 480GB") is None
    assert profiles.detect("NVIDIA A100-SXM4-80GB") == "A100"
    assert profiles.detect("NVIDIA H100 80GB HBM3", instance="p5.48xlarge") == "p5.48xlarge"
    assert profiles.detect("NVIDIA H100 PCIe") is None  # not an 8-GPU NVLink node
    assert profiles.detect("Tesla T4") is None and profiles.detect(None) is None
    monkeypatch.setenv("RINGWATCH_PROFILE", "A100")
    assert profiles.detect("NVIDIA H100 80GB HBM3") == "A100"
    monkeypatch.setenv("RINGWATCH_PROFILE", "Z9000")
    with pytest.raises(ValueError, match="unknown hardware profile"):
        profiles.detect("NVIDIA H100 80GB HBM3")


# Each Blackwell profile's rated figures and where they come from (docs/profiles.md).
BLACKWELL = {
    # name: (GPUs per node, NIC rate Gb/s, network per rail GB/s, NVLink domain, sources)
    "B200": (8, 400, 50.0, 0, ("docs.nvidia.com/dgx/dgxb200-user-guide",
                               "www.nvidia.com/en-us/data-center/nvlink")),
    "GB200-NVL72": (4, 400, 50.0, 72, ("docs.nvidia.com/dgx/dgxgb200-user-guide/hardware",
                                       "docs.nvidia.com/dgx/dgxgb200-user-guide/networking")),
    "GB300-NVL72": (4, 800, 100.0, 72, ("docs.nvidia.com/enterprise-reference-architectures/"
                                        "nvl72-ai-factory", "connectx8supernic")),
}


def test_blackwell_profiles_by_nvml_name_with_their_rated_figures(monkeypatch) -> None:
    monkeypatch.delenv("RINGWATCH_PROFILE", raising=False)
    assert profiles.detect("NVIDIA B200") == "B200"
    # "B200" is inside "GB200": the longer pattern wins, as "H100 80GB HBM3" beats "H100".
    assert profiles.detect("NVIDIA GB200") == "GB200-NVL72"
    assert profiles.detect("NVIDIA GB300") == "GB300-NVL72"
    assert profiles.detect("NVIDIA B300 SXM6 AC") is None  # HGX B300: no profile yet
    assert profiles.get("GB200").name == "GB200-NVL72"
    table = profiles.load()
    for name, (gpus, nic, rail, domain, _) in BLACKWELL.items():
        p = table[name]
        assert (p.gpus_per_node, p.nvlinks_per_gpu, p.nic_gbps, p.nvlink_domain_gpus) == (
            gpus, 18, nic, domain), name
        # NVLink 5: 1.8 TB/s per GPU both ways, 900 GB/s one way; one NIC rail per GPU.
        assert all(p.rated("nvlink", op) == 900.0 for op in profiles.OPS), name
        assert all(p.rated("network", op) == rail for op in profiles.OPS), name
        assert p.network_gbs_per_gpu == rail, name
    # Two full trays of one rack: four rails in parallel, far below the rack's NVLink.
    two_trays = [f"{n}/{g}" for n in "ab" for g in range(4)]
    assert profiles.rated_busbw(table["GB200-NVL72"], "allreduce", two_trays, 1 << 28) == 200.0


def test_an_nvl36x2_site_sets_its_nvlink_domain(tmp_path: Path) -> None:
    site = tmp_path / "profiles.json"
    site.write_text(json.dumps({"GB200-NVL72": {"nvlink_domain_gpus": 36}}))
    assert profiles.load(site)["GB200-NVL72"].nvlink_domain_gpus == 36
    assert profiles.load(site)["GB200-NVL72"].rated("nvlink", "allreduce") == 900.0


def test_every_builtin_profile_and_its_sources_are_in_the_docs() -> None:
    text = (Path(__file__).resolve().parents[1] / "docs" / "profiles.md").read_text()
    for name in profiles.BUILTIN:
        assert f"| `{name}` |" in text, name
    for name, (*_, sources) in BLACKWELL.items():
        for source in sources:
            assert source in text, (name, source)


def test_rated_figures_apply_to_bandwidth_bound_sizes_and_the_lowest_profile_wins() -> None:
    intra = [f"a/{g}" for g in range(8)]
    pair = ["a/0", "b/0"]
    two_nodes = [f"{n}/{g}" for n in "ab" for g in range(8)]
    ms = [_m(intra, 400.0), _m(intra, 1.0, size=8), _m(pair, 20.0), _m(["c/0", "c/1"], 1.0),
          _m(two_nodes, 300.0), _m(two_nodes, 80.0, op="alltoall")]
    profiles.annotate(ms, {"a": "H100-SXM", "b": "A100", "c": None})
    # Eight rails in parallel for a ring of two full nodes; an all-to-all counts 15/16 of
    # its data and sends 8/16 over the network.
    assert [m.rated_gbs for m in ms] == [450.0, None, 25.0, None, 200.0,
                                         pytest.approx(25.0 * 15 / 8)]


def test_the_floor_flags_a_link_whose_peers_are_as_slow() -> None:
    nodes = [[f"n{i}/{g}" for g in range(8)] for i in range(4)]
    ms = [_m(members, 20.0, rated=450.0) for members in nodes]
    got = assess(ms, PREFLIGHT_THRESHOLDS)
    assert all(a.bad and a.source == "rated" for a in got)
    assert got[0].ratio == pytest.approx(20.0 / 450.0)
    fine = assess([_m(members, 400.0, rated=450.0) for members in nodes], PREFLIGHT_THRESHOLDS)
    assert not any(a.bad for a in fine)


@pytest.mark.parametrize(("scenario", "scope"), [(SLOW_NETWORK, "network"),
                                                  (SLOW_NVLINK, "nvlink")])
def test_a_fleet_slow_alike_is_one_finding_naming_the_scope(scenario, scope) -> None:
    verdict = run_check(SimBackend(scenario)).verdict()
    assert not verdict["healthy"]
    kinds = [f["kind"] for f in verdict["findings"]]
    assert kinds == ["fabric_below_rated"], kinds
    f = verdict["findings"][0]
    assert f["scope"] == scope and len(f["nodes"]) == scenario["nodes"]
    assert f["measured_gbs"] < 0.5 * f["expected_gbs"]
    assert verdict["exclude"] == []  # the fleet's fault: excluding every node helps nobody


def _fleet(nodes: int, **fields) -> dict:
    return {"nodes": nodes, "gpus_per_node": 8, "gpu": "H100-SXM", "seed": 7, **fields}


@pytest.mark.parametrize("scenario, scope", [
    (_fleet(32, net_gbs=30), "network"),    # 60 % of the rated network
    (_fleet(32, net_gbs=20), "network"),    # 40 %: the world group reads slow too
    (_fleet(16, nvlink_gbs=270), "nvlink"),  # 60 % of the rated NVLink
])
def test_no_group_vetoes_a_shortfall_the_fleet_shares(scenario, scope) -> None:
    verdict = run_check(SimBackend(scenario)).verdict()
    assert not verdict["healthy"]
    assert [(f["kind"], f["scope"]) for f in verdict["findings"]] == [
        ("fabric_below_rated", scope)]
    assert verdict["exclude"] == []
    # What the fleet's finding explains is decided: the check ends with nothing open.
    assert verdict["complete"] and verdict["undecided"] == 0


def test_a_node_below_the_fleets_own_level_is_named_beside_it() -> None:
    slow = _fleet(32, net_gbs=30, faults=[{"kind": "nic", "node": "node-017", "factor": 0.5}])
    verdict = run_check(SimBackend(slow)).verdict()
    kinds = sorted(f["kind"] for f in verdict["findings"])
    assert kinds == ["fabric_below_rated", "nic_degraded"], kinds
    assert verdict["exclude"] == ["node-017"]
    assert verdict["complete"] and verdict["undecided"] == 0


def test_a_healthy_fleet_and_one_slow_node_are_not_a_fleet_shortfall() -> None:
    assert run_check(SimBackend(HEALTHY)).verdict()["healthy"]
    one = {**HEALTHY, "faults": [{"kind": "nic", "node": "node-003", "factor": 0.2}]}
    verdict = run_check(SimBackend(one)).verdict()
    assert [f["kind"] for f in verdict["findings"]] == ["nic_degraded"]
    assert verdict["exclude"] == ["node-003"]


def test_monitoring_opens_one_incident_and_the_stored_preflight_agrees(clean_db) -> None:
    backend = SimBackend(SLOW_NVLINK)
    with api_client(clean_db, settings={}) as api:
        for rotation in range(2):  # the default hysteresis: two bad cycles of the last three
            batch = run_cycle(backend, ProbeOptions(), rotation=rotation).to_batch()
            r = api.post("/v1/measurements", json=batch, headers=api.h["agent"])
            assert r.status_code == 200, r.text
        opened = api.get("/v1/findings", params={"status": "open"}, headers=api.h["reader"]).json()
        assert [(f["kind"], f["detail"]["scope"]) for f in opened] == [
            ("fabric_below_rated", "nvlink")]
        nodes = api.get("/v1/nodes", headers=api.h["reader"]).json()
        assert {n["profile"] for n in nodes} == {"H100-SXM"}
        r = api.post("/v1/preflight", json={"nodes": ["node-000", "node-001"], "max_age_s": 3600},
                     headers=api.h["reader"])
        verdict = r.json()
        assert r.status_code == 200 and not verdict["healthy"]
        assert [f["kind"] for f in verdict["findings"]] == ["fabric_below_rated"]
    from sqlalchemy import text

    from ringwatch.services.store import db
    with db.transaction(clean_db) as s:
        events = s.execute(text("SELECT event_type, payload->'finding'->>'kind' FROM outbox_events")
                           ).all()
    assert ("health.degraded", "fabric_below_rated") in [tuple(e) for e in events]


def test_the_cli_preflight_exits_1_with_the_finding(tmp_path: Path) -> None:
    path = tmp_path / "slow.json"
    path.write_text(json.dumps(SLOW_NETWORK))
    out = cli("preflight", "--fabric", str(path), "--json",
              env={**os.environ, "RINGWATCH_STATE_DIR": str(tmp_path / uuid.uuid4().hex)})
    assert out.returncode == 1, out.stderr[-500:]
    verdict = json.loads(out.stdout)
    assert [f["kind"] for f in verdict["findings"]] == ["fabric_below_rated"]
    assert verdict["findings"][0]["scope"] == "network"
