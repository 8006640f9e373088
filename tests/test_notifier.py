"""Webhooks end to end: a real local HTTP receiver, signed deliveries, retries, no duplicates."""

from __future__ import annotations

import threading

from ringwatch.services.notifier.channels import sign, verify
from ringwatch.services.notifier.loop import Notifier, RetryPolicy
from ringwatch.services.notifier.secret_box import SecretBox
from tests.api_fixtures import (
    TEST_SECRET_KEY,
    WEBHOOK_SECRET,
    WEBHOOK_TEST_SETTINGS,
    fleet_batch,
)
from tests.api_fixtures import register_webhook as register

SECRET = WEBHOOK_SECRET
# Retries come due at once, so tests need no sleeping.
NO_WAIT = RetryPolicy(base_s=0.0, cap_s=0.0)


def make_notifier(factory, **kw) -> Notifier:
    """A notifier with the test apps' key and allowed networks (loopback, where the
    receivers listen); retries due at once unless ``policy`` says otherwise."""
    kw.setdefault("policy", NO_WAIT)
    kw.setdefault("box", SecretBox.from_setting(TEST_SECRET_KEY))
    kw.setdefault("allowed_networks", WEBHOOK_TEST_SETTINGS["webhook_allowed_networks"])
    return Notifier(factory, **kw)


def ingest(api, batch) -> dict:
    resp = api.post("/v1/measurements", json=batch,
                    headers={"Authorization": f"Bearer {api.tokens['agent']}"})
    resp.raise_for_status()
    return resp.json()


def drain(notifier: Notifier, rounds: int = 5) -> None:
    for _ in range(rounds):
        if not notifier.run_once():
            return


def test_signature_verifies_with_the_secret_and_fails_with_another() -> None:
    body = b'{"event":"health.degraded"}'
    sig = sign(SECRET, body, "d-1", 1_700_000_000)
    assert sig.startswith("t=1700000000,v1=") and len(sig) == len("t=1700000000,v1=") + 64
    assert verify(SECRET, body, "d-1", sig, now=1_700_000_000)
    assert not verify("another-secret", body, "d-1", sig, now=1_700_000_000)
    assert not verify(SECRET, body + b" ", "d-1", sig, now=1_700_000_000)
    # The delivery id is signed: a signature cannot be moved to another delivery.
    assert not verify(SECRET, body, "d-2", sig, now=1_700_000_000)


def test_degraded_then_recovered_fires_signed_webhooks(api, clean_db, receiver) -> None:
    register(api, receiver.url)
    notifier = make_notifier(clean_db)
    degraded = ingest(api, fleet_batch(slow_node="node-002"))["degraded"]
    drain(notifier)
    assert len(receiver.events) == len(degraded) > 0
    assert {e["event"] for e in receiver.events} == {"health.degraded"}
    assert all(e["verified"] for e in receiver.events)
    assert all("node-002" in (e["body"]["finding"].get("nodes") or [e["body"]["finding"].get("node")])
               for e in receiver.events)

    ingest(api, fleet_batch())
    drain(notifier)
    recovered = [e for e in receiver.events if e["event"] == "health.recovered"]
    assert len(recovered) == len(degraded)
    assert len({e["delivery"] for e in receiver.events}) == len(receiver.events)
    notifier.close()


def test_receiver_down_then_up_gets_each_event_once(api, clean_db, receiver) -> None:
    hook = register(api, receiver.url)
    notifier = make_notifier(clean_db)
    receiver.status = 503
    expected = len(ingest(api, fleet_batch(slow_node="node-001"))["degraded"])
    drain(notifier, rounds=3)
    assert receiver.events == []
    log = api.get(f"/v1/webhooks/{hook}/deliveries",
                  headers={"Authorization": f"Bearer {api.tokens['admin']}"}).json()
    assert log and all(d["status"] == "pending" and d["last_status_code"] == 503 for d in log)

    receiver.status = 200
    drain(notifier)
    deliveries = [e["delivery"] for e in receiver.events]
    assert len(deliveries) == len(set(deliveries)) == expected
    log = api.get(f"/v1/webhooks/{hook}/deliveries",
                  headers={"Authorization": f"Bearer {api.tokens['admin']}"}).json()
    assert {d["status"] for d in log} == {"delivered"}
    assert min(d["attempts"] for d in log) >= 2
    notifier.close()


def test_two_notifiers_send_nothing_twice(api, clean_db, receiver) -> None:
    register(api, receiver.url)
    expected = len(ingest(api, fleet_batch(slow_node="node-003", nodes=6))["degraded"])
    notifiers = [make_notifier(clean_db, batch=2) for _ in range(2)]
    threads = [threading.Thread(target=drain, args=(n, 20)) for n in notifiers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    deliveries = [e["delivery"] for e in receiver.events]
    assert len(deliveries) == expected
    assert len(set(deliveries)) == expected
    for n in notifiers:
        n.close()


def test_delivery_gives_up_after_max_age(api, clean_db, receiver) -> None:
    hook = register(api, receiver.url)
    receiver.status = 500
    ingest(api, fleet_batch(slow_node="node-001"))
    notifier = make_notifier(clean_db, policy=RetryPolicy(base_s=10.0, cap_s=10.0, max_age_s=1.0))
    drain(notifier)
    log = api.get(f"/v1/webhooks/{hook}/deliveries",
                  headers={"Authorization": f"Bearer {api.tokens['admin']}"}).json()
    assert log and {d["status"] for d in log} == {"failed"}
    notifier.close()


def test_test_endpoint_sends_a_test_event(api, clean_db, receiver) -> None:
    hook = register(api, receiver.url)
    r = api.post(f"/v1/webhooks/{hook}/test", headers={"Authorization": f"Bearer {api.tokens['admin']}"})
    assert r.status_code == 202
    drain(make_notifier(clean_db))
    assert [e["event"] for e in receiver.events] == ["webhook.test"]
    assert receiver.events[0]["verified"]


def test_run_forever_delivers_until_stopped(api, clean_db, receiver) -> None:
    register(api, receiver.url)
    notifier = make_notifier(clean_db)
    stop = threading.Event()
    loop = threading.Thread(target=notifier.run_forever, args=(0.2, stop))
    loop.start()
    try:
        expected = len(ingest(api, fleet_batch(slow_node="node-000"))["degraded"])
        assert len(receiver.wait_for(expected, timeout_s=30)) == expected
    finally:
        stop.set()
        loop.join(timeout=10)
    assert not loop.is_alive()
    notifier.close()


def test_a_probe_error_is_its_own_event_and_excludes_the_node(api, clean_db, receiver) -> None:
    """An error in a rank (CUDA OOM, an NCCL error) is not a hang: it opens a probe_error
    finding, fires probe.error (not probe.hang) and keeps the node out of a preflight."""
    register(api, receiver.url, events=("probe.error", "probe.hang"))
    notifier = make_notifier(clean_db)
    batch = fleet_batch()
    batch["findings"] = [{"kind": "probe_error", "node": "node-001", "gpu": 1,
                          "detail": {"stage": "alltoall/1048576", "origin": "local",
                                     "error": "CUDA out of memory", "peers_failed": ["node-001/0"]}}]
    ingest(api, batch)
    drain(notifier)
    assert [e["event"] for e in receiver.events] == ["probe.error"]
    assert receiver.events[0]["body"]["finding"]["kind"] == "probe_error"
    reader = {"Authorization": f"Bearer {api.tokens['reader']}"}
    v = api.post("/v1/preflight", json={"nodes": ["node-000", "node-001", "node-002"]},
                 headers=reader).json()
    assert v["healthy"] is False and v["exclude"] == ["node-001"]
    notifier.close()
