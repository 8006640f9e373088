"""The scheduler's side of the API besides shipping results: preflight claims."""

from __future__ import annotations

import logging
from typing import Any

import httpx

from agents.groups import Group
from services.analyzer.assess import LinkKey

log = logging.getLogger(__name__)


class SchedulerApi:
    def __init__(self, api_url: str, token: str, worker: str, timeout_s: float = 10.0) -> None:
        self.worker = worker
        self.client = httpx.Client(base_url=api_url.rstrip("/"), timeout=timeout_s,
                                   headers={"Authorization": f"Bearer {token}"})

    def claim_preflight(self, lease_s: float) -> dict[str, Any] | None:
        """The oldest waiting preflight request, leased to this worker; None if none or unreachable."""
        try:
            resp = self.client.post("/v1/preflight/claim", json={"worker": self.worker, "lease_s": lease_s})
        except httpx.HTTPError:
            return None
        return resp.json() if resp.status_code == 200 else None

    def renew_preflight(self, request_id: str, lease_s: float) -> bool:
        """Extend this worker's claim by ``lease_s`` from now; False if it is no longer held
        or the API did not answer (the check goes on; completing will say which)."""
        try:
            resp = self.client.post(f"/v1/preflight/{request_id}/renew",
                                    json={"worker": self.worker, "lease_s": lease_s})
        except httpx.HTTPError:
            return False
        return resp.status_code == 200

    def complete_preflight(self, request_id: str, error: str | None = None,
                           verdict: dict[str, Any] | None = None) -> dict[str, Any]:
        resp = self.client.post(f"/v1/preflight/{request_id}/complete",
                                json={"worker": self.worker, "error": error, "verdict": verdict})
        resp.raise_for_status()
        return resp.json()

    def baselines(self, dtype: str = "float32", page: int = 10_000) -> dict[LinkKey, list[float]]:
        """Every link's own normal the API holds (``GET /v1/baselines``), keyed as the
        judgement reads history, so a check judges its links as the API will judge its
        batch. Empty, with a warning, when the API cannot be read: the check then judges
        against peers and the hardware model alone."""
        out: dict[LinkKey, list[float]] = {}
        params: dict[str, Any] = {"limit": page}
        try:
            while True:
                resp = self.client.get("/v1/baselines", params=params)
                resp.raise_for_status()
                for row in resp.json():
                    # assess.link_key of a measurement of this link at its judged size.
                    key = (row["op"], row["scope"], int(row["size_bytes"]), dtype,
                           Group(row["members"]))
                    out[key] = [float(v) for v in row["values"]]
                cursor = resp.headers.get("X-Next-Cursor")
                if not cursor:
                    return out
                params = {"limit": page, "after": cursor}
        except (httpx.HTTPError, ValueError, KeyError) as exc:
            log.warning("link baselines not read (%s): judging against peers and the "
                        "hardware model only", exc)
            return {}

    def close(self) -> None:
        self.client.close()
