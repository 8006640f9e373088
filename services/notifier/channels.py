"""Alert channels: how one event becomes one HTTP request body, and how it is signed.

A channel is a small plugin: ``render(event_type, sequence, payload) -> dict``. ``json``
is the generic webhook of docs/webhooks.md; ``slack`` is shaped for Slack incoming webhooks.
Slack renders what it is sent as mrkdwn, where an agent's free text (a headline, a cause,
evidence) could mention ``<!channel>`` or carry a labelled link: every text a Slack body
holds is escaped and cut to Slack's limit (``slack_text``). A ``json`` body is data for a
program, sent as stored; its receiver escapes for wherever it shows the text.

``X-Ringwatch-Signature`` is ``t=<unix seconds>,v1=<hex>``: HMAC-SHA256 with the webhook's
secret over ``f"{t}.{delivery_id}."`` and the raw body. The time bounds a replay to the
receiver's tolerance window; the delivery id ties the signature to one delivery. While a
rotated-out secret is in its grace period a second ``v1=`` signed with it follows.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from collections.abc import Callable, Sequence
from typing import Any

from ringwatch.agents.places import finding_place
from ringwatch.services.store import events

Render = Callable[[str, int, dict[str, Any]], dict[str, Any]]

# How far a signature's time may be from the receiver's clock (docs/webhooks.md).
TOLERANCE_S = 300.0


def _mac(secret: str, body: bytes, delivery_id: str, t: int) -> str:
    signed = f"{t}.{delivery_id}.".encode() + body
    return hmac.new(secret.encode(), signed, hashlib.sha256).hexdigest()


def sign(secret: str, body: bytes, delivery_id: str, t: int) -> str:
    """One ``t=…,v1=…`` header value for one secret."""
    return f"t={t},v1={_mac(secret, body, delivery_id, t)}"


def signature_header(secrets: Sequence[str], body: bytes, delivery_id: str, t: int) -> str:
    """``t=…,v1=…[,v1=…]``: one ``v1`` per secret, the current one first."""
    return ",".join([f"t={t}", *(f"v1={_mac(s, body, delivery_id, t)}" for s in secrets)])


def verify(secrets: str | Sequence[str], body: bytes, delivery_id: str, header: str,
           tolerance_s: float = TOLERANCE_S, now: float | None = None) -> bool:
    """Whether ``header`` carries a ``v1`` made with one of ``secrets`` at a time within
    ``tolerance_s`` of ``now``."""
    t, macs = _parse(header)
    if t is None or not macs:
        return False
    if abs((time.time() if now is None else now) - t) > tolerance_s:
        return False
    keys = [secrets] if isinstance(secrets, str) else list(secrets)
    # Every pair is compared, so the time taken says nothing about which one matched.
    matched = False
    for key in keys:
        expected = _mac(key, body, delivery_id, t)
        for mac in macs:
            matched |= hmac.compare_digest(expected, mac)
    return matched


def _parse(header: str) -> tuple[int | None, list[str]]:
    t: int | None = None
    macs: list[str] = []
    for item in header.split(","):
        key, _, value = item.strip().partition("=")
        if key == "t":
            if t is not None or not (value.isascii() and value.isdigit()):
                return None, []
            t = int(value)
        elif key == "v1" and value.isascii():
            macs.append(value)
    return t, macs


# The documented body, as the events module shapes it.
render_json: Render = events.body

# Slack's documented limits (api.slack.com/reference/block-kit/blocks): a section's text
# 3000 characters (a longer one is refused with a 400), a header's 150. The top-level
# ``text``, the notification's fallback, is held to a section's too.
SLACK_SECTION_MAX = 3000
SLACK_HEADER_MAX = 150
SLACK_TEXT_MAX = 3000
# What ends a text that was cut.
CUT = "…"
# The three characters Slack asks to be escaped (api.slack.com/reference/surfaces/formatting):
# with them escaped, no <!channel>, <@U…> or <url|label> in an agent's text acts.
_SLACK_ESCAPES = str.maketrans({"&": "&amp;", "<": "&lt;", ">": "&gt;"})


def slack_escape(text: str) -> str:
    return text.translate(_SLACK_ESCAPES)


def slack_cut(escaped: str, limit: int) -> str:
    """``escaped`` (already escaped) within ``limit`` characters, CUT at its end where it was
    longer; never cut inside an escape (every & of an escaped text starts one)."""
    if len(escaped) <= limit:
        return escaped
    kept = escaped[: limit - len(CUT)]
    amp = kept.rfind("&")
    if amp >= 0 and ";" not in kept[amp:]:
        kept = kept[:amp]
    return kept + CUT


def slack_text(text: str, limit: int = SLACK_SECTION_MAX) -> str:
    """Free text fit for a Slack mrkdwn field of ``limit`` characters."""
    return slack_cut(slack_escape(text), limit)


def _summary(event_type: str, payload: dict[str, Any]) -> str:
    """One line: the event, the fault's kind and place, and its headline (the figure every
    surface shows for the incident)."""
    finding = payload.get("finding") or {}
    where = finding_place(finding) or payload.get("group_key", "")
    line = f"[ringwatch] {event_type}: {finding.get('kind', '')} {where}".strip()
    headline = finding.get("headline")
    if isinstance(headline, dict) and isinstance(headline.get("text"), str):
        line += f": {headline['text']}"
    return line


def _field(key: str, value: Any) -> str:
    """``*key*: value``, escaped: the asterisks are ringwatch's bold, the rest is data."""
    shown = value.get("text", value) if key == "headline" and isinstance(value, dict) else value
    return f"*{slack_escape(str(key))}*: {slack_escape(str(shown))}"


def render_slack(event_type: str, sequence: int, payload: dict[str, Any]) -> dict[str, Any]:
    """Only Slack's own fields; the sequence travels in ``X-Ringwatch-Sequence``."""
    finding = payload.get("finding") or {}
    fields = [_field(k, v) for k, v in finding.items() if v not in (None, [], {})]
    summary = _summary(event_type, payload)
    return {
        "text": slack_text(summary, SLACK_TEXT_MAX),
        "blocks": [
            {"type": "section", "text": {"type": "mrkdwn", "text": slack_text(summary)}},
            {"type": "section", "text": {"type": "mrkdwn",
                                         "text": slack_cut("\n".join(fields), SLACK_SECTION_MAX)
                                         or " "}},
        ],
    }


CHANNELS: dict[str, Render] = {"json": render_json, "slack": render_slack}
