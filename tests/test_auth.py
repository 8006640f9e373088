"""Tokens and bounds on a shared cluster: auth before the body is read, expiry, revocation,
the bootstrap token, per-token caps, scoped agent tokens and paginated lists."""

from __future__ import annotations

import threading
from datetime import UTC, datetime, timedelta

from fastapi.testclient import TestClient
from sqlalchemy import create_engine, select

from ringwatch.api.app import create_app
from ringwatch.services.settings import Settings
from ringwatch.services.store import db, tokens
from ringwatch.services.store.models import ApiToken
from tests.api_fixtures import api_client, fleet_batch, measurement

NODES = ["node-000", "node-001", "node-002", "node-003"]


def _stale(api) -> None:
    old = fleet_batch(batch_id="old")
    for m in old["measurements"]:
        m["time"] = (datetime.now(UTC) - timedelta(days=2)).isoformat()
    api.post("/v1/measurements", json=old, headers=api.h["agent"]).raise_for_status()


def _token(factory, role: str, **kw) -> tuple[int, dict[str, str]]:
    with db.transaction(factory) as s:
        row, plain = tokens.issue(s, role, **kw)
    return row.id, {"Authorization": f"Bearer {plain}"}


# -- authentication comes before the body ----------------------------------------------


def test_a_request_without_a_token_is_refused_before_its_body_is_parsed(api) -> None:
    bad_json = api.post("/v1/measurements", content=b"{not json",
                        headers={"Content-Type": "application/json"})
    assert bad_json.status_code == 401 and bad_json.json()["error"] == "unauthorized"
    assert bad_json.headers["www-authenticate"] == "Bearer"
    wrong = api.post("/v1/measurements", content=b"{not json",
                     headers={"Content-Type": "application/json", "Authorization": "Bearer nope"})
    assert wrong.status_code == 401 and "unknown or revoked" in wrong.json()["message"]
    # With a valid token the same body is the client's mistake, said as such.
    r = api.post("/v1/measurements", content=b"{not json",
                 headers={"Content-Type": "application/json", **api.h["agent"]})
    assert r.status_code == 422
    # Public paths stay public; a route that does not exist is not mapped for strangers.
    assert api.get("/healthz").status_code == 200
    assert api.get("/openapi.json").status_code == 200
    assert api.get("/v1/no-such-route").status_code == 401


def test_no_database_connection_is_held_while_a_preflight_waits(api, clean_db) -> None:
    # Two connections in the pool and two requests waiting at once: were either to sit on
    # a connection while it waits, the other's polling would find none (a 503).
    _stale(api)
    engine = create_engine(clean_db.kw["bind"].url, pool_size=2, max_overflow=0, pool_timeout=3)
    factory = db.make_session_factory(engine)
    answers: list[int] = []

    def wait(client) -> None:
        r = client.post("/v1/preflight?wait=4", json={"nodes": NODES, "max_age_s": 60},
                        headers=api.h["reader"])
        answers.append(r.status_code)

    try:
        with TestClient(create_app(Settings(database_url="unused"), factory)) as small:
            threads = [threading.Thread(target=wait, args=(small,)) for _ in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
    finally:
        engine.dispose()
    assert answers == [202, 202]


# -- token lifecycle -------------------------------------------------------------------


def test_expired_and_revoked_tokens_are_refused(api, clean_db) -> None:
    _, expired = _token(clean_db, "reader", expires_at=datetime.now(UTC) - timedelta(seconds=1))
    r = api.get("/v1/health", headers=expired)
    assert r.status_code == 401 and "expired" in r.json()["message"]

    made = api.post("/v1/tokens", json={"role": "reader", "name": "ci", "expires_in_days": 1},
                    headers=api.h["admin"])
    assert made.status_code == 201
    body = made.json()
    assert body["expires_at"] is not None and body["token"].startswith("rw_")
    fresh = {"Authorization": f"Bearer {body['token']}"}
    assert api.get("/v1/health", headers=fresh).status_code == 200

    # Only an admin revokes; revoking twice is harmless; an unknown id is a 404.
    assert api.delete(f"/v1/tokens/{body['id']}", headers=api.h["reader"]).status_code == 403
    assert api.delete(f"/v1/tokens/{body['id']}", headers=api.h["admin"]).status_code == 204
    assert api.delete(f"/v1/tokens/{body['id']}", headers=api.h["admin"]).status_code == 204
    assert api.delete("/v1/tokens/999999", headers=api.h["admin"]).status_code == 404
    r = api.get("/v1/health", headers=fresh)
    assert r.status_code == 401 and "revoked" in r.json()["message"]


def test_token_list_shows_use_and_expiry_never_the_token_and_pages(api) -> None:
    api.get("/v1/health", headers=api.h["reader"])
    listed = api.get("/v1/tokens", headers=api.h["admin"])
    assert listed.status_code == 200
    rows = listed.json()
    assert {r["role"] for r in rows} == {"agent", "reader", "admin"}
    assert all("token" not in r and "token_hash" not in r for r in rows)
    reader = next(r for r in rows if r["role"] == "reader")
    assert reader["last_used_at"] is not None

    first = api.get("/v1/tokens", params={"limit": 2}, headers=api.h["admin"])
    assert len(first.json()) == 2 and 'rel="next"' in first.headers["link"]
    rest = api.get("/v1/tokens", params={"limit": 2, "after": first.headers["x-next-cursor"]},
                   headers=api.h["admin"]).json()
    assert [r["id"] for r in first.json() + rest] == [r["id"] for r in rows]
    assert "link" not in api.get("/v1/tokens", params={"limit": 2, "after": rest[-1]["id"]},
                                 headers=api.h["admin"]).headers


def test_token_input_is_checked(api) -> None:
    r = api.post("/v1/tokens", json={"role": "reader", "nodes": ["node-000"]},
                 headers=api.h["admin"])
    assert r.status_code == 422 and "agent" in r.json()["message"]
    r = api.post("/v1/tokens", json={"role": "reader", "expires_in_days": -1}, headers=api.h["admin"])
    assert r.status_code == 422


def test_the_bootstrap_token_is_stored_only_into_an_empty_table(clean_db) -> None:
    settings = Settings(database_url="unused", bootstrap_admin_token="rw_bootstrap_for_tests_0001")
    with TestClient(create_app(settings, clean_db)) as client:
        h = {"Authorization": "Bearer rw_bootstrap_for_tests_0001"}
        assert client.get("/v1/tokens", headers=h).status_code == 200
        boot = client.get("/v1/tokens", headers=h).json()[0]
        assert boot["name"] == "bootstrap" and boot["expires_at"] is not None
        assert client.delete(f"/v1/tokens/{boot['id']}", headers=h).status_code == 204
    # A restart neither fails on the revoked row nor brings the token back.
    with TestClient(create_app(settings, clean_db)) as client:
        assert client.get("/v1/health", headers=h).status_code == 401
    with db.transaction(clean_db) as s:
        assert s.scalar(select(ApiToken.revoked_at).where(ApiToken.name == "bootstrap"))


# -- preflight: caps and claims --------------------------------------------------------


def test_a_nodes_own_gate_has_a_cap_of_its_own(clean_db) -> None:
    """A big job's prologs share one token: single-node requests are capped apart from the
    token's other requests, so a job of more nodes than RINGWATCH_MAX_PENDING_PREFLIGHTS_
    PER_TOKEN does not see its nodes let in unchecked by a 429."""
    settings = {"max_pending_preflights_per_token": 2, "max_pending_gate_preflights_per_token": 3}
    with api_client(clean_db, settings) as api:
        _stale(api)
        codes = [api.post("/v1/preflight", json={"nodes": [n], "max_age_s": 60},
                          headers=api.h["reader"]).status_code for n in NODES]
        assert codes == [202, 202, 202, 429]
        r = api.post("/v1/preflight", json={"nodes": ["node-000"], "max_age_s": 60},
                     headers=api.h["reader"])
        assert "RINGWATCH_MAX_PENDING_GATE_PREFLIGHTS_PER_TOKEN" in r.json()["message"]
        # The token's other requests keep their own share.
        for _ in range(2):
            assert api.post("/v1/preflight", json={"nodes": NODES, "max_age_s": 60},
                            headers=api.h["reader"]).status_code == 202
        assert api.post("/v1/preflight", json={"nodes": NODES, "max_age_s": 60},
                        headers=api.h["reader"]).status_code == 429


def test_each_token_has_a_cap_on_waiting_preflights(clean_db) -> None:
    with api_client(clean_db, {"max_pending_preflights_per_token": 2}) as api:
        _stale(api)
        ask = {"nodes": NODES, "max_age_s": 60}
        for _ in range(2):
            assert api.post("/v1/preflight", json=ask, headers=api.h["reader"]).status_code == 202
        r = api.post("/v1/preflight", json=ask, headers=api.h["reader"])
        assert r.status_code == 429 and r.json()["error"] == "too_many_requests"
        assert int(r.headers["retry-after"]) > 0
        # Another token is not held back by this one.
        assert api.post("/v1/preflight", json=ask, headers=api.h["admin"]).status_code == 202
        # Once a scheduler answers one, the token may ask again.
        claimed = api.post("/v1/preflight/claim", json={"worker": "w"}, headers=api.h["agent"]).json()
        api.post(f"/v1/preflight/{claimed['id']}/complete", json={"worker": "w", "error": "x"},
                 headers=api.h["agent"]).raise_for_status()
        assert api.post("/v1/preflight", json=ask, headers=api.h["reader"]).status_code == 202


def test_only_the_claiming_token_completes_a_preflight(api, clean_db) -> None:
    _stale(api)
    req = api.post("/v1/preflight", json={"nodes": NODES, "max_age_s": 60},
                   headers=api.h["reader"]).json()
    api.post("/v1/preflight/claim", json={"worker": "sched-a"}, headers=api.h["agent"])
    _, other = _token(clean_db, "agent")
    # The same worker name under another agent token is not the holder.
    r = api.post(f"/v1/preflight/{req['id']}/complete", json={"worker": "sched-a"}, headers=other)
    assert r.status_code == 422 and "not claimed" in r.json()["message"]
    api.post("/v1/measurements", json=fleet_batch(), headers=api.h["agent"]).raise_for_status()
    done = api.post(f"/v1/preflight/{req['id']}/complete", json={"worker": "sched-a"},
                    headers=api.h["agent"])
    assert done.status_code == 200 and done.json()["healthy"] is True


def test_a_scoped_agent_token_reports_and_answers_for_its_nodes_only(api, clean_db) -> None:
    _stale(api)
    outside = api.post("/v1/preflight", json={"nodes": NODES, "max_age_s": 60},
                       headers=api.h["reader"]).json()
    inside = api.post("/v1/preflight", json={"nodes": ["node-000", "node-001"], "max_age_s": 60},
                      headers=api.h["reader"]).json()
    assert outside["status"] == inside["status"] == "pending"

    _, scoped = _token(clean_db, "agent", nodes=["node-000", "node-001"])
    r = api.post("/v1/measurements", json=fleet_batch(), headers=scoped)
    assert r.status_code == 403 and "node-002" in r.json()["message"]
    mine = {"batch_id": "mine", "backend": "gloo", "measurements": [
        measurement(["node-000/0", "node-000/1", "node-001/0", "node-001/1"], 10.0)]}
    assert api.post("/v1/measurements", json=mine, headers=scoped).status_code == 200

    claimed = api.post("/v1/preflight/claim", json={"worker": "rack-a"}, headers=scoped)
    assert claimed.status_code == 200 and claimed.json()["id"] == inside["id"]
    assert api.post("/v1/preflight/claim", json={"worker": "rack-a"},
                    headers=scoped).status_code == 204
    # The unscoped scheduler still gets the rest.
    assert api.post("/v1/preflight/claim", json={"worker": "all"},
                    headers=api.h["agent"]).json()["id"] == outside["id"]


# -- bounded input ---------------------------------------------------------------------


def test_query_bounds_are_enforced_with_reasons(api) -> None:
    r = api.post("/v1/preflight", json={"nodes": NODES, "max_age_s": 1e11}, headers=api.h["reader"])
    assert r.status_code == 422 and "max_age_s" in r.json()["message"]
    for path, params in [("/v1/links", {"limit": 0}), ("/v1/links", {"limit": 10**9}),
                         ("/v1/nodes", {"limit": 10**9}), ("/v1/findings", {"limit": 10**9}),
                         ("/v1/links", {"after": "not-a-cursor"})]:
        r = api.get(path, params=params, headers=api.h["reader"])
        assert r.status_code == 422, (path, params)
        assert r.json()["error"] == "invalid_input"


def test_measurement_times_within_the_configured_skew(clean_db) -> None:
    with api_client(clean_db, {"max_clock_skew_s": 60}) as api:
        ahead = fleet_batch()
        for m in ahead["measurements"]:
            m["time"] = (datetime.now(UTC) + timedelta(minutes=5)).isoformat()
        r = api.post("/v1/measurements", json=ahead, headers=api.h["agent"])
        assert r.status_code == 422 and "RINGWATCH_MAX_CLOCK_SKEW_S" in r.json()["message"]


def test_lists_page_through_everything_once(api) -> None:
    api.post("/v1/measurements", json=fleet_batch(slow_node="node-001", nodes=6),
             headers=api.h["agent"]).raise_for_status()
    everything = api.get("/v1/links", headers=api.h["reader"]).json()
    assert len(everything) > 5
    seen, after = [], None
    while True:
        params = {"limit": 4, **({"after": after} if after else {})}
        page = api.get("/v1/links", params=params, headers=api.h["reader"])
        seen += page.json()
        after = page.headers.get("x-next-cursor")
        if after is None:
            break
    assert [(x["group_key"], x["op"]) for x in seen] == [(x["group_key"], x["op"]) for x in everything]

    nodes = api.get("/v1/nodes", params={"limit": 4}, headers=api.h["reader"])
    rest = api.get("/v1/nodes", params={"after": nodes.headers["x-next-cursor"]},
                   headers=api.h["reader"]).json()
    assert [n["name"] for n in nodes.json() + rest] == [f"node-{i:03d}" for i in range(6)]


def test_every_finding_can_be_read_and_a_node_hang_resolves(clean_db) -> None:
    from tests.api_fixtures import REACT_AT_ONCE

    with api_client(clean_db, REACT_AT_ONCE) as api:
        hung = fleet_batch()
        hung["findings"] = [{"kind": "hang", "node": "node-002", "op": "allreduce",
                             "reason": "no progress"}]
        api.post("/v1/measurements", json=hung, headers=api.h["agent"]).raise_for_status()
        opened = api.get("/v1/findings", params={"status": "open"}, headers=api.h["reader"]).json()
        hang = next(f for f in opened if f["kind"] == "hang")
        one = api.get(f"/v1/findings/{hang['id']}", headers=api.h["reader"])
        assert one.status_code == 200 and one.json()["nodes"] == ["node-002"]
        assert api.get("/v1/findings/999999", headers=api.h["reader"]).status_code == 404
        # The node runs clean next cycle: the hang that named no GPU is resolved.
        api.post("/v1/measurements", json=fleet_batch(), headers=api.h["agent"]).raise_for_status()
        assert api.get(f"/v1/findings/{hang['id']}",
                       headers=api.h["reader"]).json()["status"] == "resolved"


def test_concurrent_first_starts_store_one_bootstrap_token(clean_db) -> None:
    settings = Settings(database_url="unused", bootstrap_admin_token="rw_bootstrap_for_tests_0002")
    errors: list[BaseException] = []

    def start() -> None:
        try:
            create_app(settings, clean_db)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=start) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    with db.transaction(clean_db) as s:
        assert len(s.scalars(select(ApiToken)).all()) == 1
