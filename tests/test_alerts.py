"""The alert rules ringwatch ships (deploy/prometheus/ringwatch-rules.yml): promtool checks
them and runs their unit tests (tests/data/prometheus); each has its `for:`, severity,
summary and a runbook that exists in docs/operations.md, linked through the one
RINGWATCH_RUNBOOK_URL; the PrometheusRule carries the same groups, the ServiceMonitor
selects the API's Service, and the Alertmanager example in docs/operations.md groups the
node alerts and lets the fleet's page inhibit them. Last, a real Prometheus scrapes a real
API and fires the node alert (a warning) for the node a preflight would exclude and no
other, and the fleet's page for a fleet past its share, each with a full runbook URL."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.api_fixtures import fleet_batch
from tests.procs import free_port, start_server, stop_server

ROOT = Path(__file__).resolve().parents[1]
RULES = ROOT / "deploy/prometheus/ringwatch-rules.yml"
RULE_TESTS = ROOT / "tests/data/prometheus/ringwatch-rules.test.yml"
SCRAPE_CONFIG = ROOT / "deploy/prometheus/prometheus.yml"
MONITORING = ROOT / "deploy/kubernetes/monitoring"
API_MANIFEST = ROOT / "deploy/kubernetes/base/api.yaml"
BASE_KUSTOMIZATION = ROOT / "deploy/kubernetes/base/kustomization.yaml"
OPERATIONS = ROOT / "docs/operations.md"
ALERTS = {"RingwatchNodeUnhealthy", "RingwatchFleetBelowRated", "RingwatchIngestStalled",
          "RingwatchWebhookBacklog", "RingwatchShipperFailures", "RingwatchAPIDown",
          "RingwatchOccupancyUnknown", "RingwatchSchedulerNoCycle",
          "RingwatchSchedulerSpoolGrowing", "RingwatchSchedulerIngestRefused",
          "RingwatchFleetUnhealthy", "RingwatchDatabaseDown", "RingwatchNotifierNotLooping",
          "RingwatchAPIErrorRate", "RingwatchMaintenanceFailed", "RingwatchDatabaseSize"}
# The recording rules: the page the runbook links point into.
RECORDS = {"ringwatch:runbook_url:info"}
# Every runbook_url: RINGWATCH_RUNBOOK_URL as the API replicas export it, else the
# repository's path, and the alert's anchor.
RUNBOOK_URL = ('{{ with query "ringwatch:runbook_url:info" }}{{ (. | first).Labels.url }}'
               '{{ else }}docs/operations.md{{ end }}#')
RUNBOOK_BASE = "https://docs.example/ringwatch/v1/docs/operations.md"
ADMIN = "rw_alerts_admin_token_for_tests"

needs_promtool = pytest.mark.skipif(shutil.which("promtool") is None,
                                    reason="promtool is not installed (Debian: prometheus)")


def rule_groups() -> list[dict[str, Any]]:
    return yaml.safe_load(RULES.read_text())["groups"]


def rules() -> list[dict[str, Any]]:
    """The alerting rules."""
    return [r for g in rule_groups() for r in g["rules"] if "alert" in r]


def records() -> list[dict[str, Any]]:
    return [r for g in rule_groups() for r in g["rules"] if "record" in r]


def documents(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def anchors(markdown: str) -> set[str]:
    """The anchors GitHub gives the headings of a Markdown file."""
    found = set()
    for line in markdown.splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            found.add(re.sub(r"\s", "-", re.sub(r"[^\w\s-]", "", title)))
    return found


def promtool(*args: str | Path, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(["promtool", *map(str, args)], cwd=cwd, capture_output=True,
                          text=True, timeout=120)


# -- the rule file ------------------------------------------------------------------------


@needs_promtool
def test_promtool_checks_the_rules_and_runs_their_unit_tests() -> None:
    checked = promtool("check", "rules", RULES)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert f"SUCCESS: {len(ALERTS) + len(RECORDS)} rules found" in checked.stdout
    tested = promtool("test", "rules", RULE_TESTS.name, cwd=RULE_TESTS.parent)
    assert tested.returncode == 0, tested.stdout + tested.stderr
    # Every alert has a case that waits out its `for:` and sees it fire.
    cases = yaml.safe_load(RULE_TESTS.read_text())["tests"]
    firing = {t["alertname"] for case in cases for t in case["alert_rule_test"]
              if t["exp_alerts"]}
    assert firing == ALERTS


@needs_promtool
def test_compose_prometheus_loads_the_rules() -> None:
    config = yaml.safe_load(SCRAPE_CONFIG.read_text())
    assert [(SCRAPE_CONFIG.parent / f).resolve() for f in config["rule_files"]] == [RULES]
    # The API's /metrics and the scheduler's own (services/scheduler/watch.py).
    assert [job["job_name"] for job in config["scrape_configs"]] == ["ringwatch",
                                                                     "ringwatch-scheduler"]
    checked = promtool("check", "config", SCRAPE_CONFIG)
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_every_alert_waits_is_graded_says_what_and_links_its_runbook() -> None:
    documented = anchors(OPERATIONS.read_text())
    assert {r["alert"] for r in rules()} == ALERTS
    assert {r["record"] for r in records()} == RECORDS
    for rule in rules():
        name = rule["alert"]
        assert re.fullmatch(r"\d+[smh]", rule["for"]), name
        assert rule["labels"]["severity"] in ("critical", "warning"), name
        notes = rule["annotations"]
        assert notes["summary"] and notes["description"], name
        assert notes["runbook_url"] == RUNBOOK_URL + name.lower(), name
        assert name.lower() in documented, f"{name}: docs/operations.md has no #{name.lower()}"
    by_name = {r["alert"]: r for r in rules()}
    # An alert about one node, or one scheduler, names it where a pager shows it first.
    assert "{{ $labels.node }}" in by_name["RingwatchNodeUnhealthy"]["annotations"]["summary"]
    assert "{{ $labels.host }}" in by_name["RingwatchShipperFailures"]["annotations"]["summary"]
    assert "{{ $labels.fleet }}" in by_name["RingwatchSchedulerNoCycle"]["annotations"]["summary"]
    for name in ("RingwatchSchedulerSpoolGrowing", "RingwatchSchedulerIngestRefused"):
        assert "{{ $labels.host }}" in by_name[name]["annotations"]["summary"], name
    assert "runbook" in anchors(OPERATIONS.read_text())
    # A node to drain is a warning; many at once, the fleet's page. Thresholds that are
    # settings are read from /metrics, never written into a rule.
    assert by_name["RingwatchNodeUnhealthy"]["labels"]["severity"] == "warning"
    for name in ("RingwatchFleetUnhealthy", "RingwatchDatabaseDown", "RingwatchAPIErrorRate"):
        assert by_name[name]["labels"]["severity"] == "critical", name
    assert "ringwatch_fleet_unhealthy_share_threshold" in by_name["RingwatchFleetUnhealthy"]["expr"]
    stalled = by_name["RingwatchIngestStalled"]["expr"]
    assert "ringwatch_expected_ingest_interval_seconds" in stalled
    assert not re.search(r">\s*\d+\s*$", stalled), stalled  # no fixed figure of seconds
    assert "ringwatch_database_size_alert_bytes" in by_name["RingwatchDatabaseSize"]["expr"]


# -- routing ------------------------------------------------------------------------------


def alertmanager_example() -> dict[str, Any]:
    """The Alertmanager configuration docs/operations.md shows under "Routing"."""
    text = OPERATIONS.read_text()
    section = text[text.index("\n### Routing\n"):]
    start = section.index("```yaml\n") + len("```yaml\n")
    return yaml.safe_load(section[start:section.index("\n```", start)])


def matches(matchers: list[str], labels: dict[str, str]) -> bool:
    """Whether ``labels`` satisfy every Alertmanager matcher (``name="v"``, ``=~``, ``!=``)."""
    for matcher in matchers:
        found = re.fullmatch(r'(\w+)\s*(=~|!~|!=|=)\s*"(.*)"', matcher)
        assert found, matcher
        name, op, want = found.groups()
        got = labels.get(name, "")
        hit = re.fullmatch(want, got) is not None if "~" in op else got == want
        if hit == op.startswith("!"):
            return False
    return True


def route_for(route: dict[str, Any], labels: dict[str, str],
              inherited: dict[str, Any] | None = None) -> dict[str, Any]:
    """The settings of the route an alert with ``labels`` lands on (the first matching child,
    depth first, inheriting what it does not set), as Alertmanager walks its tree."""
    here = {**(inherited or {}), **{k: v for k, v in route.items() if k != "routes"}}
    for child in route.get("routes", []):
        if matches(child.get("matchers", []), labels):
            return route_for(child, labels, here)
    return here


def alert_labels(name: str) -> dict[str, str]:
    rule = {r["alert"]: r for r in rules()}[name]
    return {"alertname": name, "job": "ringwatch", **rule["labels"]}


def test_the_alertmanager_example_groups_node_alerts_and_the_fleet_page_inhibits_them() -> None:
    config = alertmanager_example()
    node = {**alert_labels("RingwatchNodeUnhealthy"), "node": "node-002"}
    fleet = alert_labels("RingwatchFleetUnhealthy")
    # Many excluded nodes are one notification, not one each; the fleet's page pages.
    routed = route_for(config["route"], node)
    assert routed["group_by"] == ["alertname"], routed
    assert route_for(config["route"], fleet)["receiver"] != routed["receiver"]
    receivers = {r["name"] for r in config["receivers"]}
    for labels in (node, fleet, alert_labels("RingwatchDatabaseDown")):
        assert route_for(config["route"], labels)["receiver"] in receivers
    # While the fleet's page fires, the node warnings under it are inhibited.
    inhibits = [r for r in config["inhibit_rules"]
                if matches(r["source_matchers"], fleet) and matches(r["target_matchers"], node)]
    assert inhibits and all(set(r.get("equal", [])) <= fleet.keys() & node.keys()
                            for r in inhibits)
    assert not any(matches(r["source_matchers"], node) and matches(r["target_matchers"], fleet)
                   for r in config["inhibit_rules"])
    # Every alert named in a matcher is one the rules have.
    named = {n for r in config["inhibit_rules"] for m in r["source_matchers"] + r["target_matchers"]
             for n in re.findall(r"Ringwatch\w+", m)}
    assert named and named <= ALERTS, named - ALERTS


# -- Kubernetes ---------------------------------------------------------------------------


def test_the_prometheus_rule_carries_the_rule_files_groups() -> None:
    [rule] = documents(MONITORING / "prometheus-rule.yaml")
    assert (rule["apiVersion"], rule["kind"]) == ("monitoring.coreos.com/v1", "PrometheusRule")
    assert rule["spec"]["groups"] == rule_groups()


def test_the_pod_monitor_scrapes_the_schedulers_health_port_as_job_ringwatch_scheduler() -> None:
    [raycluster] = documents(ROOT / "deploy/kubernetes/base/raycluster.yaml")[:1]
    template = raycluster["spec"]["headGroupSpec"]["template"]
    [head] = [c for c in template["spec"]["containers"] if c["name"] == "ray-head"]
    [monitor] = documents(MONITORING / "pod-monitor.yaml")
    assert (monitor["apiVersion"], monitor["kind"]) == ("monitoring.coreos.com/v1", "PodMonitor")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= template["metadata"]["labels"].items()
    namespace = yaml.safe_load(BASE_KUSTOMIZATION.read_text())["namespace"]
    assert monitor["spec"]["namespaceSelector"]["matchNames"] == [namespace]
    [endpoint] = monitor["spec"]["podMetricsEndpoints"]
    port = {p["name"]: p["containerPort"] for p in head["ports"]}[endpoint["port"]]
    assert f"--health-port {port}" in " ".join(head["args"])
    assert {"targetLabel": "job", "replacement": "ringwatch-scheduler"} in endpoint["relabelings"]


def test_the_service_monitor_scrapes_the_api_service_as_job_ringwatch() -> None:
    [service] = [d for d in documents(API_MANIFEST) if d["kind"] == "Service"]
    [monitor] = documents(MONITORING / "service-monitor.yaml")
    assert (monitor["apiVersion"], monitor["kind"]) == ("monitoring.coreos.com/v1",
                                                        "ServiceMonitor")
    selector = monitor["spec"]["selector"]["matchLabels"]
    assert selector.items() <= service["metadata"]["labels"].items()
    namespace = yaml.safe_load(BASE_KUSTOMIZATION.read_text())["namespace"]
    assert monitor["spec"]["namespaceSelector"]["matchNames"] == [namespace]
    [endpoint] = monitor["spec"]["endpoints"]
    assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}
    assert endpoint["path"] == "/metrics"
    assert {"targetLabel": "job", "replacement": "ringwatch"} in endpoint["relabelings"]
    # The job the alerts read is the one scraped, here and in compose.
    assert 'up{job="ringwatch"}' in {r["alert"]: r for r in rules()}["RingwatchAPIDown"]["expr"]
    kustomization = yaml.safe_load((MONITORING / "kustomization.yaml").read_text())
    assert kustomization["namespace"] == namespace
    listed = set(kustomization["resources"])
    assert listed == {p.name for p in MONITORING.glob("*.yaml")} - {"kustomization.yaml"}


# -- a real Prometheus --------------------------------------------------------------------


def wait_for(what: str, check: Any, timeout_s: float = 90.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            found = check()
        except httpx.HTTPError:
            found = None
        if found:
            return found
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.5)


def short_rules(to: Path) -> Path:
    """The shipped rules with every `for:` cut to one second: a test cannot wait ten minutes."""
    groups = rule_groups()
    for group in groups:
        for rule in group["rules"]:
            if "alert" in rule:
                rule["for"] = "1s"
    to.write_text(yaml.safe_dump({"groups": groups}))
    return to


@pytest.mark.skipif(shutil.which("prometheus") is None,
                    reason="prometheus is not installed (Debian: prometheus)")
def test_a_real_prometheus_fires_the_node_alert_for_the_degraded_node(
        database_url, clean_db, tmp_path) -> None:
    """A real API on a test database, made to need a token for /metrics; a real Prometheus
    scraping it every second with a reader token from a file, as
    deploy/prometheus/prometheus.yml says to, and loading the shipped rules with each
    `for:` rewritten to 1s (short_rules). Two monitoring cycles with node-002 slow: the node
    alert (a warning) fires for node-002 alone, as Prometheus' /api/v1/alerts reports it,
    and, one node in four being past the fleet's 2 %, the fleet's page fires too; both link
    their runbook on the page RINGWATCH_RUNBOOK_URL names."""
    api_url = f"http://127.0.0.1:{free_port()}"
    server = start_server({
        **os.environ, "RINGWATCH_DATABASE_URL": database_url, "RINGWATCH_API_URL": api_url,
        "RINGWATCH_BOOTSTRAP_ADMIN_TOKEN": ADMIN, "RINGWATCH_STATE_DIR": str(tmp_path / "state"),
        "RINGWATCH_METRICS_CACHE_S": "0", "RINGWATCH_METRICS_TOKEN_REQUIRED": "true",
        "RINGWATCH_RUNBOOK_URL": RUNBOOK_BASE})
    prometheus = None
    try:
        admin = {"Authorization": f"Bearer {ADMIN}"}
        for _ in range(2):
            httpx.post(f"{api_url}/v1/measurements", json=fleet_batch(slow_node="node-002"),
                       headers=admin, timeout=30).raise_for_status()
        reader = httpx.post(f"{api_url}/v1/tokens", json={"role": "reader", "name": "prom"},
                            headers=admin, timeout=30).json()["token"]
        (tmp_path / "metrics-token").write_text(reader)
        prom_port = free_port()
        config = {
            "global": {"scrape_interval": "1s", "scrape_timeout": "1s",
                       "evaluation_interval": "1s"},
            "rule_files": [str(short_rules(tmp_path / "rules.yml"))],
            "scrape_configs": [{
                "job_name": "ringwatch", "metrics_path": "/metrics",
                "static_configs": [{"targets": [api_url.removeprefix("http://")]}],
                "authorization": {"type": "Bearer",
                                  "credentials_file": str(tmp_path / "metrics-token")}}]}
        (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
        with (tmp_path / "prometheus.log").open("w") as log:
            prometheus = subprocess.Popen(
                ["prometheus", f"--config.file={tmp_path / 'prometheus.yml'}",
                 f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                 f"--web.listen-address=127.0.0.1:{prom_port}"],
                stdout=log, stderr=subprocess.STDOUT)
        base = f"http://127.0.0.1:{prom_port}"

        def alerts(name: str) -> list[dict[str, Any]]:
            resp = httpx.get(f"{base}/api/v1/alerts", timeout=5).raise_for_status()
            return [a for a in resp.json()["data"]["alerts"] if a["labels"]["alertname"] == name]

        def node_alerts() -> list[dict[str, Any]]:
            return alerts("RingwatchNodeUnhealthy")

        # Until its storage is open Prometheus answers 503 in plain text.
        wait_for("Prometheus to be ready",
                 lambda: httpx.get(f"{base}/-/ready", timeout=5).status_code == 200)
        firing = wait_for("the node alert to fire",
                          lambda: [a for a in node_alerts() if a["state"] == "firing"])
        print(json.dumps(firing, indent=2))
        [target] = httpx.get(f"{base}/api/v1/targets", timeout=5).json()["data"]["activeTargets"]
        assert target["health"] == "up", target
        # Exactly the degraded node, pending or firing, and its summary names it.
        assert [a["labels"]["node"] for a in node_alerts()] == ["node-002"]
        [alert] = firing
        assert alert["labels"]["severity"] == "warning"
        assert "node-002" in alert["annotations"]["summary"]
        assert alert["annotations"]["runbook_url"] == f"{RUNBOOK_BASE}#ringwatchnodeunhealthy"
        assert float(alert["value"]) == 0
        [page] = wait_for("the fleet's page to fire", lambda: [
            a for a in alerts("RingwatchFleetUnhealthy") if a["state"] == "firing"])
        assert page["labels"]["severity"] == "critical"
        assert float(page["value"]) == 0.25  # one node of four
        assert page["annotations"]["summary"] == "ringwatch excludes 25% of the fleet's nodes"
        assert page["annotations"]["runbook_url"] == f"{RUNBOOK_BASE}#ringwatchfleetunhealthy"
    finally:
        if prometheus is not None:
            prometheus.terminate()
            prometheus.wait(timeout=30)
        stop_server(server)
