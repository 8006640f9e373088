"""The scheduler's side of the API besides shipping results: preflight claims."""

from __future__ import annotations

import logging
from datetime import datetime
from typing import Any

import httpx

from ringwatch.agents.groups import Group
from ringwatch.services.analyzer.assess import LinkKey
from ringwatch.services.scheduler.leader import LeaseRefused, NotLeader
from ringwatch.services.scheduler.shipper import token_prefix

log = logging.getLogger(__name__)


class SchedulerApi:
    def __init__(self, api_url: str, token: str, worker: str, timeout_s: float = 10.0) -> None:
        self.worker = worker
        # Enough of the token to tell which one the API refused, never the whole secret.
        self.token_prefix = token_prefix(token)
        # Why the last lease request got no answer, for the one line that says so.
        self.lease_error = ""
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

    # ---- one scheduler per fleet (docs/operations.md, "One scheduler per fleet") ----------

    def take_lease(self, fleet: str, lease_s: float) -> dict[str, Any] | None:
        """Take or renew the fleet's lease for this worker: the API's answer (``leader``,
        ``holder``, ``term``, ``expires_at``), or None where the API did not answer. A token
        the API refuses raises (an operator must act)."""
        try:
            resp = self.client.post("/v1/scheduler/lease", json={
                "fleet": fleet, "holder": self.worker, "lease_s": lease_s})
        except httpx.HTTPError as exc:
            self.lease_error = f"API unreachable ({type(exc).__name__})"
            return None
        if resp.status_code in (401, 403):
            raise LeaseRefused(f"the API refused token {self.token_prefix} for the fleet "
                               f"lease ({resp.status_code}): {_reason(resp)}")
        if resp.status_code != 200:
            self.lease_error = f"the API answered {resp.status_code}: {_reason(resp)}"
            return None
        answer: dict[str, Any] = resp.json()
        return answer

    def release_lease(self, fleet: str) -> None:
        """Hand the fleet's lease back (a clean stop): a standby takes over at once."""
        try:
            self.client.delete("/v1/scheduler/lease", params={"fleet": fleet,
                                                              "holder": self.worker})
        except httpx.HTTPError as exc:
            log.warning("fleet lease not handed back (%s): it runs out by itself", exc)

    def start_cycle(self, fleet: str, nodes: list[str]) -> tuple[int, list[str | None]]:
        """The fleet's next cycle number and its tournament seats, the node set reconciled
        (joins take vacant seats, leaves leave them). NotLeader where another scheduler
        holds the fleet now."""
        resp = self.client.post("/v1/scheduler/cycle", json={
            "fleet": fleet, "holder": self.worker, "nodes": nodes})
        if resp.status_code == 409:
            raise NotLeader(_reason(resp))
        resp.raise_for_status()
        body = resp.json()
        return int(body["cycle"]), list(body["slots"])

    def token_expires_at(self) -> datetime | None:
        """When this scheduler's own token expires (``GET /v1/tokens/self``); None where it
        never does or the API did not say."""
        try:
            resp = self.client.get("/v1/tokens/self")
            if resp.status_code != 200 or not resp.json().get("expires_at"):
                return None
            return datetime.fromisoformat(resp.json()["expires_at"])
        except (httpx.HTTPError, ValueError):
            return None

    def close(self) -> None:
        self.client.close()


def _reason(resp: httpx.Response) -> str:
    try:
        body = resp.json()
    except ValueError:
        return resp.text[:200]
    if isinstance(body, dict):
        return str(body.get("message") or body.get("error") or body)[:300]
    return str(body)[:300]
