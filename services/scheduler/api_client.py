"""The scheduler's side of the API besides shipping results: preflight claims."""

from __future__ import annotations

from typing import Any

import httpx


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

    def close(self) -> None:
        self.client.close()
