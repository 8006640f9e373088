"""One headline per incident: the measurement that names its op and size, chosen where the
finding is made, kept by the incident from the cycle that opened it, and the same in
``/v1/findings``, the webhook body, ``ringwatch status``, the preflight verdict and its text;
and a link slow in one cycle of the hysteresis window says why it is still ok."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from fastapi.testclient import TestClient

from ringwatch.agents.spec import Measurement
from ringwatch.services.analyzer.assess import GLOO_THRESHOLDS
from ringwatch.services.analyzer.headline import headline, size_text
from ringwatch.services.analyzer.hysteresis import DEGRADED, OK, LinkState, Policy, standing
from ringwatch.services.analyzer.judge import judge
from ringwatch.services.cli import output, status
from ringwatch.services.notifier.channels import render_slack
from tests.api_fixtures import measurement, pair, register_webhook
from tests.test_notifier import drain, make_notifier

NODES = [f"node-{i:03d}" for i in range(4)]
# gloo's sizes: a latency-bound one, never judged, and the bandwidth-bound one.
SMALL, LARGE = 64 << 10, 4 << 20


def batch(slow: dict[str, float]) -> dict[str, Any]:
    """Every node pair and every node's two GPUs, allreduce at both sizes; a node in
    ``slow`` runs at that share of the others at the large size, and at half that at the
    small one (its worst ratio, but latency-bound: never the headline)."""
    ms = []
    for i, a in enumerate(NODES):
        for b in NODES[i + 1:]:
            f = min(slow.get(a, 1.0), slow.get(b, 1.0))
            ms.append(measurement(pair(a, b), 10.0 * f, size=LARGE))
            ms.append(measurement(pair(a, b), 2.0 * f * (0.5 if f < 1 else 1), size=SMALL))
        f = slow.get(a, 1.0)
        ms.append(measurement([f"{a}/0", f"{a}/1"], 20.0 * f, scope="intra_node", size=LARGE))
        ms.append(measurement([f"{a}/0", f"{a}/1"], 4.0 * f * (0.5 if f < 1 else 1),
                              scope="intra_node", size=SMALL))
    return {"batch_id": str(uuid.uuid4()), "backend": "gloo", "measurements": ms}


# ---- the rule and its text (pure)


def test_the_text_names_op_size_figures_and_ratio() -> None:
    h = headline("allreduce", 256 << 20, 122.4, 238.2)
    assert h["text"] == "allreduce 256 MiB: 122 of 238 GB/s (0.51)"
    assert h["ratio"] == round(122.4 / 238.2, 4)
    assert headline("alltoall", 4 << 20, 4.213, 10.0)["text"] == "alltoall 4 MiB: 4.21 of 10.0 GB/s (0.42)"
    assert [size_text(s) for s in (512, 64 << 10, 3 << 19, 1 << 30)] == [
        "512 B", "64 KiB", "1.5 MiB", "1 GiB"]


def _probe(m: dict[str, Any]) -> Measurement:
    return Measurement(**{k: v for k, v in m.items() if k != "time"})


def test_the_headline_is_the_middle_judged_result_and_the_findings_figures() -> None:
    """A GPU-pair group measured three times at the large size and once, far slower, at the
    small one: the headline is the middle of the three large ones, never the small one, and
    the finding's measured and expected busbw are its figures."""
    ms = [_probe(m) for m in batch({})["measurements"]]
    for bw in (9.0, 7.0, 8.0):
        ms.append(_probe(measurement(["node-001/0", "node-001/1"], bw, scope="intra_node", size=LARGE)))
    ms.append(_probe(measurement(["node-001/0", "node-001/1"], 0.5, scope="intra_node", size=SMALL)))
    ms = [m for m in ms if not (m.members == ["node-001/0", "node-001/1"] and m.busbw_gbs in (20.0, 4.0))]
    (f,) = judge(ms, [], thresholds=GLOO_THRESHOLDS).findings
    h = f.detail["headline"]
    assert (f.kind, f.node) == ("nvlink_degraded", "node-001")
    assert (h["op"], h["size_bytes"], h["busbw_gbs"]) == ("allreduce", LARGE, 8.0)
    assert h["expected_gbs"] == pytest.approx(20.0) and h["ratio"] == pytest.approx(0.4)
    d = f.to_dict()
    assert (d["measured_gbs"], d["expected_gbs"]) == (h["busbw_gbs"], h["expected_gbs"])
    assert d["headline"] == h


def test_standing_says_why_a_slow_link_is_still_ok() -> None:
    once = LinkState(OK, (False, True), 0)
    assert standing(once)["text"] == "slow, 1 of 3 \u2014 opens at 2 of 3"
    assert standing(once, Policy(3, 5, 2))["text"] == "slow, 1 of 5 \u2014 opens at 3 of 5"
    assert standing(LinkState(OK, (False, False, False), 3))["text"] is None
    recovering = standing(LinkState(DEGRADED, (True, True, False), 1))
    assert recovering["text"] == "1 of 2 good \u2014 closes at 2 in a row"
    assert (recovering["bad"], recovering["window"], recovering["opens_at"]) == (2, 3, 2)


# ---- one incident through the analyzer, the store, the API, the webhook and the CLI


def test_one_incident_shows_one_headline_on_every_surface(clean_db, receiver, capsys) -> None:
    """Under the default hysteresis (2 of 3) node-002 is slow three cycles running, slower
    each time: the incident opens on the second, and the headline it opened with (that
    cycle's measurement) is what the webhook carried and what every surface shows after
    the third cycle has been folded in."""
    from tests.api_fixtures import api_client

    with api_client(clean_db, settings={}) as api:
        register_webhook(api, receiver.url)
        notifier = make_notifier(clean_db)
        for factor in (0.45, 0.4, 0.3):
            resp = api.post("/v1/measurements", json=batch({"node-002": factor}),
                            headers=api.h["agent"])
            assert resp.status_code == 200, resp.text
            drain(notifier)
        notifier.close()

        (event,) = [e for e in receiver.events if e["event"] == "health.degraded"]
        sent = event["body"]["finding"]
        h = sent["headline"]
        # The second cycle's intra-node measurement of node-002 at the judged size.
        assert (sent["kind"], sent["node"]) == ("nvlink_degraded", "node-002")
        assert (h["op"], h["size_bytes"], h["busbw_gbs"]) == ("allreduce", LARGE, 0.4 * 20.0)
        assert h["expected_gbs"] == pytest.approx(20.0)
        assert (sent["measured_gbs"], sent["expected_gbs"]) == (h["busbw_gbs"], h["expected_gbs"])
        slack = render_slack(event["event"], event["body"]["sequence"], event["body"])
        # The place as every text surface prints it (agents/places.py), then the headline.
        assert slack["text"].endswith(f"node-002 GPUs 0-1: {h['text']}")

        (incident,) = api.get("/v1/findings?status=open", headers=api.h["reader"]).json()
        assert incident["detail"]["headline"] == h
        assert incident["detail"]["measured_gbs"] == h["busbw_gbs"]
        # The latest cycle's evidence is kept beside it.
        assert incident["detail"]["evidence"][0]["measured_gbs"] == pytest.approx(0.3 * 20.0)
        assert api.get(f"/v1/findings/{incident['id']}",
                       headers=api.h["reader"]).json()["detail"]["headline"] == h

        with TestClient(api.app, headers=api.h["reader"]) as reader:
            shown = status.plain(status.fetch(reader))
        row = next(line for line in shown.splitlines() if line.startswith(str(incident["id"])))
        assert h["text"] in row and "node-002" in row

        verdict = api.post("/v1/preflight", json={"nodes": NODES}, headers=api.h["reader"]).json()
        assert verdict["healthy"] is False and verdict["exclude"] == ["node-002"]
        (found,) = [f for f in verdict["findings"] if f.get("node") == "node-002"]
        assert found["headline"] == h
        output.print_verdict(verdict, as_json=False)
        (line,) = [x for x in capsys.readouterr().out.splitlines() if "nvlink_degraded" in x]
        assert "node-002" in line and f" {h['text']} [critical]" in line


def test_a_link_slow_once_says_why_it_is_still_ok(api_default) -> None:
    """One slow cycle of node-001 under 2 of 3: its links stay ok, no incident opens, and
    each of its slow links says where it stands."""
    api = api_default
    assert api.post("/v1/measurements", json=batch({}), headers=api.h["agent"]).status_code == 200
    assert api.post("/v1/measurements", json=batch({"node-001": 0.4}),
                    headers=api.h["agent"]).status_code == 200
    assert api.get("/v1/findings?status=open", headers=api.h["reader"]).json() == []
    links = api.get("/v1/links?node=node-001", headers=api.h["reader"]).json()
    slow = [link for link in links if link["ratio"] < 0.7]
    assert slow and all(link["status"] == "ok" for link in slow)
    for link in slow:
        assert link["standing"]["text"] == "slow, 1 of 3 \u2014 opens at 2 of 3"
        assert (link["standing"]["bad"], link["standing"]["opens_at"]) == (1, 2)
    fine = [link for link in api.get("/v1/links?node=node-000", headers=api.h["reader"]).json()
            if "node-001" not in link["nodes"]]
    assert fine and all(link["standing"]["text"] is None for link in fine)


@pytest.fixture
def api_default(clean_db):
    """The app under the default hysteresis (2 bad of the last 3 open an incident)."""
    from tests.api_fixtures import api_client

    with api_client(clean_db, settings={}) as client:
        yield client
