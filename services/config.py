"""One settings object for every ringwatch process, read from ``RINGWATCH_*`` variables.

The class itself (pydantic) lives in ``services.settings`` and loads on first use: this
module's constants are imported by every process, and a command that runs on defaults
(``ringwatch preflight --fabric`` with no variable set) never needs pydantic."""

from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from services.analyzer.assess import Thresholds
    from services.settings import Settings as Settings

# The project's own state folder (embedded Postgres, Ray temp dir, spool); ignored by git.
STATE_DIR = Path(__file__).resolve().parents[1] / ".ringwatch"

PLACEHOLDER_SECRET = "change-me"
# What one check (a preflight or a monitoring cycle) may spend: rounds, modeled fabric
# seconds (the probing itself) and wall seconds; past any, its verdict is incomplete.
CHECK_MAX_ROUNDS = 512
CHECK_MAX_FABRIC_S = 600.0
CHECK_MAX_WALL_S = 1800.0
# How far ahead of the server's clock a measurement's time may be (clock skew); beyond
# it, "latest" would be pinned by a time that has not come. RINGWATCH_MAX_CLOCK_SKEW_S.
MAX_CLOCK_SKEW_S = 600.0
# Settings.rated_floor's default, here so that default_thresholds needs no pydantic.
RATED_FLOOR = 0.5

ENV_PREFIX = "RINGWATCH_"


def __getattr__(name: str) -> Any:
    if name == "Settings":
        from services.settings import Settings

        return Settings
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    from services.settings import Settings

    return Settings()


def settings_in_environment() -> bool:
    """Whether any ``RINGWATCH_*`` variable is set, in any case (Settings matches them so).
    Settings reads nothing else (no .env file, no secrets folder): without one, every
    setting is its default."""
    prefix = ENV_PREFIX.lower()
    return any(name.lower().startswith(prefix) for name in os.environ)


def default_thresholds(backend: str, rated_floor: float = RATED_FLOOR) -> Thresholds:
    """The analyzer's thresholds for ``backend`` under the process's rated floor: what
    ``Settings.thresholds`` starts from, and all of it where no ``RINGWATCH_*`` variable is
    set (without loading pydantic)."""
    from dataclasses import replace

    from services.analyzer.assess import thresholds_for

    return replace(thresholds_for(backend), rated_floor=rated_floor)
