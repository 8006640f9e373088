"""Every check reads the same facts: NVML and NIC counters and NVLink fabric state are read
and judged inside the check (services.check.facts), so `ringwatch preflight --fabric`, a
preflight a scheduler serves and a monitoring cycle name the same faults on the same fleet;
a batch says whose facts it read (``facts``), and ingest judges a counter incident only for
those nodes (docs/analysis.md, docs/formats.md)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from ringwatch.agents.groups import split_member
from ringwatch.agents.nvlink_fabric import reading as fabric_reading
from ringwatch.agents.sim import SimBackend
from ringwatch.services.check import ProbeSpec, run_check
from ringwatch.services.scheduler.api_client import SchedulerApi
from ringwatch.services.scheduler.cycle import ProbeOptions, run_cycle, serve_preflight
from ringwatch.services.scheduler.shipper import Shipper
from ringwatch.services.store import db
from ringwatch.services.store import health as health_store
from tests.api_fixtures import fleet_batch, measurement
from tests.procs import cli
from tests.test_preflight_sim import SlowRankBackend

# One fault of each kind of fact: NIC error counters and a transport fallback the sim models,
# and, read beside them as a GPU fleet's agents read NVML, an NVLink error counter rising, a
# GPU raising XIDs and a GPU whose NVLink fabric registration has not completed.
SCENARIO: dict[str, Any] = {"nodes": 8, "gpus_per_node": 8, "seed": 7, "faults": [
    {"kind": "nic_errors", "node": "node-002", "counter": "symbol_error", "per_cycle": 500},
    {"kind": "transport", "node": "node-005", "transport": "socket"}]}
CRC_GPU, XID_GPU, FABRIC_GPU = "node-003/1", "node-001/7", "node-006/4"
EXPECTED = {("nic_errors", "node-002", None), ("transport_fallback", "node-005", None),
            ("nvlink_degraded", "node-003", 1), ("gpu_xid", "node-001", 7),
            ("nvlink_fabric", "node-006", 4)}
SIM_ONLY = {("nic_errors", "node-002", None), ("transport_fallback", "node-005", None)}
SYMBOL_CAUSE = "mlx5_0 port 1 symbol_error +500 in 300 s (1.67/s, threshold 0.4/s)"
CLUSTER = bytes(range(1, 17))


def nvml_reading(gpu: int, *, crc_flit: int = 0, link_up: bool = True, state: int = 3,
                 clique: int = 1, xids: tuple[int, ...] = ()) -> dict[str, Any]:
    """One GPU's counters as agents.telemetry.read_counters and the agent's XID watcher
    give them (two links; fabric state 3 is COMPLETED, 2 IN_PROGRESS)."""
    links = [{"link": i, "active": link_up or i != 0,
              "errors": {"replay": 0, "recovery": 0, "crc_flit": crc_flit if i == 1 else 0,
                         "crc_data": 0}} for i in range(2)]
    return {"available": True, "local_index": gpu, "nvlinks": links,
            "fabric": fabric_reading(state=state, status="SUCCESS", cluster_uuid=CLUSTER,
                                     clique_id=clique, health_mask=None, health_summary=None,
                                     api="v1"),
            "xid": [{"xid": x, "type": 8} for x in xids]}


class FactsSim(SimBackend):
    """The sim, its ranks also reading NVML: GPU 1 of node-003 counts CRC errors on link 1
    between any two reads, GPU 7 of node-001 raises XID 79, GPU 4 of node-006 never finishes
    registering with its NVLink fabric. The sim's own NIC ports join node-002's reading."""

    def __init__(self, scenario: dict[str, Any]) -> None:
        super().__init__(scenario)
        self.reads = 0

    def counters(self) -> dict[str, dict[str, Any]]:
        self.reads += 1
        out = {}
        for r in self.ranks():
            out[r.member] = nvml_reading(
                r.local_index, crc_flit=7 * self.reads if r.member == CRC_GPU else 0,
                state=2 if r.member == FABRIC_GPU else 3,
                xids=(79,) if r.member == XID_GPU else ())
        for name, nic in super().counters().items():
            out[name] = {**out[name], **nic}
        return out


def places(findings: list[dict[str, Any]]) -> set[tuple[str, str | None, int | None]]:
    return {(f["kind"], f.get("node"), f.get("gpu")) for f in findings}


def test_a_check_reads_the_facts_of_its_nodes_and_names_each_fault() -> None:
    """`preflight --fabric`'s path: run_check alone, no scheduler around it."""
    backend = FactsSim(SCENARIO)
    checked = run_check(backend)
    verdict = checked.verdict()
    assert backend.reads == 2  # once before the first round, once after the last
    assert places(verdict["findings"]) == EXPECTED
    assert verdict["healthy"] is False
    assert verdict["exclude"] == sorted({node for _, node, _ in EXPECTED if node})
    nic = next(f for f in verdict["findings"] if f["kind"] == "nic_errors")
    assert nic["cause"] == SYMBOL_CAUSE
    # Shipped as the probes' own findings, with the readings of the GPUs that showed them.
    assert {(f.kind, f.node, f.gpu) for f in checked.probe_findings} == EXPECTED
    assert {(c["node"], c["local_index"]) for c in checked.counters} == {
        ("node-002", 0), ("node-003", 1), ("node-001", 7), ("node-006", 4)}
    assert checked.facts == [f"node-{i:03d}" for i in range(8)]


def test_the_cli_preflight_names_the_sims_counter_fault(tmp_path: Path) -> None:
    """`ringwatch preflight --fabric FILE --json` on a nic_errors fault whose bandwidth is
    unchanged: unhealthy, the node excluded for it (this said HEALTHY while `probe` named it)."""
    path = tmp_path / "fabric.json"
    path.write_text(json.dumps(SCENARIO))
    r = cli("preflight", "--fabric", str(path), "--json", env=dict(os.environ))
    assert r.returncode == 1, r.stderr[-2000:]
    verdict = json.loads(r.stdout)
    assert places(verdict["findings"]) == SIM_ONLY
    assert verdict["exclude"] == ["node-002", "node-005"]


def test_a_monitoring_cycle_names_the_same_faults_and_says_whose_facts_it_read() -> None:
    backend = FactsSim(SCENARIO)
    cycle = run_cycle(backend, ProbeOptions())
    assert backend.reads == 2
    judged = {(f.kind, f.node, f.gpu) for f in cycle.judged}
    assert judged == EXPECTED == {(f.kind, f.node, f.gpu) for f in cycle.findings}
    batch = cycle.to_batch()
    assert batch["facts"] == [f"node-{i:03d}" for i in range(8)]
    assert {c["node"] for c in batch["counters"]} == {"node-001", "node-002", "node-003",
                                                      "node-006"}


def test_a_check_between_cycles_reads_the_sims_rise_at_the_cycles_rate() -> None:
    """The sim's counters rise between any two reads, at the modeled interval: a preflight
    served after a cycle on the same backend sees what the cycles around it see."""
    with SimBackend(SCENARIO) as backend:
        first = run_cycle(backend, ProbeOptions(), rotation=0)
        between = run_check(backend).verdict()
        second = run_cycle(backend, ProbeOptions(), rotation=1)
    causes = [next(f.detail["cause"] for f in first.judged if f.kind == "nic_errors"),
              next(f["cause"] for f in between["findings"] if f["kind"] == "nic_errors"),
              next(f.detail["cause"] for f in second.judged if f.kind == "nic_errors")]
    assert causes == [SYMBOL_CAUSE] * 3
    assert first.facts == second.facts == ["node-002"]  # the sim reads ports where it models them


def _served(api, tmp_path: Path) -> tuple[Shipper, SchedulerApi]:
    """A shipper and a scheduler's API client that talk to the test's app in-process."""
    from fastapi.testclient import TestClient

    token = api.tokens["agent"]
    shipper = Shipper("http://testserver", token, tmp_path / "spool")
    shipper.client = TestClient(api.app, headers=api.h["agent"])
    client = SchedulerApi("http://testserver", token, "sched")
    client.client = TestClient(api.app, base_url="http://testserver", headers=api.h["agent"])
    return shipper, client


def test_a_served_preflight_names_the_same_faults_and_keeps_their_incidents_open(
        api, tmp_path: Path) -> None:
    """A cycle opens one incident per fault; a `confirm: true` preflight then goes to the
    scheduler, whose check on the same backend names the same faults (not healthy) and whose
    batch keeps every incident open; the next cycle opens none again: one fault, one
    incident, no recovered/degraded flapping."""
    backend = FactsSim(SCENARIO)
    shipper, client = _served(api, tmp_path)
    cycle = run_cycle(backend, ProbeOptions(), rotation=0)
    assert shipper.ship(cycle.to_batch()) == 0
    opened = api.get("/v1/findings", params={"status": "open"}, headers=api.h["reader"]).json()
    assert {(f["kind"], f["nodes"][0]) for f in opened} == {(k, n) for k, n, _ in EXPECTED}

    nodes = [f"node-{i:03d}" for i in range(8)]
    req = api.post("/v1/preflight", json={"nodes": nodes, "confirm": True},
                   headers=api.h["reader"])
    assert req.status_code == 202, req.text
    assert serve_preflight(backend, shipper, client, ProbeOptions())
    done = api.get(f"/v1/preflight/{req.json()['id']}", headers=api.h["reader"]).json()
    assert done["status"] == "done" and done["source"] == "probed"
    assert done["healthy"] is False and places(done["findings"]) == EXPECTED

    again = run_cycle(backend, ProbeOptions(), rotation=1)
    assert shipper.ship(again.to_batch()) == 0
    still = api.get("/v1/findings", params={"status": "open"}, headers=api.h["reader"]).json()
    assert sorted(f["id"] for f in still) == sorted(f["id"] for f in opened)
    assert api.get("/v1/findings", params={"status": "resolved"},
                   headers=api.h["reader"]).json() == []


# -- ingest: a counter incident is judged only where the batch read the node's facts ---------

COUNTER_FINDINGS = {
    "nic_errors": {"kind": "nic_errors", "node": "node-002", "severity": "warning",
                   "source": "sysfs", "device": "mlx5_0", "port": 1, "counter": "symbol_error",
                   "cause": SYMBOL_CAUSE},
    "gpu_xid": {"kind": "gpu_xid", "node": "node-002", "gpu": 3, "severity": "critical",
                "xids": [79], "source": "nvml"},
    "nvlink_fabric": {"kind": "nvlink_fabric", "node": "node-002", "gpu": 3,
                      "severity": "critical", "source": "nvml", "state": "IN_PROGRESS",
                      "cause": "GPU 3 fabric registration IN_PROGRESS"},
    "nvlink_degraded": {"kind": "nvlink_degraded", "node": "node-002", "gpu": 1,
                        "severity": "warning", "source": "nvml", "links_down": [],
                        "rising_errors": {"1": {"crc_flit": 7}}},
}


def _batch(finding: dict[str, Any] | None = None, facts: list[str] | None = None) -> dict:
    """Every pair of node-000..003 measured fine (node-002's NVLink and NIC groups too)."""
    batch = fleet_batch()
    if finding is not None:
        batch["findings"] = [finding]
    if facts is not None:
        batch["facts"] = facts
    return batch


def _fault(clean_db) -> tuple[str, int]:
    with db.transaction(clean_db) as s:
        (state,) = health_store.fault_states(s).values()
        return state.recent, state.good_streak


@pytest.mark.parametrize("kind", sorted(COUNTER_FINDINGS))
def test_only_a_batch_that_read_the_nodes_facts_clears_its_counter_incident(
        api, clean_db, kind: str) -> None:
    def post(batch: dict) -> Any:
        return api.post("/v1/measurements", json=batch, headers=api.h["agent"])

    finding = COUNTER_FINDINGS[kind]
    opened = post(_batch(finding, facts=["node-002"])).json()
    assert [d["kind"] for d in opened["degraded"]] == [kind]
    # Its node measured fine, but its counters were not read (another node's were), or the
    # sender says nothing of facts at all: no evidence either way.
    for facts in (["node-000", "node-001", "node-003"], None, []):
        answer = post(_batch(facts=facts)).json()
        assert answer["recovered"] == [], facts
        assert _fault(clean_db) == ("1", 0)
    # Read and clean: a good observation, which clears a fact at once.
    answer = post(_batch(facts=["node-000", "node-002"])).json()
    assert [d["kind"] for d in answer["recovered"]] == [kind]
    resolved = api.get("/v1/findings", params={"status": "resolved"},
                       headers=api.h["reader"]).json()
    assert [(f["kind"], f["nodes"]) for f in resolved] == [(kind, ["node-002"])]


def test_a_scoped_token_names_no_other_nodes_facts(api, clean_db) -> None:
    from tests.test_auth import _token

    _, scoped = _token(clean_db, "agent", nodes=["node-000", "node-001"])
    batch = {"batch_id": "facts-scope", "backend": "gloo", "measurements": [
        measurement(["node-000/0", "node-000/1", "node-001/0", "node-001/1"], 10.0)]}
    r = api.post("/v1/measurements", json={**batch, "facts": ["node-000", "node-007"]},
                 headers=scoped)
    assert r.status_code == 403 and "node-007" in r.json()["message"]
    r = api.post("/v1/measurements", json={**batch, "facts": ["node-000", "node-001"]},
                 headers=scoped)
    assert r.status_code == 200, r.text


# -- the check on a backend with no sim: --local's shape, with NVML readings -------------------


class ReadsCounters(SlowRankBackend):
    """gloo-shaped ranks (3 nodes x 2) whose agents read NVML: node-001's GPU 0 loses link
    0 after the first read; node-002's GPU 1 cannot read NVML at all."""

    def __init__(self, cliques: dict[str, int] | None = None) -> None:
        super().__init__(3, 2)
        self.reads = 0
        self.cliques = cliques or {}

    def counters(self) -> dict[str, dict[str, Any]]:
        self.reads += 1
        out: dict[str, dict[str, Any]] = {}
        for r in self.ranks():
            node, gpu = split_member(r.member)
            out[r.member] = nvml_reading(gpu, clique=self.cliques.get(node, 1),
                                         link_up=not (r.member == "node-001/0" and self.reads > 1))
        out["node-002/1"] = {"available": False, "reason": "NVMLError_DriverNotLoaded"}
        return out


def test_a_check_without_the_sim_reads_before_and_after_and_names_the_link_down() -> None:
    backend = ReadsCounters()
    checked = run_check(backend)
    assert backend.reads == 2
    (found,) = checked.verdict()["findings"]
    assert (found["kind"], found["node"], found["gpu"]) == ("nvlink_degraded", "node-001", 0)
    assert found["severity"] == "critical" and found["links_down"] == [0]
    # node-002 read nothing on one GPU: its facts were not read, whatever the others said.
    assert checked.facts == ["node-000", "node-001"]


def test_a_check_judges_its_own_nodes_facts_only() -> None:
    checked = run_check(ReadsCounters(), ["node-000"])
    assert checked.verdict()["findings"] == [] and checked.verdict()["healthy"] is True
    assert checked.facts == ["node-000"] and checked.counters == []


def test_a_partitioned_nvlink_domain_reaches_the_check() -> None:
    """RINGWATCH_NVLINK_PARTITIONED reaches the check through its spec: node-001 in another
    clique than the rest of its cluster is a finding, unless the domain is partitioned on
    purpose."""
    split = run_check(ReadsCounters({"node-001": 7}))
    assert {(f["kind"], f["node"], f["gpu"]) for f in split.verdict()["findings"]} == {
        ("nvlink_fabric", "node-001", 0), ("nvlink_fabric", "node-001", 1),
        ("nvlink_degraded", "node-001", 0)}
    partitioned = run_check(ReadsCounters({"node-001": 7}),
                            spec=ProbeSpec(nvlink_partitioned=True))
    assert {f["kind"] for f in partitioned.verdict()["findings"]} == {"nvlink_degraded"}
