"""One active scheduler per fleet: a lease held in Postgres through the API.

The API grants and times the lease by the database's clock alone (``POST
/v1/scheduler/lease``), so schedulers whose clocks disagree can never both hold it. The
holder renews it every third of its period, before each cycle and between a cycle's rounds;
a standby asks as often and takes over once the leader's lease has run out (within two
periods of a leader's death), or at once after a clean stop hands it back.

A leader that cannot renew (the API unreachable) stops leading when its lease would have
run out counted from when it last asked: the API's expiry is later than that, so the two
never overlap. docs/operations.md, "One scheduler per fleet".
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ringwatch.services.scheduler.api_client import SchedulerApi

log = logging.getLogger(__name__)
Progress = Callable[[str], None]
# Renew once this share of the lease has passed since the last grant.
RENEW_SHARE = 1 / 3


class LeaseLost(Exception):
    """This scheduler no longer holds the fleet: the cycle under way stops."""


class NotLeader(Exception):
    """Another scheduler holds the fleet's lease (the API's 409 to a cycle's start)."""


class LeaseRefused(Exception):
    """The API refuses this scheduler's token for the fleet lease: an operator must act."""


class FleetLease:
    """This scheduler's standing with its fleet: leader or standby, and whom it stands by."""

    def __init__(self, api: SchedulerApi, fleet: str, lease_s: float,
                 progress: Progress | None = None, clock: Callable[[], float] = time.monotonic
                 ) -> None:
        self.api, self.fleet, self.lease_s = api, fleet, lease_s
        self.progress = progress
        self.clock = clock
        self.leader = False
        self.holder: str | None = None
        self.term: int | None = None
        # When the last granted request was sent (the local end of the lease counts from it).
        self.granted_at = float("-inf")
        self.asked_at = float("-inf")
        self._said_standby_at = float("-inf")
        # The API's silence is said once, until it answers again.
        self._said_silence = False

    @property
    def valid_until(self) -> float:
        return self.granted_at + self.lease_s

    def hold(self, force: bool = False) -> bool:
        """Take or renew the lease when a third of it has passed (or ``force``); True while
        this scheduler leads. Says so when it becomes leader or standby."""
        now = self.clock()
        if not force and now - self.asked_at < self.lease_s * RENEW_SHARE:
            return self.leader and now < self.valid_until
        self.asked_at = now
        answer = self.api.take_lease(self.fleet, self.lease_s)
        was = self.leader
        if answer is None:  # unreachable: lead on only while the last grant would still hold
            self.leader = self.leader and now < self.valid_until
            if not self._said_silence:
                self._said_silence = True
                self._line(f"fleet {self.fleet}: {self.api.lease_error or 'no answer'} to the "
                           "lease; " + ("leading while the last grant holds" if self.leader
                                        else "no cycle runs until it answers and grants it"))
        else:
            self._said_silence = False
            self._take(answer, now)
        if self.leader != was or (not self.leader and answer is not None
                                  and now - self._said_standby_at >= self.lease_s):
            self._say(answer)
        return self.leader

    def _take(self, answer: dict[str, Any], sent: float) -> None:
        self.leader = bool(answer.get("leader"))
        self.holder = answer.get("holder")
        self.term = answer.get("term")
        if self.leader:
            self.granted_at = sent

    def _say(self, answer: dict[str, Any] | None) -> None:
        if self.leader:
            line = (f"fleet {self.fleet}: leading (term {self.term}, lease {self.lease_s:g} s)")
        elif answer is None:
            line = (f"fleet {self.fleet}: standing by: the lease this scheduler held has run "
                    "out without an answer from the API")
        else:
            self._said_standby_at = self.clock()
            line = (f"fleet {self.fleet}: standing by; {self.holder} leads (term {self.term}) "
                    "and this scheduler probes nothing until it stops or its lease runs out")
        self._line(line)

    def _line(self, line: str) -> None:
        log.info(line)
        if self.progress:
            self.progress(line)

    def keep(self) -> None:
        """Between a cycle's rounds: renew when due; LeaseLost once another leads."""
        if not self.hold():
            raise LeaseLost(f"fleet {self.fleet}: lease lost to {self.holder or 'no answer'}")

    def release(self) -> None:
        """A clean stop hands the lease back, so a standby takes over at once."""
        if self.leader:
            self.api.release_lease(self.fleet)
            self.leader = False
