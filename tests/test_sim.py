"""The sim backend: scenario validation, link model, and what each fault does to a group."""

from __future__ import annotations

import json

import pytest

from ringwatch.agents.groups import member
from ringwatch.agents.sim import SETUP_PER_DOUBLING_S, SETUP_S, SimBackend
from ringwatch.agents.spec import KEPT_WARMUP, GroupSpec

SIZE = 1 << 28


def sim(nodes=4, gpus=8, faults=(), noise=0.0, **kw) -> SimBackend:
    return SimBackend({"nodes": nodes, "gpus_per_node": gpus, "noise": noise, "seed": 1,
                       "faults": list(faults), **kw})


def intra(node: int, gpus: int = 8, ops=("allreduce", "alltoall")) -> GroupSpec:
    return GroupSpec("intra_node", tuple(member(f"node-{node:03d}", g) for g in range(gpus)),
                     ops=ops, sizes=(SIZE,))


def pair(node: int, a: int, b: int) -> GroupSpec:
    return GroupSpec("gpu_pair", (member(f"node-{node:03d}", a), member(f"node-{node:03d}", b)),
                     ops=("allreduce",), sizes=(SIZE,))


def nodes(*ix: int, gpus: int = 8, ops=("allreduce", "alltoall")) -> GroupSpec:
    return GroupSpec("inter_node", tuple(member(f"node-{i:03d}", g) for i in ix
                                         for g in range(gpus)), ops=ops, sizes=(SIZE,))


def busbw(b: SimBackend, group: GroupSpec, op: str = "allreduce") -> float:
    (m,) = [m for m in b.run_round([group]).measurements if m.op == op]
    return m.busbw_gbs


@pytest.mark.parametrize(("scenario", "message"), [
    ({}, "needs 'nodes'"),
    ({"nodes": 0}, "at least 1"),
    ({"nodes": 2, "gpu": "Z80"}, "gpu must be one of"),
    ({"nodes": 2, "noise": 2}, "noise"),
    ({"nodes": 2, "color": "red"}, "unknown scenario field"),
    ({"nodes": 2, "faults": [{"kind": "melt", "node": "node-000"}]}, "kind must be one of"),
    ({"nodes": 2, "faults": [{"kind": "nic", "node": "node-002"}]}, "no node 'node-002'"),
    ({"nodes": 2, "faults": [{"kind": "nic", "node": "gpu-1"}]}, "named node-000"),
    ({"nodes": 2, "faults": [{"kind": "nic", "node": "node-001", "factor": 1.5}]}, "(0, 1]"),
    ({"nodes": 2, "faults": [{"kind": "nic", "node": "node-001", "factor": 0}]}, "(0, 1]"),
    ({"nodes": 2, "faults": [{"kind": "nvlink", "node": "node-001", "gpus": [0, 8]}]}, "gpu must"),
    ({"nodes": 2, "faults": [{"kind": "pcie_only", "node": "node-001", "gpus": [3, 3]}]},
     "two different gpus"),
    ({"nodes": 2, "faults": [{"kind": "hang", "node": "node-001", "gpu": -1}]}, "gpu must"),
    ({"nodes": 2, "faults": [{"kind": "net_path", "nodes": ["node-001", "node-001"]}]},
     "two different nodes"),
])
def test_bad_scenarios_are_refused_with_a_reason(scenario, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")
                       .replace("[", r"\[").replace("]", r"\]")):
        SimBackend(scenario)


def test_from_file_and_context_manager(tmp_path):
    path = tmp_path / "fabric.json"
    path.write_text(json.dumps({"nodes": 3, "gpus_per_node": 2}))
    with SimBackend.from_file(path) as b:
        assert b.name == "sim" and len(b.ranks()) == 6
    path.write_text("{nodes")
    with pytest.raises(ValueError, match="not JSON"):
        SimBackend.from_file(path)


def test_healthy_links_run_near_their_published_rates():
    b = sim()
    assert 425 < busbw(b, intra(0)) < 460  # NVLink 4: 450 GB/s a direction, less latency
    assert 370 < busbw(b, nodes(0, 1)) < 410  # 8 NICs x 50 GB/s, one per GPU
    a100 = sim(gpu="A100")
    assert 280 < busbw(a100, intra(0)) < 310


def test_noise_and_variation_are_seeded():
    a = sim(noise=0.05).run_round([intra(0), nodes(1, 2)]).measurements
    b = sim(noise=0.05).run_round([intra(0), nodes(1, 2)]).measurements
    assert [m.time_us for m in a] == [m.time_us for m in b]
    assert len({round(m.busbw_gbs, 6) for m in a}) == len(a)


def test_nvlink_fault_slows_its_pair_and_the_intra_alltoall_only():
    b = sim(faults=[{"kind": "nvlink", "node": "node-001", "gpus": [2, 5], "factor": 0.5}])
    assert busbw(b, pair(1, 2, 5)) < 0.55 * busbw(b, pair(1, 2, 3))
    assert busbw(b, intra(1), "alltoall") < 0.55 * busbw(b, intra(0), "alltoall")
    # The ring 0-1-...-7 never uses the 2-5 link.
    assert busbw(b, intra(1)) > 0.95 * busbw(b, intra(0))


def test_nic_fault_slows_every_pair_through_its_node():
    b = sim(faults=[{"kind": "nic", "node": "node-002", "factor": 0.5}])
    good = busbw(b, nodes(0, 1))
    assert busbw(b, nodes(0, 2)) < 0.55 * good and busbw(b, nodes(1, 2)) < 0.55 * good
    assert busbw(b, intra(2)) > 425


def test_net_path_fault_slows_only_that_pair():
    b = sim(faults=[{"kind": "net_path", "nodes": ["node-003", "node-001"], "factor": 0.4}])
    assert busbw(b, nodes(1, 3)) < 0.45 * busbw(b, nodes(0, 1))
    assert busbw(b, nodes(0, 3)) > 0.95 * busbw(b, nodes(0, 1))
    # An all-to-all over all four nodes waits for the slow flow.
    assert busbw(b, nodes(0, 1, 2, 3), "alltoall") < 0.45 * b.expected_busbw(
        b.run_round([nodes(0, 1, 2, 3)]).measurements[1])


def test_hang_gives_a_finding_no_measurement_and_costs_the_deadline():
    b = sim(faults=[{"kind": "hang", "node": "node-001", "gpu": 3}])
    r = b.run_round([intra(0), GroupSpec("intra_node", intra(1).members, deadline_s=7.0)])
    assert {tuple(m.members) for m in r.measurements} == {intra(0).members}
    assert [(f.kind, f.node, f.gpu) for f in r.findings] == [("hang", "node-001", 3)]
    assert r.fabric_time_s == 7.0


def test_corrupt_rank_reports_wrong_data():
    b = sim(faults=[{"kind": "corrupt", "node": "node-000", "gpu": 6}])
    r = b.run_round([intra(0), intra(1)])
    assert all((m.wrong > 0) == m.members[0].startswith("node-000") for m in r.measurements)
    assert [(f.kind, f.node, f.gpu) for f in r.findings] == [("data_corruption", "node-000", 6)]


def test_pcie_only_pair_runs_at_pcie_rate_and_says_so_in_telemetry():
    b = sim(faults=[{"kind": "pcie_only", "node": "node-002", "gpus": [0, 1]}])
    assert 40 < busbw(b, pair(2, 0, 1)) < 60
    ranks = {r.member: r for r in b.ranks()}
    assert ranks["node-002/0"].telemetry["p2p"]["1"] == "PHB"
    assert ranks["node-002/0"].telemetry["p2p"]["2"] == "NV18"
    assert ranks["node-001/0"].telemetry["p2p"]["1"] == "NV18"


def test_expected_busbw_is_the_fault_free_figure():
    b = sim(faults=[{"kind": "nic", "node": "node-001", "factor": 0.5}])
    m = b.run_round([nodes(0, 1)]).measurements[0]
    assert m.busbw_gbs < 0.55 * b.expected_busbw(m)
    assert 380 < b.expected_busbw(m) < 400


def test_a_thousand_nodes_run_in_process():
    b = sim(nodes=1024, noise=0.03)
    assert len(b.ranks()) == 8192
    world = GroupSpec("world", tuple(r.member for r in b.ranks()), sizes=(SIZE,))
    r = b.run_round([world])
    assert {m.op for m in r.measurements} == {"allreduce", "alltoall"}
    assert 0 < r.fabric_time_s < 5


# ---- drift and per-cycle noise --------------------------------------------------------

def exact(faults=(), **kw) -> SimBackend:
    """No noise and no variation: rates are exactly what the faults make them."""
    return sim(faults=faults, noise=0.0, variation=0.0, **kw)


def nvlink(factor: float, drift: float = 0.0) -> dict:
    f = {"kind": "nvlink", "node": "node-001", "gpus": [2, 5], "factor": factor}
    return {**f, "drift": drift} if drift else f


def test_drifting_nvlink_loses_drift_per_cycle_and_stops_at_the_floor():
    b = exact([nvlink(1.0, drift=0.02)])
    healthy = busbw(b, pair(1, 2, 3))
    assert busbw(b, pair(1, 2, 5)) == healthy  # cycle 0: factor 1.0, no loss yet
    b.begin_cycle(10)
    drifted = busbw(b, pair(1, 2, 5))
    assert drifted == pytest.approx(busbw(exact([nvlink(0.8)]), pair(1, 2, 5)), rel=1e-12)
    assert drifted / healthy == pytest.approx(1 - 0.02 * 10, rel=0.01)
    assert busbw(b, pair(1, 2, 3)) == healthy  # the other links do not move
    b.begin_cycle(60)  # 1.0 - 0.02 * 60 < 0: clipped at 0.01
    assert busbw(b, pair(1, 2, 5)) == pytest.approx(
        busbw(exact([nvlink(0.01)]), pair(1, 2, 5)), rel=1e-12)
    assert busbw(b, pair(1, 2, 5)) < 0.011 * healthy
    b.begin_cycle(0)
    assert busbw(b, pair(1, 2, 5)) == healthy


def test_drift_never_reaches_the_nominal_figure_and_keeps_variation():
    b = sim(faults=[nvlink(0.9, drift=0.05)], noise=0.0)
    (m0,) = b.run_round([pair(1, 2, 5)]).measurements
    (other0,) = b.run_round([pair(1, 2, 3)]).measurements
    b.begin_cycle(8)
    (m8,) = b.run_round([pair(1, 2, 5)]).measurements
    (other8,) = b.run_round([pair(1, 2, 3)]).measurements
    assert m8.busbw_gbs < 0.6 * m0.busbw_gbs
    assert m8.preset_gbs == m0.preset_gbs == b.expected_busbw(m8)
    assert 440 < m8.preset_gbs < 450  # the profile's NVLink rate less latency, no fault
    # Per-link variation is persistent: an undrifting pair measures the same at cycle 8.
    assert other8.busbw_gbs == other0.busbw_gbs


def test_each_cycle_draws_its_own_reproducible_noise():
    def times(b: SimBackend) -> list[float]:
        return [m.time_us for m in b.run_round([intra(0), nodes(1, 2)]).measurements]

    b = sim(noise=0.05)
    b.begin_cycle(3)
    third = times(b)
    b.begin_cycle(4)
    fourth = times(b)
    b.begin_cycle(3)
    assert times(b) == third  # the same index replays the same draws
    assert all(x != y for x, y in zip(third, fourth, strict=True))
    other = sim(noise=0.05)
    other.begin_cycle(3)
    assert times(other) == third  # ... in another backend (another process) too
    # Cycle 0 is what a backend that never begins a cycle draws: preflight is unchanged.
    never, zero = sim(noise=0.05), sim(noise=0.05)
    zero.begin_cycle(0)
    assert times(never) == times(zero)


def test_begin_cycle_rebuilds_the_fabric_only_when_a_fault_drifts():
    still = sim(faults=[nvlink(0.5)])
    fabric = still.fabric
    still.begin_cycle(5)
    assert still.fabric is fabric
    moving = sim(faults=[nvlink(0.5, drift=0.01)])
    moving.begin_cycle(5)
    assert moving.fabric.cycle == 5
    with pytest.raises(ValueError, match="cycle index"):
        moving.begin_cycle(-1)


def test_a_fault_with_a_start_is_absent_before_its_cycle():
    b = exact([{**nvlink(0.8), "start": 3}, {"kind": "hang", "node": "node-002", "start": 3}])
    healthy = busbw(b, pair(1, 2, 3))
    for cycle in (0, 2):
        b.begin_cycle(cycle)
        assert busbw(b, pair(1, 2, 5)) == healthy
        assert not b.run_round([intra(2)]).findings
    b.begin_cycle(3)
    assert busbw(b, pair(1, 2, 5)) == pytest.approx(0.8 * healthy, rel=0.01)
    assert [f.kind for f in b.run_round([intra(2)]).findings] == ["hang"]
    for bad in (-1, 1.5, True, "2"):
        with pytest.raises(ValueError, match=r"faults\[0\]: start must be"):
            exact([{**nvlink(0.8), "start": bad}])


@pytest.mark.parametrize(("fault", "message"), [
    ({"kind": "nvlink", "node": "node-001", "gpus": [0, 1], "drift": -0.1}, "drift must be"),
    ({"kind": "nic", "node": "node-001", "drift": 1}, "drift must be"),
    ({"kind": "nic", "node": "node-001", "drift": 1.5}, "drift must be"),
    ({"kind": "net_path", "nodes": ["node-000", "node-001"], "drift": "0.1"}, "drift must be"),
    ({"kind": "nic", "node": "node-001", "drift": True}, "drift must be"),
    ({"kind": "nic", "node": "node-001", "drift": float("nan")}, "drift must be"),
    ({"kind": "hang", "node": "node-001", "gpu": 0, "drift": 0.1}, "drift applies to"),
    ({"kind": "pcie_only", "node": "node-001", "gpus": [0, 1], "drift": 0}, "drift applies to"),
])
def test_bad_drift_is_refused_naming_the_fault_and_field(fault, message):
    ok = {"kind": "nic", "node": "node-000", "drift": 0.5}
    with pytest.raises(ValueError) as err:
        SimBackend({"nodes": 2, "gpus_per_node": 2, "faults": [ok, fault]})
    assert str(err.value).startswith("faults[1]: ") and message in str(err.value)


def test_nic_and_net_path_drift_move_their_node_pair_groups():
    nic = {"kind": "nic", "node": "node-002", "factor": 0.9, "drift": 0.05}
    path = {"kind": "net_path", "nodes": ["node-003", "node-001"], "factor": 1.0, "drift": 0.1}
    b = exact([nic, path])
    healthy = busbw(b, nodes(0, 1))
    assert busbw(b, nodes(0, 2)) == pytest.approx(0.9 * healthy, rel=0.01)
    assert busbw(b, nodes(1, 3)) == healthy
    b.begin_cycle(4)
    static = exact([{**nic, "factor": 0.7, "drift": 0}, {**path, "factor": 0.6, "drift": 0}])
    assert busbw(b, nodes(0, 2)) == pytest.approx(busbw(static, nodes(0, 2)), rel=1e-12)
    assert busbw(b, nodes(1, 3)) == pytest.approx(busbw(static, nodes(1, 3)), rel=1e-12)
    # About the factor: the network's latency is a few % of this size's time.
    assert busbw(b, nodes(0, 2)) == pytest.approx(0.7 * healthy, rel=0.02)
    assert busbw(b, nodes(1, 3)) == pytest.approx(0.6 * healthy, rel=0.02)
    assert busbw(b, nodes(0, 1)) == healthy  # neither fault is on this pair


def test_a_monitoring_cycle_begins_the_backends_cycle_at_its_rotation():
    from ringwatch.services.scheduler.cycle import ProbeOptions, run_cycle

    b = sim(nodes=4, gpus=2, faults=[{"kind": "nic", "node": "node-002", "factor": 1.0,
                                      "drift": 0.1}])
    run_cycle(b, ProbeOptions(), rotation=7)
    assert b.fabric.cycle == 7


def test_a_group_of_the_round_before_runs_kept_without_setup_and_with_a_short_warmup():
    b = sim()
    group = nodes(0, 1, ops=("allreduce",))
    first = b.run_round([group])
    again = b.run_round([group])
    (m1,), (m2,) = first.measurements, again.measurements
    assert (m1.warmup, m2.warmup) == (group.warmup, KEPT_WARMUP)
    # Noise-free, each iteration takes the same time: the kept round saves the setup of its
    # communicator (16 ranks: four doublings) and the warm-ups beyond KEPT_WARMUP.
    per_iter = m1.time_us * 1e-6
    saved = SETUP_S + SETUP_PER_DOUBLING_S * 4 + (group.warmup - KEPT_WARMUP) * per_iter
    assert first.fabric_time_s - again.fabric_time_s == pytest.approx(saved)
    assert m2.busbw_gbs == pytest.approx(m1.busbw_gbs)

    # A round without it ends it; so does the end of a cycle.
    b.run_round([nodes(2, 3, ops=("allreduce",))])
    assert b.run_round([group]).measurements[0].warmup == group.warmup
    b.release()
    assert b.run_round([group]).measurements[0].warmup == group.warmup
