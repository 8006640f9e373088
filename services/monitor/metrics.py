"""Prometheus metrics of the fleet: a snapshot read by a few aggregate queries, rendered by
prometheus_client (escaped labels, HELP and TYPE per family, OpenMetrics when the scraper
asks for it), and cached in the API process so many scrapers cost one scan; the process's
own families (requests, latency, CPU, memory) are rendered fresh behind it at every scrape.

Every label takes its value from a closed vocabulary (a known counter, transport, GPU pair,
a node name the rule accepts, a token's id) and every family holds at most so many series
per node and in all (``SeriesLimits``): what an agent's batch says cannot choose how many
series a scrape carries. A row that cannot be labelled is left out, never a failed scrape,
and what is left out is counted (``ringwatch_metrics_series_dropped``)."""

from __future__ import annotations

import re
import threading
import time
import zlib
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, NamedTuple

from prometheus_client.exposition import choose_encoder
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector, CollectorRegistry
from prometheus_client.utils import floatToGoString
from sqlalchemy.orm import Session, sessionmaker

from ringwatch.agents.groups import is_node_name, split_member
from ringwatch.agents.nccl_log import TRANSPORTS
from ringwatch.agents.nic_counters import THRESHOLDS
from ringwatch.services.analyzer.hysteresis import DEGRADED, OK
from ringwatch.services.config import TOKEN_EXPIRY_WARN_S
from ringwatch.services.monitor.stored_verdict import excluded_nodes
from ringwatch.services.store import db
from ringwatch.services.store import health as health_store
from ringwatch.services.store import measurements as measurement_store
from ringwatch.services.store import metrics as store
from ringwatch.services.store.heartbeats import LOOPS, HeartbeatRow, heartbeats
from ringwatch.services.store.measurements import SHIPPER_HOSTS_PER_TOKEN
from ringwatch.services.store.preflight import LATENCY_BOUNDS
from ringwatch.services.store.tokens import ROLES

# nccl-tests' GB/s are 10^9 bytes a second.
BYTES_PER_GB = 1e9
PREFLIGHT_STATUSES = ("pending", "running", "done", "failed")
SHIPPER_STATES = ("pending", "failed", "rejected")

# The cause families' vocabularies (docs/transport.md): the counters the NIC reader judges
# (and "state", a port that left ACTIVE), NCCL's transport classes as its log parser names
# them, an RDMA device's name as the kernel gives it (mlx5_0, efa_3, rocep1s0f0: at most
# IB_DEVICE_NAME_MAX less its NUL), an IB port number (a u8) and a GPU's index on its node.
NIC_COUNTERS = frozenset(t.counter for t in THRESHOLDS) | {"state"}
NIC_DEVICE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}")
MAX_PORT = 255
MAX_GPU_INDEX = 4095
TRANSPORT_NAMES = frozenset(TRANSPORTS)
# A shipper's host is informational (its token is its identity): cut to a hostname's length.
MAX_HOST_LABEL = 253
# Why a series was left out (ringwatch_metrics_series_dropped's ``reason``).
UNLABELLED, NODE_CAP, FAMILY_CAP, TOKEN_CAP = "unlabelled", "node_cap", "family_cap", "token_cap"
# The owner the groups across three or more nodes (labelled ``group``) count under together.
GROUPS = ""


@dataclass(frozen=True)
class SeriesLimits:
    """The most series one node may have in any one family (the groups across three or
    more nodes count together as one node), and any one family in all
    (RINGWATCH_METRICS_MAX_SERIES_PER_NODE, RINGWATCH_METRICS_MAX_SERIES_PER_FAMILY). At
    the defaults a 16-GPU node with every GPU pair in the window (120 pairs, two ops) and
    its node pairs fits, and a link family of RINGWATCH_MAX_NODES nodes at some 15 series a
    node (docs/operations.md, "Series per node") does too."""

    per_node: int = 512
    per_family: int = 262_144


@dataclass(frozen=True)
class AlertBounds:
    """What the alert rules compare with, from the settings (Settings.alert_bounds): the
    share of the fleet's nodes excluded past which RingwatchFleetUnhealthy fires
    (RINGWATCH_FLEET_UNHEALTHY_SHARE), the database size past which RingwatchDatabaseSize
    does (RINGWATCH_DATABASE_SIZE_ALERT_BYTES; 0: never), the page the runbook links point
    into (RINGWATCH_RUNBOOK_URL; empty: none exported), and the interval between batches
    assumed until a scheduler's batch says its own (RINGWATCH_PROBE_INTERVAL_S). Rendered
    whether or not the database answers: a rule's threshold, or a runbook link, must not
    vanish with it."""

    fleet_unhealthy_share: float = 0.02
    database_size_alert_bytes: int = 150 << 30
    runbook_url: str = ""
    probe_interval_s: float = 300.0

    def families(self) -> Iterator[Metric]:
        yield _gauge("ringwatch_fleet_unhealthy_share_threshold", "The share of the fleet's "
                     "nodes excluded past which RingwatchFleetUnhealthy fires "
                     "(RINGWATCH_FLEET_UNHEALTHY_SHARE).", self.fleet_unhealthy_share)
        if self.database_size_alert_bytes:
            yield _gauge("ringwatch_database_size_alert_bytes", "The database size past which "
                         "RingwatchDatabaseSize fires (RINGWATCH_DATABASE_SIZE_ALERT_BYTES).",
                         self.database_size_alert_bytes, unit="bytes")
        if self.runbook_url:
            info = InfoMetricFamily("ringwatch_runbook", "The page the alerts' runbook links "
                                    "point into (RINGWATCH_RUNBOOK_URL).", labels=["url"])
            info.add_metric([self.runbook_url], {})
            yield info


class _Budget:
    """The series admitted so far per family and per (family, node), and those left out."""

    def __init__(self, limits: SeriesLimits) -> None:
        self.limits = limits
        self._family: Counter[str] = Counter()
        self._owner: Counter[tuple[str, str]] = Counter()
        self.dropped: Counter[tuple[str, str]] = Counter()

    def admit(self, family: str, owner: str) -> bool:
        """Whether one more series of ``owner`` (a node, or GROUPS) fits in ``family``."""
        if self._family[family] >= self.limits.per_family:
            self.dropped[family, FAMILY_CAP] += 1
            return False
        if self._owner[family, owner] >= self.limits.per_node:
            self.dropped[family, NODE_CAP] += 1
            return False
        self._family[family] += 1
        self._owner[family, owner] += 1
        return True

    def left_out(self, family: str, reason: str = UNLABELLED, n: int = 1) -> None:
        self.dropped[family, reason] += n


@dataclass(frozen=True)
class Snapshot:
    """What one scrape reports, read in one transaction."""

    link_counts: dict[str, int]
    links: list[store.LinkRow]
    nodes: list[store.NodeRow]
    excluded: frozenset[str]
    open_findings: list[store.FindingCount]
    node_findings: list[store.NodeFindingCount]
    shippers: list[measurement_store.ShipperSpool]
    backlog: store.Backlog
    preflight: dict[str, int]
    preflight_latency: dict[str, store.LatencyCounts]
    ingested: store.IngestTotals
    last_ingest_at: datetime | None
    now: datetime
    collect_s: float
    # Open nic_errors and transport_fallback incidents: why, per node (docs/transport.md).
    causes: list[store.CauseRow] = field(default_factory=list)
    # How the occupancy source answered for the newest scheduled cycle (None: none said).
    occupancy: dict[str, Any] | None = None
    # Active tokens that expire, soonest first.
    tokens: list[store.TokenExpiry] = field(default_factory=list)
    # The background loops' heartbeats (services.store.heartbeats), the database's size on
    # disk, and the seconds between batches the newest scheduler's batch planned (None: no
    # batch said).
    heartbeats: list[HeartbeatRow] = field(default_factory=list)
    database_size_bytes: int | None = None
    planned_interval_s: float | None = None


def snapshot(session: Session, link_max_age_s: float = 0.0) -> Snapshot:
    """One read of what a scrape reports. The per-link families cover links read within
    ``link_max_age_s`` (0: all) and every link that is not ok: the rotation leaves a row for
    every node pair it ever probed, and a pair probed days ago is no series worth keeping."""
    started = time.perf_counter()
    link_counts = health_store.health_counts(session)
    links, nodes = store.link_rows(session, link_max_age_s), store.node_rows(session)
    excluded = frozenset(excluded_nodes(session))
    findings, per_node = store.open_findings(session), store.open_findings_per_node(session)
    shippers = measurement_store.shipper_states(session)
    backlog = store.delivery_backlog(session)
    preflight = store.preflight_requests_by_status(session)
    latency = store.preflight_latency(session)
    ingested = store.ingest_totals(session)
    last_ingest_at, now = store.last_ingest(session), store.database_now(session)
    causes = store.open_causes(session)
    occupancy = store.latest_occupancy(session)
    expiring = store.token_expiries(session)
    beats, size = heartbeats(session), store.database_size(session)
    planned = store.planned_ingest_interval(session)
    return Snapshot(link_counts, links, nodes, excluded, findings, per_node, shippers, backlog,
                    preflight, latency, ingested, last_ingest_at, now,
                    collect_s=time.perf_counter() - started, causes=causes,
                    occupancy=occupancy, tokens=expiring, heartbeats=beats,
                    database_size_bytes=size, planned_interval_s=planned)


def _listed(value: Any) -> list[Any]:
    """``value`` where it is a JSON list, else nothing."""
    return value if isinstance(value, list) else []


def _index(value: Any, most: int) -> int | None:
    """``value`` where it is an integer from 0 to ``most`` (ASCII digits, if text)."""
    if isinstance(value, str) and value.isascii() and value.isdigit() and len(value) <= 6:
        value = int(value)
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= most:
        return value
    return None


def _count(value: Any) -> int | float:
    """A spool's count as stored (a number the schema bounded; 0 where a row lacks it)."""
    return value if isinstance(value, int | float) and not isinstance(value, bool) else 0


def _nic_labels(node: str, e: dict[str, Any]) -> list[str] | None:
    """``node``, ``device``, ``port`` and ``counter`` of one counter record, or None where
    one of them is outside its vocabulary."""
    device, counter, port = e.get("device"), e.get("counter"), _index(e.get("port"), MAX_PORT)
    if (not isinstance(device, str) or NIC_DEVICE.fullmatch(device) is None
            or counter not in NIC_COUNTERS or port is None):
        return None
    return [node, device, str(port), str(counter)]


def _fallback_labels(node: str, detail: dict[str, Any]) -> list[str] | None:
    """``node``, ``transport``, ``expected`` and ``gpus`` (a pair, or empty for the node's
    inter-node traffic) of a transport_fallback, or None where one is outside its
    vocabulary."""
    seen, expected = detail.get("transport"), detail.get("expected_transport")
    if seen not in TRANSPORT_NAMES or expected not in TRANSPORT_NAMES:
        return None
    gpus = _listed(detail.get("gpus"))
    pair = [_index(g, MAX_GPU_INDEX) for g in gpus]
    if gpus and (len(pair) != 2 or None in pair):
        return None
    return [node, str(seen), str(expected), ",".join(str(g) for g in pair)]


def link_labels(row: store.LinkRow) -> dict[str, str]:
    """A link's series labels beside ``scope`` and ``op``: ``node`` for a group on one node,
    ``node`` and ``peer_node`` for one on two (in name order), ``gpu`` and ``peer_gpu`` (with
    ``peer_node``, the same node for a GPU pair) for a group of two ranks, and ``group``, its
    key as /v1/series takes it, for a group across more nodes (a world group). ValueError
    for a row whose node or member names the rule refuses (stored before it)."""
    labels = {"scope": row.scope, "op": row.op}
    if not row.nodes:
        labels["group"] = row.group_key
        return labels
    bad = [n for n in row.nodes if not is_node_name(n)]
    if bad:
        raise ValueError(f"node {bad[0]!r} is not a node name")
    labels["node"] = row.nodes[0]
    if len(row.nodes) == 2:
        labels["peer_node"] = row.nodes[1]
    if row.members:
        (node, gpu), (peer, peer_gpu) = sorted(split_member(m) for m in row.members)
        labels.update(node=node, gpu=str(gpu), peer_node=peer, peer_gpu=str(peer_gpu))
    return labels


def _worse(a: store.LinkRow, b: store.LinkRow) -> store.LinkRow:
    """The one to report of two links that label alike (a node's NVLink group before and
    after it lost a GPU): the degraded one, else the lower ratio."""
    def badness(r: store.LinkRow) -> tuple[bool, float]:
        return r.status != OK, -(r.ratio if r.ratio is not None else float("inf"))
    return b if badness(b) > badness(a) else a


def _gauge(name: str, doc: str, value: float | None = None, labels: list[str] | None = None,
           unit: str = "") -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value, labels=labels, unit=unit)


class FleetCollector(Collector):
    """The families of one snapshot; pure, so it renders without a database."""

    def __init__(self, snap: Snapshot, limits: SeriesLimits | None = None,
                 bounds: AlertBounds | None = None) -> None:
        self.snap = snap
        self.limits = limits or SeriesLimits()
        self.bounds = bounds or AlertBounds()
        self._budget = _Budget(self.limits)

    def collect(self) -> Iterator[Metric]:
        self._budget = _Budget(self.limits)  # each rendering counts afresh
        yield from self._links()
        yield from self._findings()
        yield from self._nodes()
        yield from self._ingest()
        yield from self._notifier()
        yield from self._preflight()
        yield from self._tokens()
        yield from self._loops()
        if self.snap.database_size_bytes is not None:
            yield _gauge("ringwatch_database_size_bytes", "Bytes the database takes on disk "
                         "(pg_database_size).", self.snap.database_size_bytes, unit="bytes")
        yield _gauge("ringwatch_metrics_collect_seconds",
                     "Seconds the queries behind this scrape took (cached between scrapes).",
                     self.snap.collect_s, unit="seconds")
        dropped = _gauge("ringwatch_metrics_series_dropped", "Series this scrape left out, by "
                         "family and why: unlabelled (a name the node-name rule refuses, or a "
                         "value outside the label's closed vocabulary), node_cap (past "
                         "RINGWATCH_METRICS_MAX_SERIES_PER_NODE for one node), family_cap "
                         "(past RINGWATCH_METRICS_MAX_SERIES_PER_FAMILY), token_cap (a "
                         f"shipper's hosts past the newest {SHIPPER_HOSTS_PER_TOKEN} of its "
                         "token).",
                         labels=["family", "reason"])
        for (family, reason), n in sorted(self._budget.dropped.items()):
            dropped.add_metric([family, reason], n)
        yield dropped

    def _admit(self, family: Metric, owner: str) -> bool:
        return self._budget.admit(family.name, owner)

    def _links(self) -> Iterator[Metric]:
        by_status = Counter({OK: 0, DEGRADED: 0})
        by_status.update(self.snap.link_counts)
        links = _gauge("ringwatch_links", "Probed links and groups by health status.",
                       labels=["status"])
        for status, n in sorted(by_status.items()):
            links.add_metric([status], n)
        yield links
        window = (" Links read within RINGWATCH_METRICS_LINK_MAX_AGE_S and those not ok; "
                  "node and peer_node (gpu and peer_gpu for two ranks) name a link on one "
                  "or two nodes, group the key of a larger one.")
        busbw = Metric("ringwatch_link_busbw_bytes_per_second", "Last busbw of each link or "
                       "group at its largest probed size (nccl-tests' busbw)." + window, "gauge")
        degraded = Metric("ringwatch_link_degraded",
                          "1 while the link or group is degraded." + window, "gauge")
        ratio = Metric("ringwatch_link_ratio", "Last busbw of each link or group as a share of "
                       "what was expected of it (below the degraded ratio is bad)." + window,
                       "gauge")
        reported: dict[tuple[tuple[str, str], ...], tuple[dict[str, str], store.LinkRow]] = {}
        for r in self.snap.links:
            try:
                labels = link_labels(r)
            except ValueError:
                for family in (busbw, degraded, ratio):
                    self._budget.left_out(family.name)
                continue
            key = tuple(sorted(labels.items()))
            known = reported.get(key)
            reported[key] = (labels, r if known is None else _worse(known[1], r))
        # Past a cap the links kept are the degraded ones first, then the worst ratios.
        for labels, r in sorted(reported.values(), key=lambda lr: (lr[1].status == OK,
                                lr[1].ratio if lr[1].ratio is not None else float("inf"))):
            owner = labels.get("node", GROUPS)
            if not self._admit(busbw, owner):
                continue
            busbw.add_sample(busbw.name, labels, r.busbw_gbs * BYTES_PER_GB)
            if self._admit(degraded, owner):
                degraded.add_sample(degraded.name, labels, int(r.status == DEGRADED))
            if r.ratio is not None and self._admit(ratio, owner):
                ratio.add_sample(ratio.name, labels, r.ratio)
        yield from (busbw, degraded, ratio)

    def _findings(self) -> Iterator[Metric]:
        total = _gauge("ringwatch_open_findings", "Open findings (incidents) by kind and "
                       "severity.", labels=["kind", "severity"])
        for f in self.snap.open_findings:
            total.add_metric([f.kind, f.severity], f.open)
        yield total
        per_node = _gauge("ringwatch_node_open_findings", "Open findings (incidents) touching "
                          "the node, by kind and severity (one on a path counts on both its "
                          "nodes).", labels=["node", "kind", "severity"])
        for n in self.snap.node_findings:
            if not is_node_name(n.node):
                self._budget.left_out(per_node.name)
            elif self._admit(per_node, n.node):
                per_node.add_metric([n.node, n.kind, n.severity], n.open)
        yield per_node
        yield from self._causes()

    def _causes(self) -> Iterator[Metric]:
        """Why, per node: each open nic_errors incident's counters that rose past their
        thresholds, as rates, and each open transport_fallback's transport against the one
        expected (docs/transport.md)."""
        rates = _gauge("ringwatch_nic_error_rate_per_second", "NIC error counters past their "
                       "thresholds in the latest cycle that read them (open nic_errors "
                       "incidents), per second.", labels=["node", "device", "port", "counter"])
        fallback = _gauge("ringwatch_transport_fallback", "1 for each open transport_fallback: "
                          "NCCL took `transport` where `expected` was up (gpus: a GPU pair's, "
                          "empty: the node's inter-node traffic).",
                          labels=["node", "transport", "expected", "gpus"])
        # A detail is the agent's free-form JSON: what is not in the expected shape is left
        # out, never a failed scrape, and a label only ever takes a value of its vocabulary.
        seen: set[tuple[str, ...]] = set()
        for c in self.snap.causes:
            family = rates if c.kind == "nic_errors" else fallback
            if not is_node_name(c.node or ""):
                self._budget.left_out(family.name)
                continue
            if c.kind == "nic_errors":
                for e in _listed(c.detail.get("counters")):
                    self._add_rate(rates, c.node, e, seen)
            else:
                labels = _fallback_labels(c.node, c.detail)
                if labels is None:
                    self._budget.left_out(fallback.name)
                elif (fallback.name, *labels) not in seen and self._admit(fallback, c.node):
                    seen.add((fallback.name, *labels))
                    fallback.add_metric(labels, 1.0)
        yield rates
        yield fallback

    def _add_rate(self, rates: GaugeMetricFamily, node: str, e: Any,
                  seen: set[tuple[str, ...]]) -> None:
        """One counter record of a nic_errors detail, where it is well formed."""
        rate = e.get("rate_per_s") if isinstance(e, dict) else None
        if not isinstance(rate, int | float) or isinstance(rate, bool):
            return  # not a counter record: nothing to label
        labels = _nic_labels(node, e)
        if labels is None:
            self._budget.left_out(rates.name)
        elif (rates.name, *labels) not in seen and self._admit(rates, node):
            seen.add((rates.name, *labels))
            rates.add_metric(labels, float(rate))

    def _nodes(self) -> Iterator[Metric]:
        yield _gauge("ringwatch_nodes", "Nodes seen.", len(self.snap.nodes))
        healthy = _gauge("ringwatch_node_healthy", "1 for a node a preflight would accept, 0 "
                         "for one it would exclude (an open incident or the latest look's "
                         "fault blames the node); every node seen.", labels=["node"])
        duty = _gauge("ringwatch_node_duty_cycle",
                      "Fraction of the node's GPU time spent probing.", labels=["node"])
        probed = _gauge("ringwatch_node_last_probe_timestamp_seconds",
                        "Unix time of the node's newest measurement.", labels=["node"],
                        unit="seconds")
        busy = _gauge("ringwatch_node_busy", "1 for a node a job holds, as the scheduler's "
                      "occupancy source last said (scheduled probes leave it alone; its "
                      "health is its last results'); job empty where the source names none, "
                      "source the workload manager.", labels=["node", "source", "job"])
        yield _gauge("ringwatch_nodes_unhealthy", "Nodes a preflight would exclude "
                     "(ringwatch_node_healthy 0): over ringwatch_nodes, the share "
                     "RingwatchFleetUnhealthy reads.",
                     sum(n.name in self.snap.excluded for n in self.snap.nodes))
        for n in self.snap.nodes:
            if not is_node_name(n.name):
                self._budget.left_out(healthy.name)
                continue
            healthy.add_metric([n.name], int(n.name not in self.snap.excluded))
            if n.duty_cycle is not None:
                duty.add_metric([n.name], n.duty_cycle)
            if n.last_probed_at is not None:
                probed.add_metric([n.name], n.last_probed_at.timestamp())
            if isinstance(n.occupied, dict):
                # Ingest took both from closed forms (a source's name, a job id's pattern).
                busy.add_metric([n.name, str(n.occupied.get("source") or ""),
                                 str(n.occupied.get("job") or "")], 1.0)
        yield from (healthy, duty, probed, busy)
        yield from self._occupancy()

    def _occupancy(self) -> Iterator[Metric]:
        o = self.snap.occupancy or {}
        source = [str(o.get("source"))] if o else None
        up = _gauge("ringwatch_occupancy_source_up", "1 when the occupancy source answered for "
                    "the newest scheduled cycle, 0 when it failed or timed out (every node it "
                    "could not vouch for then counted busy).", labels=["source"])
        counted = _gauge("ringwatch_occupancy_busy_nodes", "Nodes the newest scheduled cycle "
                         "left alone as busy (unknown: counted busy because the source did "
                         "not answer for them).", labels=["source", "kind"])
        took = _gauge("ringwatch_occupancy_read_seconds", "Seconds the newest scheduled cycle "
                      "took to read occupancy.", labels=["source"], unit="seconds")
        if source:
            up.add_metric(source, 0.0 if o.get("error") else 1.0)
            unknown = int(o.get("unknown") or 0)
            counted.add_metric([source[0], "job"], int(o.get("busy") or 0) - unknown)
            counted.add_metric([source[0], "unknown"], unknown)
            took.add_metric(source, float(o.get("read_s") or 0.0))
        yield from (up, counted, took)

    def _ingest(self) -> Iterator[Metric]:
        yield CounterMetricFamily(
            "ringwatch_ingested_batches", "Measurement batches stored (a re-sent batch "
            "once), read from the database: every replica reports the fleet's total.",
            self.snap.ingested.batches)
        yield CounterMetricFamily(
            "ringwatch_ingested_measurements", "Measurements stored, read from the database: "
            "every replica reports the fleet's total.", self.snap.ingested.measurements)
        last = self.snap.last_ingest_at
        yield _gauge("ringwatch_last_ingest_timestamp_seconds",
                     "Unix time the newest measurement batch was stored.",
                     last.timestamp() if last else None, unit="seconds")
        yield _gauge("ringwatch_ingest_lag_seconds",
                     "Seconds since the newest measurement batch was stored, as of the scrape.",
                     (self.snap.now - last).total_seconds() if last else None, unit="seconds")
        planned = self.snap.planned_interval_s
        yield _gauge("ringwatch_expected_ingest_interval_seconds", "Seconds expected between "
                     "batches: what the newest scheduler's batch planned (its cycle and the "
                     "wait after it, stretched for RINGWATCH_MAX_DUTY_CYCLE), else "
                     "RINGWATCH_PROBE_INTERVAL_S. RingwatchIngestStalled fires past three.",
                     planned if planned is not None else self.bounds.probe_interval_s,
                     unit="seconds")
        shipper = _gauge("ringwatch_shipper_batches", "Batches in each scheduler's spool as "
                         "its last batch reported: pending, failed (moved aside after repeated "
                         "5xx), rejected (4xx); per token that sent it (its id, as ringwatch "
                         "token list shows it) and the host that batch named.",
                         labels=["token", "host", "state"])
        seen: set[tuple[str, str]] = set()
        for spool in self.snap.shippers:
            token, host = str(spool.token_id), spool.host[:MAX_HOST_LABEL]
            if (token, host) in seen:
                continue
            seen.add((token, host))
            for key in SHIPPER_STATES:
                shipper.add_metric([token, host, key], _count(spool.state.get(key)))
        left_out = sum(max(0, s.hosts - SHIPPER_HOSTS_PER_TOKEN) for s in
                       {s.token_id: s for s in self.snap.shippers}.values())
        if left_out:
            self._budget.left_out(shipper.name, TOKEN_CAP, left_out * len(SHIPPER_STATES))
        yield shipper

    def _notifier(self) -> Iterator[Metric]:
        b = self.snap.backlog
        yield _gauge("ringwatch_webhook_deliveries_pending",
                     "Webhook deliveries waiting to be sent or retried.", b.pending)
        yield _gauge("ringwatch_webhook_oldest_pending_age_seconds",
                     "Age of the oldest webhook delivery still waiting (0 when none is).",
                     b.oldest_pending_age_s or 0.0, unit="seconds")
        yield _gauge("ringwatch_webhook_deliveries_failed",
                     "Webhook deliveries given up after RINGWATCH_WEBHOOK_MAX_AGE_S of retries.",
                     b.failed)

    def _preflight(self) -> Iterator[Metric]:
        counts = {**dict.fromkeys(PREFLIGHT_STATUSES, 0), **self.snap.preflight}
        requests = _gauge("ringwatch_preflight_requests",
                          "Stored preflight requests by status.", labels=["status"])
        for status, n in sorted(counts.items()):
            requests.add_metric([status], n)
        yield requests
        latency = HistogramMetricFamily(
            "ringwatch_preflight_latency_seconds", "Seconds from a preflight request to its "
            "verdict, of every completed request: answered at_once from stored results, or "
            "probed by a scheduler.", labels=["answered"], unit="seconds")
        for answered in ("at_once", "probed"):
            got = self.snap.preflight_latency.get(answered)
            if got is None:
                got = store.LatencyCounts([0] * len(LATENCY_BOUNDS), 0, 0.0)
            buckets = [(floatToGoString(b), n) for b, n in zip(LATENCY_BOUNDS, got.le,
                                                               strict=True)]
            latency.add_metric([answered], [*buckets, ("+Inf", got.total)], got.sum_s)
        yield latency

    def _tokens(self) -> Iterator[Metric]:
        """Seconds each expiring token has left, by id and role (an id names one token in
        ``ringwatch token list``; names are free text, never labels)."""
        left = _gauge("ringwatch_token_expires_in_seconds", "Seconds until each active token "
                      "that has an expiry expires (ringwatch token list names it by id).",
                      labels=["id", "role"], unit="seconds")
        soon = Counter(dict.fromkeys(ROLES, 0))
        for t in self.snap.tokens:
            role = t.role if t.role in ROLES else "other"  # a row written by hand
            left.add_metric([str(t.id), role], t.expires_in_s)
            if t.expires_in_s <= TOKEN_EXPIRY_WARN_S:
                soon[role] += 1
        yield left
        expiring = _gauge("ringwatch_tokens_expiring_soon", "Active tokens expiring within "
                          f"{TOKEN_EXPIRY_WARN_S / 86400:g} days, by role: rotate them.",
                          labels=["role"])
        for role, n in sorted(soon.items()):
            expiring.add_metric([role], n)
        yield expiring


    def _loops(self) -> Iterator[Metric]:
        """The background loops' heartbeats: the notifier's delivery loop, the maintenance
        pass (a loop that never beat has no series)."""
        at = _gauge("ringwatch_loop_last_success_timestamp_seconds", "Unix time the loop last "
                    "succeeded: notifier (a delivery pass, by any notifier), maintenance (a "
                    "pass, by any replica or `ringwatch db maintain`).", labels=["loop"],
                    unit="seconds")
        since = _gauge("ringwatch_loop_success_age_seconds", "Seconds since the loop last "
                       "succeeded, as of the collection.", labels=["loop"], unit="seconds")
        failures = _gauge("ringwatch_loop_failures", "The loop's failed passes in a row since "
                          "it last succeeded (0 once it does).", labels=["loop"])
        for beat in self.snap.heartbeats:
            if beat.name not in LOOPS:  # a row written by hand
                self._budget.left_out(failures.name)
                continue
            if beat.ok_at is not None and beat.since_ok_s is not None:
                at.add_metric([beat.name], beat.ok_at.timestamp())
                since.add_metric([beat.name], beat.since_ok_s)
            failures.add_metric([beat.name], beat.failures)
        yield from (at, since, failures)


class Scrape(NamedTuple):
    body: bytes
    content_type: str
    gzipped: bool


OPENMETRICS_EOF = b"# EOF\n"


class _Rendered:
    """The fleet's families in one format, OpenMetrics' closing ``# EOF`` left off so the
    process's own families can follow; and, once a scraper asks for gzip, that text
    compressed into an open gzip stream whose compressor each scrape copies to finish."""

    def __init__(self, body: bytes) -> None:
        self.body = body
        self._zipped = b""
        self._zipper: Any = None

    def gzipped(self, tail: bytes) -> bytes:
        """The gzip of ``body`` and ``tail``, one gzip member, ``body`` compressed once."""
        if self._zipper is None:
            self._zipper = zlib.compressobj(6, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
            self._zipped = (self._zipper.compress(self.body)
                            + self._zipper.flush(zlib.Z_SYNC_FLUSH))
        rest = self._zipper.copy()
        return self._zipped + rest.compress(tail) + rest.flush()


class Collected(Collector):
    """What one collection renders: ``ringwatch_database_up``, and the fleet's families when
    the database answered (``snap``), none of them when it did not."""

    def __init__(self, snap: Snapshot | None, limits: SeriesLimits,
                 bounds: AlertBounds | None = None) -> None:
        self.snap = snap
        self.limits = limits
        self.bounds = bounds or AlertBounds()

    def collect(self) -> Iterator[Metric]:
        yield _gauge("ringwatch_database_up", "1 when this API process's latest collection of "
                     "the fleet's families read the database, 0 when it could not (unreachable, "
                     "too slow, or no free connection): those families are then left out.",
                     float(self.snap is not None))
        yield from self.bounds.families()
        if self.snap is not None:
            yield from FleetCollector(self.snap, self.limits, self.bounds).collect()


class ScrapeCache:
    """Rendered scrapes kept for ``ttl_s``: within the window every scraper gets the fleet
    families of one collection (in whichever format and encoding it asked); one collects at
    a time, and those arriving meanwhile wait for its result instead of scanning again. The
    API process's own families (``own``) are rendered at each scrape and follow them.

    A collection the database cannot serve is no failed scrape: it renders
    ``ringwatch_database_up 0`` without the fleet's families (kept, like any collection,
    for ``ttl_s``), and the process's own families follow as always."""

    def __init__(self, ttl_s: float, link_max_age_s: float = 0.0,
                 limits: SeriesLimits | None = None, bounds: AlertBounds | None = None) -> None:
        self.ttl_s = ttl_s
        self.link_max_age_s = link_max_age_s
        self.limits = limits or SeriesLimits()
        self.bounds = bounds or AlertBounds()
        self._lock = threading.Lock()
        self._snap: Snapshot | None = None
        self._taken: float | None = None  # time.monotonic() of the latest collection
        self._rendered: dict[str, _Rendered] = {}

    def get(self, factory: sessionmaker[Session], accept: str = "", gzip_ok: bool = False,
            own: Collector | None = None) -> Scrape:
        """A scrape of the fleet's families, read through ``factory`` in a transaction of
        their own when the cached collection is older than ``ttl_s``, and ``own``'s."""
        encoder, content_type = choose_encoder(accept)
        tail = encoder(own if own is not None else CollectorRegistry())
        with self._lock:
            if self._taken is None or time.monotonic() - self._taken >= self.ttl_s:
                self._snap = self._collect(factory)
                self._taken = time.monotonic()
                self._rendered = {}
            fleet = self._rendered.get(content_type)
            if fleet is None:
                body = encoder(Collected(self._snap, self.limits, self.bounds)
                               ).removesuffix(OPENMETRICS_EOF)
                fleet = self._rendered[content_type] = _Rendered(body)
            if gzip_ok:
                return Scrape(fleet.gzipped(tail), content_type, True)
        return Scrape(fleet.body + tail, content_type, False)

    def _collect(self, factory: sessionmaker[Session]) -> Snapshot | None:
        """The fleet's snapshot, or None where the database cannot serve it now."""
        try:
            with db.transaction(factory) as session:
                return snapshot(session, self.link_max_age_s)
        except db.UNAVAILABLE:  # unreachable, too slow, or no free connection
            return None
