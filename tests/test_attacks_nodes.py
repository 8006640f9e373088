"""What one agent token can do to the node table, and what a node's name may be (issue 50,
items 3 and 10): a flood of made-up nodes stops at the token's quota while a real new node
still joins; nodes leave the fleet by retirement (an admin's, or retention's) with their
history kept; and a name has one spelling, so no look-alike becomes a second node."""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

import httpx
import pytest
from sqlalchemy import text

from ringwatch.services.store import db, timeseries, tokens
from tests.api_fixtures import REACT_AT_ONCE, api_client, fleet_batch, measurement, pair
from tests.procs import api_env, cli, start_server, stop_server

ADMIN = "rw_nodes_" + uuid.uuid4().hex


def world(names: list[str], gpus: int = 1) -> dict[str, Any]:
    """One batch of one world measurement over ``names``' first ``gpus`` ranks each: what
    the attack sent, naming made-up nodes."""
    members = [f"{n}/{g}" for n in names for g in range(gpus)]
    return {"batch_id": str(uuid.uuid4()), "backend": "gloo",
            "measurements": [measurement(members, 10.0, scope="world")]}


def node_batch(node: str) -> dict[str, Any]:
    """One node's own batch: its two ranks as an NVLink group."""
    return {"batch_id": str(uuid.uuid4()), "backend": "gloo",
            "measurements": [measurement([f"{node}/0", f"{node}/1"], 20.0, scope="intra_node")]}


def make_token(api, role: str = "agent", nodes: list[str] | None = None) -> dict[str, str]:
    body: dict[str, Any] = {"role": role, **({"nodes": nodes} if nodes else {})}
    r = api.post("/v1/tokens", json=body, headers=api.h["admin"])
    assert r.status_code == 201, r.text
    return {"Authorization": f"Bearer {r.json()['token']}"}


def names_listed(api) -> list[str]:
    return [n["name"] for n in api.get("/v1/nodes", headers=api.h["reader"]).json()]


# -- item 3: one token cannot fill the node table ----------------------------------------


def test_a_flood_of_made_up_nodes_stops_at_the_tokens_quota_and_a_real_node_still_joins(
        clean_db) -> None:
    # The attack at a tenth of its size: a fleet of 10, a table that holds 90, a quota of 40
    # new nodes per token; two world batches of 40 made-up nodes each would fill it.
    settings = {"max_new_nodes_per_batch": 64, "max_nodes": 90, "max_new_nodes_per_token": 40}
    with api_client(clean_db, settings) as api:
        api.post("/v1/measurements", json=fleet_batch(nodes=10),
                 headers=api.h["agent"]).raise_for_status()
        attacker = make_token(api)
        first = api.post("/v1/measurements", json=world([f"fake-{i:04d}" for i in range(40)]),
                         headers=attacker)
        assert first.status_code == 200, first.text
        second = api.post("/v1/measurements",
                          json=world([f"fake-{i:04d}" for i in range(40, 80)]), headers=attacker)
        assert second.status_code == 429, second.text
        assert "RINGWATCH_MAX_NEW_NODES_PER_TOKEN" in second.json()["message"]
        assert 0 < int(second.headers["Retry-After"]) <= 86400
        # A real new node, its agent's own token scoped to it, joins.
        real = api.post("/v1/measurements", json=node_batch("gpu-new"),
                        headers=make_token(api, nodes=["gpu-new"]))
        assert real.status_code == 200, real.text
        assert api.get("/v1/health", headers=api.h["reader"]).json()["nodes"] == 51
        # Nodes the attacker's token already made report on: they are not new.
        again = api.post("/v1/measurements", json=world([f"fake-{i:04d}" for i in range(40)]),
                         headers=attacker)
        assert again.status_code == 200, again.text


def test_a_batch_larger_than_the_whole_quota_is_refused_for_good_and_the_window_slides(
        clean_db) -> None:
    settings = {"max_new_nodes_per_token": 20}
    with api_client(clean_db, settings) as api:
        r = api.post("/v1/measurements", json=world([f"fake-{i:03d}" for i in range(21)]),
                     headers=api.h["agent"])
        # It would never fit: not a 429 its shipper would retry for ever.
        assert r.status_code == 422 and "RINGWATCH_MAX_NEW_NODES_PER_TOKEN" in r.json()["message"]
        assert api.post("/v1/measurements", json=world([f"fake-{i:03d}" for i in range(20)]),
                        headers=api.h["agent"]).status_code == 200
        assert api.post("/v1/measurements", json=node_batch("late-000"),
                        headers=api.h["agent"]).status_code == 429
        with db.transaction(clean_db) as s:  # as if the window (a day) had passed
            s.execute(text("UPDATE nodes SET added_at = added_at - interval '1 day 1 minute'"))
        assert api.post("/v1/measurements", json=node_batch("late-000"),
                        headers=api.h["agent"]).status_code == 200


def test_the_default_quota_admits_a_1024_x_8_fleets_first_cycle(clean_db) -> None:
    with api_client(clean_db, {}) as api:
        names = [f"gpu-{i:04d}" for i in range(1024)]
        r = api.post("/v1/measurements", json=world(names, gpus=8), headers=api.h["agent"])
        assert r.status_code == 200, r.text
        # A second scheduler's fleet, with a token of its own, joins as well.
        r = api.post("/v1/measurements", json=world([f"b-{n}" for n in names], gpus=8),
                     headers=make_token(api))
        assert r.status_code == 200, r.text
        assert api.get("/v1/health", headers=api.h["reader"]).json()["nodes"] == 2048


def _scrape(api) -> str:
    return api.get("/metrics").text


def test_retire_takes_a_node_out_of_the_fleet_and_keeps_its_history(clean_db) -> None:
    settings = {**REACT_AT_ONCE, "max_nodes": 4, "max_new_nodes_per_token": 5,
                "metrics_cache_s": 0}
    with api_client(clean_db, settings) as api:
        api.post("/v1/measurements", json=fleet_batch(slow_node="node-003"),
                 headers=api.h["agent"]).raise_for_status()
        opened = api.get("/v1/findings", headers=api.h["reader"]).json()
        assert any("node-003" in f["nodes"] for f in opened)
        body = {"nodes": ["node-003"]}
        for role in ("reader", "agent"):
            assert api.post("/v1/nodes/retire", json=body,
                            headers=api.h[role]).status_code == 403
        dry = api.post("/v1/nodes/retire", params={"dry_run": True}, json=body,
                       headers=api.h["admin"])
        assert dry.status_code == 200, dry.text
        assert dry.json() == {"dry_run": True, "retired": ["node-003"], "already_retired": []}
        assert "node-003" in names_listed(api)

        done = api.post("/v1/nodes/retire", json=body, headers=api.h["admin"]).json()
        assert done == {"dry_run": False, "retired": ["node-003"], "already_retired": []}
        # Out of the fleet: listings, counts, the fleet map, /metrics and preflight.
        assert names_listed(api) == ["node-000", "node-001", "node-002"]
        assert api.get("/v1/health", headers=api.h["reader"]).json()["nodes"] == 3
        states = api.get("/v1/fleet/nodes", headers=api.h["reader"]).json()["nodes"]
        assert [n["name"] for n in states] == ["node-000", "node-001", "node-002"]
        assert api.get("/v1/fleet/pairs", headers=api.h["reader"]).json()["nodes"] == [
            "node-000", "node-001", "node-002"]
        scrape = _scrape(api)
        assert re.search(r"^ringwatch_nodes 3\.0$", scrape, re.M)
        assert 'node="node-002"' in scrape and "node-003" not in scrape
        pf = api.post("/v1/preflight", json={"nodes": ["node-000", "node-003"]},
                      headers=api.h["reader"])
        assert pf.status_code == 404 and "node-003" in pf.json()["message"]
        # Its history stays readable.
        detail = api.get("/v1/nodes/node-003", headers=api.h["reader"])
        assert detail.status_code == 200 and detail.json()["retired_at"] is not None
        assert api.get("/v1/nodes/node-000", headers=api.h["reader"]).json()["retired_at"] is None
        series = api.get("/v1/series", params={"members": ",".join(pair("node-002", "node-003"))},
                         headers=api.h["reader"])
        assert series.status_code == 200 and series.json()["points"], series.text
        assert api.get("/v1/links", params={"node": "node-003"},
                       headers=api.h["reader"]).json()
        # Its incidents are closed as retired: kept, no longer holding the fleet degraded,
        # and no "recovered" event sent (nothing recovered).
        after = api.get("/v1/findings", headers=api.h["reader"]).json()
        assert [f["id"] for f in after] == [f["id"] for f in opened]
        assert all(f["status"] == "retired" and f["resolved_at"]
                   for f in after if "node-003" in f["nodes"])
        assert not api.get("/v1/findings", params={"status": "open"}, headers=api.h["reader"]).json()
        health = api.get("/v1/health", headers=api.h["reader"]).json()
        assert health["open_findings"] == 0 and health["status"] == "healthy", health
        assert re.search(r"^ringwatch_open_findings\{", _scrape(api), re.M) is None
        with db.transaction(clean_db) as s:
            events = [e for (e,) in s.execute(text("SELECT event_type FROM outbox_events"))]
        assert "health.recovered" not in events and "health.degraded" in events

        again = api.post("/v1/nodes/retire", json=body, headers=api.h["admin"]).json()
        assert again == {"dry_run": False, "retired": [], "already_retired": ["node-003"]}
        unknown = api.post("/v1/nodes/retire", json={"nodes": ["node-000", "nope-1"]},
                           headers=api.h["admin"])
        assert unknown.status_code == 404 and "nope-1" in unknown.json()["message"]
        assert "node-000" in names_listed(api)  # nothing retired by a refused request

        # Its place counts no more toward RINGWATCH_MAX_NODES: a new node joins, the fifth
        # this token adds (RINGWATCH_MAX_NEW_NODES_PER_TOKEN 5).
        assert api.post("/v1/measurements", json=node_batch("gpu-new"),
                        headers=api.h["agent"]).status_code == 200
        # It comes back when it reports again, as a new node: past the agent token's quota,
        # then (from another token) past RINGWATCH_MAX_NODES, then in once there is room.
        back = api.post("/v1/measurements", json=node_batch("node-003"), headers=api.h["agent"])
        assert back.status_code == 429
        assert "RINGWATCH_MAX_NEW_NODES_PER_TOKEN" in back.json()["message"]
        back = api.post("/v1/measurements", json=node_batch("node-003"), headers=api.h["admin"])
        assert back.status_code == 422 and "RINGWATCH_MAX_NODES" in back.json()["message"]
        api.post("/v1/nodes/retire", json={"nodes": ["gpu-new"]},
                 headers=api.h["admin"]).raise_for_status()
        back = api.post("/v1/measurements", json=node_batch("node-003"), headers=api.h["admin"])
        assert back.status_code == 200, back.text
        assert api.get("/v1/nodes/node-003", headers=api.h["reader"]).json()["retired_at"] is None
        assert names_listed(api) == ["node-000", "node-001", "node-002", "node-003"]


def test_retention_retires_nodes_not_seen_for_the_set_days(clean_db, database_url) -> None:
    from ringwatch.services.settings import Settings

    with api_client(clean_db, {}) as api:
        api.post("/v1/measurements", json=fleet_batch(nodes=3),
                 headers=api.h["agent"]).raise_for_status()
        with db.transaction(clean_db) as s:
            s.execute(text("UPDATE nodes SET last_seen_at = now() - interval '31 days' "
                           "WHERE name = 'node-002'"))
        engine = db.make_engine(database_url)
        try:
            kept = timeseries.maintain(engine, Settings(node_retention_days=0).retention())
            assert kept.to_dict()["nodes_retired"] == 0
            report = timeseries.maintain(engine, Settings(node_retention_days=30).retention())
        finally:
            engine.dispose()
        assert report.to_dict()["nodes_retired"] == 1
        assert names_listed(api) == ["node-000", "node-001"]
        assert api.get("/v1/nodes/node-002", headers=api.h["reader"]).json()["retired_at"]


@pytest.fixture
def server(database_url, clean_db, tmp_path):
    env = api_env(database_url, tmp_path, ADMIN)
    proc = start_server(env)
    try:
        yield env
    finally:
        stop_server(proc)


def test_node_retire_from_the_cli_with_a_dry_run(server) -> None:
    api = server["RINGWATCH_API_URL"]
    admin = {"Authorization": f"Bearer {ADMIN}"}
    httpx.post(f"{api}/v1/measurements", json=fleet_batch(nodes=3),
               headers=admin).raise_for_status()

    def listed() -> list[str]:
        return [n["name"] for n in httpx.get(f"{api}/v1/nodes", headers=admin).json()]

    dry = cli("node", "retire", "node-001", "node-002", "--dry-run", env=server)
    assert dry.returncode == 0, dry.stderr
    assert "would retire 2 node(s): node-[001-002]" in dry.stdout
    assert listed() == ["node-000", "node-001", "node-002"]
    done = cli("node", "retire", "node-001", "node-002", env=server)
    assert done.returncode == 0 and "retired 2 node(s): node-[001-002]" in done.stdout
    assert listed() == ["node-000"]
    again = cli("node", "retire", "node-001", "--json", env=server)
    assert json.loads(again.stdout)["already_retired"] == ["node-001"]
    unknown = cli("node", "retire", "nope-1", env=server)
    assert unknown.returncode == 2 and "nope-1" in unknown.stderr
    reader = httpx.post(f"{api}/v1/tokens", json={"role": "reader"}, headers=admin).json()
    refused = cli("node", "retire", "node-000", env={**server, "RINGWATCH_TOKEN": reader["token"]})
    assert refused.returncode == 2 and "403" in refused.stderr
    assert listed() == ["node-000"]


# -- item 10: one spelling per name ---------------------------------------------------------

# Each refused by the name rule itself: a final newline (Python's `$` matched before it),
# a trailing dot (the DNS root: the same host as without it).
BAD_NAMES = ("node-000\n", "node-000.")
# Member indices: ASCII digits only, no leading zeros (each of these read as 3, 1 or 0).
BAD_MEMBERS = ("node-000/\u0663", "node-000/\uff11", "node-000/00", "node-000/01")


def test_names_with_a_second_spelling_are_refused_by_the_api(api) -> None:
    api.post("/v1/measurements", json=node_batch("node-000"),
             headers=api.h["agent"]).raise_for_status()
    for name in BAD_NAMES:
        # As a node of its own (a node the batch skipped) and as a member's node.
        skipped = {**node_batch("node-001"), "skipped": {name: "held by a job"}}
        r = api.post("/v1/measurements", json=skipped, headers=api.h["agent"])
        assert r.status_code == 422 and "node name" in r.text, (name, r.text)
        r = api.post("/v1/measurements", json=node_batch(name), headers=api.h["agent"])
        assert r.status_code == 422, (name, r.text)
        r = api.post("/v1/tokens", json={"role": "agent", "nodes": [name]},
                     headers=api.h["admin"])
        assert r.status_code == 422 and "node name" in r.text, (name, r.text)
    for member in BAD_MEMBERS:
        batch = node_batch("node-000")
        batch["measurements"][0]["members"] = ["node-000/0", member]
        r = api.post("/v1/measurements", json=batch, headers=api.h["agent"])
        assert r.status_code == 422 and "NODE/LOCAL_INDEX" in r.text, (member, r.text)
    # Host names are one name whatever their case: NODE-000 is node-000's twin, refused as
    # a node and as a token's scope while node-000 is in the fleet.
    r = api.post("/v1/measurements", json=node_batch("NODE-000"), headers=api.h["agent"])
    assert r.status_code == 422 and "node-000" in r.json()["message"], r.text
    r = api.post("/v1/tokens", json={"role": "agent", "nodes": ["NODE-000"]},
                 headers=api.h["admin"])
    assert r.status_code == 422 and "node-000" in r.json()["message"], r.text
    both = world(["gpu-a", "GPU-A"])
    r = api.post("/v1/measurements", json=both, headers=api.h["agent"])
    assert r.status_code == 422 and "GPU-A" in r.json()["message"], r.text
    assert names_listed(api) == ["node-000"]
    # What real hosts are called still passes: Slurm's, Kubernetes', NCCL logs' and EC2's
    # host names (tests/data), an FQDN, and a site's upper-case names.
    for name in ("gpu-001", "dgx-a01", "h100-n07", "ip-10-0-1-17", "vm", "node1.cluster.local",
                 "DGX-B200-01"):
        assert api.post("/v1/measurements", json=node_batch(name),
                        headers=api.h["agent"]).status_code == 200, name


def test_the_token_cli_refuses_the_names_the_api_refuses(database_url, clean_db, monkeypatch,
                                                          capsys) -> None:
    from ringwatch.services.cli.main import main
    from ringwatch.services.settings import get_settings

    monkeypatch.setenv("RINGWATCH_DATABASE_URL", database_url)
    get_settings.cache_clear()
    try:
        with db.transaction(clean_db) as s:
            s.execute(text("INSERT INTO nodes (name) VALUES ('node-000')"))
        for name in BAD_NAMES:
            with pytest.raises(SystemExit) as exit_:
                main(["token", "create", "--role", "agent", "--nodes", f"node-001,{name}"])
            assert exit_.value.code == 2
            assert "node name" in capsys.readouterr().err
        assert main(["token", "create", "--role", "agent", "--nodes", "NODE-000"]) == 2
        assert "node-000" in capsys.readouterr().err
        assert main(["token", "create", "--role", "agent", "--nodes", "node-000,gpu-001"]) == 0
        with db.transaction(clean_db) as s:
            scopes = [r.nodes for r in tokens.list_tokens(s)]
        assert scopes == [["gpu-001", "node-000"]]
    finally:
        get_settings.cache_clear()


def test_a_nodes_page_cursor_is_always_a_legal_header(server) -> None:
    """A page ending at a name stored before the rule (a final newline) still answers, and
    its cursor leads on to the next page."""
    url = server["RINGWATCH_DATABASE_URL"]
    engine = db.make_engine(url)
    try:
        with engine.begin() as conn:
            conn.execute(text("INSERT INTO nodes (name) VALUES ('node-000'), (:bad), ('node-001')"),
                         {"bad": "node-000\n"})
    finally:
        engine.dispose()
    api, admin = server["RINGWATCH_API_URL"], {"Authorization": f"Bearer {ADMIN}"}
    seen, after = [], None
    for _ in range(4):
        page = httpx.get(f"{api}/v1/nodes", params={"limit": 1, **({"after": after} if after else {})},
                         headers=admin)
        assert page.status_code == 200, page.text
        seen += [n["name"] for n in page.json()]
        after = page.headers.get("X-Next-Cursor")
        if after is None:
            break
        assert re.fullmatch(r"[\x21-\x7e]+", after)
    assert seen == ["node-000", "node-000\n", "node-001"]
    # A plain node name as `after` still pages on from it.
    rest = httpx.get(f"{api}/v1/nodes", params={"after": "node-000\n"}, headers=admin).json()
    assert [n["name"] for n in rest] == ["node-001"]


def test_member_and_name_rules_are_one_rule() -> None:
    from ringwatch.agents.groups import check_node_name, split_member
    from ringwatch.services.rankmap.checks import parse_hostfile

    for name in BAD_NAMES + ("-node", "node 0", "nöde", "a" * 254):
        with pytest.raises(ValueError):
            check_node_name(name)
        with pytest.raises(ValueError):
            split_member(f"{name}/0")
    for member in BAD_MEMBERS + ("node-000/-1", "node-000/1\n", "node-000/1234567"):
        with pytest.raises(ValueError):
            split_member(member)
    assert split_member("node-000/0") == ("node-000", 0)
    assert split_member("NODE.a_b-1/17") == ("NODE.a_b-1", 17)
    from ringwatch.services.errors import BadInput

    with pytest.raises(BadInput):
        parse_hostfile("node-000.\n")
    assert [e.host for e in parse_hostfile("node-000 slots=1\n")] == ["node-000"]
