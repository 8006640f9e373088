"""Ship result batches to the API; spool them on disk first so none is lost.

Every batch is written to the spool before the first send attempt and removed
only once the API has stored it, so a scheduler that dies mid-send, or an API
that is down for an hour, loses nothing: the next ``flush`` sends what is left.
The API stores a ``batch_id`` once, so sending a batch twice is harmless.

A batch the API cannot take now (unreachable, 429, 503) stops the queue until the API's
``Retry-After`` has passed. A batch the API fails on with another 5xx while it takes the
batches behind it is poisoned: after ``max_failures`` tries it moves to ``spool/failed/``
(kept for a human, counted) so later batches still flow. A 4xx moves to
``spool/rejected/`` at once. A refused token (401, 403) is said at ERROR each time the API
refuses it, and every batch stays spooled for when the operator has mended it.

The queue is bounded (``max_bytes``, RINGWATCH_SPOOL_MAX_BYTES): past it the oldest batches
are removed, each said and counted (``dropped``), so an API that is gone for days cannot
fill the scheduler's disk; nothing is removed while the queue fits.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from pathlib import Path
from typing import Any

import httpx

from ringwatch.services.logs import OutageLog, reason_of

log = logging.getLogger(__name__)


# Status codes that mean "not now" for every batch: wait, then send the same batch again.
BUSY = frozenset({408, 429, 502, 503, 504})
# The API's answers kept for the latest batches sent (``Shipper.answers``).
ANSWERS_KEPT = 16
# A refused token is the operator's to mend: between batches the shipper asks again this
# often, not at every flush, since each refusal is an ERROR line. A new batch asks at once.
REFUSED_RETRY_S = 300.0


def token_prefix(token: str) -> str:
    """Enough of a token to tell which one the API refused, never the whole secret."""
    return f"{token[:8]}…" if token else "(none)"


class Shipper:
    def __init__(self, api_url: str, token: str, spool_dir: Path, timeout_s: float = 60.0,
                 max_failures: int = 5, max_bytes: int | None = None) -> None:
        self.api_url = api_url.rstrip("/")
        self.spool_dir = spool_dir
        self.rejected_dir = spool_dir / "rejected"
        self.failed_dir = spool_dir / "failed"
        self.spool_dir.mkdir(parents=True, exist_ok=True)
        self.client = httpx.Client(timeout=timeout_s, headers={"Authorization": f"Bearer {token}"})
        self.max_failures = max_failures
        # The most bytes the queue holds (None: no bound); past it the oldest are dropped.
        self.max_bytes = max_bytes
        self.dropped = 0
        self.token_prefix = token_prefix(token)
        # The API's status for the last batch sent (None: unreachable or none sent yet), and
        # whether the API refuses the token (401, 403) as of the latest answer that says.
        self.last_status: int | None = None
        self.refused = False
        self._failures: dict[str, int] = {}
        self._not_before = 0.0
        self._refused_until = 0.0
        # The API unreachable or busy is said when it starts, once a minute and when it
        # ends, not at every try (a scheduler tries every second between cycles).
        self._api_away = OutageLog(log, f"the API at {api_url}", settle_s=0)
        # What the API said of each batch lately sent, by batch id.
        self.answers: dict[str, dict[str, Any]] = {}
        self.recovered = self._recover()

    def _recover(self) -> int:
        """Leftovers of a process killed mid-write: a ``.tmp`` that holds a whole batch is
        queued (it was fsynced before the rename that did not happen); a torn one is kept
        aside in ``rejected/`` for a human, never sent and never lost."""
        recovered = 0
        for tmp in sorted(self.spool_dir.glob("*.tmp")):
            try:
                json.loads(tmp.read_text())
            except (OSError, ValueError):
                self._move(tmp, self.rejected_dir)
                log.error("spool: %s was torn by a crash; kept in %s", tmp.name, self.rejected_dir)
                continue
            tmp.rename(tmp.with_suffix(".json"))
            recovered += 1
        if recovered:
            _fsync_dir(self.spool_dir)
            log.warning("spool: recovered %d batch(es) a crash left half-renamed", recovered)
        return recovered

    def ship(self, batch: dict[str, Any]) -> int:
        """Spool ``batch``, then send everything spooled; return how many batches remain.

        The batch carries what the spool holds (``shipper``, beside what the batch already
        says there of its sender: a scheduled cycle's interval), so the API's ``/metrics``
        shows batches waiting or moved aside on each host."""
        self.spool({**batch, "shipper": {**(batch.get("shipper") or {}), **self.state()}})
        self._refused_until = 0.0  # each new batch asks a refusing API again
        return self.flush()

    def state(self) -> dict[str, Any]:
        def count(d: Path) -> int:
            return len(list(d.glob("*.json"))) if d.exists() else 0

        return {"host": socket.gethostname(), "pending": len(self.pending()),
                "failed": count(self.failed_dir), "rejected": count(self.rejected_dir)}

    def spool(self, batch: dict[str, Any]) -> Path:
        # Nanosecond prefix keeps send order; write-then-rename keeps half-written files out.
        path = self.spool_dir / f"{time.time_ns():020d}-{batch['batch_id']}.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(batch, default=str))
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())
        tmp.rename(path)
        # The rename itself is durable only once the directory is: a power loss must not
        # take a batch the API was never sent.
        _fsync_dir(self.spool_dir)
        self._bound(keep=path)
        return path

    def pending(self) -> list[Path]:
        """The queue, oldest first."""
        return sorted(self.spool_dir.glob("*.json"))

    def spool_bytes(self) -> int:
        """Bytes of the batches in the queue (those moved aside not counted)."""
        return self.spool_state()[1]

    def spool_state(self) -> tuple[int, int]:
        """The queue's batches and their bytes, from one listing of the spool."""
        queue = self.pending()
        return len(queue), sum(_size(p) for p in queue)

    def _bound(self, keep: Path) -> None:
        """Remove the oldest batches until the queue fits in ``max_bytes``; never ``keep``
        (the batch just written), and nothing while the queue fits."""
        if self.max_bytes is None:
            return
        queue = [(p, _size(p)) for p in self.pending()]
        total = sum(size for _, size in queue)
        removed = False
        for path, size in queue:
            if total <= self.max_bytes or path == keep:
                break
            try:
                path.unlink()
            except FileNotFoundError:  # sent or moved meanwhile: it no longer counts
                total -= size
                continue
            total -= size
            removed = True
            self.dropped += 1
            self._failures.pop(path.name, None)
            log.warning("spool: dropped batch %s (%d bytes), never sent: the queue passed its "
                        "bound of %d bytes (RINGWATCH_SPOOL_MAX_BYTES); %d dropped so far",
                        _batch_id(path), size, self.max_bytes, self.dropped)
        if removed:
            _fsync_dir(self.spool_dir)

    def flush(self) -> int:
        """Send spooled batches in order; stop when the API cannot take any now."""
        if time.monotonic() < max(self._not_before, self._refused_until):
            return len(self.pending())
        for path in self.pending():
            outcome = self._send(path)
            if outcome == "busy":
                break
            if outcome == "rejected":
                # The API will never take it (4xx): keep it for a human, out of the queue.
                self._move(path, self.rejected_dir)
            elif outcome == "failed":
                tries = self._failures.get(path.name, 0) + 1
                self._failures[path.name] = tries
                if tries >= self.max_failures:
                    log.error("API failed %s %d times; moved to %s", path.name, tries,
                              self.failed_dir)
                    self._move(path, self.failed_dir)
                # else: left in the queue for the next flush; the batches behind it go on
            else:
                self._failures.pop(path.name, None)
                path.unlink()
        return len(self.pending())

    @property
    def moved_aside(self) -> int:
        """Batches kept out of the queue for a human: rejected (4xx) or failed (5xx)."""
        return sum(len(list(d.glob("*.json"))) for d in (self.rejected_dir, self.failed_dir)
                   if d.exists())

    def _move(self, path: Path, where: Path) -> None:
        where.mkdir(exist_ok=True)
        path.rename(where / path.name)
        _fsync_dir(where)
        self._failures.pop(path.name, None)

    def _send(self, path: Path) -> str:
        try:
            resp = self.client.post(f"{self.api_url}/v1/measurements", content=path.read_bytes(),
                                    headers={"Content-Type": "application/json"})
        except httpx.HTTPError as exc:
            self.last_status = None
            self._api_away.failed(f"{reason_of(exc)}; batches stay spooled until it answers")
            return "busy"
        self.last_status = resp.status_code
        if resp.status_code not in BUSY:
            self._api_away.ok()
        if resp.status_code < 300:
            self.refused = False
            self._answered(path, resp)
            return "sent"
        if resp.status_code in (401, 403):
            # A bad token is the operator's to fix and every batch would fail alike: loud at
            # every refusal (once a cycle), every batch kept for when it is mended.
            self.refused = True
            self._refused_until = time.monotonic() + REFUSED_RETRY_S
            log.error("API at %s refused token %s with %s (%s): %s and every later batch "
                      "stay spooled until the token is mended", self.api_url,
                      self.token_prefix, resp.status_code, _reason(resp), _batch_id(path))
            return "busy"
        if resp.status_code in BUSY:
            self._not_before = time.monotonic() + _retry_after(resp)
            self._api_away.failed(f"answered {resp.status_code}; batches stay spooled until "
                                  "it takes them")
            return "busy"
        if resp.status_code >= 500:
            # A 500 may be this batch alone: the batches behind it are tried.
            log.warning("API answered %s for %s: %s", resp.status_code, path.name,
                        resp.text[:300])
            return "failed"
        log.error("API rejected %s: %s", path.name, resp.text[:500])
        return "rejected"

    def _answered(self, path: Path, resp: httpx.Response) -> None:
        """Keep what the API said of a batch (its judgement: findings, incidents opened and
        resolved) for whoever shipped it to report; the few latest only."""
        try:
            body = resp.json()
        except ValueError:
            return
        if isinstance(body, dict) and body.get("batch_id"):
            dropped = body.get("dropped") or []
            if dropped:  # stored, less an item with a number out of range (an agent's bug)
                log.warning("API stored %s less %d item(s): %s", path.name, len(dropped),
                            "; ".join(str(d) for d in dropped[:3]))
            self.answers[str(body["batch_id"])] = body
            while len(self.answers) > ANSWERS_KEPT:
                self.answers.pop(next(iter(self.answers)))

    def close(self) -> None:
        self.client.close()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def _batch_id(path: Path) -> str:
    """The batch id in a spool file's name (``<nanoseconds>-<batch id>.json``)."""
    return path.stem.partition("-")[2] or path.stem


def _reason(resp: httpx.Response) -> str:
    """The API's own words for an error (its JSON ``message``), on one line."""
    try:
        body = resp.json()
        text = str(body.get("message") or body.get("error") or body)
    except (ValueError, AttributeError):
        text = resp.text
    return " ".join(text.split())[:300]


def _retry_after(resp: httpx.Response, default_s: float = 1.0, cap_s: float = 300.0) -> float:
    """Seconds from a Retry-After header (delta-seconds form), else ``default_s``."""
    try:
        return min(cap_s, max(0.0, float(resp.headers.get("Retry-After", default_s))))
    except ValueError:
        return default_s
