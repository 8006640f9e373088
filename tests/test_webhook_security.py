"""Webhook hardening: the URL policy (at registration and at delivery, after DNS), signatures
over time, delivery id and body, secrets encrypted at rest, delete/disable/rotate, delivery
claims kept by their holder, and a stalled receiver that holds up only itself.

Real Postgres, real HTTP to local receivers; the only name resolved is ``localhost``."""

from __future__ import annotations

import ipaddress
import re
import threading
import uuid
from pathlib import Path

import pytest
from sqlalchemy import select, text

from ringwatch.services.notifier import url_policy
from ringwatch.services.notifier.channels import sign, signature_header, verify
from ringwatch.services.notifier.loop import Notifier
from ringwatch.services.notifier.receiver import WebhookReceiver
from ringwatch.services.notifier.secret_box import SEALED_PREFIX, SecretBox, box_from_settings
from ringwatch.services.settings import Settings
from ringwatch.services.store import db, events
from ringwatch.services.store import webhooks as store
from ringwatch.services.store.models import Webhook, WebhookDelivery
from tests.api_fixtures import TEST_SECRET_KEY, WEBHOOK_EVENTS, api_client, fleet_batch
from tests.api_fixtures import register_webhook as register
from tests.test_notifier import SECRET, drain, ingest, make_notifier

ROOT = Path(__file__).resolve().parents[1]
EVENTS = list(WEBHOOK_EVENTS)


def a_hang() -> events.ProbeHang:
    """A probe.hang event with nothing in it: what is queued matters here, not what it says."""
    return events.ProbeHang(finding={}, finding_id=None, nodes=[], links=[], url="")


def delivery_log(api, hook: int, **params) -> list[dict]:
    resp = api.get(f"/v1/webhooks/{hook}/deliveries", headers=api.h["admin"], params=params)
    resp.raise_for_status()
    return resp.json()


# -- the URL policy --------------------------------------------------------------------

REFUSED = {
    "http://127.0.0.1:5432/": "loopback",
    "http://169.254.169.254/latest/meta-data/": "link-local",
    "http://[::1]:8080/": "loopback",
    "http://10.1.2.3/": "private",
    "http://172.16.0.1/": "private",
    "http://192.168.1.1/": "private",
    "http://100.64.0.1/": "private",
    "http://[fe80::1]/": "link-local",
    "http://[fc00::1]/": "private",
    "http://0.0.0.0/": "unspecified",
    "http://224.0.0.1/": "multicast",
    "http://240.0.0.1/": "reserved",
    "http://192.0.2.10/": "public",
    "http://[::ffff:127.0.0.1]/": "IPv6 form of 127.0.0.1, a loopback",
    "http://[::ffff:169.254.169.254]/": "link-local",
    "http://[64:ff9b::a00:1]/": "IPv6 form of 10.0.0.1, a private",
    "http://[2002:c0a8:101::]/": "IPv6 form of 192.168.1.1",
    # Names resolve first: localhost and the short form of 127.0.0.1 are loopback.
    "http://localhost:9/": "resolves to",
    "http://127.1/": "resolves to 127.0.0.1",
}


@pytest.mark.parametrize("url,reason", REFUSED.items())
def test_internal_addresses_are_refused(url: str, reason: str) -> None:
    with pytest.raises(url_policy.UrlRefused, match=re.escape(reason)) as err:
        url_policy.check_url(url, [])
    assert err.value.status_code == 422 and err.value.code == "url_refused"
    assert "RINGWATCH_WEBHOOK_ALLOWED_NETWORKS" in err.value.message


@pytest.mark.parametrize("url", ["ftp://8.8.8.8/x", "file:///etc/passwd", "http:///nohost"])
def test_only_http_urls_with_a_host_pass(url: str) -> None:
    with pytest.raises(url_policy.UrlRefused):
        url_policy.check_url(url, [])


def test_public_addresses_pass_and_allowed_networks_open_internal_ones() -> None:
    url_policy.check_url("https://8.8.8.8/hook", [])
    url_policy.check_url("http://[2606:4700::1111]/hook", [])
    url_policy.check_url("http://10.20.1.5:8080/hook", ["10.20.0.0/16"])
    # The IPv4-mapped form of an allowed address is allowed as well.
    url_policy.check_url("http://[::ffff:10.20.1.5]/hook", ["10.20.0.0/16"])
    with pytest.raises(url_policy.UrlRefused, match="private"):
        url_policy.check_url("http://10.21.0.1/hook", ["10.20.0.0/16"])
    # Every address a name resolves to must pass, not only the first.
    checked = url_policy.resolve("http://localhost:9/", ["127.0.0.0/8", "::1/128"])
    assert ipaddress.ip_address("127.0.0.1") in checked.addresses


def test_a_pinned_request_goes_to_the_checked_address_under_the_urls_name() -> None:
    checked = url_policy.CheckedUrl(url_policy.httpx.URL("https://hooks.example:8443/in?x=1"),
                                    (ipaddress.ip_address("203.0.113.7"),))
    url, headers, extensions = checked.pinned(checked.addresses[0])
    assert str(url) == "https://203.0.113.7:8443/in?x=1"
    assert headers == {"Host": "hooks.example:8443"}
    # TLS: the server name sent, and the one the certificate is checked against.
    assert extensions == {"sni_hostname": "hooks.example"}
    v6 = checked.pinned(ipaddress.ip_address("2001:db8::7"))[0]
    assert str(v6) == "https://[2001:db8::7]:8443/in?x=1"


def test_allowed_networks_are_read_as_json_or_comma_separated(monkeypatch) -> None:
    monkeypatch.setenv("RINGWATCH_WEBHOOK_ALLOWED_NETWORKS", '["10.0.0.0/8", "fd00::/8"]')
    assert Settings().webhook_allowed_networks == ["10.0.0.0/8", "fd00::/8"]
    monkeypatch.setenv("RINGWATCH_WEBHOOK_ALLOWED_NETWORKS", "10.1.2.3, 192.168.0.0/16")
    assert Settings().webhook_allowed_networks == ["10.1.2.3/32", "192.168.0.0/16"]
    monkeypatch.setenv("RINGWATCH_WEBHOOK_ALLOWED_NETWORKS", "not-a-network")
    with pytest.raises(ValueError, match="webhook_allowed_networks"):
        Settings()


def test_the_api_refuses_internal_urls_unless_allowed(clean_db) -> None:
    with api_client(clean_db, {"webhook_allowed_networks": []}) as api:
        for url in ("http://127.0.0.1:5432/", "http://169.254.169.254/", "http://[::1]/"):
            r = api.post("/v1/webhooks", headers=api.h["admin"],
                         json={"url": url, "secret": SECRET, "events": EVENTS})
            assert r.status_code == 422, url
            assert r.json()["error"] == "url_refused" and "refused" in r.json()["message"]
        assert api.get("/v1/webhooks", headers=api.h["admin"]).json() == []
        hook = register(api, "https://8.8.8.8/hook")
        r = api.patch(f"/v1/webhooks/{hook}", headers=api.h["admin"],
                      json={"url": "http://10.0.0.1/hook"})
        assert r.status_code == 422 and r.json()["error"] == "url_refused"
        assert api.get(f"/v1/webhooks/{hook}", headers=api.h["admin"]).json()["url"] == "https://8.8.8.8/hook"


def test_a_refused_address_is_not_connected_to_at_delivery(api, clean_db, receiver) -> None:
    """The webhook was allowed when registered; the notifier's policy no longer allows it."""
    hook = register(api, receiver.url)
    ingest(api, fleet_batch(slow_node="node-001"))
    notifier = make_notifier(clean_db, allowed_networks=[])
    drain(notifier)
    notifier.close()
    assert receiver.requests == 0
    log = delivery_log(api, hook)
    assert log and {d["status"] for d in log} == {"failed"}
    assert all(d["attempts"] == 1 and d["last_status_code"] is None for d in log)
    assert all(d["last_error"].startswith("refused by URL policy: 127.0.0.1 is a loopback address")
               for d in log)
    # Nothing about what answers on that port: no connection, no HTTP status.
    assert not any(re.search(r"connect|refused:|timeout|http \d", d["last_error"].lower()
                             .removeprefix("refused by url policy")) for d in log)


def test_a_name_is_resolved_checked_and_connected_to_by_address(api, clean_db, receiver) -> None:
    """``localhost`` resolves to 127.0.0.1 (and perhaps ::1, where nothing listens: the next
    checked address is tried); the receiver sees the name in Host although the connection
    went to the checked address."""
    port = receiver.url.split(":")[2].split("/")[0]
    register(api, f"http://localhost:{port}/hook")
    ingest(api, fleet_batch(slow_node="node-002"))
    notifier = make_notifier(clean_db, allowed_networks=["127.0.0.0/8", "::1/128"])
    drain(notifier)
    notifier.close()
    assert receiver.events and all(e["verified"] for e in receiver.events)
    assert {e["host"] for e in receiver.events} == {f"localhost:{port}"}

    # Allowing only ::1 leaves 127.0.0.1 refused: one refused address refuses the name.
    with pytest.raises(url_policy.UrlRefused, match="localhost resolves to 127.0.0.1"):
        url_policy.check_url(f"http://localhost:{port}/", ["::1/128"])


# -- signatures ------------------------------------------------------------------------

def test_a_signature_binds_time_delivery_and_body_within_a_tolerance() -> None:
    body, t = b'{"event":"probe.hang"}', 1_800_000_000
    header = sign(SECRET, body, "d-1", t)
    assert verify(SECRET, body, "d-1", header, now=t + 299)
    assert verify(SECRET, body, "d-1", header, now=t - 299)
    assert not verify(SECRET, body, "d-1", header, now=t + 301)  # a replay after the window
    assert verify(SECRET, body, "d-1", header, tolerance_s=600, now=t + 500)
    # The time is signed: moving t into the window breaks the signature.
    forged = header.replace(f"t={t}", f"t={t + 400}")
    assert not verify(SECRET, body, "d-1", forged, now=t + 400)
    for bad in ("", "v1=" + "0" * 64, f"t={t}", f"t=x,{header}", f"{header},t={t}", "sha256=abc"):
        assert not verify(SECRET, body, "d-1", bad, now=t)
    # Two secrets (a rotation's grace period): either one verifies.
    both = signature_header(["new-secret-0123456789", SECRET], body, "d-1", t)
    assert both.count("v1=") == 2 and both.startswith(f"t={t},v1=")
    assert verify(SECRET, body, "d-1", both, now=t)
    assert verify(["other-secret-01234", "new-secret-0123456789"], body, "d-1", both, now=t)
    assert not verify("other-secret-01234", body, "d-1", both, now=t)


def test_deliveries_carry_sequence_time_and_signature(api, clean_db, receiver) -> None:
    register(api, receiver.url)
    ingest(api, fleet_batch(slow_node="node-002"))
    ingest(api, fleet_batch())
    notifier = make_notifier(clean_db)
    drain(notifier)
    notifier.close()
    events = receiver.events
    assert {e["event"] for e in events} == {"health.degraded", "health.recovered"}
    assert all(e["verified"] for e in events)
    assert all(re.fullmatch(r"t=\d+,v1=[0-9a-f]{64}", e["signature"]) for e in events)
    # The sequence is the event's number, in the header and the body alike, and every
    # recovery was written after the degradation it ends.
    assert all(e["sequence"] == e["body"]["sequence"] for e in events)
    assert len({e["sequence"] for e in events}) == len(events)
    degraded = [e["sequence"] for e in events if e["event"] == "health.degraded"]
    recovered = [e["sequence"] for e in events if e["event"] == "health.recovered"]
    assert max(degraded) < min(recovered)
    # A captured delivery does not verify once outside the window.
    e = events[0]
    t = int(e["signature"].split(",")[0][2:])
    assert not verify(SECRET, e["raw"], e["delivery"], e["signature"], now=t + 301)


def test_the_slack_body_stays_slack_shaped(api, clean_db, receiver) -> None:
    register(api, receiver.url, format="slack")
    ingest(api, fleet_batch(slow_node="node-002"))
    drain(make_notifier(clean_db))
    assert receiver.events and all(set(e["body"]) == {"text", "blocks"} for e in receiver.events)
    assert all(e["sequence"] is not None and e["verified"] for e in receiver.events)


def docs_snippet() -> str:
    doc = (ROOT / "docs" / "webhooks.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", doc, re.S)
    [snippet] = [b for b in blocks if "def verify_ringwatch" in b]
    return snippet


def test_the_verification_snippet_in_the_docs_verifies_a_real_delivery(api, clean_db, receiver) -> None:
    register(api, receiver.url)
    ingest(api, fleet_batch(slow_node="node-003"))
    drain(make_notifier(clean_db))
    assert receiver.events
    namespace: dict = {}
    exec(compile(docs_snippet(), "docs/webhooks.md", "exec"), namespace)
    verify_ringwatch = namespace["verify_ringwatch"]
    for e in receiver.events:
        headers = {"X-Ringwatch-Signature": e["signature"], "X-Ringwatch-Delivery": e["delivery"]}
        assert verify_ringwatch(SECRET, e["raw"], headers)
        assert not verify_ringwatch("not-the-secret-000", e["raw"], headers)
        assert not verify_ringwatch(SECRET, e["raw"] + b" ", headers)
        t = int(e["signature"].split(",")[0][2:])
        assert not verify_ringwatch(SECRET, e["raw"], headers, now=t + 301)


# -- secrets ---------------------------------------------------------------------------

@pytest.mark.parametrize("secret,why", [
    ("change-me", "placeholder"), ("CHANGE-ME-please-12345", "placeholder"),
    ("short-secret", "at least 16"), ("a-long-secret-with\nnewline", "control characters"),
])
def test_weak_secrets_are_refused(api, secret: str, why: str) -> None:
    r = api.post("/v1/webhooks", headers=api.h["admin"],
                 json={"url": "https://8.8.8.8/x", "secret": secret, "events": EVENTS})
    assert r.status_code == 422 and r.json()["error"] == "invalid_input"
    assert why in r.json()["message"] and secret not in r.text
    r = api.post("/v1/webhooks/1/rotate", headers=api.h["admin"], json={"secret": secret})
    assert r.status_code == 422


def test_secrets_are_encrypted_at_rest_and_never_returned(api, clean_db) -> None:
    hook = register(api, "https://8.8.8.8/hook")
    with db.transaction(clean_db) as s:
        stored = s.get(Webhook, hook).secret
    assert stored.startswith(SEALED_PREFIX) and SECRET not in stored
    assert SecretBox.from_setting(TEST_SECRET_KEY).open(stored) == SECRET
    listed = api.get("/v1/webhooks", headers=api.h["admin"])
    one = api.get(f"/v1/webhooks/{hook}", headers=api.h["admin"])
    assert SECRET not in listed.text + one.text and SEALED_PREFIX not in listed.text + one.text
    assert "secret" not in one.json() and "secret" not in listed.json()[0]


def test_without_a_key_no_webhook_can_be_registered(clean_db) -> None:
    with api_client(clean_db, {"secret_key": ""}) as api:
        r = api.post("/v1/webhooks", headers=api.h["admin"],
                     json={"url": "https://8.8.8.8/x", "secret": SECRET, "events": EVENTS})
        assert r.status_code == 503 and r.json()["error"] == "not_configured"
        assert "RINGWATCH_SECRET_KEY" in r.json()["message"]
        assert "503" in api.get("/openapi.json").json()["paths"]["/v1/webhooks"]["post"]["responses"]


def test_a_passphrase_key_and_the_demo_key(tmp_path) -> None:
    box = SecretBox.from_setting("a long passphrase for ringwatch")
    sealed = box.seal(SECRET)
    assert SecretBox.from_setting("a long passphrase for ringwatch").open(sealed) == SECRET
    with pytest.raises(Exception, match="16 characters"):
        SecretBox.from_setting("too short")
    assert box_from_settings(Settings(secret_key="")) is None
    demo = Settings(secret_key="", demo=True, state_dir=tmp_path)
    first, again = box_from_settings(demo), box_from_settings(demo)
    assert first is not None and again is not None
    assert again.open(first.seal(SECRET)) == SECRET
    assert (tmp_path / "webhook-secret.key").stat().st_mode & 0o077 == 0


def test_a_plaintext_secret_from_before_encryption_still_signs_and_is_encrypted(
        api, clean_db, receiver) -> None:
    with db.transaction(clean_db) as s:
        hook = store.create_webhook(s, receiver.url, SECRET, EVENTS).id  # as stored before 0008
    ingest(api, fleet_batch(slow_node="node-001"))
    # A notifier without a key still signs with it (nothing to decrypt) and leaves it.
    drain(make_notifier(clean_db, box=None))
    assert receiver.events and all(e["verified"] for e in receiver.events)
    with db.transaction(clean_db) as s:
        assert s.get(Webhook, hook).secret == SECRET
    # One with the key encrypts it, and deliveries still verify with the same secret.
    make_notifier(clean_db).run_once()
    with db.transaction(clean_db) as s:
        stored = s.get(Webhook, hook).secret
    assert stored.startswith(SEALED_PREFIX)
    assert SecretBox.from_setting(TEST_SECRET_KEY).open(stored) == SECRET
    before = len(receiver.events)
    ingest(api, fleet_batch())
    drain(make_notifier(clean_db))
    assert len(receiver.events) > before and all(e["verified"] for e in receiver.events)


def test_an_encrypted_secret_without_the_key_waits_and_is_sent_once_the_key_is_set(
        api, clean_db, receiver) -> None:
    hook = register(api, receiver.url)
    ingest(api, fleet_batch(slow_node="node-001"))
    drain(make_notifier(clean_db, box=None), rounds=2)
    assert receiver.requests == 0
    log = delivery_log(api, hook)
    assert log and all(d["status"] == "pending" and "RINGWATCH_SECRET_KEY" in d["last_error"]
                       for d in log)
    drain(make_notifier(clean_db))
    assert len(receiver.events) == len(log) and all(e["verified"] for e in receiver.events)


# -- delete, disable, rotate, the log ---------------------------------------------------

def test_delete_removes_the_webhook_and_its_queued_deliveries(api, clean_db, receiver) -> None:
    hook = register(api, receiver.url)
    ingest(api, fleet_batch(slow_node="node-001"))
    with db.transaction(clean_db) as s:
        store.dispatch_outbox(s)
    assert delivery_log(api, hook)
    r = api.delete(f"/v1/webhooks/{hook}", headers=api.h["admin"])
    assert r.status_code == 204 and r.content == b""
    drain(make_notifier(clean_db))
    assert receiver.requests == 0
    assert api.get(f"/v1/webhooks/{hook}/deliveries", headers=api.h["admin"]).status_code == 404
    again = api.delete(f"/v1/webhooks/{hook}", headers=api.h["admin"])
    assert again.status_code == 404 and again.json()["error"] == "not_found"
    assert api.delete("/v1/webhooks/1", headers=api.h["reader"]).status_code == 403


def test_a_disabled_webhook_gets_nothing_until_enabled(api, clean_db, receiver) -> None:
    hook = register(api, receiver.url)
    ingest(api, fleet_batch(slow_node="node-001"))
    with db.transaction(clean_db) as s:
        store.dispatch_outbox(s)  # queued while active
    r = api.patch(f"/v1/webhooks/{hook}", headers=api.h["admin"], json={"active": False})
    assert r.status_code == 200 and r.json()["active"] is False
    ingest(api, fleet_batch())  # recovered while disabled: no delivery is made for it
    drain(make_notifier(clean_db))
    assert receiver.requests == 0

    r = api.patch(f"/v1/webhooks/{hook}", headers=api.h["admin"],
                  json={"active": True, "events": ["health.degraded", "health.recovered"]})
    assert r.json()["active"] is True and r.json()["events"] == ["health.degraded", "health.recovered"]
    drain(make_notifier(clean_db))
    assert receiver.events and {e["event"] for e in receiver.events} == {"health.degraded"}
    assert api.patch("/v1/webhooks/999", headers=api.h["admin"], json={"active": False}).status_code == 404


def test_rotation_signs_with_both_secrets_during_the_grace_period(api, clean_db) -> None:
    with WebhookReceiver(SECRET) as old_rx, WebhookReceiver(SECRET) as new_rx:
        old_hook, new_hook = register(api, old_rx.url), register(api, new_rx.url)
        r = api.post(f"/v1/webhooks/{old_hook}/rotate", headers=api.h["admin"], json={"grace_s": 3600})
        assert r.status_code == 200
        rotated = r.json()
        assert rotated["id"] == old_hook and len(rotated["secret"]) >= 32
        assert rotated["previous_secret_expires_at"] is not None
        assert rotated["secret"] not in api.get(f"/v1/webhooks/{old_hook}", headers=api.h["admin"]).text
        chosen = "a-chosen-secret-0123456789"
        r = api.post(f"/v1/webhooks/{new_hook}/rotate", headers=api.h["admin"], json={"secret": chosen})
        assert r.json()["secret"] == chosen and r.json()["previous_secret_expires_at"] is None
        new_rx.secrets = [chosen]

        ingest(api, fleet_batch(slow_node="node-001"))
        drain(make_notifier(clean_db))
        # In the grace period both v1 entries are sent: the old secret still verifies ...
        assert old_rx.events and all(e["verified"] and e["signature"].count("v1=") == 2
                                     for e in old_rx.events)
        assert all(verify(rotated["secret"], e["raw"], e["delivery"], e["signature"]) for e in old_rx.events)
        # ... and without a grace period only the new one is signed with.
        assert new_rx.events and all(e["signature"].count("v1=") == 1 and e["verified"]
                                     for e in new_rx.events)
        assert not any(verify(SECRET, e["raw"], e["delivery"], e["signature"]) for e in new_rx.events)

        # Once the grace period is over, the old secret no longer signs.
        with db.transaction(clean_db) as s:
            s.execute(text("UPDATE webhooks SET previous_secret_expires_at = now() - interval '1 s'"))
        before = len(old_rx.events)
        ingest(api, fleet_batch())
        drain(make_notifier(clean_db))
        later = old_rx.events[before:]
        assert later and not any(e["verified"] for e in later)
        assert all(verify(rotated["secret"], e["raw"], e["delivery"], e["signature"]) for e in later)
    r = api.post("/v1/webhooks/999/rotate", headers=api.h["admin"])
    assert r.status_code == 404


def test_the_delivery_log_pages_with_limit_and_before(api, clean_db) -> None:
    hook = register(api, "https://8.8.8.8/hook")
    with db.transaction(clean_db) as s:
        for _ in range(7):
            store.add_delivery(s, hook, events.emit(s, a_hang()).id)
    first = delivery_log(api, hook, limit=3)
    assert len(first) == 3 and [d["id"] for d in first] == sorted((d["id"] for d in first), reverse=True)
    second = delivery_log(api, hook, limit=3, before=first[-1]["id"])
    rest = delivery_log(api, hook, limit=3, before=second[-1]["id"])
    ids = [d["id"] for d in first + second + rest]
    assert len(ids) == 7 and len(set(ids)) == 7 and ids == sorted(ids, reverse=True)
    for bad in ({"limit": 0}, {"limit": 1001}, {"before": 0}):
        r = api.get(f"/v1/webhooks/{hook}/deliveries", headers=api.h["admin"], params=bad)
        assert r.status_code == 422 and r.json()["error"] == "invalid_input"


def test_the_new_routes_are_declared_in_openapi(api) -> None:
    paths = api.get("/openapi.json").json()["paths"]
    assert {"get", "patch", "delete"} <= set(paths["/v1/webhooks/{webhook_id}"])
    assert "post" in paths["/v1/webhooks/{webhook_id}/rotate"]
    params = {p["name"] for p in paths["/v1/webhooks/{webhook_id}/deliveries"]["get"]["parameters"]}
    assert {"limit", "before"} <= params


# -- claims and concurrency ------------------------------------------------------------

def queue(clean_db, hooks: int, per_hook: int) -> list[int]:
    with db.transaction(clean_db) as s:
        ids = [store.create_webhook(s, f"https://8.8.8.{i + 1}/", SECRET, [events.EventType.PROBE_HANG])
               .id for i in range(hooks)]
        for _ in range(per_hook):
            event = events.emit(s, a_hang())
            for h in ids:
                store.add_delivery(s, h, event.id)
    return ids


def test_only_the_holder_of_a_claim_records_its_outcome(clean_db) -> None:
    queue(clean_db, hooks=1, per_hook=1)
    a, b = uuid.uuid4(), uuid.uuid4()
    with db.transaction(clean_db) as s:
        [(delivery, _, _)] = store.claim_due(s, a, 10, lease_s=60, per_webhook=2)
        pk = delivery.id
    with db.transaction(clean_db) as s:
        assert store.claim_due(s, b, 10, lease_s=60, per_webhook=2) == []  # held by a
        # a's lease runs out (a stalled process): b takes the delivery over.
        s.execute(text("UPDATE webhook_deliveries SET claim_expires_at = now() - interval '1 s'"))
    with db.transaction(clean_db) as s:
        assert [d.id for d, _, _ in store.claim_due(s, b, 10, lease_s=60, per_webhook=2)] == [pk]
    with db.transaction(clean_db) as s:
        assert store.renew_claims(s, a, [pk], 60) == set()
        assert store.mark_delivered(s, pk, a, 200, s.scalar(select(text("now()")))) is False
        assert store.mark_failed(s, pk, a, status_code=500, error="x", retry_at=None) is False
    with db.transaction(clean_db) as s:
        row = s.get(WebhookDelivery, pk)
        assert (row.status, row.claimed_by, row.attempts) == ("pending", b, 2)
        assert store.renew_claims(s, b, [pk], 60) == {pk}
        assert store.mark_delivered(s, pk, b, 204, s.scalar(select(text("now()")))) is True
    with db.transaction(clean_db) as s:
        row = s.get(WebhookDelivery, pk)
        assert (row.status, row.last_status_code, row.claim_expires_at) == ("delivered", 204, None)


def test_claims_hold_at_most_two_in_flight_per_webhook_across_notifiers(clean_db) -> None:
    hooks = queue(clean_db, hooks=3, per_hook=4)
    a, b = uuid.uuid4(), uuid.uuid4()
    with db.transaction(clean_db) as s:
        claimed_a = store.claim_due(s, a, 100, lease_s=60, per_webhook=2)
    with db.transaction(clean_db) as s:
        claimed_b = store.claim_due(s, b, 100, lease_s=60, per_webhook=2)
    per_hook = {h: sum(1 for d, _, _ in claimed_a if d.webhook_id == h) for h in hooks}
    assert per_hook == {h: 2 for h in hooks}
    assert claimed_b == []  # every webhook already has two in flight
    with db.transaction(clean_db) as s:
        first = claimed_a[0][0]
        store.mark_delivered(s, first.id, a, 200, s.scalar(select(text("now()"))))
    with db.transaction(clean_db) as s:
        [(freed, _, _)] = store.claim_due(s, b, 100, lease_s=60, per_webhook=2)
    assert freed.webhook_id == first.webhook_id


def test_a_stalled_receiver_holds_up_only_its_own_deliveries(api, clean_db) -> None:
    """The slow receiver stalls for longer than the notifier's timeout; the healthy one gets
    the degradation and then the recovery while the slow one still has not answered."""
    with WebhookReceiver(SECRET) as slow, WebhookReceiver(SECRET) as healthy:
        slow.delay_s = 600.0
        register(api, slow.url)
        register(api, healthy.url)
        notifier = make_notifier(clean_db, timeout_s=300.0, concurrency=4)
        stop = threading.Event()
        loop = threading.Thread(target=notifier.run_forever, args=(0.2, stop))
        loop.start()
        try:
            degraded = len(ingest(api, fleet_batch(slow_node="node-001"))["degraded"])
            assert slow.wait_for_requests(1, timeout_s=60) >= 1  # the slow receiver is stalling
            assert len(healthy.wait_for(degraded, timeout_s=60)) == degraded
            recovered = len(ingest(api, fleet_batch())["recovered"])
            got = healthy.wait_for(degraded + recovered, timeout_s=60)
            assert [e["event"] for e in got].count("health.recovered") == recovered > 0
            # ... and all the while the slow receiver answered nothing.
            assert slow.events == [] and slow.requests >= 1
        finally:
            slow.release()
            stop.set()
            loop.join(timeout=60)
        assert not loop.is_alive()
        notifier.close()
    assert all(e["verified"] for e in healthy.events)


def test_notifier_settings_reach_the_notifier(clean_db) -> None:
    settings = Settings(database_url="unused", secret_key=TEST_SECRET_KEY, webhook_concurrency=3,
                        webhook_allowed_networks=["10.0.0.0/8"], webhook_timeout_s=2.0)
    notifier = Notifier.from_settings(clean_db, settings)
    try:
        assert notifier.concurrency == 3 and notifier.timeout_s == 2.0
        assert notifier.allowed_networks == [ipaddress.ip_network("10.0.0.0/8")]
        assert notifier.box is not None and notifier.box.open(notifier.box.seal("x" * 16)) == "x" * 16
        # The claim lease outlasts one whole attempt at the timeout, and is renewed while
        # the attempt lasts.
        assert notifier.lease_s > 3 * settings.webhook_timeout_s
    finally:
        notifier.close()
