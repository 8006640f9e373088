"""Contention: whether a probe's links carried other traffic while it ran.

A probe sharing NVLink or a NIC with a training job measures the job, not the link: its
bandwidth is a fraction of the link's, and that is no fault. Each rank reads the traffic on
its links over a short quiet window beside its group (its own probe not running); where a
job's traffic passes the limits below, every measurement of the group is ``contended``:
stored and shown, never judged against the link's normal, never part of it
(docs/operations.md, "Occupancy and contention").

The judgement here is pure: real agents feed it what NVML and the NICs' counters say
(``TrafficMeter``, read by ``agents.probe``), the sim what its scenario's jobs send
(``agents.sim``), so both are judged by the same rule.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Collection, Iterable
from dataclasses import asdict, dataclass
from typing import Any, TypeVar

from ringwatch.agents import counter_delta, nic_counters, telemetry

T = TypeVar("T")
log = logging.getLogger(__name__)

# How long a rank reads its links before its group forms: long enough for a job's traffic to
# move counters by far more than their noise, short beside a group's probes (its cost is
# paid once per group, by all its ranks at once).
QUIET_WINDOW_S = 0.2
# NVML's GPU utilization is the busy share of its last sample period, 1/6 s to 1 s by
# product: within this long of the agent's own GPU work it would be reading that work.
UTILIZATION_PERIOD_S = 1.0


@dataclass(frozen=True)
class Traffic:
    """The other traffic one rank saw on its links over ``window_s`` seconds: through its
    GPU's NVLinks (GB/s, both directions summed), through its node's RDMA ports (GB/s, both
    directions), the share of time its GPU was busy, and the compute processes on its GPU
    other than the agent's. None: not readable here (no NVML, no RDMA ports)."""

    member: str
    window_s: float = 0.0
    nvlink_gbs: float | None = None
    net_gbs: float | None = None
    gpu_util: float | None = None
    processes: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Traffic:
        known = {k: d[k] for k in ("member", "window_s", "nvlink_gbs", "net_gbs", "gpu_util",
                                   "processes") if k in d}
        return cls(**known)


@dataclass(frozen=True)
class Limits:
    """Other traffic up to these is noise, not a job: NVML's throughput counters and the
    ports' data counters tick with management traffic, and the GPU's utilization with the
    agent's own set-up. A training job's collectives move tens to hundreds of GB/s."""

    nvlink_gbs: float = 2.0
    net_gbs: float = 0.5
    gpu_util: float = 0.10
    processes: int = 0


def contention(traffic: Iterable[Traffic], limits: Limits = Limits()) -> str | None:
    """Why a group's measurements are contended, in one line naming the busiest rank of each
    kind of link; None where every rank's links were quiet (or unreadable: a probe that
    cannot read its counters is judged as before)."""
    worst: dict[str, tuple[float, str]] = {}

    def note(kind: str, value: float | int | None, limit: float, member: str) -> None:
        if value is not None and value > limit and value > worst.get(kind, (-1.0, ""))[0]:
            worst[kind] = (float(value), member)

    for t in traffic:
        note("nvlink", t.nvlink_gbs, limits.nvlink_gbs, t.member)
        note("network", t.net_gbs, limits.net_gbs, t.member)
        note("gpu", t.gpu_util, limits.gpu_util, t.member)
        note("processes", t.processes, limits.processes, t.member)
    if not worst:
        return None
    words = {
        "nvlink": lambda v: f"NVLink {v:.1f} GB/s",
        "network": lambda v: f"network {v:.1f} GB/s",
        "gpu": lambda v: f"GPU {v:.0%} busy",
        "processes": lambda v: f"{v:.0f} other process(es) on the GPU",
    }
    parts = [f"{words[k](v)} at {m}" for k, (v, m) in sorted(worst.items())]
    return "other traffic: " + "; ".join(parts)


@dataclass(frozen=True)
class TrafficSample:
    """What a ``TrafficMeter`` read at one moment (``at``: time.monotonic()). The counters are
    cumulative, by what they count: NVLink data KiB by (field id, link), RDMA port bytes
    (both directions) by (device, port). None: not read here, or unreadable."""

    at: float
    nvlink_kib: dict[tuple[int, int], int] | None = None
    net_bytes: dict[tuple[str, int], int] | None = None
    gpu_util: float | None = None
    processes: int | None = None

    @property
    def empty(self) -> bool:
        """Nothing could be read: waiting for a second reading would tell nothing."""
        return (self.nvlink_kib is None and self.net_bytes is None and self.gpu_util is None
                and self.processes is None)


class TrafficMeter:
    """Reads the other traffic on one rank's links from the hardware: its GPU's NVLink data
    counters, utilization and compute processes through NVML (``gpu``: the NVML index; None
    for a rank without a GPU), and where ``nics`` the data counters of every RDMA port of
    the node (sysfs under ``sysfs_root``). The processes in ``own_pids`` are the agent's.

    ``own_gpu_work_at`` (time.monotonic()) is when the agent's own last work on the GPU
    ended: NVML's utilization still covers it for up to ``UTILIZATION_PERIOD_S``, so until
    then it is not read. Nothing here raises: what cannot be read is None."""

    def __init__(self, gpu: int | None = None, own_pids: Collection[int] = (), *,
                 nics: bool = False, sysfs_root: str | os.PathLike[str] = "/",
                 own_gpu_work_at: float | None = None) -> None:
        self.gpu = gpu
        self.own_pids = frozenset(own_pids)
        self.nics = nics
        self.sysfs_root = sysfs_root
        self.own_gpu_work_at = own_gpu_work_at

    def sample(self) -> TrafficSample:
        """The counters, utilization and processes now; two samples make a ``traffic``."""
        at = time.monotonic()
        nvlink, util, processes = (None, None, None) if self.gpu is None else \
            self._gpu(self.gpu, at)
        return TrafficSample(at=at, nvlink_kib=nvlink, net_bytes=self._net(),
                             gpu_util=util, processes=processes)

    def traffic(self, before: TrafficSample, after: TrafficSample, seconds: float,
                member: str) -> Traffic:
        """The other traffic between two samples ``seconds`` apart, as ``member`` saw it: the
        counters' rates, the utilization and the processes of the later sample (a process
        seen at either end counts)."""
        seen = [s.processes for s in (before, after) if s.processes is not None]
        return Traffic(
            member=member, window_s=seconds,
            nvlink_gbs=_gbs(before.nvlink_kib, after.nvlink_kib, 1024, seconds,
                            telemetry.NVLINK_MAX_BITS_PER_S, f"{member} NVLink"),
            net_gbs=_gbs(before.net_bytes, after.net_bytes, 1, seconds,
                         2 * nic_counters.MAX_PORT_GBPS * 1e9, f"{member} RDMA port"),
            gpu_util=after.gpu_util, processes=max(seen) if seen else None)

    def _gpu(self, gpu: int, at: float) -> tuple[dict[tuple[int, int], int] | None,
                                                 float | None, int | None]:
        try:
            with telemetry._session() as nvml:
                handle = telemetry._handle(nvml, gpu)
                util = None
                if self.own_gpu_work_at is None or \
                        at - self.own_gpu_work_at >= UTILIZATION_PERIOD_S:
                    util = _nvml_read(lambda: nvml.nvmlDeviceGetUtilizationRates(handle).gpu / 100)
                return (_nvml_read(lambda: _nvlink_kib(nvml, handle)), util,
                        _nvml_read(lambda: self._others(nvml, handle)))
        except Exception:  # no NVML library, no such GPU: nothing read
            return None, None, None

    def _others(self, nvml: Any, handle: Any) -> int:
        pids = {int(p.pid) for p in nvml.nvmlDeviceGetComputeRunningProcesses(handle)}
        return len(pids - self.own_pids)

    def _net(self) -> dict[tuple[str, int], int] | None:
        if not self.nics:
            return None
        try:
            return nic_counters.read_data_bytes(self.sysfs_root) or None
        except OSError:
            return None


def _nvml_read(read: Callable[[], T]) -> T | None:
    """One NVML query some GPUs, drivers or MIG instances do not support: None for those."""
    try:
        return read()
    except Exception:
        return None


def _nvlink_kib(nvml: Any, handle: Any) -> dict[tuple[int, int], int] | None:
    """Every NVLink's data counters (TX and RX, KiB, cumulative) in one query; links the GPU
    lacks, or whose counters it does not keep, answer with an error and are left out."""
    fields = [(field, link) for link in range(int(nvml.NVML_NVLINK_MAX_LINKS))
              for field in (nvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX,
                            nvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX)]
    values = nvml.nvmlDeviceGetFieldValues(handle, fields)
    kib = {key: int(v.value.ullVal) for key, v in zip(fields, values, strict=True)
           if v.nvmlReturn == 0}
    return kib or None


def _gbs(before: dict[Any, int] | None, after: dict[Any, int] | None, unit: int,
         seconds: float, bits_per_s: float, what: str) -> float | None:
    """GB/s that cumulative counters (of ``unit`` bytes) moved between two readings, over the
    counters both readings have. A counter that went back (driver reloaded, cleared) or rose
    past what its link (``bits_per_s``) could carry adds nothing, and is logged: a planted or
    misread jump would otherwise mark every measurement of the group contended."""
    if before is None or after is None or seconds <= 0:
        return None
    common = before.keys() & after.keys()
    if not common:
        return None
    limit = counter_delta.ceiling(bits_per_s, seconds) / (8 * unit)
    moved = 0
    for key in sorted(common, key=str):
        delta, why = counter_delta.rise(before[key], after[key], limit)
        if why is not None:
            log.warning("%s %s: %s: dropped", what, key, why)
        moved += delta or 0
    return moved * unit / seconds / 1e9
