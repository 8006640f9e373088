"""The web page at fleet scale: how long each page of /ui takes, in headless chromium, until
its content is drawn, on a sim fleet of 1024 x 8 fed through the real scheduler, API and
Postgres (bench.monitoring's Fleet: a fresh database and API process).

"Drawn" is the moment the page marks itself drawn (``html[data-drawn]``, set once the view's
cells, map, chart or form are on screen), measured from the start of the navigation: the
page's own load, its API calls and its drawing. Each page is loaded cold (a new browser
context) several times; printed: the median and the slowest, and what the API sent.

    python -m bench.run ui            # 1024 x 8, 3 monitoring cycles, 5 loads per page
    python -m bench.run ui --quick    # 128 x 8, 2 cycles, 3 loads
"""

from __future__ import annotations

import json
import os
import random
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

from bench.monitoring import Fleet, scenario
from tests.api_fixtures import decode_pairs, measurement

# The pages, each by its address and the view that marks it drawn.
PAGES = (("fleet", "#/fleet", "fleet"), ("node", "#/node/{node}", "series"),
         ("network", "#/network", "network"), ("series", "#/series?pair={pair}", "series"),
         ("preflight form", "#/preflight", "preflight"))


def load_ms(browser: Any, url: str, token: str, drawn: str) -> float:
    """Milliseconds from navigation start until the page marks ``drawn``, in a new context."""
    context = browser.new_context(viewport={"width": 1600, "height": 1100})
    context.add_init_script(f"sessionStorage.setItem('ringwatch.token', {json.dumps(token)})")
    page = context.new_page()
    try:
        page.goto(url)
        page.wait_for_selector(f"html[data-drawn='{drawn}']", timeout=120_000)
        return float(page.evaluate("window.__ringwatchDrawnAt"))
    finally:
        context.close()


def verdict_ms(browser: Any, base: str, token: str, nodes: list[str]) -> float:
    """Milliseconds from submitting the preflight form (every node) to its verdict drawn."""
    context = browser.new_context()
    context.add_init_script(f"sessionStorage.setItem('ringwatch.token', {json.dumps(token)})")
    page = context.new_page()
    try:
        page.goto(f"{base}/ui/#/preflight")
        page.wait_for_selector("html[data-drawn='preflight']")
        page.fill("#pf-nodes", "\n".join(nodes))
        started = page.evaluate("performance.now()")
        page.click("#preflight-form button[type=submit]")
        page.wait_for_selector("html[data-drawn='verdict']", timeout=60_000)
        return float(page.evaluate("window.__ringwatchDrawnAt")) - float(started)
    finally:
        context.close()


def answered_at_once(fleet: Fleet, states: list[dict[str, Any]]) -> list[str]:
    """Every node, or where some lack fresh results (a hung node's cycle shipped none, and
    no scheduler runs between the bench's cycles to probe them), the nodes with links."""
    everyone = [n["name"] for n in states]
    if fleet.api.post("/v1/preflight", json={"nodes": everyone}).status_code == 200:
        return everyone
    return [n["name"] for n in states if n["links"] and not n["skipped_reason"]]


def probe_every_pair(fleet: Fleet, names: list[str], batch_size: int = 50_000) -> float:
    """Ship one inter-node AllReduce of GPU 0 of every node pair not probed yet (what a
    long-running fleet's map holds once every matching has come round), through
    POST /v1/measurements; the seconds it took."""
    have = {tuple(sorted((names[i], names[j])))
            for i, j in decode_pairs(fleet.api.get("/v1/fleet/pairs").json())}
    rng = random.Random(5)
    todo = [(a, b) for i, a in enumerate(names) for b in names[i + 1:] if (a, b) not in have]
    t0 = time.monotonic()
    for start in range(0, len(todo), batch_size):
        ms = [measurement([f"{a}/0", f"{b}/0"], 45.0 * rng.uniform(0.97, 1.03))
              for a, b in todo[start:start + batch_size]]
        resp = fleet.api.post("/v1/measurements", json={
            "batch_id": f"every-pair-{start}", "backend": "sim", "measurements": ms})
        resp.raise_for_status()
    return time.monotonic() - t0


def payloads(fleet: Fleet, node: str) -> list[tuple[str, int, float]]:
    """What the API sends for the page's heaviest reads: bytes and server wall time."""
    out = []
    for path in ("/v1/fleet/nodes", "/v1/fleet/pairs", "/v1/findings?status=open&limit=500",
                 f"/v1/nodes/{node}", f"/v1/links?node={node}&scope=gpu_pair"):
        t0 = time.perf_counter()
        resp = fleet.api.get(path)
        out.append((path, len(resp.content), time.perf_counter() - t0))
    return out


def main(flags: list[str]) -> None:
    from playwright.sync_api import sync_playwright

    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        print("no chromium on PATH (apt-get install chromium); nothing measured")
        return
    quick = "--quick" in flags
    nodes, cycles, loads = (128, 2, 3) if quick else (1024, 3, 5)
    state = Path(".ringwatch") / f"bench-ui-{os.getpid()}"
    state.mkdir(parents=True, exist_ok=True)
    sc = scenario(nodes, random.Random(20261124))
    path = state / "fleet.json"
    path.write_text(json.dumps(sc))
    fleet = Fleet(path, state / "scheduler")
    try:
        walls = [fleet.cycle() for _ in range(cycles)]
        base, token = fleet.env["RINGWATCH_API_URL"], fleet.env["RINGWATCH_TOKEN"]
        states = fleet.api.get("/v1/fleet/nodes").json()["nodes"]
        names = [n["name"] for n in states]
        pairs = decode_pairs(fleet.api.get("/v1/fleet/pairs").json())
        degraded = next((n["name"] for n in states if n["state"] == "degraded"), names[0])
        i, j = next((p for p, (_, bad) in pairs.items() if bad), next(iter(pairs)))
        pair = f"{names[i]},{names[j]}"
        links = sum(fleet.api.get("/v1/health").json()["links"].values())
        print(f"\n{nodes} x {sc['gpus_per_node']} sim fleet, {len(sc['faults'])} faults, "
              f"{cycles} monitoring cycles ({sum(walls) / len(walls):.1f} s each): {links} links, "
              f"{len(pairs)} of {nodes * (nodes - 1) // 2} node pairs probed, "
              f"{sum(n['state'] == 'degraded' for n in states)} nodes degraded")
        print(f"  {'page':<16}{'drawn, median ms':>18}{'slowest ms':>12}  (cold, {loads} loads each)")
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
            try:
                load_ms(browser, f"{base}/ui/#/fleet", token, "fleet")  # the browser's own start-up
                for name, hash_, drawn in PAGES:
                    url = f"{base}/ui/{hash_.format(node=degraded, pair=pair)}"
                    times = [load_ms(browser, url, token, drawn) for _ in range(loads)]
                    print(f"  {name:<16}{statistics.median(times):>18.0f}{max(times):>12.0f}")
                asked = answered_at_once(fleet, states)
                verdicts = [verdict_ms(browser, base, token, asked) for _ in range(loads)]
                print(f"  {'preflight verdict':<16}{statistics.median(verdicts):>18.0f}"
                      f"{max(verdicts):>12.0f}  (submit to verdict drawn, {len(asked)} nodes)")
            finally:
                browser.close()
        print(f"  {'API read':<44}{'bytes':>10}{'ms':>8}")
        for path_, size, wall in payloads(fleet, degraded):
            print(f"  {path_:<44}{size:>10}{wall * 1000:>8.0f}")
        took = probe_every_pair(fleet, names)
        dense = fleet.api.get("/v1/fleet/pairs")
        every = decode_pairs(dense.json())
        print(f"  every node pair probed ({len(every)} pairs, "
              f"{sum(bad for _, bad in every.values())} "
              f"degraded, shipped in {took:.0f} s): /v1/fleet/pairs sends "
              f"{len(dense.content)} bytes in {dense.elapsed.total_seconds() * 1000:.0f} ms")
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
            try:
                load_ms(browser, f"{base}/ui/#/fleet", token, "fleet")  # start-up, as above
                times = [load_ms(browser, f"{base}/ui/#/network", token, "network")
                         for _ in range(loads)]
            finally:
                browser.close()
        print(f"  {'network, full':<16}{statistics.median(times):>18.0f}{max(times):>12.0f}")
    finally:
        fleet.close()
