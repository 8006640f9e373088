"""One agent's attacks on /metrics and on the shipper state it shows, through the real API
on a real Postgres (docs/security.md, "/metrics: closed label vocabularies and series caps"
and "The shipper's identity"), and a database from before the strict node names, upgraded
and scraped (migration 0017)."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import create_engine, text

from ringwatch.agents import nccl_log
from ringwatch.agents.nic_counters import NicError
from ringwatch.agents.transport import judge_transports, nic_finding
from ringwatch.services.store import db, tokens
from tests.api_fixtures import REACT_AT_ONCE, api_client, fleet_batch, measurement

NCCL_LOGS = Path(__file__).parent / "data" / "nccl"


def series(body: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(body):
        for s in family.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def count(samples: dict[str, list[Any]]) -> int:
    return sum(len(v) for v in samples.values())


def batch(*, findings: list[dict[str, Any]] | None = None,
          measurements: list[dict[str, Any]] | None = None, **extra: Any) -> dict[str, Any]:
    return {"batch_id": uuid.uuid4().hex, "backend": "gloo",
            "measurements": measurements or [], "findings": findings or [], **extra}


def post(api, body: dict[str, Any], headers: dict[str, str]) -> None:
    r = api.post("/v1/measurements", json=body, headers=headers)
    assert r.status_code == 200, r.text[:500]


def real_findings() -> list[dict[str, Any]]:
    """A node's inter-node sockets and a GPU pair over SHM, judged from NCCL's own logs
    (tests/data/nccl), and a NIC counter past its threshold, as the agent sends them."""
    sockets = nccl_log.summarize(nccl_log.parse_nccl_log(
        (NCCL_LOGS / "built-2.28.3-socket-fallback-2node.log").read_text()),
        rdma_devices=("mlx5_0", "mlx5_1"))
    shm = nccl_log.summarize(nccl_log.parse_nccl_log(
        (NCCL_LOGS / "built-2.22.3-shm-pair.log").read_text()))
    found = judge_transports(sockets, "node-000", ["node-000/0", "node-001/0"], 0, "inter_node")
    found += judge_transports(shm, "node-001", ["node-001/0", "node-001/1"], 0, "gpu_pair",
                              nvlink_peers={1})
    nic = nic_finding("node-002", [NicError(
        node="node-002", device="mlx5_0", port=1, counter="symbol_error", delta=500,
        rate_per_s=500 / 300, threshold=0.4, threshold_per="second", interval_s=300.0,
        severity="warning", flap=False, why="IBTA SymbolErrorCounter")])
    assert nic is not None and len(found) == 2
    return [f.to_dict() for f in [*found, nic]]


def hostile_findings(node: str, n: int) -> list[dict[str, Any]]:
    """What one agent may send about its own nodes: a nic_errors finding listing ``n``
    made-up counters, three with 1 KiB device names, and ``n`` transport fallbacks with
    distinct GPU pairs and 2 kB transport names."""
    made_up = [{"device": f"mlx5_{i}", "port": i, "counter": f"counter_{i}",
                "rate_per_s": 1.0} for i in range(n)]
    out: list[dict[str, Any]] = [{"kind": "nic_errors", "node": node, "severity": "warning",
                                  "source": "sysfs", "counters": made_up}]
    for k in range(3):
        long = [{"device": f"{k}{'x' * 1024}{i}", "port": 1, "counter": "symbol_error",
                 "rate_per_s": 1.0} for i in range(n)]
        out.append({"kind": "nic_errors", "node": f"{node}-{k}", "severity": "warning",
                    "source": "sysfs", "counters": long})
    for i in range(n):
        out.append({"kind": "transport_fallback", "node": node, "gpus": [i % 64, 64 + i // 64],
                    "severity": "critical", "source": "nccl", "scope": "gpu_pair",
                    "transport": f"shm{'y' * 2048}{i}", "expected_transport": "p2p_nvlink"})
    return out


def value(samples: dict[str, list[Any]], name: str, **labels: str) -> float:
    found = [v for got, v in samples.get(name, []) if got == labels]
    assert len(found) == 1, (name, labels, samples.get(name))
    return found[0]


def label_values(samples: dict[str, list[Any]], name: str, label: str) -> set[str]:
    return {got[label] for got, _ in samples.get(name, []) if label in got}


@pytest.fixture
def api(clean_db):
    with api_client(clean_db, {**REACT_AT_ONCE, "metrics_cache_s": 0}) as client:
        yield client


# -- item: agents choose the cardinality of /metrics -----------------------------------------

REAL_SERIES = {
    "ringwatch_nic_error_rate_per_second": {"node": "node-002", "device": "mlx5_0", "port": "1",
                                            "counter": "symbol_error"},
    "ringwatch_transport_fallback": {"node": "node-000", "transport": "net_socket",
                                     "expected": "net_ib", "gpus": ""},
}
PAIR_OVER_SHM = {"node": "node-001", "transport": "shm", "expected": "p2p_nvlink", "gpus": "0,1"}


def test_an_agent_cannot_choose_the_cardinality_of_metrics(api) -> None:
    """An agent's made-up NIC counters, 1 KiB device names, 2 kB transport names, every
    group of three of ten nodes and a new scheduler host in each of 40 batches: /metrics
    stays within 1,000 series of what it was and under 256 KiB (today's code: 15,730
    series, 17 MB), and the real-format causes (NCCL's own logs, a NIC counter record as
    the agent writes it) are still there."""
    agent = api.h["agent"]
    post(api, fleet_batch(nodes=8), agent)
    post(api, batch(findings=real_findings()), agent)
    before = api.get("/metrics")
    assert before.status_code == 200
    baseline = count(series(before.text))

    post(api, batch(findings=hostile_findings("evil-000", 3000)), agent)
    names = [f"evil-{i:03d}" for i in range(10)]
    groups = [[f"{a}/0", f"{b}/0", f"{c}/0"] for i, a in enumerate(names)
              for j, b in enumerate(names[i + 1:], i + 1) for c in names[j + 1:]]
    post(api, batch(measurements=[measurement(g, 10.0) for g in groups]), agent)
    for i in range(40):
        post(api, batch(shipper={"host": f"sched-{i}-{'h' * 200}", "failed": i}), agent)

    after = api.get("/metrics")
    assert after.status_code == 200
    samples = series(after.text)
    got, size = count(samples), len(after.content)
    print(f"/metrics: {baseline} series, {len(before.content)} bytes before; "
          f"{got} series, {size} bytes after")
    assert got <= baseline + 1000 and size <= 256 * 1024, (got, size)
    for name, labels in REAL_SERIES.items():
        assert value(samples, name, **labels) > 0
    assert value(samples, "ringwatch_transport_fallback", **PAIR_OVER_SHM) == 1
    # Only the vocabularies' values, and what was left out said.
    assert label_values(samples, "ringwatch_nic_error_rate_per_second", "counter") == {
        "symbol_error"}
    assert label_values(samples, "ringwatch_transport_fallback", "transport") == {
        "net_socket", "shm"}
    dropped = "ringwatch_metrics_series_dropped"
    assert value(samples, dropped, family="ringwatch_nic_error_rate_per_second",
                 reason="unlabelled") == 4 * 3000
    assert value(samples, dropped, family="ringwatch_transport_fallback",
                 reason="unlabelled") == 3000
    assert value(samples, dropped, family="ringwatch_shipper_batches",
                 reason="token_cap") == (40 - 8) * 3
    assert len(label_values(samples, "ringwatch_shipper_batches", "host")) == 8


def test_series_past_a_nodes_cap_are_left_out_and_counted(clean_db) -> None:
    """Well-formed but many: 3,000 NIC counter records of real counters, devices and ports,
    3,000 GPU pairs over SHM and 120 groups of three nodes. Each node keeps
    RINGWATCH_METRICS_MAX_SERIES_PER_NODE series a family (the groups together as one), the
    degraded links first; the rest are counted."""
    cap = 50
    with api_client(clean_db, {**REACT_AT_ONCE, "metrics_cache_s": 0,
                               "metrics_max_series_per_node": cap}) as api:
        agent = api.h["agent"]
        post(api, fleet_batch(nodes=4, slow_node="node-003"), agent)
        counters = [{"device": f"mlx5_{i // 15}", "port": 1 + i % 15, "counter": "symbol_error",
                     "rate_per_s": 2.0} for i in range(3000)]
        pairs = [{"kind": "transport_fallback", "node": "evil-000", "gpus": [i % 64, 64 + i // 64],
                  "severity": "critical", "source": "nccl", "scope": "gpu_pair",
                  "transport": "shm", "expected_transport": "p2p_nvlink"} for i in range(3000)]
        post(api, batch(findings=[{"kind": "nic_errors", "node": "evil-000",
                                   "severity": "warning", "source": "sysfs",
                                   "counters": counters}, *pairs]), agent)
        names = [f"evil-{i:03d}" for i in range(10)]
        groups = [[f"{a}/0", f"{b}/0", f"{c}/0"] for i, a in enumerate(names)
                  for j, b in enumerate(names[i + 1:], i + 1) for c in names[j + 1:]]
        post(api, batch(measurements=[measurement(g, 10.0) for g in groups]), agent)
        samples = series(api.get("/metrics").text)

    nic = samples["ringwatch_nic_error_rate_per_second"]
    fallback = samples["ringwatch_transport_fallback"]
    assert len(nic) == cap and len(fallback) == cap
    busbw = samples["ringwatch_link_busbw_bytes_per_second"]
    assert len([s for s, _ in busbw if "group" in s]) == cap
    dropped = "ringwatch_metrics_series_dropped"
    assert value(samples, dropped, family="ringwatch_nic_error_rate_per_second",
                 reason="node_cap") == 3000 - cap
    assert value(samples, dropped, family="ringwatch_transport_fallback",
                 reason="node_cap") == 3000 - cap
    assert value(samples, dropped, family="ringwatch_link_busbw_bytes_per_second",
                 reason="node_cap") == len(groups) - cap
    # The fleet's own links are all there, the degraded ones among them.
    degraded = {tuple(sorted(s.items())) for s, v in samples["ringwatch_link_degraded"] if v}
    assert degraded and all(dict(d).get("node") != "evil-000" for d in degraded)


# -- item: a scoped token speaks for another scheduler --------------------------------------

def test_a_token_speaks_only_for_its_own_spool(api, clean_db, tmp_path: Path) -> None:
    """Rack b's scheduler ships through the real Shipper with its own token, two batches
    moved aside in its spool. A token scoped to one node then claims rack b's host, first
    with no failures (to hide them), then with 4242 (to page someone): rack b's series keep
    its own count, and the claim is a series of the scoped token's, named by its id."""
    import socket

    from fastapi.testclient import TestClient

    from ringwatch.services.scheduler.shipper import Shipper

    with db.transaction(clean_db) as s:
        rack_b, rack_b_token = tokens.issue(s, "agent", "sched-rack-b")
        scoped, scoped_token = tokens.issue(s, "agent", "rack-a", nodes=["node-000"])
        ids = {"rack_b": str(rack_b.id), "scoped": str(scoped.id)}
    spool = tmp_path / "spool"
    shipper = Shipper("http://testserver", rack_b_token, spool)
    shipper.client = TestClient(api.app, headers={"Authorization": f"Bearer {rack_b_token}"})
    shipper.failed_dir.mkdir()
    for i in range(2):
        (shipper.failed_dir / f"{i:020d}-old.json").write_text("{}")
    intra = [measurement(["node-001/0", "node-001/1"], 20.0, scope="intra_node")]
    assert shipper.ship(batch(measurements=intra)) == 0
    host = socket.gethostname()

    claim = {"Authorization": f"Bearer {scoped_token}"}
    own = [measurement(["node-000/0", "node-000/1"], 20.0, scope="intra_node")]
    post(api, batch(measurements=own, shipper={"host": host, "failed": 0}), claim)
    samples = series(api.get("/metrics").text)
    family = "ringwatch_shipper_batches"
    assert value(samples, family, token=ids["rack_b"], host=host, state="failed") == 2

    post(api, batch(measurements=own, shipper={"host": host, "failed": 4242}), claim)
    samples = series(api.get("/metrics").text)
    assert value(samples, family, token=ids["rack_b"], host=host, state="failed") == 2
    assert value(samples, family, token=ids["scoped"], host=host, state="failed") == 4242
    assert {s["token"] for s, v in samples[family] if v == 4242} == {ids["scoped"]}


# -- item: an upgraded database breaks /metrics ---------------------------------------------

# Names a database from before the strict node names may hold (0017 quarantines them):
# dots only, a quote, a zero-width space, a trailing newline, a trailing dot, and two names
# that differ only in case (the first seen keeps its name).
OLD_NAMES = ["..", 'a"b', "x\u200by", "node-1\n", "node-9.", "Node-7", "node-7", "good-1"]
OLD_GROUPS = [  # scope, members
    ("gpu_pair", ["../0", "../1"]),
    ("inter_node", ['a"b/0', "good-1/0"]),
    ("gpu_pair", ["good-1/0", "good-1/01"]),
    ("inter_node", ["x\u200by/0", "node-1\n/0", "good-1/0"]),
    ("gpu_pair", ["node-7/0", "node-7/1"]),
    ("gpu_pair", ["node-9./0", "node-9./1"]),
    ("gpu_pair", ["good-1/0", "good-1/1"]),
]
STATE = {  # what 0017 renames, read in a fixed order
    "nodes": "SELECT name FROM nodes ORDER BY id",
    "groups": "SELECT key, members, nodes FROM groups ORDER BY id",
    "links": "SELECT group_key, members, nodes FROM link_health ORDER BY id",
    "findings": "SELECT group_key, nodes FROM findings ORDER BY id",
    "faults": "SELECT key, nodes FROM fault_states ORDER BY id",
    "counters": "SELECT node FROM gpu_counters ORDER BY id",
    "tokens": "SELECT nodes FROM api_tokens WHERE nodes IS NOT NULL ORDER BY id",
    "fleets": "SELECT slots FROM fleets ORDER BY name",
}


def _old_rows(conn) -> None:
    from ringwatch.agents.groups import series_key

    for name in OLD_NAMES:
        conn.execute(text("INSERT INTO nodes (name) VALUES (:n)"), {"n": name})
    for i, (scope, members) in enumerate(OLD_GROUPS):
        nodes = list(dict.fromkeys(m.split("/")[0] for m in members))
        row = {"k": series_key(members), "s": scope, "m": members, "n": nodes,
               "status": "degraded" if i == 1 else "ok"}
        conn.execute(text("INSERT INTO groups (key, scope, members, nodes) "
                          "VALUES (:k, :s, :m, :n)"), row)
        conn.execute(text(
            "INSERT INTO link_health (group_key, op, scope, members, nodes, status, size_bytes, "
            "busbw_gbs, ratio, bad_streak, good_streak) VALUES (:k, 'allreduce', :s, :m, :n, "
            ":status, 1048576, 10.0, 0.9, 0, 0)"), row)
    conn.execute(text(
        "INSERT INTO findings (kind, status, severity, group_key, op, nodes, detail) VALUES "
        "('nic_errors', 'open', 'warning', NULL, NULL, :n, CAST(:d AS jsonb)), "
        "('link_degraded', 'open', 'critical', :k, 'allreduce', :pair, '{}')"),
        {"n": ["x\u200by"], "pair": ['a"b', "good-1"], "k": series_key(OLD_GROUPS[1][1]),
         "d": '{"counters": [{"device": "mlx5_0", "port": 1, "counter": "symbol_error", '
              '"rate_per_s": 1.5}]}'})
    conn.execute(text(
        "INSERT INTO fault_states (key, kind, nodes, status, recent, good_streak, detail) "
        "VALUES (:k, 'nic_errors', :n, 'open', 'B', 0, '{}')"),
        {"k": "nic_errors:x\u200by", "n": ["x\u200by"]})
    conn.execute(text("INSERT INTO gpu_counters (time, node, local_index, reading) "
                      "VALUES (now(), '..', 0, '{}')"))
    conn.execute(text("INSERT INTO api_tokens (name, role, token_hash, nodes) "
                      "VALUES ('rack', 'agent', :h, :n)"), {"h": "0" * 64, "n": ["..", "good-1"]})
    conn.execute(text("INSERT INTO fleets (name, slots) VALUES ('default', CAST(:s AS jsonb))"),
                 {"s": '["..", null, "good-1"]'})


def _state(conn) -> dict[str, list[Any]]:
    return {k: [tuple(r) for r in conn.execute(text(q))] for k, q in STATE.items()}


def test_an_upgraded_database_with_old_node_names_scrapes(admin_url: str) -> None:
    """A database at 0016 holding names today's rule refuses: the upgrade renames each to a
    quarantined name the rule accepts (history kept under it, the old names listed), and
    /metrics answers 200 with every link labelled; a row it still cannot label (one written
    after, by hand) is left out and counted; the downgrade puts every old name back."""
    from ringwatch.agents.groups import is_node_name, series_key, split_member

    name = f"rw_mig_{uuid.uuid4().hex[:10]}"
    url = db.create_database(admin_url, name)
    engine = create_engine(url)
    try:
        db.upgrade(url, "0016")
        with engine.begin() as conn:
            _old_rows(conn)
            before = _state(conn)
        db.upgrade(url)
        with engine.begin() as conn:
            after = _state(conn)
            renamed = dict(conn.execute(text(
                "SELECT was, name FROM quarantined_names WHERE kind = 'node'")).tuples().all())
        assert set(renamed) == set(OLD_NAMES) - {"Node-7", "good-1"}
        assert all(is_node_name(n) for (n,) in after["nodes"])
        assert [n for (n,) in after["nodes"]][-3:] == ["Node-7", renamed["node-7"], "good-1"]
        for key, members, nodes in after["groups"] + after["links"]:
            assert key == series_key(members) and all(is_node_name(n) for n in nodes)
            assert {split_member(m)[0] for m in members} == set(nodes)
        assert after["findings"][1] == (after["links"][1][0], after["links"][1][2])
        assert after["counters"] == [(renamed[".."],)]
        assert after["tokens"] == [([renamed[".."], "good-1"],)]
        assert after["fleets"] == [([renamed[".."], None, "good-1"],)]

        with api_client(db.make_session_factory(engine), {**REACT_AT_ONCE,
                                                          "metrics_cache_s": 0}) as api:
            r = api.get("/metrics")
            assert r.status_code == 200, r.text[:500]
            samples = series(r.text)
            busbw = samples["ringwatch_link_busbw_bytes_per_second"]
            assert len(busbw) == len(OLD_GROUPS)
            assert value(samples, "ringwatch_link_degraded", scope="inter_node", op="allreduce",
                         node="good-1", gpu="0", peer_node=renamed['a"b'], peer_gpu="0") == 1
            assert value(samples, "ringwatch_nic_error_rate_per_second",
                         node=renamed["x\u200by"], device="mlx5_0", port="1",
                         counter="symbol_error") == 1.5
            # A row the rule refuses, written after the upgrade: left out and counted.
            with engine.begin() as conn:
                conn.execute(text(
                    "INSERT INTO link_health (group_key, op, scope, members, nodes, status, "
                    "size_bytes, busbw_gbs, bad_streak, good_streak) VALUES ('bad name/0,"
                    "bad name/1', 'allreduce', 'gpu_pair', '{bad name/0,bad name/1}', "
                    "'{bad name}', 'ok', 1, 1.0, 0, 0)"))
                conn.execute(text("INSERT INTO nodes (name) VALUES ('bad name')"))
            r = api.get("/metrics")
            assert r.status_code == 200, r.text[:500]
            samples = series(r.text)
        assert len(samples["ringwatch_link_busbw_bytes_per_second"]) == len(OLD_GROUPS)
        for family in ("ringwatch_link_busbw_bytes_per_second", "ringwatch_node_healthy"):
            assert value(samples, "ringwatch_metrics_series_dropped", family=family,
                         reason="unlabelled") == 1
        with engine.begin() as conn:
            conn.execute(text("DELETE FROM link_health WHERE 'bad name' = ANY(nodes)"))
            conn.execute(text("DELETE FROM nodes WHERE name = 'bad name'"))

        db.downgrade(url, "0016")
        with engine.begin() as conn:
            assert _state(conn) == before
    finally:
        engine.dispose()
        db.drop_database(admin_url, name)
