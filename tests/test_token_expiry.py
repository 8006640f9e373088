"""Token expiry warnings: a token's own description (GET /v1/tokens/self), the tokens that
expire soon in /v1/health, /metrics and `ringwatch status`."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from ringwatch.services.cli import status
from ringwatch.services.store import db, tokens
from tests.api_fixtures import REACT_AT_ONCE, api_client

DAY = timedelta(days=1)


@pytest.fixture
def api(clean_db):
    with api_client(clean_db, {**REACT_AT_ONCE, "metrics_cache_s": 0}) as client:
        yield client


def issue(factory, role: str, name: str = "", *, expires_in: timedelta | None = None,
          revoked: bool = False, **kw: Any) -> tuple[int, str]:
    with db.transaction(factory) as s:
        at = datetime.now(UTC) + expires_in if expires_in is not None else None
        row, plain = tokens.issue(s, role, name, expires_at=at, **kw)
        if revoked:
            tokens.revoke(s, row.id)
        return row.id, plain


def bearer(plain: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {plain}"}


@pytest.fixture
def expiring(clean_db) -> dict[str, int]:
    """Tokens around the 14-day line: the API fixture's own never expire."""
    return {
        "soon": issue(clean_db, "admin", "ci-admin", expires_in=3 * DAY)[0],
        "sooner": issue(clean_db, "agent", "rack-a", expires_in=timedelta(hours=5),
                        nodes=["node-000"])[0],
        "later": issue(clean_db, "reader", "dashboards", expires_in=30 * DAY)[0],
        "revoked": issue(clean_db, "admin", "old-admin", expires_in=2 * DAY, revoked=True)[0],
        "expired": issue(clean_db, "reader", "gone", expires_in=-DAY)[0],
    }


# -- a token's own description ---------------------------------------------------------


def test_a_token_describes_itself_to_any_role_without_its_secret(api, clean_db) -> None:
    for role in ("reader", "agent", "admin"):
        r = api.get("/v1/tokens/self", headers=api.h[role])
        assert r.status_code == 200, r.text
        body = r.json()
        assert set(body) == {"id", "role", "name", "prefix", "expires_at", "nodes"}
        plain = api.tokens[role]
        assert body["role"] == role and body["expires_at"] is None and body["nodes"] is None
        assert body["prefix"] == plain[:8] and plain.startswith("rw_")
        assert plain not in r.text and plain[8:16] not in r.text
    ids = {api.get("/v1/tokens/self", headers=api.h[r]).json()["id"] for r in api.h}
    assert len(ids) == 3

    token_id, plain = issue(clean_db, "agent", "rack-a", expires_in=10 * DAY,
                            nodes=["node-001", "node-000"])
    me = api.get("/v1/tokens/self", headers=bearer(plain)).json()
    assert me["id"] == token_id and me["name"] == "rack-a"
    assert me["nodes"] == ["node-000", "node-001"]
    left = datetime.fromisoformat(me["expires_at"]) - datetime.now(UTC)
    assert 9.9 * DAY < left <= 10 * DAY


def test_a_short_hand_made_token_shows_a_quarter_of_itself_at_most(api, clean_db) -> None:
    with db.transaction(clean_db) as s:
        tokens.create_token(s, "reader", "hand-made", token="dev-token-12")
    me = api.get("/v1/tokens/self", headers=bearer("dev-token-12")).json()
    assert me["prefix"] == "dev"


def test_an_expired_or_revoked_token_cannot_ask_about_itself(api, clean_db) -> None:
    _, gone = issue(clean_db, "reader", expires_in=-DAY)
    _, revoked = issue(clean_db, "reader", revoked=True)
    assert api.get("/v1/tokens/self", headers=bearer(gone)).status_code == 401
    assert api.get("/v1/tokens/self", headers=bearer(revoked)).status_code == 401
    assert api.get("/v1/tokens/self").status_code == 401


# -- /v1/health and /metrics -----------------------------------------------------------


def test_health_names_active_tokens_expiring_within_14_days_soonest_first(
        api, expiring) -> None:
    health = api.get("/v1/health", headers=api.h["reader"]).json()
    got = health["tokens_expiring"]
    assert [t["id"] for t in got] == [expiring["sooner"], expiring["soon"]]
    assert got[1]["role"] == "admin" and got[1]["name"] == "ci-admin"
    assert set(got[1]) == {"id", "role", "name", "expires_at"}
    left = datetime.fromisoformat(got[1]["expires_at"]) - datetime.now(UTC)
    assert 2.9 * DAY < left <= 3 * DAY


def test_health_lists_none_when_no_token_expires_soon(api, clean_db) -> None:
    issue(clean_db, "admin", "far", expires_in=15 * DAY)
    assert api.get("/v1/health", headers=api.h["reader"]).json()["tokens_expiring"] == []


def scrape(api) -> dict[str, list[tuple[dict[str, str], float]]]:
    resp = api.get("/metrics")
    assert resp.status_code == 200, resp.text
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(resp.text):
        out.setdefault(family.name, [])
        for s in family.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def test_metrics_give_seconds_left_per_token_and_counts_expiring_soon(api, expiring) -> None:
    samples = scrape(api)
    left = {(labels["id"], labels["role"]): v
            for labels, v in samples["ringwatch_token_expires_in_seconds"]}
    assert set(left) == {(str(expiring["soon"]), "admin"), (str(expiring["sooner"]), "agent"),
                         (str(expiring["later"]), "reader")}
    assert 3 * 86400 - 120 < left[(str(expiring["soon"]), "admin")] <= 3 * 86400
    assert 30 * 86400 - 120 < left[(str(expiring["later"]), "reader")] <= 30 * 86400
    # Only closed-set labels: no token's name becomes one.
    assert all(set(labels) == {"id", "role"}
               for labels, _ in samples["ringwatch_token_expires_in_seconds"])
    soon = {labels["role"]: v for labels, v in samples["ringwatch_tokens_expiring_soon"]}
    assert soon == {"admin": 1, "agent": 1, "reader": 0}


def test_metrics_with_no_expiring_token_still_say_zero_per_role(api) -> None:
    samples = scrape(api)
    assert samples.get("ringwatch_token_expires_in_seconds", []) == []
    soon = {labels["role"]: v for labels, v in samples["ringwatch_tokens_expiring_soon"]}
    assert soon == {"admin": 0, "agent": 0, "reader": 0}


# -- ringwatch status ------------------------------------------------------------------

NOW = datetime(2027, 3, 1, 12, 0, tzinfo=UTC)


def fleet_status(expiring: list[dict[str, Any]] | None) -> status.FleetStatus:
    health: dict[str, Any] = {"status": "healthy", "nodes": 2, "links": {"ok": 1},
                              "open_findings": 0}
    if expiring is not None:
        health["tokens_expiring"] = expiring
    return status.FleetStatus("http://rw.test", health, [], {"node-000": NOW}, {}, NOW)


def token(i: int, role: str, name: str, left: timedelta) -> dict[str, Any]:
    return {"id": i, "role": role, "name": name, "expires_at": (NOW + left).isoformat()}


def test_status_warns_of_tokens_expiring_and_lists_them_in_json() -> None:
    expiring = [token(4, "agent", "rack-a", timedelta(hours=5)),
                token(2, "admin", "ci-admin", 3 * DAY), token(9, "reader", "", 13 * DAY)]
    st = fleet_status(expiring)
    line = [ln for ln in status.plain(st).splitlines() if ln.startswith("tokens")]
    assert line == ["tokens      3 expire within 14 days: rack-a (agent) in 5 h, "
                    "ci-admin (admin) in 3 d, token 9 (reader) in 13 d"]
    assert st.to_dict()["tokens_expiring"] == expiring


def test_status_says_nothing_of_tokens_when_none_expire_or_the_api_is_older() -> None:
    for health_tokens in ([], None):
        st = fleet_status(health_tokens)
        assert not any(ln.startswith("tokens") for ln in status.plain(st).splitlines())
        assert st.to_dict()["tokens_expiring"] == []


def test_status_lists_five_tokens_and_counts_the_rest() -> None:
    many = [token(i, "agent", f"rack-{i}", DAY * (i + 1)) for i in range(8)]
    text = status.tokens_text(many, NOW)
    assert text.startswith("8 expire within 14 days: rack-0 (agent) in 1 d")
    assert "rack-4" in text and "rack-5" not in text and text.endswith("and 3 more")


def test_a_token_name_cannot_write_to_the_terminal(capsys) -> None:
    odd = token(3, "admin", "ci\x1b[2J\n[bold red]boom[/]", 2 * DAY)
    text = status.tokens_text([odd], NOW)
    assert "\x1b" not in text and "\n" not in text and "\\x1b[2J\\n" in text
    status.render_rich(fleet_status([odd]))
    shown = capsys.readouterr().out
    assert "[bold red]boom[/]" in shown and "\x1b[2J" not in shown


def test_status_reads_the_warning_from_the_api(api, expiring) -> None:
    api.headers.update(api.h["reader"])
    st = status.fetch(api)
    lines = [ln for ln in status.plain(st).splitlines() if ln.startswith("tokens")]
    assert len(lines) == 1 and "2 expire within 14 days" in lines[0]
    assert "rack-a (agent) in 5 h" in lines[0] and "ci-admin (admin) in 3 d" in lines[0]
    assert [t["id"] for t in st.to_dict()["tokens_expiring"]] == [expiring["sooner"],
                                                                  expiring["soon"]]

