"""The webhook events module against its contract, docs/webhooks.md: every event name is
documented, and each payload kind becomes the documented ``json`` body, field for field as
the bodies were before the module existed. The outbox half runs on real Postgres."""

from __future__ import annotations

import json
import re
import typing
from dataclasses import fields
from pathlib import Path

import pytest

from ringwatch.services.notifier.channels import render_json
from ringwatch.services.store import db, events
from ringwatch.services.store.events import EventType

DOCS = Path(__file__).resolve().parents[1] / "docs" / "webhooks.md"
API = "https://rw.example"
# What docs/webhooks.md says a json body carries.
DOCUMENTED_KEYS = {"event", "sequence", "finding", "nodes", "links", "url"}

FAULT = {"kind": "slow_link", "node": "node-001", "measured_gbs": 10.0, "expected_gbs": 40.0,
         "evidence": [{"group": "node-001/0,node-002/0", "op": "allreduce"}],
         "fault": "slow_link:node-001"}
VERDICT = {"healthy": False, "exclude": ["node-001"], "findings": [FAULT]}

# One payload per event, and the body it must become (sequence 7): the wire format.
CASES: list[tuple[events.Payload, dict[str, typing.Any]]] = [
    (events.incident_opened("slow_link", FAULT, 3, ["node-001"], API),
     {"event": "health.degraded", "finding": FAULT, "finding_id": 3, "nodes": ["node-001"],
      "links": FAULT["evidence"], "url": f"{API}/v1/findings/3", "sequence": 7}),
    (events.incident_opened("hang", {**FAULT, "kind": "hang"}, 4, ["node-001"], API),
     {"event": "probe.hang", "finding": {**FAULT, "kind": "hang"}, "finding_id": 4,
      "nodes": ["node-001"], "links": FAULT["evidence"], "url": f"{API}/v1/findings/4",
      "sequence": 7}),
    (events.incident_opened("probe_error", {"kind": "probe_error", "fault": "probe_error:n"}, 5,
                            ["n"], API),
     {"event": "probe.error", "finding": {"kind": "probe_error", "fault": "probe_error:n"},
      "finding_id": 5, "nodes": ["n"], "links": [], "url": f"{API}/v1/findings/5", "sequence": 7}),
    (events.incident_recovered(FAULT, 3, ["node-001"], API),
     {"event": "health.recovered", "finding": FAULT, "finding_id": 3, "nodes": ["node-001"],
      "links": [], "url": f"{API}/v1/findings/3", "sequence": 7}),
    (events.preflight_failed("0b5e", ["node-001", "node-002"], VERDICT, API),
     {"event": "preflight.failed", "preflight_id": "0b5e", "nodes": ["node-001", "node-002"],
      "exclude": ["node-001"], "findings": [FAULT], "finding": FAULT, "links": [],
      "url": f"{API}/v1/preflight/0b5e", "sequence": 7}),
    (events.WebhookTest(webhook_id=9),
     {"event": "webhook.test", "finding": None, "webhook_id": 9, "test": True, "sequence": 7}),
]


def _events_section() -> str:
    text = DOCS.read_text()
    return text.split("## Events", 1)[1].split("\n## ", 1)[0]


def test_every_event_name_is_documented() -> None:
    named = set(re.findall(r"`([a-z_]+\.[a-z_]+)`", _events_section()))
    assert set(EventType) <= named, sorted(set(EventType) - named)
    assert named <= set(EventType), sorted(named - set(EventType))


def test_the_documented_body_keys_are_the_ones_checked_here() -> None:
    section = _events_section()
    assert all(f"`{key}`" in section for key in DOCUMENTED_KEYS)


def test_every_field_a_body_carries_is_documented() -> None:
    section = _events_section()
    sent = {f.name for payload, _ in CASES for f in fields(payload)}
    assert {name for name in sent if f"`{name}`" not in section} == set()


def test_each_event_has_exactly_one_payload_kind() -> None:
    assert set(events.PAYLOADS) == set(EventType)
    assert {type(p).event for p, _ in CASES} == set(EventType)


@pytest.mark.parametrize(("payload", "expected"), CASES,
                         ids=[str(type(p).event) for p, _ in CASES])
def test_each_payload_round_trips_to_the_documented_body(payload, expected) -> None:
    stored = json.loads(json.dumps(events.to_payload(payload)))  # as JSONB gives it back
    body = events.body(type(payload).event, 7, stored)
    # The bytes the notifier signs decode to the same body.
    wire = json.loads(json.dumps(body, separators=(",", ":"), sort_keys=True))
    assert wire == body == expected
    assert set(wire) == {"event", "sequence", *(f.name for f in fields(payload))}
    # A test event names no fault, so it carries no nodes, links or url.
    documented = DOCUMENTED_KEYS if type(payload) is not events.WebhookTest else {
        "event", "sequence", "finding"}
    assert documented <= set(wire)
    # The notifier's json channel renders the same body.
    assert render_json(str(type(payload).event), 7, stored) == body


def test_a_recovery_without_its_incident_points_at_the_findings() -> None:
    payload = events.incident_recovered(FAULT, None, ["node-001"], API)
    assert payload.finding_id is None and payload.url == f"{API}/v1/findings"


def test_the_api_accepts_subscriptions_to_every_subscribable_event() -> None:
    from pydantic import ValidationError

    from ringwatch.api.schemas import WebhookIn

    enum = WebhookIn.model_json_schema()["properties"]["events"]["items"]["enum"]
    assert enum == [str(e) for e in typing.get_args(events.Subscribable)]
    assert set(enum) == {str(e) for e in events.SUBSCRIBABLE} == {
        str(e) for e in EventType} - {"webhook.test"}
    hook = WebhookIn(url="https://hooks.example/r", secret="s" * 16, events=["probe.hang"])
    assert hook.model_dump(mode="json")["events"] == ["probe.hang"]
    with pytest.raises(ValidationError):
        WebhookIn(url="https://hooks.example/r", secret="s" * 16, events=["webhook.test"])


def test_an_event_is_pending_only_once_its_change_commits(clean_db) -> None:
    payload = events.incident_opened("slow_link", FAULT, 3, ["node-001"], API)
    with pytest.raises(RuntimeError), db.transaction(clean_db) as s:
        events.emit(s, payload)
        raise RuntimeError("the change fails")
    with db.transaction(clean_db) as s:
        assert events.pending(s) == []
        emitted = events.emit(s, payload)
    with db.transaction(clean_db) as s:
        [event] = events.pending(s)
        assert event.id == emitted.id and event.event_type == "health.degraded"
        assert event.payload == events.to_payload(payload)
        events.mark_dispatched(s, [event.id])
    with db.transaction(clean_db) as s:
        assert events.pending(s) == []
