"""The schema: nodes and their ranks, probe runs and measurements (a time series),
link health, findings, webhooks with their outbox and deliveries, API tokens."""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any

from sqlalchemy import (
    BigInteger,
    Column,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    PrimaryKeyConstraint,
    String,
    Table,
    Text,
    UniqueConstraint,
    Uuid,
    func,
    text,
)
from sqlalchemy.dialects.postgresql import ARRAY, JSONB
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship
from sqlalchemy.types import TIMESTAMP

NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

TZ = TIMESTAMP(timezone=True)


# Indexes on expressions: declared below as the migrations build them, but autogenerate
# cannot compare them (tests/test_migrations.py checks they exist instead).
EXPRESSION_INDEXES = ("ix_link_health_pair",)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


class Node(Base):
    __tablename__ = "nodes"
    # The new-node quota counts a token's nodes added within its window.
    __table_args__ = (Index("ix_nodes_added_by", "added_by_token_id", "added_at"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(255), unique=True)
    hostname: Mapped[str | None] = mapped_column(String(255))
    backend: Mapped[str | None] = mapped_column(String(16))
    # Fraction of its GPUs' time spent probing, as its scheduler last measured it.
    duty_cycle: Mapped[float | None] = mapped_column(Float)
    # Why the last scheduled cycle left it out (other work held it); None when probed.
    skipped_reason: Mapped[str | None] = mapped_column(Text)
    # The job holding it as the scheduler's occupancy source last said (agents.spec.Occupant
    # as a dict, with ``since``); None while idle.
    occupied: Mapped[dict[str, Any] | None] = mapped_column(JSONB)
    first_seen_at: Mapped[datetime] = mapped_column(TZ, server_default=func.now())
    last_seen_at: Mapped[datetime] = mapped_column(TZ, server_default=func.now())
    # Time of its newest measurement: "was it probed since T" without scanning them.
    last_probed_at: Mapped[datetime | None] = mapped_column(TZ)
    # Its hardware profile (agents.profiles), as its agents detected or were told.
    profile: Mapped[str | None] = mapped_column(String(64))
    # When it joined the fleet (created, or back from retirement) and with which token: what
    # RINGWATCH_MAX_NEW_NODES_PER_TOKEN counts.
    added_at: Mapped[datetime] = mapped_column(TZ, server_default=func.now())
    added_by_token_id: Mapped[int | None] = mapped_column(Integer)
    # Taken out of the fleet (by an admin, or not seen for RINGWATCH_NODE_RETENTION_DAYS):
    # left out of the fleet's lists, counts and map, its history kept; None while in it.
    retired_at: Mapped[datetime | None] = mapped_column(TZ)

    gpus: Mapped[list[Gpu]] = relationship(back_populates="node", lazy="raise")


class Gpu(Base):
    """One probe rank: a GPU under nccl, a CPU slot under gloo."""

    __tablename__ = "gpus"
    __table_args__ = (UniqueConstraint("node_id", "local_index", name="uq_gpus_node_local"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    node_id: Mapped[int] = mapped_column(ForeignKey("nodes.id", ondelete="CASCADE"))
    local_index: Mapped[int] = mapped_column(Integer)
    uuid: Mapped[str | None] = mapped_column(String(64))
    pci_bus_id: Mapped[str | None] = mapped_column(String(32))
    numa_node: Mapped[int | None] = mapped_column(Integer)
    name: Mapped[str | None] = mapped_column(String(128))
    telemetry: Mapped[dict[str, Any]] = mapped_column(JSONB, default=dict)
    updated_at: Mapped[datetime] = mapped_column(TZ, server_default=func.now())

    node: Mapped[Node] = relationship(back_populates="gpus", lazy="raise")


class ProbeRun(Base):
    """One ingested batch; ``batch_id`` makes a retried POST a no-op."""

    __tablename__ = "probe_runs"

    id: Mapped[int] = mapped_column(primary_key=True)
    batch_id: Mapped[str] = mapped_column(String(128), unique=True)
    backend: Mapped[str] = mapped_column(String(16))
    received_at: Mapped[datetime] = mapped_column(TZ, server_default=func.now())
    measurement_count: Mapped[int] = mapped_column(Integer, default=0)
    findings: Mapped[list[dict[str, Any]]] = mapped_column(JSONB, default=list)
    # The sender's spool when it wrote the batch (host, pending, failed, rejected).
    shipper: Mapped[dict[str, Any] | None] = mapped_column(JSONB)
    # SHA-256 of the batch's content and the token that sent it: the same id with other
    # content, or from another token, is a conflict rather than a retry.
    content_sha256: Mapped[str | None] = mapped_column(String(64))
    token_id: Mapped[int | None] = mapped_column(Integer)
    # How the sender's occupancy source answered for this batch: source, error, read_s,
    # busy and unknown (counts of nodes).
    occupancy: Mapped[dict[str, Any] | None] = mapped_column(JSONB)


class IngestRetired(Base):
    """What retention deleted of ``probe_runs``: its batches and their measurements, so the
    ingest counters of ``/metrics`` (stored rows plus these) only ever count up. One row,
    written by retention in the transaction that deletes the runs."""

    __tablename__ = "ingest_retired"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    batches: Mapped[int] = mapped_column(BigInteger)
    measurements: Mapped[int] = mapped_column(BigInteger)


class PreflightLatency(Base):
    """Completed preflight requests by how long their verdict took: per way of answering
    (``at_once`` from stored results, ``probed`` by a scheduler) and latency bucket (``le``,
    its upper bound in seconds; infinity for the last), how many and their summed seconds.
    Written with each verdict, so the histogram of ``/metrics`` reads a few rows."""

    __tablename__ = "preflight_latency"

    answered: Mapped[str] = mapped_column(String(16), primary_key=True)
    le: Mapped[float] = mapped_column(Float, primary_key=True)
    count: Mapped[int] = mapped_column(BigInteger)
    sum_s: Mapped[float] = mapped_column(Float)


class Group(Base):
    """A link or group that was probed: its members stored once, its compact key (the
    members comma-joined, or ``sha256:`` of that for a large group) and a small id that
    every measurement of it carries."""

    __tablename__ = "groups"

    id: Mapped[int] = mapped_column(primary_key=True)
    key: Mapped[str] = mapped_column(Text, unique=True)
    scope: Mapped[str] = mapped_column(String(16))
    members: Mapped[list[str]] = mapped_column(ARRAY(Text))
    nodes: Mapped[list[str]] = mapped_column(ARRAY(Text))
    first_seen_at: Mapped[datetime] = mapped_column(TZ, server_default=func.now())


# The raw time series, partitioned by day on ``time`` (services.store.timeseries makes and
# drops the partitions). No primary key and no per-row foreign keys: a row is written once
# by COPY and leaves with its whole partition. Columns are ordered 8-byte first so rows
# carry no alignment padding; the one index serves every series query.
measurements = Table(
    "measurements",
    Base.metadata,
    Column("time", TZ, nullable=False),
    Column("size_bytes", BigInteger, nullable=False),
    Column("time_us", Float, nullable=False),
    Column("algbw_gbs", Float, nullable=False),
    Column("busbw_gbs", Float, nullable=False),
    # The sender's hardware-model figure for it (GB/s busbw), where it had one.
    Column("preset_gbs", Float),
    Column("group_id", Integer, nullable=False),
    Column("run_id", Integer, nullable=False),
    Column("warmup", Integer, nullable=False),
    Column("iters", Integer, nullable=False),
    Column("wrong", Integer, nullable=False),
    Column("op", String(32), nullable=False),
    Column("backend", String(16), nullable=False),
    Column("dtype", String(16), nullable=False),
    # nccl-tests' redop of a reducing op; "sum" for ops that do not reduce.
    Column("redop", String(8), nullable=False, server_default="sum"),
    # How it was timed (agents.spec.TIMINGS); None where the sender did not say.
    Column("timing", String(16)),
    # The transports NCCL took for the group (agents.nccl_log's classes, comma-joined);
    # None where the probe did not say (gloo, rows from before).
    Column("transport", String(64)),
    # The other traffic its links carried while it ran (agents.contention), in one line;
    # None where they were quiet. Stored and shown, never judged, never in a rollup.
    Column("contended", Text),
    Index("ix_measurements_series", "group_id", "op", "size_bytes", "time"),
    postgresql_partition_by="RANGE (time)",
)


def _rollup_table(name: str) -> Table:
    """Per link, op and size, per time bucket: how many probes and their busbw spread."""
    return Table(
        name,
        Base.metadata,
        Column("bucket", TZ, nullable=False),
        Column("group_id", Integer, nullable=False),
        Column("op", String(32), nullable=False),
        Column("size_bytes", BigInteger, nullable=False),
        Column("count", Integer, nullable=False),
        Column("busbw_min", Float, nullable=False),
        Column("busbw_median", Float, nullable=False),
        Column("busbw_max", Float, nullable=False),
        Column("busbw_mean", Float, nullable=False),
        Column("algbw_median", Float, nullable=False),
        Column("time_us_median", Float, nullable=False),
        Column("wrong", BigInteger, nullable=False),
        # A series query walks one link's buckets in order; retention deletes by bucket.
        PrimaryKeyConstraint("group_id", "op", "size_bytes", "bucket"),
        Index(f"ix_{name}_bucket", "bucket"),
    )


series_1h = _rollup_table("series_1h")
series_1d = _rollup_table("series_1d")


class RollupState(Base):
    """How far each rollup has been computed, and the oldest bucket a late batch touched
    since (recomputed on the next pass)."""

    __tablename__ = "rollup_state"

    resolution: Mapped[str] = mapped_column(String(8), primary_key=True)
    rolled_until: Mapped[datetime | None] = mapped_column(TZ)
    dirty_from: Mapped[datetime | None] = mapped_column(TZ)


def is_partition(name: str) -> bool:
    """A day's partition of the measurements (``measurements_pYYYYMMDD``)."""
    return name.startswith("measurements_p") and name[len("measurements_p"):].isdigit()


class GpuCounters(Base):
    """One GPU's NVML readings around a cycle in which an error counter rose, a link went
    down or an XID error was reported: kept with the cycle, shown by ``/v1/series``."""

    __tablename__ = "gpu_counters"
    __table_args__ = (Index("ix_gpu_counters_rank_time", "node", "local_index", "time"),)

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    time: Mapped[datetime] = mapped_column(TZ)
    node: Mapped[str] = mapped_column(String(255))
    local_index: Mapped[int] = mapped_column(Integer)
    reading: Mapped[dict[str, Any]] = mapped_column(JSONB)


class LinkHealth(Base):
    """Current health of one link or group for one op (the largest probed size)."""

    __tablename__ = "link_health"
    __table_args__ = (UniqueConstraint("group_key", "op", name="uq_link_health_group_op"),
                      Index("ix_link_health_updated_at", "updated_at"),
                      Index("ix_link_health_not_ok", "status",
                            postgresql_where=text("status <> 'ok'")),
                      # One node pair's rows (services.monitor.fleet.node_pairs).
                      Index("ix_link_health_pair", text("(nodes[1])"), text("(nodes[2])"),
                            postgresql_where=text("scope = 'inter_node' AND "
                                                  "cardinality(nodes) = 2")))

    id: Mapped[int] = mapped_column(primary_key=True)
    group_key: Mapped[str] = mapped_column(Text)
    op: Mapped[str] = mapped_column(String(32))
    scope: Mapped[str] = mapped_column(String(16))
    members: Mapped[list[str]] = mapped_column(ARRAY(Text))
    nodes: Mapped[list[str]] = mapped_column(ARRAY(Text))
    status: Mapped[str] = mapped_column(String(16), default="ok")
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    busbw_gbs: Mapped[float] = mapped_column(Float)
    expected_gbs: Mapped[float | None] = mapped_column(Float)
    ratio: Mapped[float | None] = mapped_column(Float)
    bad_streak: Mapped[int] = mapped_column(Integer, default=0)
    good_streak: Mapped[int] = mapped_column(Integer, default=0)
    # The last verdicts, oldest first, "1" bad and "0" good: the hysteresis window.
    recent: Mapped[str] = mapped_column(String(64), default="", server_default="")
    # The link's own last busbw values at ``size_bytes`` (oldest first, at most 50): its
    # baseline, kept on ingest so judging never rescans the measurement history.
    recent_busbw: Mapped[list[float]] = mapped_column(ARRAY(Float), default=list,
                                                      server_default="{}")
    updated_at: Mapped[datetime] = mapped_column(TZ, server_default=func.now())
    changed_at: Mapped[datetime] = mapped_column(TZ, server_default=func.now())


class Finding(Base):
    """An incident: opened by a health change, resolved by the recovery."""

    __tablename__ = "findings"
    __table_args__ = (Index("ix_findings_status_kind", "status", "kind"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    kind: Mapped[str] = mapped_column(String(32))
    status: Mapped[str] = mapped_column(String(16), default="open")
    severity: Mapped[str] = mapped_column(String(16), default="critical")
    group_key: Mapped[str | None] = mapped_column(Text)
    op: Mapped[str | None] = mapped_column(String(32))
    nodes: Mapped[list[str]] = mapped_column(ARRAY(Text), default=list)
    detail: Mapped[dict[str, Any]] = mapped_column(JSONB, default=dict)
    opened_at: Mapped[datetime] = mapped_column(TZ, server_default=func.now())
    last_seen_at: Mapped[datetime] = mapped_column(TZ, server_default=func.now())
    resolved_at: Mapped[datetime | None] = mapped_column(TZ)


class FaultState(Base):
    """One localized fault (kind and place, ``services.analyzer.faults.fault_key``) through
    the hysteresis: its recent observations, and the incident it opened while it is open.

    A row exists while the fault is open or has been seen in the window; a fault that is
    ok with no bad observation left in its window is deleted.
    """

    __tablename__ = "fault_states"
    __table_args__ = (UniqueConstraint("key", name="uq_fault_states_key"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    key: Mapped[str] = mapped_column(Text)
    kind: Mapped[str] = mapped_column(String(32))
    nodes: Mapped[list[str]] = mapped_column(ARRAY(Text))
    status: Mapped[str] = mapped_column(String(16), default="ok")
    # The last observations, oldest first, "1" seen and "0" looked and not seen.
    recent: Mapped[str] = mapped_column(String(64), default="")
    good_streak: Mapped[int] = mapped_column(Integer, default=0)
    # The finding as localized the last time it was seen.
    detail: Mapped[dict[str, Any]] = mapped_column(JSONB, default=dict)
    finding_id: Mapped[int | None] = mapped_column(ForeignKey("findings.id", ondelete="SET NULL"))
    updated_at: Mapped[datetime] = mapped_column(TZ, server_default=func.now())


class DriftState(Base):
    """One place's CUSUM of slight, persistent loss (services.analyzer.drift), keyed by place
    (``nvlink:node-003``, ``nvlink:node-003:gpus=2,5``, ``nic:node-011``).

    A row exists while the place's score is above zero: a healthy place has none.
    """

    __tablename__ = "drift_states"

    key: Mapped[str] = mapped_column(Text, primary_key=True)
    # Accumulated shortfall, in sigmas beyond the slack.
    score: Mapped[float] = mapped_column(Float)
    # When the current excursion began, and how many cycles it has lasted.
    since: Mapped[datetime | None] = mapped_column(TZ)
    cycles: Mapped[int] = mapped_column(Integer)
    updated_at: Mapped[datetime] = mapped_column(TZ, server_default=func.now())


class Webhook(Base):
    __tablename__ = "webhooks"

    id: Mapped[int] = mapped_column(primary_key=True)
    url: Mapped[str] = mapped_column(Text)
    # ``fernet:`` and the secret encrypted with RINGWATCH_SECRET_KEY; without the prefix, a
    # secret stored in plain text before encryption (the notifier seals it once it can).
    secret: Mapped[str] = mapped_column(Text)
    # The secret a rotation replaced, signed with as well until its grace period ends.
    previous_secret: Mapped[str | None] = mapped_column(Text)
    previous_secret_expires_at: Mapped[datetime | None] = mapped_column(TZ)
    events: Mapped[list[str]] = mapped_column(ARRAY(Text))
    format: Mapped[str] = mapped_column(String(16), default="json")
    # False: no deliveries are made for new events, and queued ones wait.
    active: Mapped[bool] = mapped_column(default=True)
    created_at: Mapped[datetime] = mapped_column(TZ, server_default=func.now())


class OutboxEvent(Base):
    """An event written in the same transaction as the change that caused it."""

    __tablename__ = "outbox_events"

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    event_type: Mapped[str] = mapped_column(String(64))
    payload: Mapped[dict[str, Any]] = mapped_column(JSONB)
    created_at: Mapped[datetime] = mapped_column(TZ, server_default=func.now())
    # Set once the event has been fanned out into one delivery per matching webhook.
    dispatched_at: Mapped[datetime | None] = mapped_column(TZ, index=True)


class WebhookDelivery(Base):
    __tablename__ = "webhook_deliveries"
    __table_args__ = (
        UniqueConstraint("webhook_id", "event_id", name="uq_webhook_deliveries_webhook_event"),
        Index("ix_webhook_deliveries_due", "status", "next_attempt_at"),
    )

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    webhook_id: Mapped[int] = mapped_column(ForeignKey("webhooks.id", ondelete="CASCADE"))
    event_id: Mapped[int] = mapped_column(ForeignKey("outbox_events.id", ondelete="CASCADE"))
    # X-Ringwatch-Delivery: the same on every retry so receivers can deduplicate.
    delivery_id: Mapped[str] = mapped_column(String(64), unique=True)
    status: Mapped[str] = mapped_column(String(16), default="pending")
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    next_attempt_at: Mapped[datetime] = mapped_column(TZ, server_default=func.now())
    # The notifier that claimed it last, and until when that claim holds (renewed while it
    # sends, cleared when it is done); only the holder may record the outcome.
    claimed_by: Mapped[uuid.UUID | None] = mapped_column(Uuid)
    claim_expires_at: Mapped[datetime | None] = mapped_column(TZ)
    last_status_code: Mapped[int | None] = mapped_column(Integer)
    last_error: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(TZ, server_default=func.now())
    delivered_at: Mapped[datetime | None] = mapped_column(TZ)


class ApiToken(Base):
    __tablename__ = "api_tokens"

    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(128), default="")
    role: Mapped[str] = mapped_column(String(16))
    # sha256 of the token; the token itself is shown once and never stored.
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)
    created_at: Mapped[datetime] = mapped_column(TZ, server_default=func.now())
    revoked_at: Mapped[datetime | None] = mapped_column(TZ)
    expires_at: Mapped[datetime | None] = mapped_column(TZ)
    # Coarse (updated at most once a minute), so a busy token does not write on every request.
    last_used_at: Mapped[datetime | None] = mapped_column(TZ)
    # An agent token limited to these nodes' results; None: any node.
    nodes: Mapped[list[str] | None] = mapped_column(ARRAY(Text))


class PreflightRequest(Base):
    """A durable preflight: answered from fresh results, or claimed by a scheduler that probes.

    A claim holds a lease; a scheduler that dies mid-request lets the lease run out and
    another claims the request again.
    """

    __tablename__ = "preflight_requests"
    __table_args__ = (Index("ix_preflight_requests_status_created", "status", "created_at"),
                      Index("ix_preflight_requests_token_status", "token_id", "status"))

    id: Mapped[str] = mapped_column(String(36), primary_key=True)
    nodes: Mapped[list[str]] = mapped_column(ARRAY(Text))
    max_age_s: Mapped[float] = mapped_column(Float)
    status: Mapped[str] = mapped_column(String(16), default="pending")
    verdict: Mapped[dict[str, Any] | None] = mapped_column(JSONB)
    claimed_by: Mapped[str | None] = mapped_column(String(255))
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    error: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(TZ, server_default=func.now())
    lease_until: Mapped[datetime | None] = mapped_column(TZ)
    completed_at: Mapped[datetime | None] = mapped_column(TZ)
    # The token that asked (a cap on each token's waiting requests) and the token holding
    # the claim (only it, under the worker name it claimed with, completes the request).
    token_id: Mapped[int | None] = mapped_column(Integer)
    claim_token_id: Mapped[int | None] = mapped_column(Integer)
    # The job it asks about: {"profile": "fsdp", "job": {"tp": 8, "pp": 1, "dp": null}}.
    # Such a request is always probed (agents.workloads).
    workload: Mapped[dict[str, Any] | None] = mapped_column(JSONB)


class Fleet(Base):
    """One fleet's scheduling state (services.store.fleets): the lease its one active
    scheduler holds, the number of the last cycle started and the node-pair tournament's
    slots, so a standby that takes over goes on where the last holder stopped."""

    __tablename__ = "fleets"

    name: Mapped[str] = mapped_column(Text, primary_key=True)
    # The scheduler holding the lease (a worker id such as "host:pid"); None: free.
    holder: Mapped[str | None] = mapped_column(Text)
    # The token the holder asked with: only the same holder with the same token renews,
    # hands back or starts a cycle (as a preflight claim is its worker's and token's).
    token_id: Mapped[int | None] = mapped_column(Integer)
    # Incremented whenever the holder changes: a scheduler can tell it was replaced.
    term: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    # Every time here is the database's clock, never a scheduler's.
    lease_expires_at: Mapped[datetime | None] = mapped_column(TZ)
    acquired_at: Mapped[datetime | None] = mapped_column(TZ)
    renewed_at: Mapped[datetime | None] = mapped_column(TZ)
    cycle: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    # The tournament's slots: a node name, or None for a vacant slot.
    slots: Mapped[list[str | None]] = mapped_column(JSONB, default=list,
                                                    server_default=text("'[]'::jsonb"))
    updated_at: Mapped[datetime] = mapped_column(TZ, server_default=func.now())


class Heartbeat(Base):
    """When one background loop (``notifier``, ``maintenance``) last succeeded and failed,
    on the database's clock, and its failures in a row since (services.store.heartbeats):
    what /metrics reports of loops that run outside the API process, or in another replica."""

    __tablename__ = "heartbeats"

    name: Mapped[str] = mapped_column(Text, primary_key=True)
    ok_at: Mapped[datetime | None] = mapped_column(TZ)
    failed_at: Mapped[datetime | None] = mapped_column(TZ)
    failures: Mapped[int] = mapped_column(Integer, default=0, server_default="0")


class QuarantinedName(Base):
    """A node name, group member or group key stored before the strict name rule, and the
    name migration 0017 gave it (``quarantined-...``): the history reads on under the new
    name, and the downgrade puts the old one back."""

    __tablename__ = "quarantined_names"

    # "node", "member" or "key".
    kind: Mapped[str] = mapped_column(String(8), primary_key=True)
    was: Mapped[str] = mapped_column(Text, primary_key=True)
    name: Mapped[str] = mapped_column(Text)
    quarantined_at: Mapped[datetime] = mapped_column(TZ, server_default=func.now())

    __table_args__ = (UniqueConstraint("kind", "name"),)
