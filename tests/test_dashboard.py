"""The Grafana dashboard (deploy/grafana) asks for what /metrics serves: every metric its
PromQL names is in a scrape of the real app with real data, with every label the query
filters or groups by. It imports into any Grafana: no panel names a datasource but through
its `datasource` variable, every query follows the `cluster` variable, and a node's links
are found by their node labels, whatever their group key."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.api_fixtures import REACT_AT_ONCE, api_client, fleet_batch, measurement

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "deploy/grafana/dashboards/ringwatch.json"
DATASOURCES = ROOT / "deploy/grafana/provisioning/datasources"

# ------------------------------------------------------------------ reading PromQL

_TOKEN = re.compile(r"""
    (?P<ws>\s+)
  | (?P<string>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*'|`[^`]*`)
  | (?P<number>(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)
  | (?P<ident>[A-Za-z_:][A-Za-z0-9_:]*)
  | (?P<var>\$\{[^}]*\}|\$[A-Za-z_]\w*)
  | (?P<op>=~|!~|==|!=|<=|>=|[-+*/%^<>=,(){}\[\]])
""", re.VERBOSE)
_OPEN = {"(": ")", "[": "]", "{": "}"}
# Words of the language that are no metric: binary operators and modifiers.
_KEYWORDS = {"and", "or", "unless", "bool", "offset", "atan2", "inf", "nan"}
_GROUPING = {"by", "without"}
_MATCHING = {"on", "ignoring", "group_left", "group_right"}
# Clauses that name labels to leave out: they need none of them.
_EXCLUDING = {"without", "ignoring"}
# Labels Prometheus adds to every series it scrapes (``cluster`` where the scrape config or
# relabelling sets one), never the exporter's.
TARGET_LABELS = frozenset({"job", "instance", "cluster"})
# What every panel and variable names as its datasource: the dashboard's own variable.
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}


@dataclass
class Selector:
    name: str
    at: int  # token index
    labels: set[str] = field(default_factory=set)  # filtered by its matchers


@dataclass
class Query:
    """What one expression asks of the scrape: its metrics, the labels each filters on,
    and the labels each must carry to be grouped or matched as the expression says."""

    selectors: list[Selector]
    needs: dict[str, set[str]]  # metric -> labels grouped or matched on


def _tokens(expr: str) -> list[tuple[str, str]]:
    out, pos = [], 0
    while pos < len(expr):
        m = _TOKEN.match(expr, pos)
        assert m, f"cannot read {expr[pos:]!r} in {expr!r}"
        pos = m.end()
        if m.lastgroup != "ws":
            assert m.lastgroup is not None
            out.append((m.lastgroup, m.group()))
    return out


def _pairs(tokens: list[tuple[str, str]]) -> dict[int, int]:
    """Each bracket's index to its partner's, both ways."""
    stack: list[int] = []
    pairs: dict[int, int] = {}
    for i, (kind, text) in enumerate(tokens):
        if kind == "op" and text in _OPEN:
            stack.append(i)
        elif kind == "op" and text in _OPEN.values():
            j = stack.pop()
            assert _OPEN[tokens[j][1]] == text, "mismatched brackets"
            pairs[i], pairs[j] = j, i
    assert not stack, "unclosed bracket"
    return pairs


def _label_list(tokens: list[tuple[str, str]], start: int, end: int) -> set[str]:
    return {text for kind, text in tokens[start + 1:end] if kind == "ident"}


def read_promql(expr: str) -> Query:
    tokens = _tokens(expr)
    pairs = _pairs(tokens)
    selectors: list[Selector] = []
    clauses: list[tuple[set[str], range]] = []
    i = 0
    while i < len(tokens):
        kind, text = tokens[i]
        following = tokens[i + 1][1] if i + 1 < len(tokens) else ""
        if kind == "op" and text == "[":  # a range or subquery: durations, Grafana's $__…
            i = pairs[i] + 1
            continue
        if kind == "op" and text == "{":
            raise AssertionError(f"a selector without a metric name in {expr!r}")
        if kind != "ident" or text.lower() in _KEYWORDS:
            i += 1
            continue
        word = text.lower()
        if word in _GROUPING | _MATCHING:
            assert following == "(", f"{text} without its label list in {expr!r}"
            close = pairs[i + 1]
            labels = set() if word in _EXCLUDING else _label_list(tokens, i + 1, close)
            if word in _MATCHING:
                clauses.append((labels, range(len(tokens))))
            elif tokens[i - 1][0] == "ident":  # sum by (x) (arg)
                clauses.append((labels, range(close + 1, pairs[close + 1])))
            else:  # sum (arg) by (x)
                clauses.append((labels, range(pairs[i - 1], i)))
            i = close + 1
            continue
        if following == "(" or (following.lower() in _GROUPING and i + 2 < len(tokens)):
            i += 1  # a function or an aggregation
            continue
        selector = Selector(text, i)
        if following == "{":
            close = pairs[i + 1]
            body = tokens[i + 2:close]
            for j in range(0, len(body), 4):  # label, operator, "value", [","]
                assert body[j][0] == "ident" and body[j + 2][0] == "string", expr
                selector.labels.add(body[j][1])
            i = close
        selectors.append(selector)
        i += 1
    needs: dict[str, set[str]] = {s.name: set() for s in selectors}
    for labels, scope in clauses:
        for s in selectors:
            if s.at in scope:
                needs[s.name] |= labels
    return Query(selectors, needs)


_LABEL_VALUES = re.compile(r"^label_values\((?P<selector>.+),\s*(?P<label>[A-Za-z_]\w*)\s*\)$")


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def panels(board: dict) -> Iterator[dict]:
    for p in board["panels"]:
        yield p
        yield from p.get("panels", [])


def query_variables(board: dict) -> list[dict]:
    """The variables that query Prometheus (the datasource variable lists datasources)."""
    return [v for v in board["templating"]["list"] if v["type"] == "query"]


def variable(board: dict, name: str) -> dict:
    [found] = [v for v in board["templating"]["list"] if v["name"] == name]
    return found


def expressions(board: dict) -> Iterator[tuple[str, Query]]:
    """Every PromQL expression of the dashboard (panel targets and variables' queries),
    each with what it asks of the scrape."""
    for p in panels(board):
        for t in p.get("targets", []):
            yield f"panel {p['title']!r}", read_promql(t["expr"])
    for var in query_variables(board):
        query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
        m = _LABEL_VALUES.match(query)
        assert m, f"variable {var['name']}: {query!r} is no label_values(metric, label)"
        q = read_promql(m["selector"])
        for s in q.selectors:
            q.needs[s.name].add(m["label"])
        yield f"variable {var['name']!r}", q


Labels = dict[str, set[str]]


def sample_labels(body: str) -> Labels:
    """Each sample name of a scrape (``_total``, ``_bucket`` and the like included, as
    Prometheus stores them) with the label names its samples carry."""
    out: Labels = {}
    for family in text_string_to_metric_families(body):
        for s in family.samples:
            out.setdefault(s.name, set()).update(s.labels)
    return out


def problems(where: str, query: Query, scraped: Labels) -> list[str]:
    found = []
    for s in query.selectors:
        if s.name not in scraped:
            found.append(f"{where}: {s.name} is not in the scrape")
            continue
        for label in sorted((s.labels | query.needs[s.name]) - scraped[s.name] - TARGET_LABELS):
            found.append(f"{where}: {s.name} has no label {label}")
    return found


# ------------------------------------------------------------------ the reader itself


def test_the_reader_finds_metrics_and_the_labels_they_must_carry() -> None:
    q = read_promql("histogram_quantile(0.9, max by (le, answered) "
                    "(rate(ringwatch_preflight_latency_seconds_bucket[$__rate_interval])))")
    assert [s.name for s in q.selectors] == ["ringwatch_preflight_latency_seconds_bucket"]
    assert q.needs == {"ringwatch_preflight_latency_seconds_bucket": {"le", "answered"}}

    q = read_promql('max by (scope, op, members) (ringwatch_link_busbw_gbs{scope=~"$scope", '
                    'members=~"(.*,)?${node:regex}/.*"}) and on (scope, op, members) '
                    'bottomk(10, ringwatch_link_ratio) / sum(ringwatch_links) by (status) '
                    "- time() > 0.5")
    assert [(s.name, s.labels) for s in q.selectors] == [
        ("ringwatch_link_busbw_gbs", {"scope", "members"}), ("ringwatch_link_ratio", set()),
        ("ringwatch_links", set())]
    assert q.needs["ringwatch_link_ratio"] == {"scope", "op", "members"}
    assert q.needs["ringwatch_links"] == {"scope", "op", "members", "status"}

    q = read_promql("max without (instance, pod) (ringwatch_node_healthy) == 0 "
                    "or ignoring (kind) ringwatch_open_findings")
    assert q.needs == {"ringwatch_node_healthy": set(), "ringwatch_open_findings": set()}

    scraped = {"ringwatch_links": {"status"}, "ringwatch_link_ratio": {"scope", "op"}}
    assert problems("q", read_promql("sum by (kind) (ringwatch_links) + ringwatch_link_ratio"
                                     '{members="a"} + ringwatch_nope'), scraped) == [
        "q: ringwatch_links has no label kind", "q: ringwatch_link_ratio has no label members",
        "q: ringwatch_nope is not in the scrape"]


# ------------------------------------------------------------------ against a real scrape


def fail_unexpectedly() -> None:
    raise RuntimeError("a handler's own bug")


@pytest.fixture
def scraped(clean_db) -> Labels:
    """A scrape of a fleet with a degraded node, an open incident, a GPU pair, a world
    group (with a hardware figure, so it has a ratio), a scheduler's spool, duty cycles, a
    preflight answered from stored results, and a route whose handler raised."""
    with api_client(clean_db, {**REACT_AT_ONCE, "metrics_cache_s": 0}) as api:
        batch = fleet_batch(slow_node="node-002")
        world = measurement([f"node-00{i}/{g}" for i in range(4) for g in range(2)], 10.0,
                            scope="world")
        batch["measurements"] += [
            measurement(["node-001/0", "node-001/1"], 20.0, scope="gpu_pair"),
            {**world, "preset_gbs": 10.0}]
        batch["duty_cycle"] = {f"node-{i:03d}": 0.01 * (i + 1) for i in range(4)}
        batch["shipper"] = {"host": "sched-a", "pending": 0, "failed": 0, "rejected": 0}
        api.post("/v1/measurements", json=batch, headers=api.h["agent"]).raise_for_status()
        api.post("/v1/measurements", json=fleet_batch(nodes=2, prefix="spare"),
                 headers=api.h["agent"]).raise_for_status()
        api.post("/v1/preflight", json={"nodes": ["node-000", "node-001"]},
                 headers=api.h["reader"]).raise_for_status()
        api.app.add_api_route("/v1/fails", fail_unexpectedly)
        with pytest.raises(RuntimeError):
            api.get("/v1/fails", headers=api.h["reader"])
        resp = api.get("/metrics")
        assert resp.status_code == 200
        return sample_labels(resp.text)


def test_every_query_names_metrics_and_labels_the_scrape_has(scraped: Labels) -> None:
    board = dashboard()
    found = [p for where, q in expressions(board) for p in problems(where, q, scraped)]
    assert found == []
    # The dashboard shows what the fleet's operators asked for.
    used = {s.name for _, q in expressions(board) for s in q.selectors}
    assert {"ringwatch_node_healthy", "ringwatch_node_open_findings", "ringwatch_open_findings",
            "ringwatch_links", "ringwatch_link_busbw_bytes_per_second", "ringwatch_link_ratio",
            "ringwatch_node_duty_cycle", "ringwatch_ingested_batches_total",
            "ringwatch_ingested_measurements_total", "ringwatch_ingest_lag_seconds",
            "ringwatch_webhook_deliveries_pending", "ringwatch_preflight_latency_seconds_bucket",
            "ringwatch_http_requests_total", "ringwatch_http_request_duration_seconds_bucket",
            "process_cpu_seconds_total"} <= used


def test_a_renamed_metric_or_label_would_be_caught(scraped: Labels) -> None:
    """The check above fails when the dashboard and /metrics part ways."""
    text = DASHBOARD.read_text()
    for old, new in (("ringwatch_ingested_batches_total", "ringwatch_batches_total"),
                     ("by (kind)", "by (finding_kind)")):
        assert old in text
        board = json.loads(text.replace(old, new))
        assert [p for where, q in expressions(board) for p in problems(where, q, scraped)]


def test_every_panel_reads_the_datasource_variable_and_none_is_fixed() -> None:
    board = dashboard()
    [source] = [v for v in board["templating"]["list"] if v["type"] == "datasource"]
    assert source["name"] == "datasource" and source["query"] == "prometheus"
    # Importing asks for a Prometheus datasource and makes it the variable's value.
    [wanted] = board["__inputs"]
    assert (wanted["type"], wanted["pluginId"]) == ("datasource", "prometheus")
    assert source["current"]["value"] == "${" + wanted["name"] + "}"
    queried = [p for p in panels(board) if p["type"] != "row"]
    assert queried and all(p["targets"] for p in queried)
    for p in queried:
        assert p["datasource"] == DATASOURCE, p["title"]
        for t in p["targets"]:
            assert t.get("datasource", p["datasource"]) == DATASOURCE, p["title"]
    for var in query_variables(board):
        assert var["datasource"] == DATASOURCE, var["name"]
    # No uid of any one Grafana anywhere: not the one provisioning makes, nor
    # kube-prometheus-stack's "prometheus".
    provisioned = [d for f in sorted(DATASOURCES.glob("*.yaml"))
                   for d in yaml.safe_load(f.read_text())["datasources"]]
    uids = {json.dumps(d) for p in panels(board) for d in
            [p.get("datasource"), *(t.get("datasource") for t in p.get("targets", []))] if d}
    assert uids == {json.dumps(DATASOURCE)}
    assert all(d["uid"] not in DASHBOARD.read_text() for d in provisioned)
    # Provisioned (compose), the variable falls back to the default datasource: there is one.
    assert [(d["type"], d.get("isDefault")) for d in provisioned] == [("prometheus", True)]
    ids = [p["id"] for p in panels(board)]
    assert len(ids) == len(set(ids))


def test_every_query_follows_the_cluster_variable() -> None:
    """One Prometheus may hold several clusters' ringwatch: every selector of every panel
    and of the node, scope and op variables filters on ``cluster``. The variable lists the
    clusters of a series every scrape has, and its All (``.*``) also matches series with no
    cluster label at all, so the dashboard works where none is set."""
    board = dashboard()
    cluster = variable(board, "cluster")
    assert cluster["query"]["query"] == "label_values(ringwatch_node_healthy, cluster)"
    assert cluster["includeAll"] and cluster["allValue"] == ".*"
    assert cluster["current"]["value"] == "$__all"
    for where, q in expressions(board):
        if where == "variable 'cluster'":
            continue
        for s in q.selectors:
            assert "cluster" in s.labels, f"{where}: {s.name} ignores the cluster"


def test_nodes_come_from_a_series_every_node_has_and_links_follow_node_labels(
        scraped: Labels) -> None:
    """The node variable reads ringwatch_node_healthy, which every node seen has (a node with
    no duty cycle reported or no link yet included); a node's links are chosen by ``node``
    or ``peer_node``, so a node pair whose group key is hashed (long host names) is shown as
    well as any other, and no query picks links by a pattern over member lists."""
    board = dashboard()
    node = variable(board, "node")
    assert node["query"]["query"] == 'label_values(ringwatch_node_healthy{cluster=~"$cluster"}, node)'
    assert "node" in scraped["ringwatch_node_healthy"]
    [panel] = [p for p in panels(board) if p["title"] == "Busbw of a node's links"]
    [target] = panel["targets"]
    q = read_promql(target["expr"])
    assert {s.name for s in q.selectors} == {"ringwatch_link_busbw_bytes_per_second"}
    assert sorted("node" in s.labels or "peer_node" in s.labels for s in q.selectors) == [True, True]
    assert 'node="$node"' in target["expr"] and 'peer_node="$node"' in target["expr"]
    for where, q in expressions(board):
        assert all("members" not in s.labels for s in q.selectors), where
