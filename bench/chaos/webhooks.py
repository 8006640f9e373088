"""Faults aimed at webhooks: URLs that point inside the network (SSRF), and deliveries
captured and replayed against a receiver's signature check."""

from __future__ import annotations

import importlib.util
import time

import httpx

from bench.chaos.harness import Row, Stage, wait_until
from ringwatch.services.notifier.receiver import WebhookReceiver

SECRET = "chaos-webhook-secret"
NOT_PRESENT = "not run: webhook hardening not present"

# Each must be refused (422, error "url_refused") unless its network is allowed.
INTERNAL_URLS = (
    "http://127.0.0.1:5432/",
    "http://169.254.169.254/latest/meta-data/",
    "http://[::1]/",
    "http://10.0.0.1/",
    "http://localhost/",
    "http://127.1/",
    "http://0.0.0.0/",
    "http://192.168.1.1/",
    "http://172.16.0.1/",
    "http://100.64.0.1/",
    "http://[fd00::1]/",
    "http://[fe80::1]/",
    "http://[::ffff:127.0.0.1]/",
    "http://[64:ff9b::a9fe:a9fe]/",
    "http://2130706433/",
    "http://0x7f000001/",
    "https://127.0.0.1:8420/v1/tokens",
    "http://user:pass@10.1.2.3:8080/",
)


def hardened() -> bool:
    """Whether the webhook URL policy is part of this checkout."""
    return importlib.util.find_spec("ringwatch.services.notifier.url_policy") is not None


def ssrf(admin_url: str | None = None) -> Row:
    """POST /v1/webhooks with internal URLs: each refused with ``url_refused`` when no network
    is allowed; with 127.0.0.1/32 allowed, only that address is let through. A webhook
    registered while its network was allowed gets nothing once the allowance is gone: the
    policy is applied again at delivery."""
    row = Row("SSRF attempts on webhook URLs", None, note=NOT_PRESENT)
    if not hardened():
        return row
    row.survived = False
    stage = Stage("ssrf", admin_url, env={"RINGWATCH_WEBHOOK_ALLOWED_NETWORKS": "[]",
                                          "RINGWATCH_NOTIFIER_POLL_S": "0.2"})
    try:
        api = stage.start_api(notifier=True)
        problems: list[str] = []
        with WebhookReceiver(SECRET) as rx, stage.client(stage.admin) as admin:
            for url in (*INTERNAL_URLS, rx.url):
                problems += _refused(admin, url)
            stop_api(api)
            api = stage.start_api(notifier=True, env={"RINGWATCH_WEBHOOK_ALLOWED_NETWORKS": '["127.0.0.1/32"]'})
            resp = admin.post("/v1/webhooks", json=_hook(rx.url))
            if resp.status_code != 201:
                problems.append(f"{rx.url} with 127.0.0.1/32 allowed: {resp.status_code} {resp.text[:120]}")
            hook = resp.json().get("id") if resp.status_code == 201 else None
            for url in ("http://169.254.169.254/", "http://10.0.0.1/", "http://[::1]/", "http://127.0.0.2/"):
                problems += _refused(admin, url, "with 127.0.0.1/32 allowed")
            # The allowance is withdrawn: the registered receiver must not be called.
            stop_api(api)
            api = stage.start_api(notifier=True)
            if hook is not None:
                admin.post(f"/v1/webhooks/{hook}/test").raise_for_status()
                tried = wait_until(lambda: stage.scalar(
                    "SELECT attempts FROM webhook_deliveries WHERE webhook_id = :w", w=hook), 30)
                time.sleep(1.0)
                if rx.requests:
                    problems.append(f"a delivery reached {rx.url} after its network was disallowed")
                if not tried:
                    problems.append("the delivery to a disallowed network was never attempted")
        row.survived = not problems and api.poll() is None
        row.note = (f"{len(INTERNAL_URLS) + 1 + 4} URLs refused as expected, 1 allowed; delivery "
                    "re-checked" if not problems else f"{len(problems)} wrong: " + "; ".join(problems[:6]))
        return row
    finally:
        stage.close(keep_logs=not row.met)


def stop_api(proc) -> None:
    from ringwatch.services.cli.api_process import stop

    stop(proc)


def _hook(url: str) -> dict:
    return {"url": url, "secret": SECRET, "events": ["health.degraded"]}


def _refused(admin: httpx.Client, url: str, context: str = "") -> list[str]:
    resp = admin.post("/v1/webhooks", json=_hook(url))
    try:
        code = resp.json().get("error")
    except ValueError:
        code = None
    if resp.status_code == 422 and code == "url_refused":
        return []
    return [f"{url}{' ' + context if context else ''}: {resp.status_code} {code or resp.text[:80]}"]


def replayed_signature(admin_url: str | None = None) -> Row:
    """A real delivery is captured at the receiver. Its signature verifies now; the same
    bytes are refused once the tolerance has passed, under another delivery id, with the
    body altered, with the time in the header moved, or with another secret."""
    row = Row("replayed signatures", None, note=NOT_PRESENT)
    if not hardened():
        return row
    from ringwatch.services.notifier.channels import verify

    row.survived = False
    stage = Stage("replay", admin_url, env={"RINGWATCH_NOTIFIER_POLL_S": "0.2"})
    try:
        stage.start_api(notifier=True)
        with WebhookReceiver(SECRET) as rx, stage.client(stage.admin) as admin:
            hook = stage.webhook(admin, rx.url, SECRET, ["health.degraded"])
            admin.post(f"/v1/webhooks/{hook}/test").raise_for_status()
            got = rx.wait_for(1, timeout_s=30)
        if not got:
            row.note = "no delivery arrived to capture"
            return row
        e = got[0]
        raw, delivery, header = e["raw"], e["delivery"], e["signature"]
        t = int(header.split("t=", 1)[1].split(",", 1)[0])
        tolerance = 300.0
        checks = {
            "accepted now": (e["verified"] and verify(SECRET, raw, delivery, header), True),
            "replayed after the tolerance": (verify(SECRET, raw, delivery, header, tolerance, now=t + tolerance + 1), False),
            "dated ahead of the tolerance": (verify(SECRET, raw, delivery, header, tolerance, now=t - tolerance - 1), False),
            "under another delivery id": (verify(SECRET, raw, "00000000-0000-0000-0000-000000000000", header), False),
            "body with one byte changed": (verify(SECRET, raw.replace(b'"', b"'", 1), delivery, header), False),
            "body with a byte appended": (verify(SECRET, raw + b" ", delivery, header), False),
            "time in the header moved": (verify(SECRET, raw, delivery, header.replace(f"t={t}", f"t={t + 1}")), False),
            "another secret": (verify("another-secret-of-16+", raw, delivery, header), False),
            "no v1 at all": (verify(SECRET, raw, delivery, f"t={t}"), False),
        }
        wrong = [name for name, (got_, want) in checks.items() if bool(got_) != want]
        row.survived = not wrong
        row.note = (f"{len(checks)} checks on delivery {delivery[:8]}"
                    + (f"; wrong: {', '.join(wrong)}" if wrong else ""))
        return row
    finally:
        stage.close(keep_logs=not row.met)
