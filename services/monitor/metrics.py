"""Prometheus metrics of the fleet: a snapshot read by a few aggregate queries, rendered by
prometheus_client (escaped labels, HELP and TYPE per family, OpenMetrics when the scraper
asks for it), and cached in the API process so many scrapers cost one scan."""

from __future__ import annotations

import gzip
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from typing import Any, NamedTuple

from prometheus_client.exposition import choose_encoder
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString
from sqlalchemy.orm import Session

from services.analyzer.hysteresis import DEGRADED, OK
from services.store import health as health_store
from services.store import measurements as measurement_store
from services.store import metrics as store
from services.store.preflight import LATENCY_BOUNDS

LINK_LABELS = ["scope", "op", "members"]
PREFLIGHT_STATUSES = ("pending", "running", "done", "failed")
SHIPPER_STATES = ("pending", "failed", "rejected")


@dataclass(frozen=True)
class Snapshot:
    """What one scrape reports, read in one transaction."""

    link_counts: dict[str, int]
    links: list[store.LinkRow]
    nodes: list[store.NodeRow]
    open_findings: dict[str, int]
    shippers: dict[str, dict[str, Any]]
    backlog: store.Backlog
    preflight: dict[str, int]
    preflight_latency: dict[str, store.LatencyCounts]
    ingested: store.IngestTotals
    last_ingest_at: datetime | None
    now: datetime
    collect_s: float


def snapshot(session: Session, link_max_age_s: float = 0.0) -> Snapshot:
    """One read of what a scrape reports. The per-link families cover links read within
    ``link_max_age_s`` (0: all) and every link that is not ok: the rotation leaves a row for
    every node pair it ever probed, and a pair probed days ago is no series worth keeping."""
    started = time.perf_counter()
    link_counts = health_store.health_counts(session)
    links, nodes = store.link_rows(session, link_max_age_s), store.node_rows(session)
    open_findings = store.open_findings_by_kind(session)
    shippers = measurement_store.shipper_states(session)
    backlog = store.delivery_backlog(session)
    preflight = store.preflight_requests_by_status(session)
    latency = store.preflight_latency(session)
    ingested = store.ingest_totals(session)
    last_ingest_at, now = store.last_ingest(session), store.database_now(session)
    return Snapshot(link_counts, links, nodes, open_findings, shippers, backlog, preflight,
                    latency, ingested, last_ingest_at, now,
                    collect_s=time.perf_counter() - started)


def _gauge(name: str, doc: str, value: float | None = None, labels: list[str] | None = None,
           unit: str = "") -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value, labels=labels, unit=unit)


class FleetCollector(Collector):
    """The families of one snapshot; pure, so it renders without a database."""

    def __init__(self, snap: Snapshot) -> None:
        self.snap = snap

    def collect(self) -> Iterator[Metric]:
        yield from self._links()
        yield from self._findings()
        yield from self._nodes()
        yield from self._ingest()
        yield from self._notifier()
        yield from self._preflight()
        yield _gauge("ringwatch_metrics_collect_seconds",
                     "Seconds the queries behind this scrape took (cached between scrapes).",
                     self.snap.collect_s, unit="seconds")

    def _links(self) -> Iterator[Metric]:
        by_status = Counter({OK: 0, DEGRADED: 0})
        by_status.update(self.snap.link_counts)
        links = _gauge("ringwatch_links", "Probed links and groups by health status.",
                       labels=["status"])
        for status, n in sorted(by_status.items()):
            links.add_metric([status], n)
        yield links
        busbw = _gauge("ringwatch_link_busbw_gbs", "Last busbw of each link or group at its "
                       "largest probed size (GB/s, nccl-tests); members is the group key. Links "
                       "read within RINGWATCH_METRICS_LINK_MAX_AGE_S and those not ok.",
                       labels=LINK_LABELS)
        degraded = _gauge("ringwatch_link_degraded", "1 while the link or group is degraded.",
                          labels=LINK_LABELS)
        ratio = _gauge("ringwatch_link_ratio", "Last busbw of each link or group as a share "
                       "of what was expected of it (below the degraded ratio is bad).",
                       labels=LINK_LABELS)
        for r in self.snap.links:
            labels = [r.scope, r.op, r.group_key]
            busbw.add_metric(labels, r.busbw_gbs)
            degraded.add_metric(labels, int(r.status == DEGRADED))
            if r.ratio is not None:
                ratio.add_metric(labels, r.ratio)
        yield from (busbw, degraded, ratio)

    def _findings(self) -> Iterator[Metric]:
        yield _gauge("ringwatch_open_findings", "Open findings (incidents).",
                     sum(self.snap.open_findings.values()))
        by_kind = _gauge("ringwatch_open_findings_by_kind", "Open findings (incidents) by kind.",
                         labels=["kind"])
        for kind, n in sorted(self.snap.open_findings.items()):
            by_kind.add_metric([kind], n)
        yield by_kind

    def _nodes(self) -> Iterator[Metric]:
        yield _gauge("ringwatch_nodes", "Nodes seen.", len(self.snap.nodes))
        duty = _gauge("ringwatch_node_duty_cycle",
                      "Fraction of the node's GPU time spent probing.", labels=["node"])
        probed = _gauge("ringwatch_node_last_probe_timestamp_seconds",
                        "Unix time of the node's newest measurement.", labels=["node"],
                        unit="seconds")
        for n in self.snap.nodes:
            if n.duty_cycle is not None:
                duty.add_metric([n.name], n.duty_cycle)
            if n.last_probed_at is not None:
                probed.add_metric([n.name], n.last_probed_at.timestamp())
        yield from (duty, probed)

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
        shipper = _gauge("ringwatch_shipper_batches", "Batches in each scheduler's spool as "
                         "its last batch reported: pending, failed (moved aside after repeated "
                         "5xx), rejected (4xx).", labels=["host", "state"])
        for host, state in sorted(self.snap.shippers.items()):
            for key in SHIPPER_STATES:
                shipper.add_metric([host, key], int(state.get(key, 0)))
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


class Scrape(NamedTuple):
    body: bytes
    content_type: str
    gzipped: bool


class ScrapeCache:
    """Rendered scrapes kept for ``ttl_s``: within the window every scraper gets the body of
    one collection (in whichever format and encoding it asked); one collects at a time, and
    those arriving meanwhile wait for its result instead of scanning again."""

    def __init__(self, ttl_s: float, link_max_age_s: float = 0.0) -> None:
        self.ttl_s = ttl_s
        self.link_max_age_s = link_max_age_s
        self._lock = threading.Lock()
        self._snap: Snapshot | None = None
        self._taken = 0.0
        self._bodies: dict[tuple[str, bool], bytes] = {}

    def get(self, session: Session, accept: str = "", gzip_ok: bool = False) -> Scrape:
        encoder, content_type = choose_encoder(accept)
        with self._lock:
            if self._snap is None or time.monotonic() - self._taken >= self.ttl_s:
                self._snap = snapshot(session, self.link_max_age_s)
                self._taken = time.monotonic()
                self._bodies = {}
            key = (content_type, gzip_ok)
            if key not in self._bodies:
                body = encoder(FleetCollector(self._snap))
                self._bodies[key] = gzip.compress(body, compresslevel=6) if gzip_ok else body
            return Scrape(self._bodies[key], content_type, gzip_ok)
