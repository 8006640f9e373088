"""Security headers on every answer, /docs served whole from the API (no CDN, no inline
script), and the web page drawn around a malformed record.

The headers and the /docs page through the in-process app; then, in headless Chromium
against a real API process (skipped without a chromium): /docs renders with every request
off the server refused and no Content-Security-Policy violation, and the home view shows
the other findings beside one whose detail is not what the page expects."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from html.parser import HTMLParser
from typing import Any
from urllib.parse import urljoin, urlsplit

import httpx
import pytest
from sqlalchemy import text

from ringwatch.services.store import db
from ringwatch.services.store.health import open_finding
from ringwatch.services.store.models import Base
from tests.api_fixtures import api_client, fleet_batch, measurement
from tests.procs import free_port, start_server, stop_server

ADMIN = "rw_docs_admin_token_for_tests"
SECURITY_HEADERS = {"x-content-type-options": "nosniff", "referrer-policy": "no-referrer",
                    "x-frame-options": "DENY"}


def assert_security_headers(resp: httpx.Response) -> None:
    for name, value in SECURITY_HEADERS.items():
        assert resp.headers.get(name) == value, (resp.request.url, name, resp.headers)
    policy = {d.split()[0]: d.split()[1:] for d in resp.headers["content-security-policy"].split(";")
              if d.strip()}
    assert policy["script-src"] == ["'self'"] and policy["style-src"] == ["'self'"]
    assert policy["frame-ancestors"] == ["'none'"]
    assert "unsafe-inline" not in resp.headers["content-security-policy"]


# ---- through the app


def test_every_kind_of_answer_carries_the_security_headers(api, clean_db) -> None:
    answers = {
        "/ui/": api.get("/ui/"),
        "/ui/app.js": api.get("/ui/app.js"),
        "/docs": api.get("/docs"),
        "/openapi.json": api.get("/openapi.json"),
        "a JSON route": api.get("/v1/fleet/nodes", headers=api.h["reader"]),
        "401": api.get("/v1/fleet/nodes"),
        "404": api.get("/v1/no-such-route", headers=api.h["reader"]),
    }
    with api_client(clean_db, {"max_body_bytes": 1024}) as small:
        answers["413"] = small.post("/v1/measurements", content=b"x" * 4096,
                                    headers={"Content-Type": "application/json"})
    codes = {k: r.status_code for k, r in answers.items()}
    assert codes == {"/ui/": 200, "/ui/app.js": 200, "/docs": 200, "/openapi.json": 200,
                     "a JSON route": 200, "401": 401, "404": 404, "413": 413}
    for resp in answers.values():
        assert_security_headers(resp)


class _Page(HTMLParser):
    """The scripts, stylesheets and every URL-bearing attribute of a page."""

    def __init__(self) -> None:
        super().__init__()
        self.scripts: list[dict[str, str | None]] = []
        self.inline_script = ""
        self.urls: list[str] = []
        self.handlers: list[str] = []
        self._in_script = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        found = dict(attrs)
        self.urls += [v for k, v in attrs if k in ("src", "href", "action") and v]
        self.urls += [v for k, v in attrs if k.startswith("data-") and v and "url" in k]
        self.handlers += [k for k, _ in attrs if k.startswith("on")]
        if tag == "script":
            self.scripts.append(found)
            self._in_script = True

    def handle_endtag(self, tag: str) -> None:
        if tag == "script":
            self._in_script = False

    def handle_data(self, data: str) -> None:
        if self._in_script:
            self.inline_script += data.strip()


def parse(html: str) -> _Page:
    page = _Page()
    page.feed(html)
    return page


def test_docs_loads_only_files_of_this_server_and_runs_no_inline_script(api) -> None:
    resp = api.get("/docs")
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/html")
    page = parse(resp.text)
    assert page.scripts and all(s.get("src") for s in page.scripts)
    assert page.inline_script == "" and page.handlers == []
    # Nothing absolute: no CDN, no other host, not even this one by name.
    assert not re.search(r"(https?:)?//", resp.text), resp.text
    kinds = {"js": "javascript", "css": "text/css", "json": "application/json"}
    fetched = set()
    for ref in page.urls:
        url = urlsplit(urljoin("http://testserver/docs", ref))
        assert url.netloc == "testserver"
        asset = api.get(url.path)  # without a token: the page's own files are public
        assert asset.status_code == 200, url.path
        assert kinds[url.path.rsplit(".", 1)[1]] in asset.headers["content-type"], url.path
        fetched.add(url.path)
    assert {"/docs/assets/swagger-ui-bundle.js", "/docs/assets/swagger-ui.css",
            "/docs/assets/init.js", "/openapi.json"} <= fetched
    assert "SwaggerUIBundle(" in api.get("/docs/assets/init.js").text


def test_redoc_and_fastapis_cdn_page_are_gone(api) -> None:
    # /redoc loaded its script from a CDN: it is no longer served, nor public.
    assert api.get("/redoc").status_code == 401
    assert api.get("/redoc", headers=api.h["reader"]).status_code == 404
    assert api.get("/docs/assets/nothing.js").status_code == 404


# ---- in a browser, against a real API process


@pytest.fixture(scope="module")
def served(database_url, session_factory, tmp_path_factory) -> Iterator[dict[str, Any]]:
    """A real API process on an emptied database with one slow node's findings and one
    finding stored with a detail the page does not expect (``gpus`` a string, figures not
    numbers). Returns the API's URL, a reader token and the findings' nodes."""
    tables = ", ".join(t.name for t in Base.metadata.sorted_tables)
    with db.transaction(session_factory) as s:
        s.execute(text(f"TRUNCATE {tables} RESTART IDENTITY CASCADE"))
    url = f"http://127.0.0.1:{free_port()}"
    env = {**os.environ, "RINGWATCH_DATABASE_URL": database_url, "RINGWATCH_API_URL": url,
           "RINGWATCH_BOOTSTRAP_ADMIN_TOKEN": ADMIN,
           "RINGWATCH_STATE_DIR": str(tmp_path_factory.mktemp("docs")),
           "RINGWATCH_HYSTERESIS_K_BAD": "1", "RINGWATCH_HYSTERESIS_N_WINDOW": "1",
           "RINGWATCH_HYSTERESIS_M_GOOD": "1"}
    proc = start_server(env, notifier=False)
    try:
        admin = {"Authorization": f"Bearer {ADMIN}"}
        batch = fleet_batch(slow_node="node-002")
        # GPU pairs, one slow, so the node view draws its heatmap with a glyph (styled from JS).
        batch["measurements"] += [measurement([f"node-00{i}/0", f"node-00{i}/2"],
                                              8.0 if i == 2 else 20.0, scope="gpu_pair")
                                  for i in range(4)]
        httpx.post(f"{url}/v1/measurements", json=batch, headers=admin).raise_for_status()
        with db.transaction(session_factory) as s:
            open_finding(s, kind="nvlink_bad_record", group_key=None, op=None, nodes=["node-001"],
                         severity="warning", detail={"node": "node-001", "gpus": "abc",
                                                     "measured_gbs": "fast",
                                                     "expected_gbs": {"not": "a number"}})
        reader = httpx.post(f"{url}/v1/tokens", json={"role": "reader", "name": "docs"},
                            headers=admin).json()["token"]
        yield {"url": url, "reader": reader, "h": {"Authorization": f"Bearer {reader}"}}
    finally:
        stop_server(proc)


@pytest.fixture
def offline_page(browser, served) -> Iterator[tuple[Any, dict[str, list[str]]]]:
    """A page that can reach the API's own address only; what it tried elsewhere, what the
    console said and what failed to run are recorded."""
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    page = context.new_page()
    seen: dict[str, list[str]] = {"elsewhere": [], "console": [], "errors": []}
    own = urlsplit(served["url"]).netloc

    def route(r: Any) -> None:
        if urlsplit(r.request.url).netloc == own:
            r.continue_()
        else:
            seen["elsewhere"].append(r.request.url)
            r.abort()

    page.route("**/*", route)
    page.on("console", lambda m: seen["console"].append(f"{m.type}: {m.text}"))
    page.on("pageerror", lambda e: seen["errors"].append(str(e)))
    yield page, seen
    context.close()


def csp_violations(seen: dict[str, list[str]]) -> list[str]:
    return [m for m in seen["console"] if "Content Security Policy" in m]


def test_docs_render_offline_under_the_policy(served, offline_page) -> None:
    page, seen = offline_page
    page.goto(f"{served['url']}/docs")
    page.wait_for_selector(".opblock", timeout=30_000)
    operations = page.locator(".opblock").count()
    assert operations >= 10, operations
    assert page.locator(".opblock-summary-path", has_text="/v1/fleet/nodes").count() >= 1
    assert seen["elsewhere"] == [] and seen["errors"] == []
    assert csp_violations(seen) == []


def test_home_view_draws_the_other_findings_beside_a_bad_one(served, offline_page) -> None:
    page, seen = offline_page
    page.goto(f"{served['url']}/ui/")
    page.fill("#token", served["reader"])
    page.click("#login-form button[type=submit]")
    page.wait_for_selector("html[data-drawn='fleet'], html[data-drawn='error']", timeout=30_000)
    assert "Could not load" not in (page.text_content("#view") or "")
    assert page.get_attribute("html", "data-drawn") == "fleet"
    open_ = httpx.get(f"{served['url']}/v1/findings?status=open", headers=served["h"]).json()
    assert len(open_) >= 2
    items = page.locator("#incidents li")
    assert items.count() == len(open_)
    listed = page.text_content("#incidents") or ""
    assert "node-002" in listed  # the slow node's findings, drawn as usual
    bad = items.filter(has_text="nvlink_bad_record")
    assert bad.count() == 1
    # The bad record is drawn with what can be shown: its node, its gpus as text, no figures.
    assert "node-001" in (bad.text_content() or "") and "GPUs abc" in (bad.text_content() or "")
    assert "\u2013 of \u2013 GB/s" in (bad.text_content() or "")
    # A node view (its SVG heatmap styles its glyphs) is drawn under the policy as well.
    page.click(".cell[data-node='node-002']")
    page.wait_for_selector("html[data-drawn='series']", timeout=30_000)
    assert page.locator("#gpu-heatmap rect[data-status='degraded']").count() == 2
    assert seen["elsewhere"] == [] and seen["errors"] == []
    assert csp_violations(seen) == []
