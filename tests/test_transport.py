"""Why a link is slow: the transport NCCL fell back to and NIC error counters rising, as the
sim models them, through the check, a monitoring cycle, the real API, its webhooks and the
preflight (docs/transport.md)."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path

import httpx
import pytest

from ringwatch.agents.groups import split_member
from ringwatch.agents.nccl_log import NcclLogReader
from ringwatch.agents.nic_counters import NicError
from ringwatch.agents.outcome import transport_of
from ringwatch.agents.probe import ProbeAgent
from ringwatch.agents.sim import Scenario, SimBackend
from ringwatch.agents.spec import GroupSpec
from ringwatch.agents.transport import error_text, nic_finding
from ringwatch.services.check import run_check
from ringwatch.services.cli.output import headline
from ringwatch.services.notifier.receiver import WebhookReceiver
from ringwatch.services.scheduler.cycle import ProbeOptions, run_cycle
from tests.api_fixtures import TEST_SECRET_KEY
from tests.procs import api_env, cli, start_server, stop_server

SOCKET = {"kind": "transport", "node": "node-002", "transport": "socket"}
SHM = {"kind": "transport", "node": "node-005", "gpus": [1, 6], "transport": "shm"}
SYMBOLS = {"kind": "nic_errors", "node": "node-009", "counter": "symbol_error", "per_cycle": 500}
FLAP = {"kind": "nic_errors", "node": "node-012", "counter": "link_downed", "per_cycle": 1}


def _scenario(nodes: int, *faults: dict) -> dict:
    return {"nodes": nodes, "gpus_per_node": 8, "seed": 5, "faults": list(faults)}


@pytest.mark.parametrize("fault, error", [
    ({"kind": "transport", "node": "node-001", "transport": "shm"}, "must be one of socket"),
    ({"kind": "transport", "node": "node-001", "gpus": [1, 2], "transport": "socket"},
     "must be one of shm, pcie"),
    ({"kind": "transport", "node": "node-001", "gpus": [3, 3], "transport": "shm"},
     "two different gpus"),
    ({"kind": "nic_errors", "node": "node-001", "counter": "crc", "per_cycle": 1},
     "counter must be one of"),
    ({"kind": "nic_errors", "node": "node-001", "counter": "symbol_error", "per_cycle": 0},
     "positive integer"),
    ({"kind": "nic_errors", "node": "node-001", "counter": "symbol_error", "per_cycle": 5,
      "factor": 0.5}, "unknown field"),
])
def test_a_scenario_names_what_is_wrong_with_a_transport_or_counter_fault(fault, error) -> None:
    with pytest.raises(ValueError, match=error):
        Scenario.from_dict(_scenario(4, fault))


def test_a_preflight_names_the_transport_it_fell_back_to_and_nothing_else_there() -> None:
    with SimBackend(_scenario(16, SOCKET, SHM)) as backend:
        verdict = run_check(backend).verdict()
    assert verdict["exclude"] == ["node-002", "node-005"]
    found = {(f["kind"], f["node"], tuple(f.get("gpus") or ())): f for f in verdict["findings"]}
    assert set(found) == {("transport_fallback", "node-002", ()),
                          ("transport_fallback", "node-005", (1, 6))}
    net = found[("transport_fallback", "node-002", ())]
    assert (net["transport"], net["expected_transport"]) == ("net_socket", "net_ib")
    assert net["cause"] == "inter-node over NET/Socket, expected NET/IB (mlx5_0..mlx5_7 up)"
    pair = found[("transport_fallback", "node-005", (1, 6))]
    assert pair["cause"] == "GPUs 1,6 over SHM, expected P2P over NVLink"


def test_a_rising_counter_is_a_finding_while_bandwidth_is_fine() -> None:
    with SimBackend(_scenario(16, SYMBOLS, FLAP)) as backend:
        cycle = run_cycle(backend, ProbeOptions(), rotation=0)
    nic = {f.node: f for f in cycle.findings if f.kind == "nic_errors"}
    assert set(nic) == {"node-009", "node-012"}
    symbols = nic["node-009"].detail
    assert (symbols["device"], symbols["port"], symbols["counter"]) == ("mlx5_0", 1, "symbol_error")
    # 500 in the modeled 300 s between reads is 1.67/s, past 400 Gb/s x 1e-12 = 0.4/s.
    assert symbols["cause"] == "mlx5_0 port 1 symbol_error +500 in 300 s (1.67/s, threshold 0.4/s)"
    assert nic["node-009"].severity == "warning"
    assert nic["node-012"].severity == "critical" and "(a link flap)" in nic["node-012"].detail["cause"]
    # Its bandwidth is still fine: nothing else is found on either node.
    assert {f.node for f in cycle.judged} == {"node-009", "node-012"}
    assert {f.kind for f in cycle.judged} == {"nic_errors"}
    assert cycle.counters and {c["node"] for c in cycle.counters} == {"node-009", "node-012"}


def test_the_worst_counter_of_a_node_is_its_cause() -> None:
    def err(counter: str, delta: int, threshold: float, flap: bool = False) -> NicError:
        return NicError(node="n", device="mlx5_1", port=1, counter=counter, delta=delta,
                        rate_per_s=delta / 60, threshold=threshold, threshold_per="interval",
                        interval_s=60, severity="critical" if flap else "warning", flap=flap,
                        why="")
    minor, major = err("port_rcv_errors", 12, 10), err("port_xmit_discards", 5000, 100)
    f = nic_finding("n", [minor, major])
    assert f is not None and f.detail["counter"] == "port_xmit_discards"
    assert f.severity == "warning" and len(f.detail["counters"]) == 2
    flap = nic_finding("n", [major, err("link_downed", 1, 1, flap=True)])
    assert flap is not None and flap.severity == "critical"
    assert flap.detail["cause"] == error_text(err("link_downed", 1, 1, flap=True))
    assert nic_finding("n", []) is None


ADMIN = "rw_transport_" + uuid.uuid4().hex
EXPECTED = {"node-002": {"transport_fallback"}, "node-705": {"transport_fallback"},
            "node-009": {"nic_errors"}, "node-900": {"nic_errors"}}


@pytest.mark.slow
def test_the_whole_path_at_fleet_scale(database_url, clean_db, tmp_path) -> None:
    """1024 x 8 on the sim through `ringwatch scheduler --once`, the real API and its
    notifier: each fault opens one incident saying why, its webhook carries the cause, the
    stored preflight of the whole fleet excludes exactly those nodes for those kinds alone,
    and `ringwatch status` prints the cause."""
    fabric = tmp_path / "fabric.json"
    fabric.write_text(json.dumps(_scenario(
        1024, SOCKET | {"node": "node-002"}, SHM | {"node": "node-705"}, SYMBOLS,
        FLAP | {"node": "node-900"})))
    env = {**api_env(database_url, tmp_path, ADMIN), "RINGWATCH_SECRET_KEY": TEST_SECRET_KEY,
           "RINGWATCH_WEBHOOK_ALLOWED_NETWORKS": "127.0.0.1/32", "RINGWATCH_NOTIFIER_POLL_S": "0.5"}
    api, h = env["RINGWATCH_API_URL"], {"Authorization": f"Bearer {ADMIN}"}
    proc = start_server(env, notifier=True)
    try:
        with WebhookReceiver("a receiver's own secret") as rx:
            httpx.post(f"{api}/v1/webhooks", headers=h, timeout=30, json={
                "url": rx.url, "secret": "a receiver's own secret",
                "events": ["health.degraded"]}).raise_for_status()
            run = subprocess.run([sys.executable, "-m", "ringwatch.services.cli.main", "scheduler",
                                  "--fabric", str(fabric), "--gpus-per-node", "8", "--once"],
                                 env=env, capture_output=True, text=True, timeout=600)
            assert run.returncode == 0, run.stderr[-2000:]
            events = rx.wait_for(len(EXPECTED), timeout_s=120)
        incidents = httpx.get(f"{api}/v1/findings", params={"status": "open"}, headers=h,
                              timeout=30).json()
        status = cli("status", env=env)
        metrics = httpx.get(f"{api}/metrics", headers=h, timeout=60).text
        # Each probe records the transports its group took: node-705's NVLink group, one of
        # whose pairs went over SHM.
        series = httpx.get(f"{api}/v1/series", headers=h, timeout=60, params={
            "members": ",".join(f"node-705/{g}" for g in range(8)), "resolution": "raw"}).json()
    finally:
        stop_server(proc)

    # Facts read, not timed: open on the first cycle that sees them, one incident each.
    assert sorted((f["kind"], f["nodes"][0]) for f in incidents) == sorted(
        (kind, node) for node, kinds in EXPECTED.items() for kind in kinds)
    causes = {f["nodes"][0]: f["detail"]["cause"] for f in incidents}
    assert causes["node-002"].startswith("inter-node over NET/Socket, expected NET/IB")
    assert causes["node-705"] == "GPUs 1,6 over SHM, expected P2P over NVLink"
    assert causes["node-009"].startswith("mlx5_0 port 1 symbol_error +500 in 300 s")
    assert "link_downed" in causes["node-900"] and "(a link flap)" in causes["node-900"]

    hooks = {e["body"]["finding"]["node"]: e["body"]["finding"] for e in events}
    assert set(hooks) == set(EXPECTED) and all(e["verified"] for e in events)
    assert all(hooks[n]["cause"] == causes[n] for n in EXPECTED)

    nodes = [f"node-{i:03d}" for i in range(1024)]
    with httpx.Client(base_url=api, headers=h, timeout=60) as client:
        proc = start_server(env)
        try:
            verdict = client.post("/v1/preflight", json={"nodes": nodes}).json()
        finally:
            stop_server(proc)
    assert verdict["exclude"] == sorted(EXPECTED)
    named: dict[str, set[str]] = {}
    for f in verdict["findings"]:
        named.setdefault(f["node"], set()).add(f["kind"])
    assert named == EXPECTED

    assert status.returncode == 1, status.stderr
    for node in EXPECTED:
        assert causes[node] in status.stdout

    assert series["points"] and {p["transport"] for p in series["points"]} == {"p2p_nvlink,shm"}

    # Per node and device on /metrics: the counters' rates, the transport taken.
    assert ('ringwatch_nic_error_rate_per_second{counter="symbol_error",device="mlx5_0",'
            'node="node-009",port="1"} 1.6666' in metrics)
    assert 'counter="link_downed",device="mlx5_0",node="node-900",port="1"}' in metrics
    assert ('ringwatch_transport_fallback{expected="net_ib",gpus="",node="node-002",'
            'transport="net_socket"} 1.0' in metrics)
    assert ('ringwatch_transport_fallback{expected="p2p_nvlink",gpus="1,6",node="node-705",'
            'transport="shm"} 1.0' in metrics)


# -- a rank's own NCCL log, through the agent's judgement ---------------------------------

NCCL_LOGS = Path(__file__).parent / "data" / "nccl"


def _agent_reads(log: str, members: list[str], scope: str, *, rdma: tuple[str, ...] = (),
                 nvlink_peers: set[int] | None = None) -> dict:
    """What ProbeAgent._transports adds to rank 0's reply after a group whose NCCL log is
    ``log`` (the file NCCL writes is the seam: everything from it on is the agent's)."""
    agent = ProbeAgent(split_member(members[0])[0], 0, "gloo")
    agent._nccl_log = NcclLogReader(str(NCCL_LOGS / log))
    agent._rdma = rdma
    agent._nvlink_peers = nvlink_peers or set()
    out: dict = {}
    agent._transports({"members": members, "scope": scope}, 0, out)
    return out


def test_a_rank_names_inter_node_sockets_while_its_rdma_nics_are_up() -> None:
    members = ["node-000/0", "node-001/0"]
    out = _agent_reads("built-2.28.3-socket-fallback-2node.log", members, "inter_node",
                       rdma=("mlx5_0", "mlx5_1"))
    assert "net_socket" in out["transports"]["inter_node"]
    [f] = out["transport_findings"]
    assert (f["kind"], f["node"], f["transport"], f["expected_transport"]) == (
        "transport_fallback", "node-000", "net_socket", "net_ib")
    assert f["cause"] == "inter-node over NET/Socket, expected NET/IB (mlx5_0..mlx5_1 up)"


def test_ib_with_gpudirect_is_no_fallback() -> None:
    out = _agent_reads("built-2.22.3-ib-gdr-2node.log", ["node-000/0", "node-001/0"],
                       "inter_node", rdma=("mlx5_0",))
    assert "net_ib" in out["transports"]["inter_node"] and out["transport_findings"] == []


def test_a_gpu_pair_over_shm_is_a_fallback_only_where_nvlink_joins_it() -> None:
    members = ["node-000/0", "node-000/1"]
    out = _agent_reads("built-2.22.3-shm-pair.log", members, "gpu_pair", nvlink_peers={1})
    [f] = out["transport_findings"]
    assert (f["gpus"], f["transport"], f["cause"]) == (
        [0, 1], "shm", "GPUs 0-1 over SHM, expected P2P over NVLink")
    # A pair NVML does not join by NVLink (a PCIe-only box): SHM is what NCCL should take.
    assert _agent_reads("built-2.22.3-shm-pair.log", members, "gpu_pair")["transport_findings"] == []


def test_eight_gpus_over_nvlink_say_nothing() -> None:
    members = [f"node-000/{g}" for g in range(8)]
    out = _agent_reads("built-2.22.3-a100-nvlink-8gpu.log", members, "intra_node",
                       nvlink_peers=set(range(1, 8)))
    assert out["transports"]["intra_node"] == ["p2p_nvlink"]
    assert out["transport_findings"] == []


def test_a_cause_carries_the_slow_figure_it_explains() -> None:
    """Sockets slow the network as a NIC at 0.4 would, a pair over SHM is slow like a bad
    NVLink: each node is named for its cause alone, with the slow result beside it as its
    headline; a slow NVLink with no fact beside it is an nvlink_degraded as ever."""
    with SimBackend(_scenario(16, SOCKET, {"kind": "nic", "node": "node-002", "factor": 0.4},
                              SHM, {"kind": "nvlink", "node": "node-005", "gpus": [1, 6],
                                    "factor": 0.3},
                              {"kind": "nvlink", "node": "node-011", "gpus": [0, 3],
                               "factor": 0.4})) as backend:
        verdict = run_check(backend).verdict()
    found = {(f["kind"], f["node"]): f for f in verdict["findings"]}
    assert set(found) == {("transport_fallback", "node-002"), ("transport_fallback", "node-005"),
                          ("nvlink_degraded", "node-011")}
    net = found[("transport_fallback", "node-002")]
    assert net["headline"]["ratio"] < 0.7 and net["headline"]["op"] in ("allreduce", "alltoall")
    assert headline({**net}) == f"{net['headline']['text']}; {net['cause']}"
    pair = found[("transport_fallback", "node-005")]
    assert pair["headline"]["ratio"] < 0.7
    assert "cause" not in found[("nvlink_degraded", "node-011")]
    # Without a slowdown the cause stands alone.
    with SimBackend(_scenario(16, SOCKET)) as backend:
        (alone,) = run_check(backend).verdict()["findings"]
    assert "headline" not in alone and headline(alone) == alone["cause"]


def test_a_counter_cause_beside_a_slow_nic_carries_its_figure() -> None:
    """NIC errors counted on a node whose NIC is also slow: the check names the node for its
    cause alone, with the slow figure beside it, as the API names it on ingest."""
    with SimBackend(_scenario(16, SYMBOLS, {"kind": "nic", "node": "node-009",
                                            "factor": 0.6})) as backend:
        verdict = run_check(backend).verdict()
    mine = [f for f in verdict["findings"]
            if "node-009" in (f.get("node"), *(f.get("nodes") or ()))]
    assert [f["kind"] for f in mine] == ["nic_errors"]
    assert mine[0]["measured_gbs"] < mine[0]["expected_gbs"]
    assert mine[0]["headline"]["ratio"] < 0.8
    assert "node-009" in verdict["exclude"]


def test_a_cause_takes_no_headline_from_another_faults_groups() -> None:
    """A node whose NIC counts errors but whose bandwidth is untouched, in a fleet where a
    slow path elsewhere slows the world group and the search's unions through every node:
    the cause's headline would have to come from its own node pairs, and they were fine."""
    path = {"kind": "net_path", "nodes": ["node-001", "node-014"], "factor": 0.5}
    with SimBackend(_scenario(24, SYMBOLS, path)) as backend:
        verdict = run_check(backend).verdict()
    (cause,) = [f for f in verdict["findings"] if f["kind"] == "nic_errors"]
    assert cause["node"] == "node-009"
    assert any(f["kind"] == "net_path_degraded" for f in verdict["findings"])
    assert "headline" not in cause and cause.get("measured_gbs") is None


def test_slurm_drains_the_node_with_its_cause_as_the_reason() -> None:
    from ringwatch.services.cli.slurm import reason_for

    with SimBackend(_scenario(16, SYMBOLS | {"node": "node-004"})) as backend:
        cycle = run_cycle(backend, ProbeOptions())
    (f,) = [x.to_dict() for x in cycle.judged]
    verdict = {"exclude": ["node-004"], "findings": [f]}
    assert reason_for(verdict, "node-004") == (
        "ringwatch: nic_errors node-004 mlx5_0 port 1 symbol_error +500 in 300 s "
        "(1.67/s, threshold 0.4/s)")
    assert reason_for(verdict, "node-005") is None


def test_each_measurement_records_the_transports_its_group_took() -> None:
    with SimBackend(_scenario(4, SOCKET, SHM | {"node": "node-001"},
                              {"kind": "pcie_only", "node": "node-003", "gpus": [2, 3]})) as b:
        got = b.run_round([GroupSpec(scope, tuple(members), sizes=(1 << 20,)) for scope, members in (
            ("intra_node", [f"node-000/{g}" for g in range(8)]),
            ("gpu_pair", ["node-001/1", "node-001/6"]),
            ("gpu_pair", ["node-003/2", "node-003/3"]),
            ("inter_node", ["node-000/0", "node-003/0"]),
            ("inter_node", ["node-002/0", "node-002/1", "node-003/0", "node-003/1"]))])
    taken = {(m.scope, m.members[0]): m.transport for m in got.measurements}
    assert taken == {("intra_node", "node-000/0"): "p2p_nvlink",
                     ("gpu_pair", "node-001/1"): "p2p_nvlink,shm",
                     ("gpu_pair", "node-003/2"): "p2p_nvlink,p2p_pcie",
                     ("inter_node", "node-000/0"): "net_ib",
                     ("inter_node", "node-002/0"): "net_ib,net_socket,p2p_nvlink"}
    # From the ranks' replies, as the Ray backend reduces them.
    replies = {0: {"transports": {"counts": {"net_ib": 4, "p2p_nvlink": 2}}},
               1: {"transports": {"counts": {"net_ib": 4}}}, 2: {}}
    assert transport_of(replies) == "net_ib,p2p_nvlink"
    assert transport_of({0: {}, 1: {"status": "ok"}}) is None


def test_an_agent_removes_the_nccl_logs_of_agents_that_are_gone(tmp_path) -> None:
    from ringwatch.agents.nccl_log import DEBUG_FILE_NAME, nccl_hostname
    from ringwatch.agents.probe import _remove_dead_logs

    host = nccl_hostname()
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    dead, alive = tmp_path / f"nccl.{host}.{gone}.log", tmp_path / f"nccl.{host}.1.log"
    other = tmp_path / "nccl.another-host.12345.log"
    for p in (dead, alive, other):
        p.write_text("x\n")
    _remove_dead_logs(str(tmp_path / DEBUG_FILE_NAME))
    assert not dead.exists() and alive.exists() and other.exists()


def test_an_excluded_nodes_own_groups_are_not_left_undecided() -> None:
    """node-005 is excluded for its SHM pair; its own groups (fine on bandwidth) need no
    decision, so they do not make the verdict incomplete."""
    with SimBackend(_scenario(16, SHM)) as backend:
        result = run_check(backend)
    assert result.verdict()["exclude"] == ["node-005"]
    assert any(set(v.nodes) == {"node-005"} for v in result.judgement.verdicts.values())
    assert all(set(g["nodes"]) != {"node-005"} for g in result.undecided_groups)
