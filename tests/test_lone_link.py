"""Never silent: a link monitoring calls degraded opens an incident, at whatever granularity
the evidence has (docs/analysis.md)."""

from __future__ import annotations

import uuid

from sqlalchemy import text

from ringwatch.services.store import db
from tests.api_fixtures import api_client, measurement, pair


def _cycle(slow: float) -> dict:
    """Four node pairs, no node in two: (node-000, node-001) at ``slow`` of 10 GB/s."""
    names = [f"node-{i:03d}" for i in range(8)]
    ms = [measurement(pair(names[i], names[i + 1]), 10.0 * (slow if i == 0 else 1.0))
          for i in range(0, 8, 2)]
    return {"batch_id": uuid.uuid4().hex, "backend": "gloo", "measurements": ms}


def test_a_lone_slow_node_pair_opens_an_incident_and_its_webhook(clean_db) -> None:
    with api_client(clean_db, settings={}) as api:  # the default hysteresis
        for slow in (1.0, 1.0, 1.0, 0.3, 0.3, 0.3):
            r = api.post("/v1/measurements", headers=api.h["agent"], json=_cycle(slow))
            assert r.status_code == 200, r.text
        links = api.get("/v1/links", params={"status": "degraded"},
                        headers=api.h["reader"]).json()
        assert [link["nodes"] for link in links] == [["node-000", "node-001"]]
        opened = api.get("/v1/findings", params={"status": "open"},
                         headers=api.h["reader"]).json()
        assert [(f["kind"], f["nodes"]) for f in opened] == [
            ("net_path_degraded", ["node-000", "node-001"])]
        assert opened[0]["detail"]["localized"] == "node_pair"
    with db.transaction(clean_db) as s:
        events = s.execute(text("SELECT event_type FROM outbox_events")).scalars().all()
    assert "health.degraded" in events
