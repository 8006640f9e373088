"""``Settings``: every ringwatch process's settings, read from ``RINGWATCH_*`` variables
once (``get_settings``), and the policies assembled from them (thresholds, hysteresis,
drift) where a process hands them on. The constants they default to are in
``services.config``, which loads without pydantic."""

from __future__ import annotations

import base64
import os
from dataclasses import replace
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from ringwatch.services.analyzer.evidence import CusumPolicy
from ringwatch.services.analyzer.hysteresis import Policy
from ringwatch.services.config import (
    CHECK_MAX_FABRIC_S,
    CHECK_MAX_ROUNDS,
    CHECK_MAX_WALL_S,
    ENV_PREFIX,
    MAX_CLOCK_SKEW_S,
    PLACEHOLDER_SECRET,
    RATED_FLOOR,
    STATE_DIR,
)
from ringwatch.services.scheduler.occupancy import DEFAULT_TIMEOUT_S as OCCUPANCY_TIMEOUT_S
from ringwatch.services.scheduler.occupancy import OccupancySetting

if TYPE_CHECKING:
    from ringwatch.services.analyzer.assess import Thresholds
    from ringwatch.services.monitor.metrics import AlertBounds, SeriesLimits

# What a server of this machine alone (``Settings.local``) delivers webhooks to: receivers
# on this machine, which the URL policy otherwise refuses.
LOOPBACK_NETWORKS = ("127.0.0.0/8", "::1/128")
# The key its webhook secrets are encrypted with, generated once under the state dir.
LOCAL_KEY_FILE = "webhook-secret.key"
# Seconds a process stopped by SIGTERM gives the work under way (RINGWATCH_SHUTDOWN_TIMEOUT_S):
# with a 5 s preStop pause it ends well inside Kubernetes' 30 s grace.
SHUTDOWN_TIMEOUT_S = 8.0


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="ignore")

    # Empty: start an embedded Postgres under STATE_DIR (the demo and the tests).
    database_url: str = ""
    # Seconds `ringwatch db upgrade` waits for another upgrade's migration lock, then exits 2
    # (unset: services.store.db.MIGRATION_LOCK_WAIT_S, 300).
    migration_lock_timeout_s: float | None = Field(default=None, gt=0)
    # Each process's connections (services.store.db.make_engine): kept open, opened beyond
    # those at a busy moment, and how long a request waits for a free one (then a 503 with
    # Retry-After). Two API replicas and two notifiers at these stay under Postgres' default
    # max_connections of 100 (docs/operations.md, "Database connections").
    db_pool_size: int = Field(default=10, ge=1, le=1000)
    db_max_overflow: int = Field(default=10, ge=0, le=1000)
    db_pool_timeout_s: float = Field(default=30.0, gt=0)
    # How long a connection attempt may take, and any one statement (0: no bound): a
    # vanished database or a stuck query frees its connection and its request.
    db_connect_timeout_s: float = Field(default=10.0, ge=1)
    db_statement_timeout_ms: int = Field(default=60_000, ge=0)
    api_url: str = "http://127.0.0.1:8420"
    # Token the scheduler and CLI present to the API.
    token: str = ""
    # Token created at start-up with the admin role when the table is empty (bootstrap).
    bootstrap_admin_token: str = ""
    probe_interval_s: float = Field(default=300.0, gt=0)
    # The most of any GPU's time scheduled probing may take; stretches the interval.
    max_duty_cycle: float = Field(default=0.005, gt=0, le=1)
    # Where each cycle learns which nodes other jobs hold (services.scheduler.occupancy):
    # auto, slurm, kubernetes, ray, sim or none; how long that read may take (past it, every
    # node counts as busy); whether scheduled probes touch busy nodes anyway; and the
    # Kubernetes API's URL where it is not the pod's own (empty: in-cluster).
    occupancy: OccupancySetting = "auto"
    occupancy_timeout_s: float = Field(default=OCCUPANCY_TIMEOUT_S, gt=0)
    probe_busy_nodes: bool = False
    # One scheduler per fleet (docs/operations.md, "One scheduler per fleet"): the fleet's
    # name, one per fleet where one API serves several, and the lease its active scheduler
    # holds through the API (a standby takes over within two of them after its death).
    fleet: str = Field(default="default", min_length=1, max_length=128,
                       pattern=r"^[A-Za-z0-9][A-Za-z0-9_.:-]*$")
    scheduler_lease_s: float = Field(default=60.0, ge=5, le=3600)
    # The scheduler's spool of unsent batches holds at most this many bytes; past it the
    # oldest are dropped, each logged and counted. A 1024 x 8 cycle's batch is about 7 MB,
    # 2.0 GB a day at the default interval: 4 GiB holds two days of a 1024-node fleet's,
    # and fits the 5 GiB volume the Kubernetes base gives the scheduler's state.
    spool_max_bytes: int = Field(default=4 << 30, ge=1 << 20)
    kubernetes_api_url: str = ""
    # NVLink domains (an NVL72 rack) split into NVLink partitions on purpose: GPUs of one
    # cluster in several cliques is then the layout, not a fault (docs/transport.md).
    nvlink_partitioned: bool = False
    state_dir: Path = STATE_DIR
    # Webhook delivery: retries with exponential backoff up to this age.
    webhook_max_age_s: float = Field(default=24 * 3600.0, gt=0)
    webhook_timeout_s: float = Field(default=5.0, gt=0)
    notifier_poll_s: float = Field(default=1.0, gt=0)
    # On SIGTERM a process gives the work under way this long: the API its requests in
    # flight (waiting preflights are answered at once), the notifier its deliveries (those
    # still going are then cut and released to the next notifier). docs/operations.md,
    # "Stopping and rollouts".
    shutdown_timeout_s: float = Field(default=SHUTDOWN_TIMEOUT_S, gt=0, le=300)
    # Analyzer: busbw below this fraction of its expectation is degraded. Unset: the
    # analyzer's default for the backend (services.analyzer.assess.thresholds_for), the
    # same for monitoring and preflight.
    degraded_ratio: float | None = Field(default=None, gt=0, lt=1)
    # Below this share of its hardware profile's rated busbw a link is degraded even when
    # every peer is as slow (agents.profiles; docs/profiles.md).
    rated_floor: float = Field(default=RATED_FLOOR, gt=0, lt=1)
    # Hysteresis of incidents: k bad of the last n cycles open one, m good in a row close
    # it. Defaults: services.analyzer.hysteresis.Policy (the one place they are defined).
    hysteresis_k_bad: int = Field(default=Policy.k_bad, ge=1)
    hysteresis_n_window: int = Field(default=Policy.n_window, ge=1)
    hysteresis_m_good: int = Field(default=Policy.m_good, ge=1)
    # Slow drift: each place's one-sided CUSUM, in sigmas, opens a finding past the
    # threshold (h); the slack (k) is half the loss (in sigmas) it is tuned to find. Defaults:
    # services.analyzer.evidence.CusumPolicy (docs/analysis.md, "Slow drift").
    drift_threshold: float = Field(default=CusumPolicy.threshold, gt=0)
    drift_slack: float = Field(default=CusumPolicy.slack, gt=0)
    # Weighing a group's repeated measurements (a sequential test per group; on gloo the
    # plain two-of-two rule instead): the chance one decision calls a healthy link slow, and
    # misses a loss of ``min_loss``; the least loss worth finding; the most measurements
    # one decision may take; how far healthy links of one kind differ for good (one sigma,
    # relative; a run that measures it smaller uses its own figure). Unset: the analyzer's
    # defaults (services.analyzer.evidence.Weighing; docs/analysis.md, "Weighing evidence").
    false_alarm: float | None = Field(default=None, gt=0, lt=0.5)
    miss: float | None = Field(default=None, gt=0, lt=0.5)
    min_loss: float | None = Field(default=None, gt=0, lt=1)
    max_repeats: int | None = Field(default=None, ge=1, le=100)
    link_variation: float | None = Field(default=None, ge=0, lt=0.5)
    # The largest request body the API reads (a 1024 x 8 cycle's batch is a few MB).
    max_body_bytes: int = Field(default=64 << 20, ge=1024)
    # Backpressure: batches stored at once, how long another waits for a turn before a 503
    # with Retry-After, and the most measurements one batch may carry (413 beyond).
    max_concurrent_ingests: int = Field(default=2, ge=1)
    ingest_wait_s: float = Field(default=10.0, ge=0)
    max_batch_measurements: int = Field(default=200_000, ge=1)
    # A batch's body is read inside its slot, so its pace is bounded: whole within
    # ingest_body_timeout_s, and, past the first 5 s, at least ingest_body_min_bytes_per_s
    # on average (0: no floor); a slower body is a 408 and frees the slot. One token holds at
    # most half the slots (rounded up) at once; its other batches wait as for a full house.
    ingest_body_timeout_s: float = Field(default=60.0, gt=0)
    ingest_body_min_bytes_per_s: int = Field(default=16384, ge=0)
    # Findings one batch may carry (413 beyond). A 1024 x 8 fleet's worst cycle, a
    # transport_fallback on each of every node's 28 GPU pairs and a finding of each other
    # kind on every GPU, stays under 50 000.
    max_batch_findings: int = Field(default=65_536, ge=1)
    # Nodes one batch may create, and nodes the fleet may hold in all (413 / 422 beyond):
    # one token cannot grow the node table, and every read over it, without bound.
    max_new_nodes_per_batch: int = Field(default=8192, ge=1)
    max_nodes: int = Field(default=16384, ge=1)
    # Nodes one token may add to the fleet (create, or bring back from retirement) within
    # the window (429 beyond, 422 for a batch the whole quota cannot hold): one agent's
    # made-up names cannot fill RINGWATCH_MAX_NODES. A scheduler's first cycle of a 1024 x 8
    # fleet adds 1024; raise it for one scheduler of more than 4096 nodes.
    max_new_nodes_per_token: int = Field(default=4096, ge=1)
    new_nodes_window_s: float = Field(default=86400.0, gt=0)
    # Nodes no batch has named for this many days leave the fleet at the next maintenance
    # pass (retired: their history kept; back when they report); 0: never.
    node_retention_days: float = Field(default=30.0, ge=0)
    # Days each resolution of the time series is kept: raw probes, hourly and daily rollups.
    retention_raw_days: float = Field(default=14.0, gt=0)
    retention_hourly_days: float = Field(default=90.0, gt=0)
    retention_daily_days: float = Field(default=730.0, gt=0)
    # Seconds between maintenance passes in `ringwatch serve` (partitions, rollups,
    # retention); 0 leaves them to `ringwatch maintain`.
    maintenance_interval_s: float = Field(default=60.0, ge=0)
    # Tokens made without an expiry of their own (and the bootstrap token) live this many
    # days; 0: they never expire.
    token_ttl_days: float = Field(default=365.0, ge=0)
    # Measurement times further ahead of the server's clock than this are refused (422):
    # they would pin "latest" and open partitions for days that have not come.
    max_clock_skew_s: float = Field(default=MAX_CLOCK_SKEW_S, gt=0)
    # Preflight requests one token may have waiting for a scheduler at once (429 beyond).
    max_pending_preflights_per_token: int = Field(default=16, ge=1)
    # ... and of one node's own gate (one node, no workload: a prolog, an epilog, an NHC
    # check): as many as the largest job's nodes, since a job's prologs share one token and a
    # 429 there lets a node in unchecked (fail-open).
    max_pending_gate_preflights_per_token: int = Field(default=4096, ge=1)
    # The budget of one check (preflight or monitoring cycle); docs/analysis.md, "Budget".
    check_max_rounds: int = Field(default=CHECK_MAX_ROUNDS, ge=1)
    check_max_fabric_s: float = Field(default=CHECK_MAX_FABRIC_S, gt=0)
    check_max_wall_s: float = Field(default=CHECK_MAX_WALL_S, gt=0)
    # Callers waiting on ?wait= at once, across all tokens (each is an asyncio event, not a thread).
    # Enough for a 4096-node job's prologs waiting at once beside other callers.
    max_waiting_preflights: int = Field(default=8192, ge=1)
    # /metrics: seconds one rendered scrape is served again (many scrapers, one scan; 0:
    # every scrape reads the database), and whether it needs a token (any valid one).
    metrics_cache_s: float = Field(default=10.0, ge=0)
    metrics_token_required: bool = False
    # Per-link series cover links read within this many seconds, and every link that is not
    # ok (0: every link; the rotation leaves a row for each node pair it ever probed).
    metrics_link_max_age_s: float = Field(default=3600.0, ge=0)
    # The most series one node may have in any one /metrics family (the groups across three
    # or more nodes count as one node), and one family in all; what is left out is counted
    # in ringwatch_metrics_series_dropped (services.monitor.metrics.SeriesLimits).
    metrics_max_series_per_node: int = Field(default=512, ge=1)
    metrics_max_series_per_family: int = Field(default=262_144, ge=1)
    # The alerts (docs/operations.md, "Alerts"): the share of the fleet's nodes excluded past
    # which RingwatchFleetUnhealthy fires, and the database's size past which
    # RingwatchDatabaseSize does (0: never; a 1024 x 8 fleet settles at 108 GB at the
    # default retention, docs/scale.md), both on /metrics for the rules to read; and the page
    # the alerts' runbook links point into: docs/operations.md where your documentation
    # serves it (empty: the links name the repository's path).
    fleet_unhealthy_share: float = Field(default=0.02, gt=0, lt=1)
    database_size_alert_bytes: int = Field(default=150 << 30, ge=0)
    runbook_url: str = Field(default="", max_length=1024,
                             pattern=r'^(https?://[^\x00-\x20\x7f#"\\]+)?$')
    # GET /v1/fleet/pairs sends the whole node-pair map up to this many nodes (n(n-1)/2
    # bytes: 8 MiB at 4096), beyond it 422 and the map in tiles of at most this many rows
    # by as many columns (docs/scale.md, "Node-pair map bounds").
    max_pair_map_nodes: int = Field(default=4096, ge=2)
    # Webhooks. The key their secrets are encrypted with at rest: a Fernet key, or a
    # passphrase of 16+ characters a key is derived from (docs/webhooks.md). The networks a
    # webhook may reach although they are loopback, link-local or private: CIDRs, as a JSON
    # list or comma-separated. Deliveries one notifier sends at once (different webhooks go
    # out side by side, so a stalled receiver holds up only its own).
    secret_key: SecretStr = SecretStr("")
    webhook_allowed_networks: Annotated[list[str], NoDecode] = Field(default_factory=list)
    webhook_concurrency: int = Field(default=8, ge=1, le=256)
    # How every process logs: services.logs reads these two before any setting is read (a
    # command on defaults never loads pydantic); declared here so a bad value is refused
    # with the rest. Text or json; the level (unset: info for json and with -v, else warning).
    log_format: str = "text"
    log_level: str = ""

    @field_validator("log_format", "log_level")
    @classmethod
    def _log_vocabulary(cls, value: str, info: Any) -> str:
        from ringwatch.services.logs import FORMATS, LEVELS

        value = value.strip().lower()
        allowed = FORMATS if info.field_name == "log_format" else ("", *LEVELS)
        if value not in allowed:
            raise ValueError(f"one of {', '.join(a for a in allowed if a)}")
        return value

    @field_validator("webhook_allowed_networks", mode="before")
    @classmethod
    def _networks(cls, value: object) -> list[str]:
        import ipaddress
        import json

        if isinstance(value, str):
            text = value.strip()
            value = json.loads(text) if text.startswith("[") else [v for v in text.split(",") if v.strip()]
        if not isinstance(value, list | tuple):
            raise ValueError("a list of CIDRs (JSON) or CIDRs separated by commas")
        return [str(ipaddress.ip_network(str(v).strip(), strict=False)) for v in value]

    demo: bool = False

    def retention(self):  # -> services.store.timeseries.Retention
        from ringwatch.services.store.timeseries import Retention

        return Retention(self.retention_raw_days, self.retention_hourly_days,
                         self.retention_daily_days, self.node_retention_days)

    def metrics_limits(self) -> SeriesLimits:
        from ringwatch.services.monitor.metrics import SeriesLimits

        return SeriesLimits(self.metrics_max_series_per_node, self.metrics_max_series_per_family)

    def alert_bounds(self) -> AlertBounds:
        from ringwatch.services.monitor.metrics import AlertBounds

        return AlertBounds(self.fleet_unhealthy_share, self.database_size_alert_bytes,
                           self.runbook_url, self.probe_interval_s)

    def hysteresis(self) -> Policy:
        return Policy(self.hysteresis_k_bad, self.hysteresis_n_window, self.hysteresis_m_good)

    def drift(self) -> CusumPolicy:
        return CusumPolicy(slack=self.drift_slack, threshold=self.drift_threshold)

    def thresholds(self, backend: str) -> Thresholds:
        """The judgement's thresholds for results from ``backend`` (the analyzer loads
        here, not with the settings: a client command reads settings and judges nothing)."""
        from ringwatch.services.analyzer.assess import thresholds_for

        t = thresholds_for(backend, self.rated_floor)
        weighing: dict[str, Any] = {name: value for name, value in (
            ("false_alarm", self.false_alarm), ("miss", self.miss), ("min_loss", self.min_loss),
            ("max_repeats", self.max_repeats), ("variation_prior", self.link_variation))
            if value is not None}
        if weighing:
            t = replace(t, weighing=replace(t.weighing, **weighing))
        return t if self.degraded_ratio is None else replace(t, degraded_ratio=self.degraded_ratio)

    @property
    def spool_dir(self) -> Path:
        return self.state_dir / "spool"

    @property
    def local(self) -> bool:
        """Whether a server on these settings is this machine's alone: the demo's, or one on
        the embedded Postgres (no RINGWATCH_DATABASE_URL). Production names its database and
        sets RINGWATCH_SECRET_KEY and RINGWATCH_WEBHOOK_ALLOWED_NETWORKS itself."""
        return self.demo or not self.database_url

    def with_local_defaults(self) -> Settings:
        """These settings as a ``local`` server runs on them: without RINGWATCH_SECRET_KEY,
        the key generated once under the state dir (and reused on every restart); webhooks
        to loopback receivers allowed besides the networks set. Anything else, and every
        setting of a server that is not ``local``, as it is."""
        if not self.local:
            return self
        allowed = [*self.webhook_allowed_networks,
                   *(n for n in LOOPBACK_NETWORKS if n not in self.webhook_allowed_networks)]
        update: dict[str, Any] = {"webhook_allowed_networks": allowed}
        if not self.secret_key.get_secret_value():
            update["secret_key"] = SecretStr(local_secret_key(self.state_dir / LOCAL_KEY_FILE))
        return self.model_copy(update=update)

    def check_secrets(self) -> None:
        """Refuse placeholder secrets outside the demo."""
        if self.demo:
            return
        for name in ("token", "bootstrap_admin_token"):
            if getattr(self, name) == PLACEHOLDER_SECRET:
                raise ValueError(f"RINGWATCH_{name.upper()} is the placeholder {PLACEHOLDER_SECRET!r}")


def local_secret_key(path: Path) -> str:
    """The Fernet key in ``path``, made by whichever process comes first: written to a
    file of its own (0600) and linked into place whole, so a process starting at the same
    moment never reads half a key."""
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        draft = path.with_name(f"{path.name}.{os.getpid()}")
        fd = os.open(draft, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            # What cryptography's Fernet.generate_key makes; settings load without it.
            f.write(base64.urlsafe_b64encode(os.urandom(32)))
        try:
            os.link(draft, path)
        except FileExistsError:
            pass
        finally:
            draft.unlink()
    if path.stat().st_mode & 0o077:  # a copy or an old umask left it readable to others
        path.chmod(0o600)
    return path.read_text().strip()


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    """This process's settings, read once."""
    return Settings()
