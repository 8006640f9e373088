"""Slow drift: each place's CUSUM across cycles, on seeded noise, and through the API, where
a node losing a little more each cycle opens one incident that says since when."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import numpy as np
import pytest
from sqlalchemy import text

from ringwatch.agents.matchings import circle_matching
from ringwatch.agents.spec import Finding, Measurement
from ringwatch.services.analyzer.assess import Assessment
from ringwatch.services.analyzer.drift import (
    confidence,
    drift_observations,
    expected_worst,
    step_drift,
    unexplained,
)
from ringwatch.services.analyzer.evidence import CusumPolicy
from ringwatch.services.store import db
from tests.api_fixtures import api_client, measurement

T0 = datetime(2026, 1, 1, tzinfo=UTC)
CYCLE = timedelta(minutes=5)
POLICY = CusumPolicy()
NODES = [f"node-{i:03d}" for i in range(8)]
OPS = ("allreduce", "alltoall")


def _assessment(members: list[str], scope: str, ratio: float, sigma: float,
                op: str = "allreduce", expected: float = 100.0) -> Assessment:
    m = Measurement(op=op, scope=scope, members=members, size_bytes=1 << 28, dtype="float32",
                    warmup=5, iters=20, time_us=1.0, algbw_gbs=1.0,
                    busbw_gbs=expected * ratio, wrong=0, time=T0)
    return Assessment(measurement=m, expected_gbs=expected, ratio=ratio, bad=False,
                      source="history", spread=sigma)


def _intra(node: str, ratio: float, sigma: float, op: str = "allreduce") -> Assessment:
    return _assessment([f"{node}/{g}" for g in range(4)], "intra_node", ratio, sigma, op)


def _pair(a: str, b: str, ratio: float, sigma: float, op: str = "allreduce") -> Assessment:
    return _assessment([f"{a}/0", f"{a}/1", f"{b}/0", f"{b}/1"], "inter_node", ratio, sigma, op)


def _run(cycles: int, batch, policy: CusumPolicy = POLICY):
    """Step every cycle's assessments (``batch(i)``) through the detector; per cycle, the
    states and the keys of the findings."""
    states: dict[str, dict[str, Any]] = {}
    history = []
    for i in range(cycles):
        states, findings = step_drift(states, drift_observations(batch(i)), T0 + i * CYCLE, policy)
        history.append((states, findings))
    return history


def _key(f: Finding) -> str:
    return f"{'nic' if f.kind == 'nic_degraded' else 'nvlink'}:{f.node}"


def test_observations_name_each_place_once_and_skip_what_is_not_evidence() -> None:
    pair_members = ["node-001/2", "node-001/5"]
    latency = _intra("node-002", 0.5, 0.02)
    latency.judged = False
    explained = _intra("node-003", 0.5, 0.02)
    explained.explained = True
    no_ratio = _intra("node-004", 1.0, 0.02)
    no_ratio.ratio = None
    slow = _intra("node-005", 0.5, 0.02)
    slow.bad = True  # the judgement's own to find
    obs = drift_observations([
        _intra("node-000", 0.98, 0.02), _intra("node-000", 0.96, 0.02, "alltoall"),
        _assessment(pair_members, "gpu_pair", 0.97, 0.0), _pair("node-000", "node-001", 0.95, 0.02),
        latency, explained, no_ratio, slow,
        _assessment(["node-000/0", "node-001/0", "node-002/0"], "world", 0.5, 0.02),
    ])
    assert sorted(obs) == ["nic:node-000", "nic:node-001", "nvlink:node-000",
                           "nvlink:node-001:gpus=2,5"]
    pair = obs["nvlink:node-001:gpus=2,5"]
    assert (pair.kind, pair.node, pair.gpus, pair.sigma) == ("nvlink_degraded", "node-001", [2, 5], 0.01)
    # The worst of two ops, raised by what the worst of two healthy ones shows on average.
    node = obs["nvlink:node-000"]
    assert node.gpus is None and node.measured_gbs == pytest.approx(96.0)
    assert node.ratio == pytest.approx(0.96 + expected_worst(2) * 0.02)
    # Both ends of a node pair get its ratio.
    assert obs["nic:node-000"].ratio == obs["nic:node-001"].ratio == pytest.approx(0.95)
    assert obs["nic:node-000"].kind == "nic_degraded" and obs["nic:node-000"].evidence


def test_a_place_losing_one_and_a_half_sigma_alarms_and_says_since_when() -> None:
    # Powers of two: 1.5 sigma of loss is exactly 1.5 in the CUSUM's units.
    sigma, onset = 1 / 32, 10

    def batch(i: int) -> list[Assessment]:
        return [_intra(n, 1.0 - (1.5 * sigma if n == "node-003" and i >= onset else 0.0), sigma)
                for n in NODES]

    history = _run(40, batch)
    first = next(i for i, (_, fs) in enumerate(history) if fs)
    # Noise-free, the score grows by 1.5 - 0.5 = 1 a cycle: at the threshold (8) on the
    # eighth cycle down, past it on the ninth.
    assert first == onset + 8
    (f,) = history[first][1]
    assert (f.kind, f.node, f.gpus, f.severity) == ("nvlink_degraded", "node-003", None, "warning")
    assert f.detail["drift"] == {"since": (T0 + onset * CYCLE).isoformat(), "cycles": 9,
                                 "score": 9.0}
    assert 0.5 < f.detail["confidence"] < 1.0
    assert f.measured_gbs == pytest.approx(100 * (1 - 1.5 * sigma)) and f.expected_gbs == 100.0
    assert f.detail["evidence"][0]["nodes"] == ["node-003"]
    # It stays in alarm while the loss lasts, and no other place ever alarms.
    assert all(fs for _, fs in history[first:])
    assert {_key(f) for _, fs in history for f in fs} == {"nvlink:node-003"}


def test_no_loss_alarms_in_fewer_than_three_cycles_and_a_repair_clears_in_eight() -> None:
    """However far one cycle falls short, it adds at most threshold / 2.5; and however long a
    loss lasted, the score is kept at 1.5 thresholds, so a repaired link clears in h / 2k."""
    sigma = 1 / 32

    def batch(i: int) -> list[Assessment]:
        ratio = 0.5 if i < 3 else 1.0 - 1.5 * sigma if i < 200 else 1.0
        return [_intra("node-003", ratio, sigma)]

    history = _run(215, batch)
    alarms = [i for i, (_, fs) in enumerate(history) if fs]
    assert alarms[0] == 2  # the third cycle down
    assert history[199][0]["nvlink:node-003"]["score"] == 1.5 * POLICY.threshold
    # Back at its expectation from cycle 200: the score falls by the slack each cycle, out
    # of alarm (at the threshold itself) on the eighth.
    assert alarms[-1] == 206 and alarms == list(range(2, 207))
    assert history[214][0] == {"nvlink:node-003": {
        "score": 4.5, "since": T0.isoformat(), "cycles": 215}}


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_noisy_loss_alarms_within_a_bound_and_since_is_where_its_excursion_began(seed) -> None:
    rng = np.random.default_rng(seed)
    sigma, onset = 0.03, 20

    def batch(i: int) -> list[Assessment]:
        shift = 1.5 * sigma if i >= onset else 0.0
        return [_intra("node-003", 1.0 - shift + rng.normal(0, sigma), sigma, op) for op in OPS]

    history = _run(80, batch)
    first = next(i for i, (_, fs) in enumerate(history) if fs)
    # About nine cycles on average (the worst of two ops, corrected for being the worst).
    assert onset <= first <= onset + 20
    # The excursion began the cycle after the score was last at zero (no state).
    last_zero = max(i for i, (states, _) in enumerate(history[:first]) if "nvlink:node-003" not in states)
    (f,) = history[first][1]
    assert f.detail["drift"]["since"] == (T0 + (last_zero + 1) * CYCLE).isoformat()
    assert f.detail["drift"]["cycles"] == first - last_zero


def test_a_stable_fleet_never_alarms_in_200_cycles_of_noise() -> None:
    """Two ops per node, each N(1, sigma): the worst of them sits low every cycle, and
    must not add up to an alarm."""
    rng = np.random.default_rng(7)
    sigma = 0.04

    def batch(i: int) -> list[Assessment]:
        return [_intra(n, 1.0 + rng.normal(0, sigma), sigma, op) for n in NODES for op in OPS]

    history = _run(200, batch)
    assert not [f for _, fs in history for f in fs]
    scores = [s["score"] for states, _ in history for s in states.values()]
    assert scores and max(scores) < POLICY.threshold
    # States exist only for places above zero.
    assert all(s > 0 for s in scores)


def test_only_the_slow_nic_accumulates_while_its_partner_rotates() -> None:
    rng = np.random.default_rng(11)
    sigma, fleet = 0.02, [f"node-{i:03d}" for i in range(16)]

    def batch(i: int) -> list[Assessment]:
        return [_pair(a, b, (0.94 if "node-005" in (a, b) else 1.0) + rng.normal(0, sigma), sigma, op)
                for a, b in circle_matching(fleet, i) for op in OPS]

    history = _run(60, batch)
    alarmed = {_key(f) for _, fs in history for f in fs}
    assert alarmed == {"nic:node-005"}
    peak = max(s["score"] for states, _ in history for k, s in states.items() if k != "nic:node-005")
    assert peak < POLICY.threshold


def test_in_a_small_fleet_a_healthy_node_is_charged_with_its_best_partner() -> None:
    """Up to 8 nodes every pair meets every cycle: each node meets the slow one each time,
    and only the slow one is slow with all of its partners."""
    fleet = NODES[:4]

    def batch(i: int) -> list[Assessment]:
        return [_pair(a, b, 0.94 if "node-002" in (a, b) else 1.0, 0.02)
                for j, a in enumerate(fleet) for b in fleet[j + 1:]]

    history = _run(30, batch)
    assert {_key(f) for _, fs in history for f in fs} == {"nic:node-002"}
    assert set(history[-1][0]) == {"nic:node-002"}


def test_a_place_not_observed_keeps_its_state_and_makes_no_finding() -> None:
    at = T0 + 3 * CYCLE
    states = {"nvlink:node-001": {"score": 12.0, "since": T0.isoformat(), "cycles": 3},
              "nvlink:node-002": {"score": 1.0, "since": T0.isoformat(), "cycles": 1}}
    after, findings = step_drift(states, drift_observations([_intra("node-002", 1.05, 0.02)]), at,
                                 POLICY)
    # node-001 was not looked at: unchanged, and no evidence this cycle; node-002 recovered.
    assert after == {"nvlink:node-001": states["nvlink:node-001"]}
    assert findings == []


def test_confidence_grows_with_the_score_inside_half_and_one() -> None:
    values = [confidence(s, POLICY) for s in (8.01, 9.0, 10.0, 12.0, 20.0, 200.0)]
    assert all(0.5 < v < 1.0 for v in values)
    assert values == sorted(values) and values[0] < values[-1]
    assert confidence(POLICY.threshold, POLICY) == 0.5


def test_what_the_judgement_already_names_is_not_found_twice() -> None:
    judged = [Finding("nvlink_degraded", node="node-001", gpus=[2, 5]),
              Finding("net_path_degraded", nodes=["node-006", "node-007"])]
    drift = [Finding("nvlink_degraded", node="node-001", severity="warning"),   # node blamed
             Finding("nvlink_degraded", node="node-002", gpus=[0, 1], severity="warning"),
             Finding("nvlink_degraded", node="node-002", severity="warning"),    # its pair first
             Finding("nvlink_degraded", node="node-003", severity="warning"),
             Finding("nic_degraded", node="node-003", severity="warning"),       # its NVLink first
             Finding("nic_degraded", node="node-006", severity="warning")]       # a path blames no node
    assert [(f.kind, f.node, f.gpus) for f in unexplained(drift, judged)] == [
        ("nvlink_degraded", "node-002", [0, 1]), ("nvlink_degraded", "node-003", None),
        ("nic_degraded", "node-006", None)]
    same_key = [Finding("nvlink_degraded", node="node-004", severity="warning")]
    assert unexplained(same_key, [Finding("nvlink_degraded", node="node-004")]) == []


# ---- through the API -------------------------------------------------------------------------


def _cycle_batch(i: int, start: datetime, loss_per_cycle: float, rng: np.random.Generator
                 ) -> dict[str, Any]:
    """One monitoring cycle of 8 two-GPU nodes on gloo: every node's intra-node group and
    one rotating node-pair matching, all flat within 0.3 % but node-003's NVLink, which
    loses ``loss_per_cycle`` more each cycle."""
    at = start + i * CYCLE
    ms = []
    for n in NODES:
        factor = 1.0 - loss_per_cycle * i if n == "node-003" else 1.0
        ms.append(measurement([f"{n}/0", f"{n}/1"], 20.0 * factor * (1 + rng.normal(0, 0.003)),
                              scope="intra_node", time=at))
    for a, b in circle_matching(NODES, i):
        ms.append(measurement([f"{a}/0", f"{a}/1", f"{b}/0", f"{b}/1"],
                              10.0 * (1 + rng.normal(0, 0.003)), time=at))
    return {"batch_id": str(uuid.uuid4()), "backend": "gloo", "measurements": ms}


def test_a_node_losing_a_little_more_each_cycle_opens_one_drift_incident(clean_db) -> None:
    """gloo judges a cycle slow only below 70 % of its expectation: a node losing 3 % a
    cycle is never slow in any one of them, and its drift opens the incident (through the
    default hysteresis: two cycles in alarm) long before; once repaired, it closes."""
    rng = np.random.default_rng(5)
    start = datetime.now(UTC) - timedelta(hours=2)
    with api_client(clean_db, settings={}) as api:
        opened_at = None
        for i in range(6):
            r = api.post("/v1/measurements", json=_cycle_batch(i, start, 0.03, rng),
                         headers=api.h["agent"])
            assert r.status_code == 200, r.text
            if r.json()["degraded"]:
                opened_at = i
                (d,) = r.json()["degraded"]
                assert (d["kind"], d["node"], d["severity"]) == ("nvlink_degraded", "node-003", "warning")
                break
        # In alarm from the third cycle down (9 %; no loss alarms sooner), open on the
        # fourth: long before the judgement's 70 %.
        assert opened_at == 4
        (f,) = api.get("/v1/findings", params={"status": "open"}, headers=api.h["reader"]).json()
        assert (f["kind"], f["nodes"]) == ("nvlink_degraded", ["node-003"])
        drift = f["detail"]["drift"]
        assert datetime.fromisoformat(drift["since"]) == start + CYCLE  # the first cycle down
        assert drift["cycles"] == opened_at
        assert 0.5 < f["detail"]["confidence"] < 1.0 and f["detail"]["evidence"]
        assert f["detail"]["fault"] == "nvlink_degraded:node-003:gpus=0,1"
        with db.transaction(clean_db) as s:
            states = dict(s.execute(text("SELECT key, cycles FROM drift_states")).tuples().all())
        assert states["nvlink:node-003"] == opened_at
        # Repaired: the score falls back under the threshold within h / 2k cycles, and the
        # hysteresis closes the incident two clean cycles later.
        recovered_at = None
        for i in range(opened_at + 1, opened_at + 13):
            r = api.post("/v1/measurements", json=_cycle_batch(i, start, 0.0, rng),
                         headers=api.h["agent"]).json()
            if r["recovered"]:
                recovered_at = i
                break
        assert recovered_at is not None
        assert api.get("/v1/findings", params={"status": "open"}, headers=api.h["reader"]).json() == []
    with db.transaction(clean_db) as s:
        events = [tuple(e) for e in s.execute(text(
            "SELECT event_type, payload->'finding'->>'node' FROM outbox_events ORDER BY id"))]
    assert events == [("health.degraded", "node-003"), ("health.recovered", "node-003")]


def test_a_flat_fleet_opens_no_drift_incident(clean_db) -> None:
    rng = np.random.default_rng(6)
    start = datetime.now(UTC) - timedelta(hours=3)
    with api_client(clean_db, settings={}) as api:
        for i in range(20):
            r = api.post("/v1/measurements", json=_cycle_batch(i, start, 0.0, rng),
                         headers=api.h["agent"])
            assert r.status_code == 200, r.text
            assert r.json()["degraded"] == []
        assert api.get("/v1/findings", headers=api.h["reader"]).json() == []


def test_the_drift_threshold_setting_reaches_the_monitor(clean_db) -> None:
    """RINGWATCH_DRIFT_THRESHOLD far up: the same drifting node accumulates, opens nothing."""
    rng = np.random.default_rng(5)
    start = datetime.now(UTC) - timedelta(hours=2)
    with api_client(clean_db, settings={"drift_threshold": 1000.0}) as api:
        for i in range(5):
            r = api.post("/v1/measurements", json=_cycle_batch(i, start, 0.03, rng),
                         headers=api.h["agent"])
            assert r.status_code == 200 and r.json()["degraded"] == [], r.text
    with db.transaction(clean_db) as s:
        score = s.execute(text("SELECT score FROM drift_states WHERE key = 'nvlink:node-003'")).scalar()
    assert score is not None and 8.0 < score < 1000.0
