"""Health with hysteresis: k bad of the last n observations degrade a link, m good in a row
recover it, so a link that flaps between good and bad does not flap its alerts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

OK = "ok"
DEGRADED = "degraded"


@dataclass(frozen=True)
class Policy:
    """The one set of defaults (settings read theirs from here): 2 bad of the last 3
    observations open an incident, 2 good in a row close it."""

    k_bad: int = 2
    n_window: int = 3
    m_good: int = 2

    def __post_init__(self) -> None:
        if not 1 <= self.k_bad <= self.n_window:
            raise ValueError(f"need 1 <= k_bad <= n_window, got {self.k_bad} and {self.n_window}")
        if self.m_good < 1:
            raise ValueError(f"m_good must be at least 1, got {self.m_good}")


@dataclass(frozen=True)
class LinkState:
    status: str = OK
    # The last n_window verdicts, oldest first: True for a bad one.
    recent: tuple[bool, ...] = ()
    good_streak: int = 0


# Faults the probes see themselves (a hang, a rank's error, wrong data) are not noise:
# they open at once and close on the rank's first clean probe.
AT_ONCE = Policy(1, 1, 1)


def step(state: LinkState, bad: bool, policy: Policy = Policy()) -> LinkState:
    """Fold one verdict into the state."""
    recent = (*state.recent, bad)[-policy.n_window:]
    streak = 0 if bad else state.good_streak + 1
    status = state.status
    if status == OK and sum(recent) >= policy.k_bad:
        status = DEGRADED
    elif status == DEGRADED and streak >= policy.m_good:
        status = OK
    return LinkState(status, recent, streak)


def standing(state: LinkState, policy: Policy = Policy()) -> dict[str, Any]:
    """Where a state stands in ``policy``'s window, and why its status is what it is, in
    words a page can show beside it: a link slow in one cycle is still ``ok`` because one
    bad cycle of the window is not ``k_bad`` (``slow, 1 of 3 — opens at 2 of 3``); a
    degraded one seen good again waits for ``m_good`` in a row (``1 of 2 good — closes at 2
    in a row``). ``text`` is None where there is nothing to explain (ok and never slow in
    the window)."""
    k, n, m = policy.k_bad, policy.n_window, policy.m_good
    bad = sum(state.recent[-n:])  # a window kept under a longer policy counts its last n
    text: str | None = None
    if state.status == OK and bad:
        text = f"slow, {bad} of {n} \u2014 opens at {k} of {n}"
    elif state.status == DEGRADED and state.good_streak:
        text = f"{state.good_streak} of {m} good \u2014 closes at {m} in a row"
    elif state.status == DEGRADED:
        text = f"slow, {bad} of {n}"
    return {"bad": bad, "window": n, "opens_at": k, "good_streak": state.good_streak,
            "closes_at": m, "text": text}


def changes(series: list[str]) -> int:
    return sum(a != b for a, b in zip(series, series[1:], strict=False))
