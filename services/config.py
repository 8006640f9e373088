"""Constants every ringwatch process shares, and whether its environment sets anything.

A leaf: it imports nothing of ringwatch. The settings object (pydantic) is
``services.settings``, loaded only where a process reads ``RINGWATCH_*`` variables, so a
command on defaults (``ringwatch preflight --fabric`` with no variable set) never needs it."""

from __future__ import annotations

import os
from pathlib import Path

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

# Below this share of its node type's rated busbw a link is degraded whatever its peers
# and history say (agents.profiles; RINGWATCH_RATED_FLOOR).
RATED_FLOOR = 0.5

# Active tokens expiring within this are named by /v1/health, `ringwatch status` and
# /metrics (ringwatch_tokens_expiring_soon): time to rotate them.
TOKEN_EXPIRY_WARN_S = 14 * 24 * 3600.0

ENV_PREFIX = "RINGWATCH_"


def settings_in_environment() -> bool:
    """Whether any ``RINGWATCH_*`` variable is set, in any case (Settings matches them so).
    Settings reads nothing else (no .env file, no secrets folder): without one, every
    setting is its default."""
    prefix = ENV_PREFIX.lower()
    return any(name.lower().startswith(prefix) for name in os.environ)
