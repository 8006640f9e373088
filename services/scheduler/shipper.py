"""Ship result batches to the API; spool them on disk first so none is lost.

Every batch is written to the spool before the first send attempt and removed
only once the API has stored it, so a scheduler that dies mid-send, or an API
that is down for an hour, loses nothing: the next ``flush`` sends what is left.
The API stores a ``batch_id`` once, so sending a batch twice is harmless.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import httpx

log = logging.getLogger(__name__)


class Shipper:
    def __init__(self, api_url: str, token: str, spool_dir: Path, timeout_s: float = 10.0) -> None:
        self.api_url = api_url.rstrip("/")
        self.spool_dir = spool_dir
        self.rejected_dir = spool_dir / "rejected"
        self.spool_dir.mkdir(parents=True, exist_ok=True)
        self.client = httpx.Client(timeout=timeout_s, headers={"Authorization": f"Bearer {token}"})

    def ship(self, batch: dict[str, Any]) -> int:
        """Spool ``batch``, then send everything spooled; return how many batches remain."""
        self.spool(batch)
        return self.flush()

    def spool(self, batch: dict[str, Any]) -> Path:
        # Nanosecond prefix keeps send order; write-then-rename keeps half-written files out.
        path = self.spool_dir / f"{time.time_ns():020d}-{batch['batch_id']}.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(batch, default=str))
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())
        tmp.rename(path)
        return path

    def pending(self) -> list[Path]:
        return sorted(self.spool_dir.glob("*.json"))

    def flush(self) -> int:
        """Send spooled batches in order; stop at the first that the API cannot take now."""
        for path in self.pending():
            outcome = self._send(path)
            if outcome == "retry":
                break
            if outcome == "rejected":
                # The API will never take it (4xx): keep it for a human, out of the queue.
                self.rejected_dir.mkdir(exist_ok=True)
                path.rename(self.rejected_dir / path.name)
            else:
                path.unlink()
        return len(self.pending())

    def _send(self, path: Path) -> str:
        try:
            resp = self.client.post(f"{self.api_url}/v1/measurements", content=path.read_bytes(),
                                    headers={"Content-Type": "application/json"})
        except httpx.HTTPError as exc:
            log.warning("API unreachable (%s); %s stays spooled", exc, path.name)
            return "retry"
        if resp.status_code < 300:
            return "sent"
        if resp.status_code in (401, 403, 408, 429) or resp.status_code >= 500:
            log.warning("API answered %s; %s stays spooled", resp.status_code, path.name)
            return "retry"
        log.error("API rejected %s: %s", path.name, resp.text[:500])
        return "rejected"

    def close(self) -> None:
        self.client.close()
