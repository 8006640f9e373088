"""localize: from judged groups to GPU pair, NIC, path, hang and corruption findings."""

from __future__ import annotations

import math
from statistics import NormalDist

import pytest

from ringwatch.agents.spec import Finding, Measurement, RankInfo
from ringwatch.services.analyzer.assess import Assessment, assess
from ringwatch.services.analyzer.evidence import Weighing
from ringwatch.services.analyzer.localize import GroupVerdict, localize, measured_variation
from ringwatch.services.analyzer.verdict import build_verdict

G = 4  # ranks per node in these hand-made fleets


def meas(members, busbw, *, op="allreduce", scope="inter_node") -> Measurement:
    return Measurement(op=op, scope=scope, members=list(members), size_bytes=1 << 22,
                       dtype="float32", warmup=1, iters=1, time_us=1.0, algbw_gbs=busbw,
                       busbw_gbs=busbw, wrong=0)


def node(i: int) -> str:
    return f"node-{i:03d}"


def ranks_of(*nodes: int) -> list[str]:
    return [f"{node(n)}/{g}" for n in nodes for g in range(G)]


def intra(n: int, busbw: float) -> Measurement:
    return meas(ranks_of(n), busbw, scope="intra_node")


def gpu_pair(n: int, a: int, b: int, busbw: float) -> Measurement:
    return meas([f"{node(n)}/{a}", f"{node(n)}/{b}"], busbw, scope="gpu_pair")


def inter(a: int, b: int, busbw: float) -> Measurement:
    return meas(ranks_of(a, b), busbw)


def all_pairs(n: int, fn) -> list[Measurement]:
    return [gpu_pair(n, a, b, fn(a, b)) for a in range(G) for b in range(a + 1, G)]


def run(ms, probe=(), nodes=(), ranks=None):
    return localize(assess(ms), list(probe), list(nodes), ranks)


def kinds(findings):
    return sorted((f.kind, f.node or ",".join(f.nodes or [])) for f in findings)


def test_slow_nvlink_pair_is_named():
    ms = [intra(n, 100.0) for n in range(3)] + [intra(3, 60.0)]
    ms += all_pairs(3, lambda a, b: 50.0 if (a, b) == (1, 2) else 100.0)
    found = run(ms)
    assert kinds(found) == [("nvlink_degraded", "node-003")]
    f = found[0]
    assert f.gpus == [1, 2] and f.measured_gbs == 50.0 and f.expected_gbs == pytest.approx(100.0)
    assert f.severity == "warning"


def test_gpu_slow_with_every_partner_is_named_as_the_gpu():
    ms = [intra(n, 100.0) for n in range(3)] + [intra(3, 40.0)]
    # Eight GPUs: GPU 2 is slow with each of its seven partners, the other 21 pairs fine.
    pairs = [gpu_pair(3, a, b, 40.0 if 2 in (a, b) else 100.0)
             for a in range(8) for b in range(a + 1, 8)]
    found = run(ms + pairs)
    assert len(found) == 1 and found[0].gpu == 2 and found[0].severity == "critical"


def test_half_the_pairs_slow_after_one_measurement_each_names_nothing_yet():
    # Four GPUs, GPU 2 in half of the six pairs: one measurement each cannot tell which
    # half is normal (their spread is all there is to go by); the check measures again.
    ms = [intra(n, 100.0) for n in range(3)] + [intra(3, 40.0)]
    ms += all_pairs(3, lambda a, b: 40.0 if 2 in (a, b) else 100.0)
    assert run(ms) == []


def test_unconfirmed_intra_result_is_dropped():
    ms = [intra(n, 100.0) for n in range(3)] + [intra(3, 60.0)]
    ms += all_pairs(3, lambda a, b: 100.0)
    assert run(ms) == []


def test_pcie_pair_from_telemetry_is_a_topology_mismatch():
    ms = [intra(n, 100.0) for n in range(3)] + [intra(3, 20.0)]
    ms += all_pairs(3, lambda a, b: 20.0 if (a, b) == (0, 1) else 100.0)
    ranks = [RankInfo(node(3), g, node(3), telemetry={"p2p": {
        str(p): ("PHB" if {g, p} == {0, 1} else "NV18") for p in range(G) if p != g}})
        for g in range(G)]
    found = run(ms, ranks=ranks)
    assert [(f.kind, f.gpus) for f in found] == [("topology_mismatch", [0, 1])]


def test_pcie_rate_without_telemetry_is_a_topology_mismatch():
    ms = [intra(n, 400.0) for n in range(3)] + [intra(3, 30.0)]
    ms += all_pairs(3, lambda a, b: 30.0 if (a, b) == (0, 3) else 400.0)
    found = run(ms)
    assert [(f.kind, f.gpus) for f in found] == [("topology_mismatch", [0, 3])]


def test_slow_nic_explains_its_pairs():
    # node-002 is slow with both partners; node-000 and node-001 are fine together.
    ms = [inter(0, 1, 100.0), inter(0, 2, 50.0), inter(1, 2, 52.0)]
    found = run(ms)
    assert kinds(found) == [("nic_degraded", "node-002")]
    assert build_verdict(backend="sim", nodes=[node(i) for i in range(3)], findings=found,
                         rounds=3, duration_s=1.0)["exclude"] == ["node-002"]


def test_slow_path_between_two_good_nodes():
    ms = [inter(0, 1, 50.0), inter(2, 3, 100.0), inter(0, 2, 100.0), inter(1, 3, 100.0),
          inter(4, 5, 100.0)]
    found = run(ms)
    assert kinds(found) == [("net_path_degraded", "node-000,node-001")]
    assert found[0].blamed_nodes == []


def test_slow_rank_on_gloo_blames_its_node_only():
    # A slow rank slows its node's intra group and every node pair through that node.
    ms = [intra(0, 10.0), intra(1, 5.0), intra(2, 10.0)]
    ms += [inter(0, 1, 4.0), inter(0, 2, 8.0), inter(1, 2, 4.1)]
    found = run(ms)
    assert kinds(found) == [("nvlink_degraded", "node-001")]
    v = build_verdict(backend="gloo", nodes=[node(i) for i in range(3)], findings=found,
                      rounds=3, duration_s=1.0)
    assert v["exclude"] == ["node-001"] and not v["healthy"]


def test_probe_findings_pass_through_once_and_explain_their_node():
    hang = Finding(kind="hang", node=node(1), gpu=1)
    ms = [inter(0, 1, 30.0), inter(0, 2, 100.0), inter(2, 3, 100.0), inter(1, 3, 30.0)]
    found = run(ms, probe=[hang, Finding(kind="hang", node=node(1), gpu=1)])
    assert kinds(found) == [("hang", "node-001")]


def test_findings_limited_to_requested_nodes():
    ms = [inter(0, 1, 100.0), inter(0, 2, 50.0), inter(1, 2, 52.0)]
    assert run(ms, nodes=[node(0), node(1)]) == []
    assert len(run(ms, nodes=[node(0), node(1), node(2)])) == 1


def _first_readings(logs, centre_se=0.005):
    """One node-pair group per log ratio, judged against its peers."""
    out = []
    for i, x in enumerate(logs):
        m = inter(2 * i, 2 * i + 1, 100.0)
        v = GroupVerdict(m.scope, m.group.members, (node(2 * i), node(2 * i + 1)))
        v.by_op["allreduce"] = [Assessment(m, 100.0, math.exp(x), False, "peers",
                                           centre_se=centre_se)]
        out.append(v)
    return out


def _spread(n, sd):
    """n log ratios whose robust spread (MAD) is ``sd``, evenly over the normal's quantiles."""
    return [sd * NormalDist().inv_cdf((i + 0.5) / n) for i in range(n)]


def test_a_kind_picked_for_looking_slow_does_not_read_its_slow_groups_as_variation():
    # Forty groups picked because they may be slow (the search's two-node unions): most
    # are, 20-35 % under the centre; the other twenty scatter about it by the noise alone
    # (2 %). Over both sides that mixture spreads by well over ten percent; the lasting
    # offset of its healthy groups is nowhere near the 3 % prior, let alone past it.
    w = Weighing()
    slow = [math.log(1 - 0.20 - 0.15 * i / 19) for i in range(20)]
    healthy = _spread(20, 0.02)
    out = measured_variation(_first_readings(slow + healthy), {"allreduce": 0.02}, w)
    assert all(x <= w.variation_prior for x in out.values())
    # A fair draw whose groups do sit 8 % apart for good still shows it, from half as many
    # readings as a scatter over both sides would need: 120 groups here.
    wide = measured_variation(_first_readings(_spread(120, 0.082)), {"allreduce": 0.02}, w)
    (figure,) = wide.values()
    assert figure > 2 * w.variation_prior


def test_a_scatter_low_by_chance_under_heavy_noise_leaves_the_prior_variation_standing():
    # Noise 7.7 %: sixty first readings that scatter by 5.9 % (below the noise alone, as a
    # low draw of sixty can) say nothing sure of a variation under the prior's 3 %.
    w = Weighing()
    out = measured_variation(_first_readings(_spread(60, 0.059)), {"allreduce": 0.077}, w)
    assert out == {}
    # Where the noise is slight, the same number of groups does show links more alike than
    # the prior, and the run takes its own figure (the upper end of its estimate).
    tight = measured_variation(_first_readings(_spread(60, 0.012)), {"allreduce": 0.01}, w)
    (figure,) = tight.values()
    assert w.min_variation <= figure < w.variation_prior


def _union_verdict(ratios, nodes=(0, 1, 2, 3)):
    """A union of ``nodes`` measured once per ratio against its path model, under a noise
    the run has measured (5 %)."""
    m = meas(ranks_of(*nodes), 100.0, op="alltoall")
    v = GroupVerdict(m.scope, m.group.members, tuple(node(n) for n in nodes), noise={"alltoall": 0.05})
    v.by_op["alltoall"] = [Assessment(m, 100.0, r, False, "paths", spread=0.03,
                                      variation=0.03) for r in ratios]
    return v


def test_a_union_is_not_cleared_on_one_reading_however_high():
    # Cleared, a union takes every path between its nodes out of the search: one reading
    # high by the noise must not lose a path. It is measured again instead.
    one = _union_verdict([1.15])
    assert one.decisions["alltoall"].llr < Weighing().lower  # the test alone would clear it
    assert not one.cleared and one.pending_ops == ("alltoall",)
    two = _union_verdict([1.15, 1.05])
    assert two.cleared and two.pending_ops == ()
    # A node pair, which names what it finds, is weighed as before.
    m = meas(ranks_of(0, 1), 100.0, op="alltoall")
    pair = GroupVerdict(m.scope, m.group.members, (node(0), node(1)), noise={"alltoall": 0.05})
    pair.by_op["alltoall"] = [Assessment(m, 100.0, 1.15, False, "peers", spread=0.03,
                                         variation=0.03)]
    assert pair.cleared


def test_a_lone_slow_pair_is_named_at_the_granularity_it_has():
    # Four node pairs, no node in two of them: the slow one cannot be told NIC from path.
    ms = [inter(a, a + 1, 30.0 if a == 0 else 100.0) for a in range(0, 8, 2)] * 3
    found = run(ms)
    assert kinds(found) == [("net_path_degraded", "node-000,node-001")]
    assert found[0].detail["localized"] == "node_pair"
    assert "not told apart" in found[0].detail["reason"]


def test_a_slow_pair_whose_ends_have_other_partners_is_left_to_the_path_and_nic_rules():
    # node-000 is slow with both its partners: its NIC, not a lone pair.
    ms = [inter(0, 1, 30.0), inter(0, 2, 30.0), inter(1, 2, 100.0), inter(3, 4, 100.0),
          inter(1, 3, 100.0), inter(2, 4, 100.0)] * 3
    found = run(ms)
    assert ("nic_degraded", "node-000") in kinds(found)
    assert all(f.detail.get("localized") != "node_pair" for f in found)
