"""Slurm host lists wherever the API and the web page take node names: expanded by the
command line's rules (agents.hostlist), bounded by the list's maximum before a name is built."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

import ringwatch.agents.hostlist as hostlist
from ringwatch.agents.hostlist import TooManyHosts, expand_hostlist, expand_hostlists
from ringwatch.api.schemas import MAX_NODES_NAMED, NodesRetireIn, PreflightIn, TokenIn
from tests.api_fixtures import fleet_batch
from tests.procs import running_api

FIVE = [f"node-{i:03d}" for i in range(5)]
ARTIFACTS = Path(__file__).parent / "artifacts" / "ui"

# ---- the rules: the API's expansion is the command line's


@pytest.mark.parametrize("text", [
    "node-[000-004]", "node[001-003,007]", "node-00[0-1],gpu[8-10]b,login",
    "rack[1-2]-n[01-02]", "a,a,b", "n[1-02]", " node-1 , node-[2-3] "])
def test_each_request_expands_a_host_list_as_the_command_line_does(text: str) -> None:
    names = expand_hostlist(text)
    assert PreflightIn(nodes=[text]).nodes == names
    assert TokenIn(role="agent", nodes=[text]).nodes == names
    assert NodesRetireIn(nodes=[text]).nodes == names


def test_names_and_host_lists_mix_in_one_list_in_order() -> None:
    assert PreflightIn(nodes=["login", "node-[001-002]", "gpu7"]).nodes == [
        "login", "node-001", "node-002", "gpu7"]
    # A plain name is judged as it was: by the node name rule, one item at a time.
    with pytest.raises(ValueError, match="not hostname-like"):
        PreflightIn(nodes=["node-[001-002]", "bad name"])


@pytest.mark.parametrize("text, why", [
    ("node-[1-", "unclosed"), ("node-]1[", "unbalanced"), ("node-[3-1]", "runs backwards"),
    ("node-[a-b]", "bad range"), ("n[1[2]]", "nested"), (",", "names no node"),
    ("node-[1-2]x y", "not hostname-like")])
def test_a_malformed_host_list_is_refused_with_its_reason(text: str, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        PreflightIn(nodes=[text])


def test_the_count_is_bounded_before_a_name_is_built(monkeypatch) -> None:
    def built(*_: Any) -> Iterator[str]:
        raise AssertionError("names built before the count was checked")

    monkeypatch.setattr(hostlist, "_names", built)
    for text in ("node-[0-99999999999]", "n[0-999999][0-999999]", "x" + "[1-2]" * 5000):
        with pytest.raises(TooManyHosts):
            expand_hostlist(text)
    # Across the parts of one list and across lists, not per part.
    with pytest.raises(TooManyHosts):
        expand_hostlists(["a[1-600000]", "b[1-600000]"])
    with pytest.raises(TooManyHosts):
        expand_hostlist("a[1-6],b[1-6]", limit=10)


def test_a_request_takes_as_many_names_as_its_list_holds_and_no_more() -> None:
    top = MAX_NODES_NAMED - 1
    assert len(PreflightIn(nodes=[f"n[0-{top}]"]).nodes) == MAX_NODES_NAMED
    for over in ([f"n[0-{MAX_NODES_NAMED}]"], [f"n[0-{top}]", "m1"], ["m1", f"n[0-{top}]"],
                 ["node-[0-99999999999]"]):
        with pytest.raises(ValueError, match="100000"):
            PreflightIn(nodes=over)


def test_the_command_line_takes_host_lists_wherever_it_takes_node_names() -> None:
    from ringwatch.services.cli.errors import CliError
    from ringwatch.services.cli.main import build_parser
    from ringwatch.services.cli.nodes import _expand

    args = build_parser().parse_args(["token", "create", "--role", "agent",
                                      "--nodes", "node-[000-001],gpu7"])
    assert args.nodes == ["node-000", "node-001", "gpu7"]
    assert _expand(["node-[000-001]", "node-001", "gpu7"]) == ["node-000", "node-001", "gpu7"]
    # Bounded over every argument together, as the API bounds a list.
    with pytest.raises(CliError, match="more than 1000000 hosts"):
        _expand(["a[1-600000]", "b[1-600000]"])


# ---- through the API: the same verdict, bounds as a 422 that names the field


def test_a_preflight_by_host_list_gets_the_expanded_lists_verdict(api) -> None:
    api.post("/v1/measurements", json=fleet_batch(slow_node="node-003", nodes=5),
             headers=api.h["agent"]).raise_for_status()
    keep = ("healthy", "exclude", "nodes_checked", "findings", "source", "status")

    def verdict(nodes: list[str]) -> dict[str, Any]:
        r = api.post("/v1/preflight", json={"nodes": nodes}, headers=api.h["reader"])
        assert r.status_code == 200, r.text
        return {k: r.json().get(k) for k in keep}

    expanded = verdict(FIVE)
    assert expanded["healthy"] is False and expanded["exclude"] == ["node-003"]
    assert verdict(["node-[000-004]"]) == expanded
    assert verdict(["node-[000-002],node-[003-004]"]) == expanded
    assert verdict(["node-000", "node-[001-004]"]) == expanded
    # A subset by host list is judged as that subset named one by one.
    assert verdict(["node-[000-002]"]) == verdict(FIVE[:3])


def test_the_api_refuses_a_host_list_past_the_bound_naming_the_field(api) -> None:
    for body in ({"nodes": ["node-[0-99999999999]"]}, {"nodes": ["node-[1-"]},
                 {"nodes": [f"n[0-{MAX_NODES_NAMED}]"]}):
        r = api.post("/v1/preflight", json=body, headers=api.h["reader"])
        assert r.status_code == 422, r.text
        assert r.json()["message"].startswith("nodes: "), r.json()
    # At the bound it passes the schema: the names are then judged (none is in the fleet).
    r = api.post("/v1/preflight", json={"nodes": [f"n[0-{MAX_NODES_NAMED - 1}]"]},
                 headers=api.h["reader"])
    assert r.status_code == 404 and "unknown" in r.json()["message"]
    r = api.get("/v1/links", params={"node": "node-[0-99999999999]"}, headers=api.h["reader"])
    assert r.status_code == 422 and r.json()["message"].startswith("query.node: ")


def test_token_scopes_retirement_and_the_links_filter_take_host_lists(api) -> None:
    api.post("/v1/measurements", json=fleet_batch(nodes=5),
             headers=api.h["agent"]).raise_for_status()
    made = api.post("/v1/tokens", json={"role": "agent", "nodes": ["node-[000-001]"]},
                    headers=api.h["admin"])
    assert made.status_code == 201, made.text
    listed = {t["id"]: t for t in api.get("/v1/tokens", headers=api.h["admin"]).json()}
    assert listed[made.json()["id"]]["nodes"] == ["node-000", "node-001"]

    def links(**params: Any) -> set[str]:
        r = api.get("/v1/links", params=params, headers=api.h["reader"])
        assert r.status_code == 200, r.text
        return {link["group_key"] for link in r.json()}

    either = links(node="node-000") | links(node="node-001")
    assert links(node="node-[000-001]") == either
    assert links(node=["node-000", "node-001"]) == either
    assert links(node="node-[000-001]") < links()

    r = api.post("/v1/nodes/retire", params={"dry_run": True}, json={"nodes": ["node-[003-004]"]},
                 headers=api.h["admin"])
    assert r.status_code == 200 and r.json()["retired"] == ["node-003", "node-004"], r.text


# ---- the web page's preflight form, in a browser, against a real API process


@pytest.fixture(scope="module")
def served(database_url, session_factory, tmp_path_factory) -> Iterator[dict[str, Any]]:
    """A real API process whose fleet is five nodes, node-003 slow; a reader token."""
    from sqlalchemy import text

    from ringwatch.services.store import db
    from ringwatch.services.store.models import Base

    tables = ", ".join(t.name for t in Base.metadata.sorted_tables)
    with db.transaction(session_factory) as s:
        s.execute(text(f"TRUNCATE {tables} RESTART IDENTITY CASCADE"))
    admin_token = "rw_hostlists_admin_token_for_tests"
    with running_api(database_url, tmp_path_factory.mktemp("hostlists"), admin_token) as env:
        url = env["RINGWATCH_API_URL"]
        admin = {"Authorization": f"Bearer {admin_token}"}
        agent = httpx.post(f"{url}/v1/tokens", json={"role": "agent"}, headers=admin).json()
        httpx.post(f"{url}/v1/measurements", json=fleet_batch(slow_node="node-003", nodes=5),
                   headers={"Authorization": f"Bearer {agent['token']}"}).raise_for_status()
        reader = httpx.post(f"{url}/v1/tokens", json={"role": "reader"},
                            headers=admin).json()["token"]
        yield {"url": url, "reader": reader, "h": {"Authorization": f"Bearer {reader}"}}


@pytest.fixture
def page(browser):
    context = browser.new_context(viewport={"width": 1200, "height": 900})
    yield context.new_page()
    context.close()


def submit(page, text: str) -> None:
    page.fill("#pf-nodes", text)
    page.click("#preflight-form button[type=submit]")


@pytest.mark.parametrize("text", ["node-[000-004]", "node-[000,001-002],node-[003-004]",
                                  "node-000 node-[001-004]"])
def test_the_preflight_form_takes_a_host_list(served, page, text: str) -> None:
    expanded = httpx.post(f"{served['url']}/v1/preflight", headers=served["h"],
                          json={"nodes": FIVE}).json()
    assert expanded["healthy"] is False and expanded["exclude"] == ["node-003"]
    page.goto(f"{served['url']}/ui/#/preflight")
    page.fill("#token", served["reader"])
    page.click("#login-form button[type=submit]")
    page.wait_for_selector("html[data-drawn='preflight']", timeout=30_000)
    submit(page, text)
    page.wait_for_selector("#verdict-card", timeout=30_000)
    assert page.get_attribute("#verdict-card", "data-healthy") == "false"
    assert page.text_content("#pf-exclude") == "Exclude: node-003"
    assert f"{expanded['nodes_checked']} node(s) checked" in (
        page.text_content("#verdict-card") or "")
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / f"preflight-host-list-{len(text)}.png"), full_page=True)


def test_the_preflight_form_shows_why_a_host_list_is_refused(served, page) -> None:
    page.goto(f"{served['url']}/ui/#/preflight")
    page.fill("#token", served["reader"])
    page.click("#login-form button[type=submit]")
    page.wait_for_selector("html[data-drawn='preflight']", timeout=30_000)
    submit(page, "node-[0-99999999999]")
    page.wait_for_selector("#pf-error")
    shown = page.text_content("#pf-error") or ""
    assert "nodes" in shown and "100000" in shown, shown


@pytest.mark.parametrize("name", ["node-000\n", "node-000\t", "node-00\u0661"])
def test_a_host_list_gives_no_name_a_second_spelling(name: str) -> None:
    """Spaces around a comma are dropped; other whitespace and non-ASCII digits stay for
    the name rule to refuse, as it refuses them in a plain list."""
    for nodes in ([name], [f"node-001,{name}"], [f"node-[001-002],{name}"]):
        with pytest.raises(ValueError, match="not hostname-like"):
            PreflightIn(nodes=nodes)
    with pytest.raises(ValueError):
        PreflightIn(nodes=["node-[\u0661-2]"])
