"""One settings object for every ringwatch process, read from ``RINGWATCH_*`` variables."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from services.analyzer.hysteresis import Policy

# The project's own state folder (embedded Postgres, Ray temp dir, spool); ignored by git.
STATE_DIR = Path(__file__).resolve().parents[1] / ".ringwatch"

PLACEHOLDER_SECRET = "change-me"


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="RINGWATCH_", extra="ignore")

    # Empty: start an embedded Postgres under STATE_DIR (the demo and the tests).
    database_url: str = ""
    api_url: str = "http://127.0.0.1:8420"
    # Token the scheduler and CLI present to the API.
    token: str = ""
    # Token created at start-up with the admin role when the table is empty (bootstrap).
    bootstrap_admin_token: str = ""
    probe_interval_s: float = Field(default=300.0, gt=0)
    # The most of any GPU's time scheduled probing may take; stretches the interval.
    max_duty_cycle: float = Field(default=0.005, gt=0, le=1)
    state_dir: Path = STATE_DIR
    # Webhook delivery: retries with exponential backoff up to this age.
    webhook_max_age_s: float = Field(default=24 * 3600.0, gt=0)
    webhook_timeout_s: float = Field(default=5.0, gt=0)
    notifier_poll_s: float = Field(default=1.0, gt=0)
    # Analyzer: busbw below this fraction of its expectation is degraded. Unset: the
    # analyzer's default for the backend (services.analyzer.assess.thresholds_for), the
    # same for monitoring and preflight.
    degraded_ratio: float | None = Field(default=None, gt=0, lt=1)
    # Below this share of its hardware profile's rated busbw a link is degraded even when
    # every peer is as slow (agents.profiles; docs/profiles.md).
    rated_floor: float = Field(default=0.5, gt=0, lt=1)
    # Hysteresis of incidents: k bad of the last n cycles open one, m good in a row close
    # it. Defaults: services.analyzer.hysteresis.Policy (the one place they are defined).
    hysteresis_k_bad: int = Field(default=Policy.k_bad, ge=1)
    hysteresis_n_window: int = Field(default=Policy.n_window, ge=1)
    hysteresis_m_good: int = Field(default=Policy.m_good, ge=1)
    # The largest request body the API reads (a 1024 x 8 cycle's batch is a few MB).
    max_body_bytes: int = Field(default=64 << 20, ge=1024)
    # Backpressure: batches stored at once, how long another waits for a turn before a 503
    # with Retry-After, and the most measurements one batch may carry (413 beyond).
    max_concurrent_ingests: int = Field(default=2, ge=1)
    ingest_wait_s: float = Field(default=10.0, ge=0)
    max_batch_measurements: int = Field(default=200_000, ge=1)
    # Days each resolution of the time series is kept: raw probes, hourly and daily rollups.
    retention_raw_days: float = Field(default=14.0, gt=0)
    retention_hourly_days: float = Field(default=90.0, gt=0)
    retention_daily_days: float = Field(default=730.0, gt=0)
    # Seconds between maintenance passes in `ringwatch serve` (partitions, rollups,
    # retention); 0 leaves them to `ringwatch maintain`.
    maintenance_interval_s: float = Field(default=60.0, ge=0)
    demo: bool = False

    def retention(self):  # -> services.store.timeseries.Retention
        from services.store.timeseries import Retention

        return Retention(self.retention_raw_days, self.retention_hourly_days,
                         self.retention_daily_days)

    def hysteresis(self) -> Policy:
        return Policy(self.hysteresis_k_bad, self.hysteresis_n_window, self.hysteresis_m_good)

    def thresholds(self, backend: str):  # -> services.analyzer.assess.Thresholds
        """The judgement's thresholds for results from ``backend``."""
        from dataclasses import replace

        from services.analyzer.assess import thresholds_for

        t = replace(thresholds_for(backend), rated_floor=self.rated_floor)
        return t if self.degraded_ratio is None else replace(t, degraded_ratio=self.degraded_ratio)

    @property
    def spool_dir(self) -> Path:
        return self.state_dir / "spool"

    def check_secrets(self) -> None:
        """Refuse placeholder secrets outside the demo."""
        if self.demo:
            return
        for name in ("token", "bootstrap_admin_token"):
            if getattr(self, name) == PLACEHOLDER_SECRET:
                raise ValueError(f"RINGWATCH_{name.upper()} is the placeholder {PLACEHOLDER_SECRET!r}")


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    return Settings()
