"""The web page at /ui: its endpoints through the app, and its pages in headless Chromium
against a real API process fed by a sim fleet with faults, through the real scheduler.

Screenshots of every page land in tests/artifacts/ui/ (ignored by git)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import text

from ringwatch.agents.places import node_list
from ringwatch.agents.sim import SimBackend
from ringwatch.services.scheduler.api_client import SchedulerApi
from ringwatch.services.scheduler.cycle import ProbeOptions, run_scheduler
from ringwatch.services.scheduler.shipper import Shipper
from ringwatch.services.store import db
from ringwatch.services.store.models import Base
from tests.api_fixtures import decode_pairs, fleet_batch
from tests.procs import free_port, start_server, stop_server

ARTIFACTS = Path(__file__).parent / "artifacts" / "ui"
ADMIN = "rw_ui_admin_token_for_tests"

# ---- the endpoints the page reads (in-process app, real Postgres)


def test_node_states_mark_the_node_a_finding_names(api) -> None:
    resp = api.post("/v1/measurements", json=fleet_batch(slow_node="node-002"),
                    headers=api.h["agent"])
    assert resp.status_code == 200, resp.text
    body = api.get("/v1/fleet/nodes", headers=api.h["reader"]).json()
    states = {n["name"]: n for n in body["nodes"]}
    assert sorted(states) == ["node-000", "node-001", "node-002", "node-003"]
    blamed = {n for f in api.get("/v1/findings?status=open", headers=api.h["reader"]).json()
              for n in f["nodes"]}
    assert blamed == {"node-002"}
    assert states["node-002"]["state"] == "degraded" and states["node-002"]["open_findings"] >= 1
    # Its own intra-node group ran at 0.4 of its peers; the others' did not.
    assert states["node-002"]["nvlink_ratio"] < 0.7
    assert all(states[n]["nvlink_ratio"] > 0.9 for n in ("node-000", "node-001", "node-003"))
    # A partner of the slow node shares one slow pair of three: its median pair is fine.
    assert all(states[n]["net_ratio"] > 0.9 for n in ("node-000", "node-001", "node-003"))
    assert {states[n]["state"] for n in ("node-000", "node-001", "node-003")} <= {"ok", "suspect"}
    assert body["degraded_ratio"]["gloo"] > 0


def test_node_pairs_list_each_probed_pair_once_by_index(api) -> None:
    batch = fleet_batch(slow_node="node-001", nodes=5)
    # Leave one pair out: it is not probed, so it is not in the map.
    batch["measurements"] = [m for m in batch["measurements"]
                             if not {"node-003/0", "node-004/0"} <= set(m["members"])]
    assert api.post("/v1/measurements", json=batch, headers=api.h["agent"]).status_code == 200
    body = api.get("/v1/fleet/pairs", headers=api.h["reader"]).json()
    assert body["nodes"] == [f"node-{i:03d}" for i in range(5)]
    pairs = decode_pairs(body)
    assert len(pairs) == 9 and (3, 4) not in pairs
    links = api.get("/v1/links?scope=inter_node", headers=api.h["reader"]).json()
    assert len(links) == 9
    for link in links:
        i, j = sorted(body["nodes"].index(n) for n in link["nodes"])
        assert pairs[(i, j)][0] == round(min(link["ratio"], 1.25), 2)
        assert pairs[(i, j)][1] == (link["status"] != "ok")
    assert {bad for _, bad in pairs.values()} == {True, False}


def test_the_pair_map_follows_each_batch_and_forgets_removed_links(api) -> None:
    """The map is kept from read to read, patched with the pairs a batch touched: what a
    later batch changes shows at once, judged over all of that pair's rows, and emptied
    link rows are not shown from memory."""
    from datetime import UTC, datetime, timedelta

    from ringwatch.services.store import db

    def pairs() -> dict:
        return decode_pairs(api.get("/v1/fleet/pairs", headers=api.h["reader"]).json())

    old = datetime.now(UTC) - timedelta(hours=1)
    first = fleet_batch(nodes=4)
    for m in first["measurements"]:
        m["time"] = old.isoformat()
    api.post("/v1/measurements", json=first, headers=api.h["agent"]).raise_for_status()
    before = pairs()
    assert len(before) == 6 and not any(bad for _, bad in before.values())
    # An hour later node-002 is slow: its three pairs change, the others do not.
    api.post("/v1/measurements", json=fleet_batch(slow_node="node-002", nodes=4),
             headers=api.h["agent"]).raise_for_status()
    api.post("/v1/measurements", json=fleet_batch(slow_node="node-002", nodes=4),
             headers=api.h["agent"]).raise_for_status()
    after = pairs()
    slow = {k for k, (ratio, _) in after.items() if ratio is not None and ratio < 0.6}
    assert slow == {(0, 2), (1, 2), (2, 3)}
    assert {k for k, (_, bad) in after.items() if bad} == slow
    # The link rows are emptied (a restored database, a cleared fleet): not shown from memory.
    with db.transaction(api.app.state.session_factory) as s:
        s.execute(text("TRUNCATE link_health RESTART IDENTITY"))
    api.post("/v1/measurements", json=fleet_batch(nodes=3, slow_node="node-000"),
             headers=api.h["agent"]).raise_for_status()
    again = pairs()
    assert set(again) == {(0, 1), (0, 2), (1, 2)}  # node-003's pairs are gone
    assert {k for k, (ratio, _) in again.items() if ratio is not None and ratio < 0.6} == {
        (0, 1), (0, 2)}


def test_node_detail_has_inventory_nics_and_counters(api) -> None:
    batch = fleet_batch(nodes=2)
    batch["ranks"] = [{"node": "node-000", "local_index": g, "hostname": "h0", "gpu_name": "H100",
                       "gpu_uuid": f"GPU-{g}", "telemetry": {"nics": [{"name": "mlx5_0",
                                                                        "state": "ACTIVE"}]}
                       if g == 0 else {}} for g in range(2)]
    batch["counters"] = [{"node": "node-000", "local_index": 1,
                          "before": [{"field": "nvlink_crc_errors", "value": 0}],
                          "after": [{"field": "nvlink_crc_errors", "value": 7}]}]
    assert api.post("/v1/measurements", json=batch, headers=api.h["agent"]).status_code == 200
    node = api.get("/v1/nodes/node-000", headers=api.h["reader"]).json()
    assert [g["uuid"] for g in node["gpus"]] == ["GPU-0", "GPU-1"]
    assert node["nics"] == [{"name": "mlx5_0", "state": "ACTIVE"}]
    assert api.get("/v1/nodes/node-404", headers=api.h["reader"]).status_code == 404
    stored = api.get("/v1/series", params={"members": "node-000/1"},
                     headers=api.h["reader"]).json()["counters"]
    assert node["counters"] and [c["local_index"] for c in node["counters"]] == [1]
    assert [c["local_index"] for c in node["counters"]] == [c["local_index"] for c in stored]


def test_the_shell_is_public_and_the_data_is_not(api) -> None:
    page = api.get("/ui/")
    assert page.status_code == 200 and "<title>ringwatch</title>" in page.text
    assert api.get("/ui/app.js").status_code == 200
    for path in ("/v1/fleet/nodes", "/v1/fleet/pairs", "/v1/nodes/node-000"):
        assert api.get(path).status_code == 401
        assert api.get(path, headers={"Authorization": "Bearer nope"}).status_code == 401


# ---- the pages, in a browser, against a real API process

FLEET = {"nodes": 12, "gpus_per_node": 8, "seed": 7, "noise": 0.02, "faults": [
    {"kind": "nvlink", "node": "node-003", "gpus": [2, 5], "factor": 0.5},
    {"kind": "nic", "node": "node-008", "factor": 0.5}]}


@pytest.fixture(scope="module")
def served(database_url, session_factory, tmp_path_factory) -> Iterator[dict[str, Any]]:
    """A real API process on an emptied database, fed two cycles of the real scheduler on
    a 12 x 8 sim fleet (one matching of node pairs per cycle, so some pairs stay unprobed);
    one bad cycle opens an incident. Returns the API's URL and a reader token."""
    tables = ", ".join(t.name for t in Base.metadata.sorted_tables)
    with db.transaction(session_factory) as s:
        s.execute(text(f"TRUNCATE {tables} RESTART IDENTITY CASCADE"))
    state = tmp_path_factory.mktemp("ui")
    url = f"http://127.0.0.1:{free_port()}"
    env = {**os.environ, "RINGWATCH_DATABASE_URL": database_url, "RINGWATCH_API_URL": url,
           "RINGWATCH_BOOTSTRAP_ADMIN_TOKEN": ADMIN, "RINGWATCH_STATE_DIR": str(state),
           "RINGWATCH_HYSTERESIS_K_BAD": "1", "RINGWATCH_HYSTERESIS_N_WINDOW": "1",
           "RINGWATCH_HYSTERESIS_M_GOOD": "1"}
    proc = start_server(env, notifier=False)
    client = SchedulerApi(url, ADMIN, "ui-test")
    try:
        shipper = Shipper(url, ADMIN, state / "spool")
        backend = SimBackend(FLEET)
        for _ in range(2):
            assert run_scheduler(backend, shipper, ProbeOptions(), interval_s=3600, once=True,
                                 api=client) == 1
        admin = {"Authorization": f"Bearer {ADMIN}"}
        reader = httpx.post(f"{url}/v1/tokens", json={"role": "reader", "name": "ui"},
                            headers=admin).json()["token"]
        yield {"url": url, "reader": reader, "h": {"Authorization": f"Bearer {reader}"}}
    finally:
        client.close()
        stop_server(proc)


@pytest.fixture
def page(browser):
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    yield context.new_page()
    context.close()


def login(page, served: dict[str, Any], hash_: str = "") -> None:
    page.goto(f"{served['url']}/ui/{hash_}")
    page.fill("#token", served["reader"])
    page.click("#login-form button[type=submit]")


def wait_drawn(page, name: str) -> None:
    page.wait_for_selector(f"html[data-drawn='{name}']", timeout=30_000)


def shot(page, name: str) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True)


def test_login_refuses_a_bad_token_with_a_message(served, page) -> None:
    page.goto(f"{served['url']}/ui/")
    wait_drawn(page, "login")
    page.fill("#token", "not-a-token")
    page.click("#login-form button[type=submit]")
    # A selector, not wait_for_function: the page's policy runs no script from a string.
    page.wait_for_selector("#login-error:not(:empty)")
    message = page.text_content("#login-error") or ""
    assert message.startswith("Token refused")
    assert page.is_visible("#login-form") and not page.is_visible("#fleet-grid")
    shot(page, "login-bad-token-refused")


def test_fleet_shows_every_node_and_marks_the_degraded_one(served, page) -> None:
    login(page, served)
    wait_drawn(page, "fleet")
    nodes = httpx.get(f"{served['url']}/v1/nodes", headers=served["h"]).json()
    open_ = httpx.get(f"{served['url']}/v1/findings?status=open", headers=served["h"]).json()
    blamed = {n for f in open_ for n in f["nodes"]}
    cells = page.eval_on_selector_all(
        ".cell[data-node]", "cs => cs.map(c => [c.dataset.node, c.dataset.state, c.textContent])")
    assert sorted(c[0] for c in cells) == sorted(n["name"] for n in nodes)
    assert len(cells) == FLEET["nodes"]
    marked = {name for name, state, glyph in cells if state == "degraded" and glyph == "\u2715"}
    assert "node-003" in marked and marked == blamed
    listed = page.text_content("#incidents") or ""
    assert all(n in listed for n in blamed)
    shot(page, "fleet-degraded-node-marked")
    # The filter keeps the degraded nodes alone.
    page.select_option("#filter-state", "degraded")
    visible = page.eval_on_selector_all(".cell[data-node]:not([hidden])", "cs => cs.map(c => c.dataset.node)")
    assert set(visible) == blamed
    shot(page, "fleet-filtered-to-degraded")


def test_a_click_on_a_degraded_cell_opens_its_series(served, page) -> None:
    login(page, served)
    wait_drawn(page, "fleet")
    page.click(".cell[data-node='node-003']")
    wait_drawn(page, "series")
    assert page.url.endswith("#/node/node-003")
    selected = page.eval_on_selector("tr.link-row.selected", "r => r.dataset.status")
    assert selected != "ok"  # the worst link first, and it is degraded
    points = int(page.get_attribute("#series-chart", "data-points") or 0)
    assert points > 0 and page.locator("#series-chart .point").count() == points
    # Its slow points sit below the expected band, drawn as crosses.
    assert page.locator("#series-chart .point.low").count() > 0
    # The NVLink heatmap shows the slow GPU pair among those probed.
    assert page.locator("#gpu-heatmap rect[data-pair='2,5'][data-status='degraded']").count() == 1
    shot(page, "node-003-degraded-series")


def test_network_map_shows_pairs_probed_and_not_yet(served, page) -> None:
    login(page, served, "#/network")
    wait_drawn(page, "network")
    pairs = decode_pairs(httpx.get(f"{served['url']}/v1/fleet/pairs", headers=served["h"]).json())
    total = FLEET["nodes"] * (FLEET["nodes"] - 1) // 2
    coverage = page.text_content("#coverage") or ""
    assert f"{len(pairs)} of {total} pairs probed" in coverage
    assert 0 < len(pairs) < total
    degraded = [p for p, (_, bad) in pairs.items() if bad]
    assert page.locator("#degraded-pairs a").count() == len(degraded)
    # An unprobed pair's pixel is grey, a probed one is not.
    probed = set(pairs)
    unprobed = next((i, j) for i in range(12) for j in range(i + 1, 12) if (i, j) not in probed)
    i, j = next(iter(probed))
    colours = page.evaluate("""([a, b]) => {
        const c = document.getElementById('network-matrix'), n = 12, px = c.width / n;
        // Near the cell's corner, clear of its text and of a degraded pair's ring.
        const at = ([r, k]) => Array.from(c.getContext('2d').getImageData(
            Math.floor((k + 0.12) * px), Math.floor((r + 0.12) * px), 1, 1).data);
        return [at(a), at(b)];
    }""", [[i, j], list(unprobed)])
    assert colours[1][:3] == [228, 230, 234] and colours[0][:3] != [228, 230, 234]
    shot(page, "network-pairs-probed")
    if degraded:
        page.click("#degraded-pairs a >> nth=0")
        wait_drawn(page, "series")
        assert int(page.get_attribute("#series-chart", "data-points") or 0) > 0
        shot(page, "network-degraded-pair-series")


def test_preflight_form_shows_the_verdict(served, page) -> None:
    login(page, served, "#/preflight")
    wait_drawn(page, "preflight")
    page.fill("#pf-nodes", "\n".join(f"node-{i:03d} slots=8" for i in range(FLEET["nodes"])))
    page.click("#preflight-form button[type=submit]")
    wait_drawn(page, "verdict")
    stored = httpx.post(f"{served['url']}/v1/preflight", headers=served["h"],
                        json={"nodes": [f"node-{i:03d}" for i in range(FLEET["nodes"])]}).json()
    assert page.get_attribute("#verdict-card", "data-healthy") == str(stored["healthy"]).lower()
    assert stored["healthy"] is False and "node-003" in stored["exclude"]
    # The exclude list as every surface writes it: a host list (agents.places).
    assert (page.text_content("#pf-exclude") or "") == f"Exclude: {node_list(stored['exclude'])}"
    shot(page, "preflight-verdict-unhealthy")
    # An unknown node is refused with the API's reason.
    page.fill("#pf-nodes", "node-999")
    page.click("#preflight-form button[type=submit]")
    page.wait_for_selector("#pf-error")
    assert "node-999" in (page.text_content("#pf-error") or "")


# ---- names on the map and on the cells, and a narrow window


def axis_labels(page, axis: str) -> list[tuple[int, str]]:
    return [(int(i), name) for i, name in page.eval_on_selector_all(
        f"#matrix-{axis} span", "ss => ss.map(s => [s.dataset.index, s.textContent])")]


def label_geometry(page) -> dict[str, Any]:
    """The map's box, and each axis label's box, in page pixels."""
    return page.evaluate("""() => {
        const box = (e) => { const r = e.getBoundingClientRect();
                             return {top: r.top, bottom: r.bottom, left: r.left, right: r.right}; };
        return {map: box(document.getElementById('network-matrix')),
                size: document.getElementById('network-matrix').width,
                rows: [...document.querySelectorAll('#matrix-rows span')].map(box),
                cols: [...document.querySelectorAll('#matrix-cols span')].map(box)};
    }""")


def test_the_network_map_names_each_row_and_column(served, page) -> None:
    login(page, served, "#/network")
    wait_drawn(page, "network")
    nodes = httpx.get(f"{served['url']}/v1/fleet/pairs", headers=served["h"]).json()["nodes"]
    assert axis_labels(page, "rows") == axis_labels(page, "cols") == list(enumerate(nodes))
    # Each name sits beside its own row, above its own column (the map has a 1 px border).
    geo = label_geometry(page)
    px = geo["size"] / len(nodes)
    for i, r in enumerate(geo["rows"]):
        assert r["right"] <= geo["map"]["left"]
        assert abs((r["top"] + r["bottom"]) / 2 - (geo["map"]["top"] + 1 + (i + 0.5) * px)) <= 2
    for i, c in enumerate(geo["cols"]):
        assert c["bottom"] <= geo["map"]["top"]
        assert abs((c["left"] + c["right"]) / 2 - (geo["map"]["left"] + 1 + (i + 0.5) * px)) <= 2
    shot(page, "network-axes-named")
    # Zoomed in on the middle, the names are those of the nodes in view.
    page.click("button:text('zoom in')")
    shown = axis_labels(page, "rows")
    assert shown == axis_labels(page, "cols") == [(i, nodes[i]) for i in range(3, 9)]


def test_the_fleet_cells_carry_their_names(served, page) -> None:
    login(page, served)
    wait_drawn(page, "fleet")
    cells = page.eval_on_selector_all(".cell[data-node]", """cs => cs.map(c => [
        c.dataset.node, c.getAttribute('aria-label'), c.getBoundingClientRect().width])""")
    assert len(cells) == FLEET["nodes"]
    for name, label, _ in cells:
        assert label.startswith(f"{name}: ")
        # The accessible name a screen reader says is the node's, with its state.
        assert page.get_by_role("button", name=label, exact=True).count() == 1
    # A small fleet shows each name in its cell; the box says so in the address.
    assert page.is_checked("#fleet-names") and "names=1" in page.url
    assert all(width > 50 for _, _, width in cells)
    written = page.eval_on_selector_all(
        ".cell[data-node]", "cs => cs.map(c => [c.dataset.node, getComputedStyle(c, '::after').content])")
    assert all(content == f'" {name}"' for name, content in written)
    shot(page, "fleet-cells-named")
    page.uncheck("#fleet-names")
    assert "names=0" in page.url
    widths = page.eval_on_selector_all(".cell[data-node]", "cs => cs.map(c => c.getBoundingClientRect().width)")
    assert set(widths) == {20}


NARROW = {"width": 800, "height": 900}


def overflow(page) -> int:
    """How far the page is wider than its window (0: no horizontal scroll)."""
    return page.evaluate("document.documentElement.scrollWidth - document.documentElement.clientWidth")


def test_every_page_fits_an_800_px_window(served, browser) -> None:
    context = browser.new_context(viewport=NARROW)
    page = context.new_page()
    try:
        login(page, served)
        wait_drawn(page, "fleet")
        assert overflow(page) == 0
        # One column: the open incidents under the fleet, not squeezed beside it.
        fleet, aside = (page.locator(s).bounding_box() for s in (".layout > section", ".layout > aside"))
        assert aside["y"] >= fleet["y"] + fleet["height"]
        shot(page, "narrow-fleet")
        for hash_, name in (("#/node/node-003", "series"), ("#/network", "network"),
                            ("#/preflight", "preflight")):
            page.goto(f"{served['url']}/ui/{hash_}")
            wait_drawn(page, name)
            assert overflow(page) == 0, hash_
            shot(page, f"narrow-{name}")
        page.fill("#pf-nodes", " ".join(f"node-{i:03d}" for i in range(FLEET["nodes"])))
        page.click("#preflight-form button[type=submit]")
        wait_drawn(page, "verdict")
        assert overflow(page) == 0
        shot(page, "narrow-verdict")
        page.goto(f"{served['url']}/ui/#/network")
        wait_drawn(page, "network")
        geo = label_geometry(page)
        assert geo["map"]["right"] <= NARROW["width"] and len(geo["rows"]) == FLEET["nodes"]
    finally:
        context.close()


# ---- one headline per incident, and why a slow link is still ok (default hysteresis)


@pytest.fixture(scope="module")
def served_2_of_3(database_url, session_factory, tmp_path_factory) -> Iterator[dict[str, Any]]:
    """A real API process under the default hysteresis (2 slow cycles of the last 3 open
    an incident), fed three gloo cycles over HTTP: node-001 slow in all three (its incident
    opens on the second), node-003 slow in the third only (no incident yet)."""
    from tests.procs import api_env
    from tests.test_headline import batch

    tables = ", ".join(t.name for t in Base.metadata.sorted_tables)
    with db.transaction(session_factory) as s:
        s.execute(text(f"TRUNCATE {tables} RESTART IDENTITY CASCADE"))
    env = {**api_env(database_url, tmp_path_factory.mktemp("ui-2-of-3"), ADMIN),
           "RINGWATCH_HYSTERESIS_K_BAD": "2", "RINGWATCH_HYSTERESIS_N_WINDOW": "3",
           "RINGWATCH_HYSTERESIS_M_GOOD": "2"}
    url = env["RINGWATCH_API_URL"]
    proc = start_server(env, notifier=False)
    try:
        admin = {"Authorization": f"Bearer {ADMIN}"}
        for slow in ({"node-001": 0.4}, {"node-001": 0.4}, {"node-001": 0.3, "node-003": 0.4}):
            httpx.post(f"{url}/v1/measurements", json=batch(slow), headers=admin,
                       timeout=60).raise_for_status()
        reader = httpx.post(f"{url}/v1/tokens", json={"role": "reader", "name": "ui"},
                            headers=admin).json()["token"]
        yield {"url": url, "reader": reader, "h": {"Authorization": f"Bearer {reader}"},
               "env": env}
    finally:
        stop_server(proc)


def test_every_surface_shows_the_incidents_one_headline(served_2_of_3, page) -> None:
    from tests.procs import cli

    served = served_2_of_3
    (incident,) = httpx.get(f"{served['url']}/v1/findings?status=open", headers=served["h"]).json()
    headline = incident["detail"]["headline"]["text"]
    # Opened by the second cycle (node-001 at 0.4 of its peers), kept through the third.
    assert headline.startswith("allreduce 4 MiB: 8.00 of ") and incident["nodes"] == ["node-001"]
    login(page, served)
    wait_drawn(page, "fleet")
    assert page.locator("#incidents .headline").all_text_contents() == [headline]
    shot(page, "fleet-incident-headline")
    status = cli("status", env={**served["env"], "RINGWATCH_TOKEN": served["reader"]})
    assert headline in status.stdout, status.stdout
    page.goto(f"{served['url']}/ui/#/preflight")
    wait_drawn(page, "preflight")
    page.fill("#pf-nodes", "node-000 node-001 node-002")
    page.click("#preflight-form button[type=submit]")
    wait_drawn(page, "verdict")
    assert page.locator("#verdict-card td.headline").all_text_contents() == [headline]
    shot(page, "preflight-incident-headline")


def test_a_link_slow_once_says_why_it_is_still_ok_on_the_page(served_2_of_3, page) -> None:
    served = served_2_of_3
    links = httpx.get(f"{served['url']}/v1/links?node=node-003", headers=served["h"]).json()
    once = {(link["group_key"], link["op"]) for link in links
            if link["status"] == "ok" and link["ratio"] < 0.7}
    assert once  # slow in the third cycle only: still ok, no incident
    login(page, served, "#/node/node-003")
    wait_drawn(page, "series")
    rows = page.eval_on_selector_all(
        "tr.link-row", "rs => rs.map(r => [r.dataset.group, r.dataset.op, r.dataset.status, "
                       "r.cells[3].textContent])")
    shown = {(g, op): (st, badge) for g, op, st, badge in rows}
    for key in once:
        st, badge = shown[key]
        assert st == "ok" and "slow, 1 of 3 \u2014 opens at 2 of 3" in badge
    # A link that was never slow in its window says nothing more than ok.
    fine = [badge for (g, op), (st, badge) in shown.items() if st == "ok" and (g, op) not in once]
    assert fine and all(badge.strip() == "\u2713 ok" for badge in fine)
    shot(page, "node-003-slow-once-still-ok")


# ---- why: the cause beside (or, without a bandwidth figure, instead of) the headline


@pytest.fixture(scope="module")
def served_why(database_url, session_factory, tmp_path_factory) -> Iterator[dict[str, Any]]:
    """A real API process fed one cycle of a 12 x 8 sim fleet where NCCL took sockets out of
    node-004 and node-007's NIC counts symbol errors (facts: each opens at once)."""
    from ringwatch.agents.sim import SimBackend
    from ringwatch.services.scheduler.cycle import ProbeOptions, run_cycle
    from ringwatch.services.scheduler.shipper import Shipper
    from tests.procs import api_env

    tables = ", ".join(t.name for t in Base.metadata.sorted_tables)
    with db.transaction(session_factory) as s:
        s.execute(text(f"TRUNCATE {tables} RESTART IDENTITY CASCADE"))
    state = tmp_path_factory.mktemp("ui-why")
    env = api_env(database_url, state, ADMIN)
    url = env["RINGWATCH_API_URL"]
    proc = start_server(env, notifier=False)
    try:
        with SimBackend({"nodes": 12, "gpus_per_node": 8, "seed": 3, "faults": [
                {"kind": "transport", "node": "node-004", "transport": "socket"},
                {"kind": "nic_errors", "node": "node-007", "counter": "symbol_error",
                 "per_cycle": 900}]}) as backend:
            cycle = run_cycle(backend, ProbeOptions())
        shipper = Shipper(url, ADMIN, state / "spool")
        assert shipper.ship(cycle.to_batch()) == 0
        shipper.close()
        reader = httpx.post(f"{url}/v1/tokens", json={"role": "reader", "name": "ui"},
                            headers={"Authorization": f"Bearer {ADMIN}"}).json()["token"]
        yield {"url": url, "reader": reader, "h": {"Authorization": f"Bearer {reader}"}}
    finally:
        stop_server(proc)


def test_the_page_says_why(served_why, page) -> None:
    served = served_why
    incidents = httpx.get(f"{served['url']}/v1/findings?status=open", headers=served["h"]).json()
    causes = {f["nodes"][0]: f["detail"]["cause"] for f in incidents}
    assert set(causes) == {"node-004", "node-007"}
    assert causes["node-007"].startswith("mlx5_0 port 1 symbol_error +900 in 300 s")
    login(page, served)
    wait_drawn(page, "fleet")
    shown = page.locator("#incidents .headline").all_text_contents()
    assert sorted(shown) == sorted(causes.values())
    shot(page, "fleet-incident-cause")


# ---- a busy fleet: a job's nodes shown busy, with the job -------------------------------

BUSY_FLEET = {"nodes": 8, "gpus_per_node": 4, "seed": 3, "noise": 0.02,
              "jobs": [{"id": "train-42", "nodes": "node-[002-004]", "cycles": [1, 9],
                        "traffic": {"nvlink": 0.5, "network": 0.5}}]}


@pytest.fixture(scope="module")
def served_busy(database_url, session_factory, tmp_path_factory) -> Iterator[dict[str, Any]]:
    """A real API process fed one scheduled cycle of a sim fleet with a job on three nodes:
    they are left alone and shown busy."""
    from tests.procs import api_env

    tables = ", ".join(t.name for t in Base.metadata.sorted_tables)
    with db.transaction(session_factory) as s:
        s.execute(text(f"TRUNCATE {tables} RESTART IDENTITY CASCADE"))
    state = tmp_path_factory.mktemp("ui-busy")
    env = api_env(database_url, state, ADMIN)
    url = env["RINGWATCH_API_URL"]
    proc = start_server(env, notifier=False)
    client = SchedulerApi(url, ADMIN, "ui-busy")
    try:
        shipper = Shipper(url, ADMIN, state / "spool")
        assert run_scheduler(SimBackend(BUSY_FLEET), shipper, ProbeOptions(), interval_s=3600,
                             once=True, api=client) == 1
        admin = {"Authorization": f"Bearer {ADMIN}"}
        reader = httpx.post(f"{url}/v1/tokens", json={"role": "reader", "name": "ui"},
                            headers=admin).json()["token"]
        yield {"url": url, "reader": reader, "h": {"Authorization": f"Bearer {reader}"}}
    finally:
        client.close()
        stop_server(proc)


def test_the_fleet_shows_a_jobs_nodes_busy_and_the_node_page_names_the_job(served_busy, page) -> None:
    served = served_busy
    login(page, served)
    wait_drawn(page, "fleet")
    cells = page.eval_on_selector_all(
        ".cell[data-node]", "cs => cs.map(c => [c.dataset.node, c.dataset.state, c.getAttribute('aria-label')])")
    busy = {name for name, state, _ in cells if state == "busy"}
    assert busy == {"node-002", "node-003", "node-004"}
    assert all("busy" in label for name, _, label in cells if name in busy)
    page.select_option("#filter-state", "busy")
    visible = page.eval_on_selector_all(".cell[data-node]:not([hidden])", "cs => cs.map(c => c.dataset.node)")
    assert set(visible) == busy
    shot(page, "fleet-busy-nodes")
    page.click(".cell[data-node='node-003']")
    wait_drawn(page, "node")  # never probed: busy since the first cycle
    header = page.text_content("#view") or ""
    assert "busy: job train-42" in header and "per sim" in header
    shot(page, "node-busy-with-its-job")


# ---- a wider fleet: thinned axis names, and auto-refresh --------------------------------

WIDE = 80


@pytest.fixture(scope="module")
def served_wide(database_url, session_factory, tmp_path_factory) -> Iterator[dict[str, Any]]:
    """A real API process that reacts to one cycle (hysteresis 1 of 1), fed one batch of an
    80-node fleet with every node pair probed and node-017 slow."""
    from tests.procs import api_env

    tables = ", ".join(t.name for t in Base.metadata.sorted_tables)
    with db.transaction(session_factory) as s:
        s.execute(text(f"TRUNCATE {tables} RESTART IDENTITY CASCADE"))
    env = {**api_env(database_url, tmp_path_factory.mktemp("ui-wide"), ADMIN),
           "RINGWATCH_HYSTERESIS_K_BAD": "1", "RINGWATCH_HYSTERESIS_N_WINDOW": "1",
           "RINGWATCH_HYSTERESIS_M_GOOD": "1"}
    url = env["RINGWATCH_API_URL"]
    proc = start_server(env, notifier=False)
    try:
        admin = {"Authorization": f"Bearer {ADMIN}"}
        httpx.post(f"{url}/v1/measurements", json=fleet_batch(slow_node="node-017", nodes=WIDE),
                   headers=admin, timeout=120).raise_for_status()
        reader = httpx.post(f"{url}/v1/tokens", json={"role": "reader", "name": "ui"},
                            headers=admin).json()["token"]
        yield {"url": url, "reader": reader, "admin": admin,
               "h": {"Authorization": f"Bearer {reader}"}}
    finally:
        stop_server(proc)


def test_a_wide_maps_names_are_thinned_to_fit_and_fill_in_when_zoomed(served_wide, page) -> None:
    served = served_wide
    login(page, served, "#/network")
    wait_drawn(page, "network")
    nodes = httpx.get(f"{served['url']}/v1/fleet/pairs", headers=served["h"],
                      timeout=60).json()["nodes"]
    assert len(nodes) == WIDE
    rows, cols = axis_labels(page, "rows"), axis_labels(page, "cols")
    step = int(page.get_attribute("#matrix-rows", "data-step") or 0)
    # Too many to write each: every step-th, a round number, the same on both axes.
    assert step in (2, 5, 10) and rows == cols == [(i, nodes[i]) for i in range(0, WIDE, step)]
    geo = label_geometry(page)
    for a, b in zip(geo["rows"], geo["rows"][1:], strict=False):
        assert a["bottom"] <= b["top"]  # no two names overlap
    for a, b in zip(geo["cols"], geo["cols"][1:], strict=False):
        assert a["right"] <= b["left"]
    shot(page, "network-wide-axes-thinned")
    for _ in range(3):
        page.click("button:text('zoom in')")
    shown = axis_labels(page, "rows")
    first = shown[0][0]
    assert page.get_attribute("#matrix-rows", "data-step") == "1"
    assert shown == axis_labels(page, "cols") == [(i, nodes[i]) for i in range(first, first + 10)]
    shot(page, "network-wide-axes-zoomed")


def test_the_names_choice_is_kept_in_the_address(served_wide, page) -> None:
    login(page, served_wide)
    wait_drawn(page, "fleet")
    assert page.is_checked("#fleet-names")  # 80 nodes: at most NAMED_CELLS (128) are named
    page.uncheck("#fleet-names")
    page.fill("#filter", "node-04")
    address = page.evaluate("location.href")
    assert "names=0" in address and "q=node-04" in address
    page.goto("about:blank")
    page.goto(address)
    wait_drawn(page, "fleet")
    assert not page.is_checked("#fleet-names") and page.input_value("#filter") == "node-04"
    shown = page.eval_on_selector_all(".cell[data-node]:not([hidden])", "cs => cs.map(c => c.dataset.node)")
    assert shown == [f"node-04{i}" for i in range(10)]


def test_auto_refresh_draws_each_page_again_in_place(served_wide, page) -> None:
    served = served_wide
    page.clock.install()
    login(page, served)
    wait_drawn(page, "fleet")
    page.select_option("#filter-state", "degraded")

    def degraded() -> set[str]:
        return set(page.eval_on_selector_all(".cell[data-node]:not([hidden])",
                                             "cs => cs.map(c => c.dataset.node)"))

    assert degraded() == {"node-017"}
    assert page.is_visible("#auto-refresh") and not page.is_checked("#auto-refresh")
    page.check("#auto-refresh")
    # The fleet changes: node-017 is well again, node-042 slow.
    httpx.post(f"{served['url']}/v1/measurements", json=fleet_batch(slow_node="node-042", nodes=WIDE),
               headers=served["admin"], timeout=120).raise_for_status()
    page.clock.run_for(31_000)
    page.wait_for_selector("html[data-refreshes='1']", timeout=30_000)
    # Drawn again in place, the filter kept: what the fleet is now.
    assert page.input_value("#filter-state") == "degraded" and degraded() == {"node-042"}
    assert (page.text_content("#updated") or "").startswith("updated ")
    shot(page, "fleet-refreshed")

    def refreshed() -> None:
        before = int(page.get_attribute("html", "data-refreshes") or 0)
        page.clock.run_for(31_000)
        page.wait_for_selector(f"html[data-refreshes='{before + 1}']", timeout=30_000)

    # Every page has the toggle, kept for the tab. A node's page keeps the link picked.
    page.goto(f"{served['url']}/ui/#/network")
    wait_drawn(page, "network")
    assert page.is_checked("#auto-refresh")
    page.goto(f"{served['url']}/ui/#/node/node-042")
    wait_drawn(page, "series")
    assert page.is_checked("#auto-refresh")
    page.click("tr.link-row >> nth=3")
    picked = page.eval_on_selector("tr.link-row.selected", "r => [r.dataset.group, r.dataset.op]")
    refreshed()
    assert page.eval_on_selector("tr.link-row.selected", "r => [r.dataset.group, r.dataset.op]") == picked
    # On the preflight form a refresh leaves what was typed.
    page.goto(f"{served['url']}/ui/#/preflight")
    wait_drawn(page, "preflight")
    page.fill("#pf-nodes", "node-[000-003]")
    refreshed()
    assert page.input_value("#pf-nodes") == "node-[000-003]"

    # Unticked, nothing is drawn again.
    count = page.get_attribute("html", "data-refreshes")
    page.uncheck("#auto-refresh")
    page.clock.run_for(120_000)
    assert page.get_attribute("html", "data-refreshes") == count
