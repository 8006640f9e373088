"""Alert channels: how one event becomes one HTTP request body, and how it is signed.

A channel is a small plugin: ``render(event_type, payload) -> dict``. ``json`` is
the generic webhook of DESIGN.md; ``slack`` is shaped for Slack incoming webhooks.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable
from typing import Any

Render = Callable[[str, dict[str, Any]], dict[str, Any]]


def sign(secret: str, body: bytes) -> str:
    """``X-Ringwatch-Signature``: ``sha256=`` + hex HMAC-SHA256 of the raw body."""
    return "sha256=" + hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()


def verify(secret: str, body: bytes, signature: str) -> bool:
    return hmac.compare_digest(sign(secret, body), signature)


def render_json(event_type: str, payload: dict[str, Any]) -> dict[str, Any]:
    return {"event": event_type, **payload}


def _summary(event_type: str, payload: dict[str, Any]) -> str:
    finding = payload.get("finding") or {}
    where = finding.get("node") or ", ".join(finding.get("nodes") or []) or payload.get("group_key", "")
    return f"[ringwatch] {event_type}: {finding.get('kind', '')} {where}".strip()


def render_slack(event_type: str, payload: dict[str, Any]) -> dict[str, Any]:
    finding = payload.get("finding") or {}
    fields = [f"*{k}*: {v}" for k, v in finding.items() if v not in (None, [], {})]
    return {
        "text": _summary(event_type, payload),
        "blocks": [
            {"type": "section", "text": {"type": "mrkdwn", "text": _summary(event_type, payload)}},
            {"type": "section", "text": {"type": "mrkdwn", "text": "\n".join(fields) or " "}},
        ],
    }


CHANNELS: dict[str, Render] = {"json": render_json, "slack": render_slack}
