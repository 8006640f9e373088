"""POST /v1/rank-maps/check through the real ASGI app, on a real migrated Postgres."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from ringwatch.api.app import create_app
from ringwatch.services.settings import Settings
from ringwatch.services.store import db, tokens
from tests.api_fixtures import fleet_batch

PATH = "/v1/rank-maps/check"


@pytest.fixture
def api(clean_db):
    with db.transaction(clean_db) as s:
        toks = {role: tokens.create_token(s, role) for role in ("agent", "reader")}
    app = create_app(Settings(database_url="unused", api_url="http://rw.test"), clean_db)
    with TestClient(app) as client:
        client.tokens = toks  # type: ignore[attr-defined]
        yield client


def auth(client, role: str = "reader") -> dict[str, str]:
    return {"Authorization": f"Bearer {client.tokens[role]}"}


def ingest(client, batch: dict) -> dict:
    resp = client.post("/v1/measurements", json=batch, headers=auth(client, "agent"))
    resp.raise_for_status()
    return resp.json()


def check(client, body: dict) -> dict:
    resp = client.post(PATH, json=body, headers=auth(client))
    assert resp.status_code == 200, resp.text
    return resp.json()


def by_problem(result: dict, problem: str) -> dict[str, dict]:
    return {f.get("node", ""): f for f in result["findings"] if f["problem"] == problem}


def test_sound_table_on_a_healthy_fleet(api) -> None:
    assert PATH in api.get("/openapi.json").json()["paths"]
    ingest(api, fleet_batch())
    hostfile = "\n".join(f"node-{i:03d} slots=2" for i in range(4))
    assert check(api, {"hostfile": hostfile}) == {"ok": True, "ranks": 8, "hosts": 4,
                                                  "findings": [], "skipped": []}


def test_unknown_host_and_structure_in_one_answer(api) -> None:
    ingest(api, fleet_batch())
    ranks = [{"rank": 0, "host": "node-000", "local_rank": 0},
             {"rank": 1, "host": "node-009", "local_rank": 0},
             {"rank": 2, "host": "node-000", "local_rank": 1},
             {"rank": 3, "host": "node-009", "local_rank": 1}]
    result = check(api, {"ranks": ranks})
    assert result["ok"] is False and (result["ranks"], result["hosts"]) == (4, 2)
    assert sorted(f["problem"] for f in result["findings"]) == ["non_contiguous", "unknown_host"]
    unknown = by_problem(result, "unknown_host")["node-009"]
    assert unknown["kind"] == "rank_mapping" and unknown["ranks"] == [1, 3]


def test_unhealthy_host_names_the_open_finding(api) -> None:
    batch = fleet_batch()
    batch["findings"] = [{"kind": "hang", "node": "node-003", "gpu": 1}]
    ingest(api, batch)
    (hang,) = api.get("/v1/findings", params={"status": "open"}, headers=auth(api)).json()
    result = check(api, {"hostfile": "node-002:2\nnode-003:2\n"})
    assert [f["problem"] for f in result["findings"]] == ["unhealthy_host"]
    (f,) = result["findings"]
    assert f["node"] == "node-003" and f["severity"] == "critical"
    assert f["because"]["kind"] == "hang" and f["because"]["finding_id"] == hang["id"]
    assert f["because"]["gpu"] == 1


def test_slow_node_is_unhealthy_but_its_peers_are_not(api) -> None:
    # The analyzer may want more than one bad round before it calls a link degraded.
    for _ in range(3):
        ingest(api, fleet_batch(slow_node="node-002"))
        if api.get("/v1/links", params={"status": "degraded"}, headers=auth(api)).json():
            break
    result = check(api, {"hostfile": "node-000:2\nnode-001:2\nnode-002:2\n"})
    unhealthy = by_problem(result, "unhealthy_host")
    # The node-000 <-> node-002 path is degraded too, but a path blames neither end.
    assert list(unhealthy) == ["node-002"]
    because = unhealthy["node-002"]["because"]
    assert because["kind"] == "nvlink_degraded" and because["nodes"] == ["node-002"]


def test_hosts_match_by_hostname_and_gpu_uuids_by_fleet_index(api) -> None:
    batch = fleet_batch()
    batch["ranks"] = [{"node": "node-000", "local_index": i, "hostname": "gpu-a",
                       "gpu_uuid": f"GPU-a{i}"} for i in (0, 1)]
    ingest(api, batch)
    ranks = [{"rank": 0, "host": "gpu-a", "local_rank": 0, "gpu_uuid": "GPU-a1"},
             {"rank": 1, "host": "gpu-a", "local_rank": 1, "gpu_uuid": "GPU-a1"},
             {"rank": 2, "host": "node-001", "local_rank": 0, "gpu_uuid": "GPU-unknown"}]
    result = check(api, {"ranks": ranks})
    problems = sorted((f["problem"], f.get("rank")) for f in result["findings"])
    # rank 1 sits where the fleet has GPU-a1; rank 0 claims it at index 0; both claim one GPU.
    assert problems == [("duplicate_gpu", None), ("local_rank_mismatch", 0)]
    mismatch = by_problem(result, "local_rank_mismatch")["gpu-a"]
    assert (mismatch["gpu_uuid"], mismatch["local_rank"], mismatch["fleet_local_index"]) == (
        "GPU-a1", 0, 1)


@pytest.mark.parametrize("body,needle", [
    ({}, "ranks"),
    ({"ranks": [{"rank": 0, "host": "a", "local_rank": 0}], "hostfile": "a"}, "one of the two"),
    ({"ranks": []}, "ranks"),
    ({"ranks": [{"rank": "0", "host": "a", "local_rank": 0}]}, "rank"),
    ({"ranks": [{"rank": 0, "host": "a/b", "local_rank": 0}]}, "host"),
    ({"ranks": [{"rank": 0, "host": "a", "local_rank": 0, "slot": 1}]}, "slot"),
    ({"hostfile": "a slots=2\nb slots=many\n"}, "line 2"),
    ({"hostfile": "# only a comment"}, "no hosts"),
])
def test_bad_tables_are_422_with_a_reason(api, body, needle) -> None:
    resp = api.post(PATH, json=body, headers=auth(api))
    assert resp.status_code == 422, resp.text
    assert resp.json()["error"] == "invalid_input" and needle in resp.json()["message"]


def test_needs_a_token(api) -> None:
    assert api.post(PATH, json={"hostfile": "a"}).status_code == 401
    assert api.post(PATH, json={"hostfile": "a"}, headers=auth(api, "agent")).status_code == 200
