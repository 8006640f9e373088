"""The check: plan a round of probe groups from what the rounds before it showed, run it,
judge everything again; until nothing is left to ask or the budget is spent. ``run_check``
is the one way in, for monitoring cycles, the preflights a scheduler serves and the CLI."""

from ringwatch.services.check.loop import CheckBudget, CheckResult, run_check
from ringwatch.services.check.shape import ProbeSpec

__all__ = ["CheckBudget", "CheckResult", "ProbeSpec", "run_check"]
