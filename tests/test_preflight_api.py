"""Durable preflight requests: answered from fresh results, or claimed, probed and completed."""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta

from ringwatch.services.store import db
from tests.api_fixtures import api_client, fleet_batch, measurement

NODES = ["node-000", "node-001", "node-002", "node-003"]


def stale(api) -> None:
    """Register the nodes with results too old for any preflight."""
    old = fleet_batch(batch_id="old")
    for m in old["measurements"]:
        m["time"] = (datetime.now(UTC) - timedelta(days=2)).isoformat()
    api.post("/v1/measurements", json=old, headers=api.h["agent"]).raise_for_status()


def test_fresh_results_answer_at_once_and_are_recorded(api) -> None:
    api.post("/v1/measurements", json=fleet_batch(slow_node="node-003"), headers=api.h["agent"])
    r = api.post("/v1/preflight", json={"nodes": NODES}, headers=api.h["reader"])
    assert r.status_code == 200
    v = r.json()
    assert v["status"] == "done" and v["healthy"] is False and v["exclude"] == ["node-003"]
    again = api.get(f"/v1/preflight/{v['id']}", headers=api.h["reader"]).json()
    assert again["exclude"] == ["node-003"]


def test_missing_results_wait_for_a_scheduler(api) -> None:
    stale(api)
    r = api.post("/v1/preflight", json={"nodes": NODES, "max_age_s": 60}, headers=api.h["reader"])
    assert r.status_code == 202
    req = r.json()
    assert req["status"] == "pending" and "healthy" not in req

    claimed = api.post("/v1/preflight/claim", json={"worker": "sched-a"}, headers=api.h["agent"])
    assert claimed.status_code == 200 and claimed.json()["id"] == req["id"]
    assert api.post("/v1/preflight/claim", json={"worker": "sched-b"},
                    headers=api.h["agent"]).status_code == 204
    assert api.get(f"/v1/preflight/{req['id']}", headers=api.h["reader"]).json()["status"] == "running"

    api.post("/v1/measurements", json=fleet_batch(), headers=api.h["agent"]).raise_for_status()
    done = api.post(f"/v1/preflight/{req['id']}/complete", json={"worker": "sched-a"},
                    headers=api.h["agent"]).json()
    assert done["status"] == "done" and done["healthy"] is True and done["exclude"] == []
    # A second completion is refused with a reason.
    r = api.post(f"/v1/preflight/{req['id']}/complete", json={"worker": "sched-a"}, headers=api.h["agent"])
    assert r.status_code == 422 and "already done" in r.json()["message"]


def test_a_dead_schedulers_request_is_claimed_again(api) -> None:
    stale(api)
    req = api.post("/v1/preflight", json={"nodes": NODES, "max_age_s": 60}, headers=api.h["reader"]).json()
    first = api.post("/v1/preflight/claim", json={"worker": "dies", "lease_s": 0.5}, headers=api.h["agent"])
    assert first.json()["id"] == req["id"]
    time.sleep(0.7)  # the claimer never completes; its lease runs out
    second = api.post("/v1/preflight/claim", json={"worker": "lives"}, headers=api.h["agent"]).json()
    assert second["id"] == req["id"] and second["attempts"] == 2
    r = api.post(f"/v1/preflight/{req['id']}/complete", json={"worker": "dies"}, headers=api.h["agent"])
    # Refused, without naming who holds it now.
    assert r.status_code == 422 and "not claimed by this worker" in r.json()["message"]
    assert "lives" not in r.json()["message"]


def test_nobody_completes_a_request_without_a_live_claim_or_with_a_forged_verdict(api) -> None:
    stale(api)
    req = api.post("/v1/preflight", json={"nodes": NODES, "max_age_s": 60}, headers=api.h["reader"]).json()
    healthy = {"healthy": True, "backend": "gloo", "nodes_checked": 4, "exclude": [], "findings": [],
               "rounds": 1, "duration_s": 1.0}
    done = f"/v1/preflight/{req['id']}/complete"
    # Unclaimed: an agent token cannot answer it by naming any worker.
    r = api.post(done, json={"worker": "x", "verdict": healthy}, headers=api.h["agent"])
    assert r.status_code == 422 and "claim it first" in r.json()["message"]
    api.post("/v1/preflight/claim", json={"worker": "s", "lease_s": 60}, headers=api.h["agent"])
    for bad, why in (
            ({**healthy, "healthy": False, "exclude": ["elsewhere-9"]}, "did not name"),
            ({**healthy, "healthy": False, "findings": [{"kind": "gremlins", "node": "node-000"}]},
             "verdict.findings.0.kind"),
            ({**healthy, "exclude": ["node-001"]}, "healthy verdict")):
        r = api.post(done, json={"worker": "s", "verdict": bad}, headers=api.h["agent"])
        assert r.status_code == 422 and why in r.json()["message"], r.text
    r = api.post(done, json={"worker": "s", "verdict": healthy}, headers=api.h["agent"])
    assert r.status_code == 200 and r.json()["status"] == "done"


def test_the_api_admits_exactly_the_finding_kinds_ringwatch_makes() -> None:
    from typing import get_args

    from ringwatch.agents.spec import FINDING_KINDS
    from ringwatch.api.schemas import FindingIn

    assert set(get_args(FindingIn.model_fields["kind"].annotation)) == set(FINDING_KINDS)


def test_unhealthy_verdict_queues_preflight_failed(api, clean_db) -> None:
    from sqlalchemy import select

    from ringwatch.services.store.models import OutboxEvent

    api.post("/v1/measurements", json=fleet_batch(slow_node="node-001"), headers=api.h["agent"])
    api.post("/v1/preflight", json={"nodes": NODES}, headers=api.h["reader"])
    with db.transaction(clean_db) as s:
        events = s.scalars(select(OutboxEvent).where(OutboxEvent.event_type == "preflight.failed")).all()
        assert len(events) == 1 and events[0].payload["exclude"] == ["node-001"]


def test_wait_returns_pending_when_no_scheduler_answers(api) -> None:
    stale(api)
    r = api.post("/v1/preflight?wait=0.5", json={"nodes": NODES[:2], "max_age_s": 60},
                 headers=api.h["reader"])
    assert r.status_code == 202 and r.json()["status"] == "pending"


def test_bad_preflight_input(api) -> None:
    api.post("/v1/measurements", json={"batch_id": "b", "backend": "gloo",
                                       "measurements": [measurement(["node-000/0", "node-001/0"], 1.0)]},
             headers=api.h["agent"])
    assert api.post("/v1/preflight", json={"nodes": []}, headers=api.h["reader"]).status_code == 422
    assert api.post("/v1/preflight", json={"nodes": ["node-000"], "max_age_s": -1},
                    headers=api.h["reader"]).status_code == 422
    assert api.post("/v1/preflight?wait=-1", json={"nodes": ["node-000"]},
                    headers=api.h["reader"]).status_code == 422
    assert api.get("/v1/preflight/nope", headers=api.h["reader"]).status_code == 404
    assert api.post("/v1/preflight/claim", json={"worker": "x"}, headers=api.h["reader"]).status_code == 403


def test_confirm_sends_unhealthy_fresh_results_to_a_scheduler(api) -> None:
    api.post("/v1/measurements", json=fleet_batch(slow_node="node-002"), headers=api.h["agent"])
    r = api.post("/v1/preflight", json={"nodes": NODES, "confirm": True}, headers=api.h["reader"])
    assert r.status_code == 202 and r.json()["status"] == "pending"
    req = api.post("/v1/preflight/claim", json={"worker": "s"}, headers=api.h["agent"]).json()
    # The scheduler's own preflight re-tested node-002 and found it fine after all.
    verdict = {"healthy": True, "backend": "gloo", "nodes_checked": 4, "exclude": [],
               "findings": [], "rounds": 3, "duration_s": 1.5}
    done = api.post(f"/v1/preflight/{req['id']}/complete", json={"worker": "s", "verdict": verdict},
                    headers=api.h["agent"]).json()
    assert done["status"] == "done" and done["healthy"] is True and done["source"] == "probed"
    assert done["rounds"] == 3


def test_confirm_answers_healthy_fresh_results_at_once(api) -> None:
    api.post("/v1/measurements", json=fleet_batch(), headers=api.h["agent"])
    r = api.post("/v1/preflight", json={"nodes": NODES, "confirm": True}, headers=api.h["reader"])
    assert r.status_code == 200 and r.json()["healthy"] is True


def test_a_malformed_scheduler_verdict_is_refused(api) -> None:
    stale(api)
    api.post("/v1/preflight", json={"nodes": NODES, "max_age_s": 60}, headers=api.h["reader"])
    req = api.post("/v1/preflight/claim", json={"worker": "s"}, headers=api.h["agent"]).json()
    r = api.post(f"/v1/preflight/{req['id']}/complete",
                 json={"worker": "s", "verdict": {"healthy": "maybe"}}, headers=api.h["agent"])
    assert r.status_code == 422


def test_the_stored_answer_excludes_what_the_latest_look_found(clean_db) -> None:
    """With the default hysteresis (2 bad of 3 open an incident) one slow cycle opens no
    incident, but the stored preflight excludes what that cycle's judgement found, as a
    fresh preflight would; a clean look after it leaves a suspect; a second slow cycle
    opens the incident."""
    with api_client(clean_db, settings={}) as api:
        _slow_clean_slow(api)


def _slow_clean_slow(api) -> None:
    def preflight() -> dict:
        return api.post("/v1/preflight", json={"nodes": NODES}, headers=api.h["reader"]).json()

    def incidents() -> list:
        return api.get("/v1/findings", params={"status": "open"}, headers=api.h["reader"]).json()

    api.post("/v1/measurements", json=fleet_batch(), headers=api.h["agent"])
    api.post("/v1/measurements", json=fleet_batch(slow_node="node-001"), headers=api.h["agent"])
    v = preflight()
    assert v["healthy"] is False and v["exclude"] == ["node-001"] and v["suspects"] == []
    assert all(f["pending"] for f in v["findings"]) and incidents() == []
    # With confirm, an unhealthy stored answer is sent to a scheduler to re-probe.
    r = api.post("/v1/preflight", json={"nodes": NODES, "confirm": True}, headers=api.h["reader"])
    assert r.status_code == 202
    # Looked at again and fine: no longer excluded, still a suspect in the window.
    api.post("/v1/measurements", json=fleet_batch(), headers=api.h["agent"])
    v = preflight()
    assert v["healthy"] is True and v["exclude"] == [] and v["suspects"] == ["node-001"]
    # Slow again: two bad of the last three open the incident.
    api.post("/v1/measurements", json=fleet_batch(slow_node="node-001"), headers=api.h["agent"])
    v = preflight()
    assert v["healthy"] is False and v["exclude"] == ["node-001"] and v["suspects"] == []
    assert not any(f.get("pending") for f in v["findings"]) and incidents() != []


def test_newer_degraded_results_at_a_smaller_size_are_not_hidden(clean_db) -> None:
    """Clean results at 4 MiB, then two cycles where node-001 is slow at 1 MiB only: the
    stored preflight must answer from the newer results (as /v1/health does), not let the
    older, larger clean size stand for the link."""
    with api_client(clean_db, settings={}) as api:
        big = fleet_batch()
        for m in big["measurements"]:
            m.update(measurement(m["members"], m["busbw_gbs"], scope=m["scope"], size=4 << 20))
        api.post("/v1/measurements", json=big, headers=api.h["agent"]).raise_for_status()
        for _ in range(2):
            api.post("/v1/measurements", json=fleet_batch(slow_node="node-001"),
                     headers=api.h["agent"]).raise_for_status()
        health = api.get("/v1/health", headers=api.h["reader"]).json()
        v = api.post("/v1/preflight", json={"nodes": NODES}, headers=api.h["reader"]).json()
    assert health["status"] == "degraded"
    assert v["healthy"] is False and v["exclude"] == ["node-001"]


def test_only_the_holder_of_a_live_claim_renews_it(api) -> None:
    stale(api)
    req = api.post("/v1/preflight", json={"nodes": NODES, "max_age_s": 60}, headers=api.h["reader"]).json()
    api.post("/v1/preflight/claim", json={"worker": "slow", "lease_s": 0.5}, headers=api.h["agent"])
    renew = f"/v1/preflight/{req['id']}/renew"
    r = api.post(renew, json={"worker": "other", "lease_s": 60}, headers=api.h["agent"])
    assert r.status_code == 422 and "not claimed by this worker" in r.json()["message"]
    assert api.post(renew, json={"worker": "slow", "lease_s": 60}, headers=api.h["agent"]).status_code == 200
    time.sleep(0.7)  # past the first lease: the renewed one holds
    assert api.post("/v1/preflight/claim", json={"worker": "other"}, headers=api.h["agent"]).status_code == 204
    done = api.post(f"/v1/preflight/{req['id']}/complete", json={"worker": "slow"}, headers=api.h["agent"])
    assert done.status_code == 200
    # A lease that ran out is not renewed: another scheduler may hold the request by then.
    req2 = api.post("/v1/preflight", json={"nodes": NODES, "max_age_s": 60}, headers=api.h["reader"]).json()
    api.post("/v1/preflight/claim", json={"worker": "late", "lease_s": 0.3}, headers=api.h["agent"])
    time.sleep(0.5)
    r = api.post(f"/v1/preflight/{req2['id']}/renew", json={"worker": "late", "lease_s": 60},
                 headers=api.h["agent"])
    assert r.status_code == 422 and "expired" in r.json()["message"]
