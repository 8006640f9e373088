"""RDMA NIC port counters from sysfs (InfiniBand and RoCE HCAs, AWS EFA), their rates between
two readings, and the ``nic_errors`` they add up to: a counter rising past its threshold (even
while bandwidth still looks fine), a link that flapped.

Everything is read under a root directory (a parameter, "/" by default): the one seam a test
replaces with a tree of its own. Reading, rates and judgement are separate pure steps, so the
agent reads each cycle and the analyzer judges what it is sent.
"""

from __future__ import annotations

import itertools
import logging
import os
import re
import stat
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from ringwatch.agents import counter_delta

log = logging.getLogger(__name__)

IB_CLASS = Path("sys/class/infiniband")
# "400 Gb/sec (4X NDR)", "2.5 Gb/sec (1X SDR)": the kernel's rate_show, number first, ASCII.
_RATE = re.compile(r"(\d+(?:\.\d+)?) Gb/sec(?: |\Z)", re.ASCII)
# A sysfs attribute is at most a page; a longer file under the root is not the kernel's.
ATTRIBUTE_MAX_BYTES = 4096
# mlx5's hw_counters, the longest such directory, has under a hundred files.
MAX_COUNTER_FILES = 512
# A counter is an unsigned 64-bit number: at most 20 ASCII digits, at most this.
U64_MAX = (1 << 64) - 1
# The fastest RDMA port today is ConnectX-8's XDR at 800 Gb/s: a port that states no rate is
# held to twice that when its counters' rises are checked (counter_delta).
MAX_PORT_GBPS = 1600.0

# The IBTA PortCounters as Linux publishes them (drivers/infiniband/core/sysfs.c,
# PORT_PMA_ATTR: name, counter, width in bits). By the IBTA spec these stop at all ones
# instead of wrapping: a counter at its maximum can no longer show a rise.
PMA_WIDTHS = {
    "symbol_error": 16, "link_error_recovery": 8, "link_downed": 8, "port_rcv_errors": 16,
    "port_rcv_remote_physical_errors": 16, "port_rcv_switch_relay_errors": 16,
    "port_xmit_discards": 16, "port_xmit_constraint_errors": 8, "port_rcv_constraint_errors": 8,
    "local_link_integrity_errors": 4, "excessive_buffer_overrun_errors": 4, "VL15_dropped": 16,
}

NicKind = Literal["ib", "roce", "efa", "unknown"]
Source = Literal["counters", "hw_counters"]
Per = Literal["interval", "second", "ratio"]    # what a threshold is counted against
_SOURCES: tuple[Source, ...] = ("counters", "hw_counters")


@dataclass(frozen=True)
class PortSnapshot:
    """One port's state and counters at one moment.

    ``counters`` are the IBTA port counters (ports/N/counters: mlx5 IB and RoCE); ``hw_counters``
    the driver's own (ports/N/hw_counters: EFA's rx_drops, retrans_pkts, ...; mlx5's
    out_of_buffer, ...). A file that could not be read is in ``unreadable``, not in either: a
    counter as ``counters/NAME``, a port attribute (``state``, ``rate``, ...) by its name."""

    device: str
    port: int
    kind: NicKind
    link_layer: str | None            # "InfiniBand", "Ethernet" (RoCE), "Unknown" (EFA)
    state: str | None                 # "ACTIVE", "DOWN", ... ("4: ACTIVE" without the number)
    phys_state: str | None            # "LinkUp", "Polling", ...
    rate_gbps: float | None
    counters: dict[str, int] = field(default_factory=dict)
    hw_counters: dict[str, int] = field(default_factory=dict)
    unreadable: tuple[str, ...] = ()
    read_at: float = 0.0              # time.time() when read

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def rate_gbps(text: str | None) -> float | None:
    """A port's ``rate`` attribute in Gb/s ("400 Gb/sec (4X NDR)" -> 400.0); None where it
    is no rate as the kernel writes one."""
    m = _RATE.match(text or "")
    return float(m.group(1)) if m else None


def read_attribute(path: Path) -> str | None:
    """A sysfs attribute's text, stripped; None where it cannot be read, is not UTF-8, is
    longer than a page, or is not a regular file: opened without blocking and checked
    before it is read, so a FIFO or a device planted under the root neither blocks the
    reader nor feeds it without end."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        data = os.read(fd, ATTRIBUTE_MAX_BYTES + 1)
    except OSError:
        return None
    finally:
        os.close(fd)
    if len(data) > ATTRIBUTE_MAX_BYTES:
        return None
    try:
        return data.decode().strip()
    except UnicodeDecodeError:
        return None


def parse_counter(text: str | None) -> int | None:
    """A counter file's text as its value: ASCII digits only (str.isdigit alone takes "²"
    and "٣"), an unsigned 64-bit number; None for anything else."""
    if text is None or not (0 < len(text) <= 20 and text.isascii() and text.isdigit()):
        return None
    value = int(text)
    return value if value <= U64_MAX else None


def _counters(directory: Path) -> tuple[dict[str, int], list[str]]:
    """Every counter file of a directory as an int; the ones that do not read as one apart
    (a PMA the device lacks reads "N/A (no PMA)" on older kernels, or fails with EINVAL;
    a file that is not a regular one). At most MAX_COUNTER_FILES are read."""
    values: dict[str, int] = {}
    bad: list[str] = []
    if not directory.is_dir():
        return values, bad
    listed = list(itertools.islice(directory.iterdir(), MAX_COUNTER_FILES + 1))
    if len(listed) > MAX_COUNTER_FILES:
        bad.append(f"{directory.name}/ (more than {MAX_COUNTER_FILES} files; none read)")
        return values, bad
    for entry in sorted(listed):
        if entry.is_dir():
            continue
        value = parse_counter(read_attribute(entry))
        if value is not None:
            values[entry.name] = value
        else:
            bad.append(f"{directory.name}/{entry.name}")
    return values, bad


def _kind(device: Path, link_layer: str | None) -> NicKind:
    """EFA by its driver (device/driver links to .../drivers/efa) or, without that link, by its
    name (efa_0; rdma-core's udev rules may rename it rdmap...); else by the link layer."""
    driver = device / "device" / "driver"
    try:
        if os.path.basename(os.readlink(driver)) == "efa":
            return "efa"
    except OSError:
        pass
    if device.name.startswith("efa"):
        return "efa"
    if link_layer == "InfiniBand":
        return "ib"
    if link_layer == "Ethernet":
        return "roce"
    return "unknown"


def _state(text: str | None) -> str | None:
    """"4: ACTIVE" -> "ACTIVE", "5: LinkUp" -> "LinkUp"."""
    if not text:
        return None
    return text.split(":", 1)[-1].strip() or None


# A port's own attributes, read beside its counters.
_ATTRIBUTES = ("link_layer", "rate", "state", "phys_state")


def read_ports(root: str | os.PathLike[str] = "/",
               devices: Iterable[str] | None = None) -> list[PortSnapshot]:
    """Every port of every RDMA device under ``root``/sys/class/infiniband (or of ``devices``
    only). Empty where the tree does not exist: no RDMA NICs, or not Linux."""
    base = Path(root) / IB_CLASS
    if not base.is_dir():
        return []
    wanted = set(devices) if devices is not None else None
    snapshots: list[PortSnapshot] = []
    for device in sorted(base.iterdir()):
        if wanted is not None and device.name not in wanted:
            continue
        ports = device / "ports"
        if not ports.is_dir():
            continue
        for port in sorted(ports.iterdir(), key=lambda p: (len(p.name), p.name)):
            if not (port.name.isascii() and port.name.isdigit()):
                continue
            text = {name: read_attribute(port / name) for name in _ATTRIBUTES}
            rate = _RATE.match(text["rate"] or "")
            # An attribute that did not read (or a rate that is no number) is noted, as a
            # counter is: None says "not known", the note says why.
            bad = [name for name, value in text.items()
                   if value is None or (name == "rate" and rate is None)]
            counters, counters_bad = _counters(port / "counters")
            hw_counters, hw_bad = _counters(port / "hw_counters")
            snapshots.append(PortSnapshot(
                device=device.name, port=int(port.name), kind=_kind(device, text["link_layer"]),
                link_layer=text["link_layer"], state=_state(text["state"]),
                phys_state=_state(text["phys_state"]),
                rate_gbps=float(rate.group(1)) if rate else None,
                counters=counters, hw_counters=hw_counters,
                unreadable=tuple(bad + counters_bad + hw_bad), read_at=time.time()))
    return snapshots


# The data a port carried, both directions. IBTA PortXmitData/PortRcvData (counters/, mlx5 IB
# and RoCE alike) count 4-byte words; EFA's hw_counters count bytes.
_DATA_COUNTERS = (("counters", ("port_xmit_data", "port_rcv_data"), 4),
                  ("hw_counters", ("tx_bytes", "rx_bytes"), 1))
# Without the extended PortCounters the words counters are the 32-bit PMA ones, which stop at
# all ones (16 GiB) instead of wrapping: from there on they say nothing.
_PMA_DATA_MAX = (1 << 32) - 1


def read_data_bytes(root: str | os.PathLike[str] = "/",
                    devices: Iterable[str] | None = None) -> dict[tuple[str, int], int]:
    """Bytes each RDMA port under ``root`` has sent and received so far, summed, by (device,
    port): cumulative, so two readings give the traffic between them. Only the data counters
    are read (mlx5 queries its firmware for each hw_counters file read, and this is read
    around every probe). A port without readable data counters, or with a saturated 32-bit
    one, is left out."""
    base = Path(root) / IB_CLASS
    if not base.is_dir():
        return {}
    wanted = set(devices) if devices is not None else None
    data: dict[tuple[str, int], int] = {}
    for device in sorted(base.iterdir()):
        ports = device / "ports"
        if (wanted is not None and device.name not in wanted) or not ports.is_dir():
            continue
        for port in ports.iterdir():
            if port.name.isascii() and port.name.isdigit():
                total = _data_bytes(port)
                if total is not None:
                    data[(device.name, int(port.name))] = total
    return data


def _data_bytes(port: Path) -> int | None:
    for sub, names, unit in _DATA_COUNTERS:
        texts = [read_attribute(port / sub / name) for name in names]
        if any(text is None for text in texts):
            continue
        values = [parse_counter(t) for t in texts]
        if any(v is None for v in values):
            return None
        counts = [v for v in values if v is not None]
        if unit == 4 and _PMA_DATA_MAX in counts:
            return None
        return sum(counts) * unit
    return None


@dataclass(frozen=True)
class CounterRate:
    """One counter between two readings of a port. A counter that went backwards (cleared by
    perfquery -R, or the driver reloaded) is a ``reset``: no delta and no rate for that
    interval, rather than a negative one. One that rose by more than the port could carry
    (agents.counter_delta: a jump from 0 to 2^64-1) is ``impossible``: no delta and no rate
    either. Both are logged."""

    device: str
    port: int
    counter: str
    source: Source
    before: int
    after: int
    delta: int | None                # per interval; None on a reset
    interval_s: float
    rate_per_s: float | None         # None on a reset or an interval of no length
    reset: bool = False
    saturated: bool = False          # an IBTA counter at its maximum: rises no longer show
    impossible: bool = False         # rose past what the port could carry: misread or planted

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def counter_rates(before: Sequence[PortSnapshot],
                  after: Sequence[PortSnapshot]) -> list[CounterRate]:
    """Per port present in both readings, every counter present in both; a counter that
    went back or rose past what the port could carry has no delta, and is logged."""
    earlier = {(s.device, s.port): s for s in before}
    rates: list[CounterRate] = []
    for now in after:
        then = earlier.get((now.device, now.port))
        if then is None:
            continue
        interval = now.read_at - then.read_at
        gbps = max(then.rate_gbps or 0.0, now.rate_gbps or 0.0) or MAX_PORT_GBPS
        # Both directions' bits: a port's counters count either or both.
        limit = counter_delta.ceiling(2 * gbps * 1e9, interval)
        for source in _SOURCES:
            old: dict[str, int] = getattr(then, source)
            new: dict[str, int] = getattr(now, source)
            for name in sorted(old.keys() & new.keys()):
                delta, why = counter_delta.rise(old[name], new[name], limit)
                if why is not None:
                    log.warning("%s port %s %s/%s %s in %.0f s: dropped", now.device, now.port,
                                source, name, why, interval)
                width = PMA_WIDTHS.get(name) if source == "counters" else None
                rates.append(CounterRate(
                    device=now.device, port=now.port, counter=name, source=source,
                    before=old[name], after=new[name], delta=delta, interval_s=interval,
                    rate_per_s=None if delta is None or interval <= 0 else delta / interval,
                    reset=new[name] < old[name], impossible=delta is None and new[name] > old[name],
                    saturated=width is not None and new[name] >= (1 << width) - 1))
    return rates


@dataclass(frozen=True)
class Threshold:
    """When a rising counter is a ``nic_errors`` finding, and where that number comes from.

    A rise counts when the interval's delta is at least ``min_delta`` and, where set, the rate
    is above ``per_s``, the ratio to ``ratio_of``'s delta above ``max_ratio``, or the errors per
    bit carried at the port's rate above ``ber`` (falling back to ``min_delta`` alone when the
    port gives no rate)."""

    counter: str
    source: Source
    kinds: frozenset[str]
    min_delta: int
    severity: Literal["warning", "critical"]
    meaning: str
    cited: str
    per_s: float | None = None
    ber: float | None = None
    ratio_of: str | None = None
    max_ratio: float | None = None
    flap: bool = False


_IB = frozenset({"ib", "roce"})
_EFA = frozenset({"efa"})
_OWN = "ringwatch's own choice: no public source sets a number for it"
_IBQ = ("infiniband-diags ibqueryerrors(8), whose example error_thresholds file sets "
        "SymbolErrorCounter=10 and LinkErrorRecoveryCounter=10")

THRESHOLDS: tuple[Threshold, ...] = (
    Threshold(
        "link_downed", "counters", _IB, 1, "critical", flap=True,
        meaning="IBTA LinkDownedCounter: the link failed its error recovery and went down",
        cited="any rise is a flap: azurehpc-health-checks' check_ib_link_flapping fails a node "
              "on any IB link flap inside its window (6 h by default); facebookresearch/gcm's "
              "link-flaps check calls an InfiniBand flap CRITICAL"),
    Threshold(
        "link_error_recovery", "counters", _IB, 1, "warning",
        meaning="IBTA LinkErrorRecoveryCounter: the link retrained after errors (a step short of "
                "going down)",
        cited=f"any rise per interval is ringwatch's choice; {_IBQ}, counted since the last "
              "clear rather than per cycle"),
    Threshold(
        "symbol_error", "counters", _IB, 10, "warning", ber=1e-12,
        meaning="IBTA SymbolErrorCounter: bad symbols received; on HDR/NDR the errors left after "
                "FEC, the ones the application sees",
        cited="errors per bit at the port's rate above 1e-12, NVIDIA ibdiagnet's default BER "
              "threshold (--ber_thresh); where the port gives no rate, 10 per interval after "
              + _IBQ),
    Threshold(
        "local_link_integrity_errors", "counters", _IB, 1, "warning",
        meaning="IBTA LocalLinkIntegrityErrors: times local physical errors exceeded the "
                "LocalPhyErrors threshold",
        cited="any rise: by the IBTA definition each count is already a threshold crossing"),
    Threshold(
        "excessive_buffer_overrun_errors", "counters", _IB, 1, "warning",
        meaning="IBTA ExcessiveBufferOverrunErrors: times OverrunErrors consecutive flow-control "
                "update periods each saw a buffer overrun",
        cited="any rise: by the IBTA definition each count is already a threshold crossing"),
    Threshold(
        "port_rcv_errors", "counters", _IB, 10, "warning",
        meaning="IBTA PortRcvErrors: packets received with errors (CRC, length, ...)",
        cited=f"10 per interval, {_OWN}; the same count ibqueryerrors' example uses for the "
              "link error counters"),
    Threshold(
        "port_rcv_remote_physical_errors", "counters", _IB, 10, "warning",
        meaning="IBTA PortRcvRemotePhysicalErrors: packets marked bad upstream (the fault is on "
                "the far side of this link)",
        cited=f"10 per interval, {_OWN}; as port_rcv_errors"),
    Threshold(
        "port_xmit_discards", "counters", _IB, 100, "warning",
        meaning="IBTA PortXmitDiscards: outbound packets dropped, for congestion or while the "
                "port was down",
        cited=f"100 per interval, {_OWN}; higher than the corruption counters because "
              "congestion alone raises it"),
    Threshold(
        "rx_drops", "hw_counters", _EFA, 100, "warning",
        meaning="EFA: received packets the device dropped",
        cited=f"100 per interval, {_OWN}"),
    Threshold(
        "retrans_pkts", "hw_counters", _EFA, 100, "warning", ratio_of="tx_pkts", max_ratio=0.01,
        meaning="EFA: packets the device sent again (SRD retransmission)",
        cited=f"over 1% of the interval's tx_pkts and at least 100, {_OWN}: SRD retransmits "
              "routinely, a rising share is what degrades"),
    Threshold(
        "retrans_timeout_events", "hw_counters", _EFA, 1, "warning",
        meaning="EFA: retransmissions that timed out waiting for the peer",
        cited=f"any rise, {_OWN}"),
    Threshold(
        "unresponsive_remote_events", "hw_counters", _EFA, 1, "critical",
        meaning="EFA: a remote peer stopped responding",
        cited=f"any rise, {_OWN}"),
    Threshold(
        "impaired_remote_conn_events", "hw_counters", _EFA, 1, "warning",
        meaning="EFA: a connection to a remote peer was impaired",
        cited=f"any rise, {_OWN}"),
    Threshold(
        "rdma_read_wr_err", "hw_counters", _EFA, 1, "warning",
        meaning="EFA: RDMA read work requests completed in error",
        cited=f"any rise, {_OWN}"),
    Threshold(
        "rdma_write_wr_err", "hw_counters", _EFA, 1, "warning",
        meaning="EFA: RDMA write work requests completed in error",
        cited=f"any rise, {_OWN}"),
)


@dataclass(frozen=True)
class NicError:
    """One ``nic_errors`` record: a counter of one port rose past its threshold in one interval
    (or the port left ACTIVE: ``counter`` "state")."""

    node: str
    device: str
    port: int
    counter: str
    delta: int
    rate_per_s: float
    threshold: float
    threshold_per: Per
    interval_s: float
    severity: str
    flap: bool
    why: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _limit(rule: Threshold, port: PortSnapshot) -> tuple[float, Per]:
    if rule.ber is not None and port.rate_gbps:
        return port.rate_gbps * 1e9 * rule.ber, "second"
    if rule.per_s is not None:
        return rule.per_s, "second"
    if rule.max_ratio is not None:
        return rule.max_ratio, "ratio"
    return float(rule.min_delta), "interval"


def _breaches(rule: Threshold, rate: CounterRate, port: PortSnapshot,
              deltas: dict[str, int]) -> tuple[bool, float, Per]:
    limit, per = _limit(rule, port)
    delta = rate.delta or 0
    if per == "second":
        over = rate.rate_per_s is not None and rate.rate_per_s > limit and delta >= 1
    elif per == "ratio":
        base = deltas.get(rule.ratio_of or "", 0)
        over = delta >= rule.min_delta and base > 0 and delta / base > limit
    else:
        over = delta >= rule.min_delta
    return over, limit, per


def nic_errors(before: Sequence[PortSnapshot], after: Sequence[PortSnapshot], node: str,
               thresholds: Sequence[Threshold] = THRESHOLDS) -> list[NicError]:
    """The cycle's verdict on a node's NICs: every counter that rose past its threshold
    (``link_downed`` rising is a flap), and every port that was ACTIVE and no longer is. A
    counter reset (it went backwards) is judged on the next interval, not this one; a rise
    the port could not have carried is not judged at all."""
    rules = {(t.source, t.counter): t for t in thresholds}
    ports = {(p.device, p.port): p for p in after}
    rates = counter_rates(before, after)
    deltas: dict[tuple[str, int], dict[str, int]] = {}
    for r in rates:
        if r.delta is not None:
            deltas.setdefault((r.device, r.port), {})[r.counter] = r.delta
    errors: list[NicError] = []
    for r in rates:
        rule = rules.get((r.source, r.counter))
        port = ports[(r.device, r.port)]
        if rule is None or r.delta is None or port.kind not in rule.kinds:
            continue
        over, limit, per = _breaches(rule, r, port, deltas.get((r.device, r.port), {}))
        if over:
            errors.append(NicError(
                node=node, device=r.device, port=r.port, counter=r.counter, delta=r.delta or 0,
                rate_per_s=r.rate_per_s or 0.0, threshold=limit, threshold_per=per,
                interval_s=r.interval_s, severity=rule.severity, flap=rule.flap,
                why=f"{rule.meaning}; threshold: {rule.cited}"))
    earlier = {(s.device, s.port): s for s in before}
    for key, port in ports.items():
        then = earlier.get(key)
        if then is not None and then.state == "ACTIVE" and port.state != "ACTIVE":
            errors.append(NicError(
                node=node, device=port.device, port=port.port, counter="state", delta=0,
                rate_per_s=0.0, threshold=0.0, threshold_per="interval",
                interval_s=port.read_at - then.read_at, severity="critical", flap=False,
                why=f"port state went from ACTIVE to {port.state} ({port.phys_state}): the link "
                    "is down now (LBNL NHC's check_hw_ib, too, requires an ACTIVE port)"))
    return errors
