"""NVML telemetry of one GPU: identity, NVLink state and error counters, NVLink fabric
state, P2P topology.

Everything goes through the module-level ``_nvml`` (the ``pynvml`` module of
nvidia-ml-py): the one seam a test replaces with a fake. Without an NVML library
(CPU machines, containers without the driver) every reader answers
``{"available": False, "reason": ...}`` and nothing else changes.
"""

from __future__ import annotations

import ctypes
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from typing import Any

import pynvml

from ringwatch.agents import counter_delta, nvlink_fabric
from ringwatch.agents.spec import Finding

_nvml: Any = pynvml
log = logging.getLogger(__name__)

# NVML error counters per link, under the names the output uses.
_ERROR_COUNTERS = {
    "replay": "NVML_NVLINK_ERROR_DL_REPLAY",
    "recovery": "NVML_NVLINK_ERROR_DL_RECOVERY",
    "crc_flit": "NVML_NVLINK_ERROR_DL_CRC_FLIT",
    "crc_data": "NVML_NVLINK_ERROR_DL_CRC_DATA",
}
# The fastest NVLink (NVLink 5) carries 100 GB/s per link, both directions: no error counter
# of a link rises by more than its bits (agents.counter_delta).
NVLINK_MAX_BITS_PER_S = 800e9
# Two readings without their times (an older agent's) are held to a day apart: no check
# reads a GPU's counters further apart than that.
UNTIMED_INTERVAL_S = 86400.0
# A cumulative count since driver load past int64 would take centuries of errors: misread.
_COUNT_MAX = (1 << 63) - 1
# nvmlGpuTopologyLevel_t -> nvidia-smi topo's words, nearest first.
_TOPOLOGY_LEVELS = {0: "internal", 10: "PIX", 20: "PXB", 30: "PHB", 40: "NODE", 50: "SYS"}
# GPU fabric info, newest struct first: v3 adds a health summary to v2's health mask; the
# unversioned call (deprecated, older drivers) has neither. A driver that knows only v2
# answers v3 with NVML_ERROR_ARGUMENT_VERSION_MISMATCH, one without the V call with
# NVML_ERROR_FUNCTION_NOT_FOUND: either way the next one is tried.
_FABRIC_QUERIES = (
    ("nvmlDeviceGetGpuFabricInfoV", "c_nvmlGpuFabricInfo_v3_t", "v3"),
    ("nvmlDeviceGetGpuFabricInfoV", "c_nvmlGpuFabricInfo_v2_t", "v2"),
    ("nvmlDeviceGetGpuFabricInfo", "c_nvmlGpuFabricInfo_t", "v1"),
)
_NVML_ERROR_NOT_SUPPORTED = 3
# nvmlReturn_t by name, for a fabric struct's ``status`` (pynvml's own table, not the seam).
_RETURN_NAMES = {0: "SUCCESS", **{getattr(pynvml, n): n.removeprefix("NVML_")
                                  for n in dir(pynvml) if n.startswith("NVML_ERROR_")}}


class NvmlUnavailable(Exception):
    """NVML cannot be used here; the message says why."""


@contextmanager
def _session() -> Iterator[Any]:
    """nvmlInit/nvmlShutdown around one read; any NVML failure to start becomes NvmlUnavailable."""
    nvml = _nvml
    try:
        nvml.nvmlInit()
    except Exception as exc:  # NVMLError_LibraryNotFound, DriverNotLoaded, ...
        raise NvmlUnavailable(f"{type(exc).__name__}: {exc}") from exc
    try:
        yield nvml
    finally:
        with suppress(Exception):
            nvml.nvmlShutdown()


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _optional(fn: Any, *args: Any) -> Any:
    """An NVML query that some GPUs or drivers do not support: None instead of an error."""
    try:
        return fn(*args)
    except Exception:
        return None


def _handle(nvml: Any, local_index: int) -> Any:
    count = nvml.nvmlDeviceGetCount()
    if not 0 <= local_index < count:
        raise NvmlUnavailable(f"GPU {local_index} not present (NVML sees {count})")
    return nvml.nvmlDeviceGetHandleByIndex(local_index)


def _identity(nvml: Any, handle: Any) -> dict[str, Any]:
    pci = _optional(nvml.nvmlDeviceGetPciInfo, handle)
    return {
        "uuid": _text(nvml.nvmlDeviceGetUUID(handle)),
        "name": _text(nvml.nvmlDeviceGetName(handle)),
        "pci_bus_id": _text(pci.busId) if pci is not None else None,
        "numa_node": _numa_node(nvml, handle),
    }


def _numa_node(nvml: Any, handle: Any) -> int | None:
    # nvmlDeviceGetNumaNodeId is recent (driver 535+); older drivers simply lack it.
    fn = getattr(nvml, "nvmlDeviceGetNumaNodeId", None)
    return _optional(fn, handle) if fn is not None else None


def _link_active(nvml: Any, handle: Any, link: int) -> bool | None:
    """True/False for an existing link, None past the last link this GPU has."""
    try:
        return nvml.nvmlDeviceGetNvLinkState(handle, link) == nvml.NVML_FEATURE_ENABLED
    except Exception:
        return None


def _link_throughput(nvml: Any, handle: Any, link: int) -> dict[str, int] | None:
    """Data TX/RX counters in KiB (Hopper and later); None where the field is unsupported."""
    ids = [(nvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, link),
           (nvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX, link)]
    values = _optional(nvml.nvmlDeviceGetFieldValues, handle, ids)
    if values is None or any(v.nvmlReturn != 0 for v in values):
        return None
    return {"tx_kib": int(values[0].value.ullVal), "rx_kib": int(values[1].value.ullVal)}


def _error_counts(nvml: Any, handle: Any, link: int) -> dict[str, int | None]:
    """A link's error counters; None where NVML has none, or answers with a count no
    driver's lifetime reaches (logged)."""
    counts: dict[str, int | None] = {}
    for name, const in _ERROR_COUNTERS.items():
        value = _optional(nvml.nvmlDeviceGetNvLinkErrorCounter, handle, link, getattr(nvml, const))
        if value is not None and not 0 <= int(value) <= _COUNT_MAX:
            log.warning("NVLink: link %s %s read %s, past any real count: dropped", link, name,
                        value)
            value = None
        counts[name] = None if value is None else int(value)
    return counts


def _nvlinks(nvml: Any, handle: Any) -> list[dict[str, Any]]:
    links = []
    for link in range(int(nvml.NVML_NVLINK_MAX_LINKS)):
        active = _link_active(nvml, handle, link)
        if active is None:
            continue
        errors = _error_counts(nvml, handle, link)
        remote = _optional(nvml.nvmlDeviceGetNvLinkRemotePciInfo, handle, link)
        links.append({
            "link": link,
            "active": active,
            "errors": errors,
            "remote_pci_bus_id": _text(remote.busId) if remote is not None else None,
            "throughput": _link_throughput(nvml, handle, link),
        })
    return links


def _fabric(nvml: Any, handle: Any) -> dict[str, Any]:
    """This GPU's NVLink fabric registration, domain, clique and health
    (agents.nvlink_fabric.reading); ``{"supported": False, "reason": ...}`` where it has no
    fabric (NVML_ERROR_NOT_SUPPORTED, state NOT_SUPPORTED) or this NVML cannot say."""
    reason = "no GPU fabric query in this NVML"
    for call, struct, api in _FABRIC_QUERIES:
        fn, make = getattr(nvml, call, None), getattr(nvml, struct, None)
        if fn is None or make is None:
            continue
        info = make()
        try:
            fn(handle, ctypes.byref(info))
        except Exception as exc:  # NotSupported ends the search; VersionMismatch, ... do not
            reason = f"{call}: {type(exc).__name__}: {exc}"
            if getattr(exc, "value", None) == _NVML_ERROR_NOT_SUPPORTED:
                break
            continue
        status = int(info.status)
        return nvlink_fabric.reading(
            # nvml.h declares the state an unsigned char; pynvml reads a c_uint, whose
            # upper bytes are the struct's padding.
            state=int(info.state) & 0xFF, status=_RETURN_NAMES.get(status, f"ERROR_{status}"),
            cluster_uuid=bytes(info.clusterUuid), clique_id=int(info.cliqueId),
            health_mask=int(info.healthMask) if api != "v1" else None,
            health_summary=int(info.healthSummary) if api == "v3" else None, api=api)
    return {"supported": False, "reason": reason}


def _p2p_row(nvml: Any, handle: Any, local_index: int) -> dict[str, dict[str, Any]]:
    """How this GPU reaches each other GPU of the node: over NVLink or only over PCIe."""
    row: dict[str, dict[str, Any]] = {}
    for other in range(nvml.nvmlDeviceGetCount()):
        if other == local_index:
            continue
        peer = nvml.nvmlDeviceGetHandleByIndex(other)
        status = _optional(nvml.nvmlDeviceGetP2PStatus, handle, peer, nvml.NVML_P2P_CAPS_INDEX_NVLINK)
        level = _optional(nvml.nvmlDeviceGetTopologyCommonAncestor, handle, peer)
        nvlink = status == nvml.NVML_P2P_STATUS_OK
        row[str(other)] = {
            "nvlink": nvlink,
            "link": "NVLINK" if nvlink else "PCIE",
            "pcie_path": _TOPOLOGY_LEVELS.get(level) if level is not None else None,
        }
    return row


def gpu_identity(local_index: int) -> dict[str, Any]:
    """UUID, name, PCI bus id and NUMA node of GPU ``local_index``, plus its NVLink state.

    Shaped for agents.spec.RankInfo: the identity keys, and ``telemetry`` holding the
    rest. ``{"available": False, "reason": ...}`` where NVML cannot answer.
    """
    try:
        with _session() as nvml:
            handle = _handle(nvml, local_index)
            ident = _identity(nvml, handle)
            links = _nvlinks(nvml, handle)
            driver = _optional(lambda: nvml.nvmlSystemGetDriverVersion())
            ident["telemetry"] = {
                "nvlinks_active": sum(1 for link in links if link["active"]),
                "nvlinks_total": len(links),
                "p2p": _p2p_row(nvml, handle, local_index),
                "gpu_count": int(nvml.nvmlDeviceGetCount()),
                "driver": _text(driver) if driver is not None else None,
            }
    except NvmlUnavailable as exc:
        return {"available": False, "reason": str(exc)}
    return {"available": True, **ident}


def read_gpu_telemetry(local_index: int) -> dict[str, Any]:
    """A full reading of GPU ``local_index``: identity, every NVLink with its error
    counters and throughput, its NVLink fabric state, and the P2P row. Counters are
    cumulative since driver load, so compare two readings (``telemetry_findings``) to see
    errors that are rising.
    """
    try:
        with _session() as nvml:
            handle = _handle(nvml, local_index)
            return {
                "available": True,
                "local_index": local_index,
                **_identity(nvml, handle),
                "nvlinks": _nvlinks(nvml, handle),
                "fabric": _fabric(nvml, handle),
                "p2p": _p2p_row(nvml, handle, local_index),
            }
    except NvmlUnavailable as exc:
        return {"available": False, "reason": str(exc)}


def _rising_errors(before: dict[str, Any], after: dict[str, Any],
                   where: str = "") -> dict[int, dict[str, int]]:
    """Per link, the error counters that grew between two readings (of the GPU ``where``
    names); one that went back (a driver reload clears them), or rose by more than any
    NVLink could in the readings' interval (agents.counter_delta), is dropped and logged."""
    old = {link["link"]: link for link in before.get("nvlinks", [])}
    first, last = before.get("read_at"), after.get("read_at")
    interval = last - first if first is not None and last is not None else UNTIMED_INTERVAL_S
    limit = counter_delta.ceiling(NVLINK_MAX_BITS_PER_S, interval)
    rising: dict[int, dict[str, int]] = {}
    for link in after.get("nvlinks", []):
        prev = old.get(link["link"], {}).get("errors", {})
        grew: dict[str, int] = {}
        for name, now in link.get("errors", {}).items():
            then = prev.get(name) or 0
            if now is None or now == then:
                continue
            delta, why = counter_delta.rise(then, now, limit)
            if delta is None:
                log.warning("%s NVLink: link %s %s %s: dropped", where, link["link"], name, why)
            else:
                grew[name] = delta
        if grew:
            rising[link["link"]] = grew
    return rising


def telemetry_findings(
    before: dict[str, Any], after: dict[str, Any], node: str, gpu: int
) -> list[Finding]:
    """Findings from two readings of one GPU: a link that went down or whose error
    counters rose is ``nvlink_degraded``; a peer GPU reached over PCIe although the
    earlier reading had it on NVLink is ``topology_mismatch``.
    """
    if not (before.get("available") and after.get("available")):
        return []
    findings: list[Finding] = []
    was_active = {link["link"] for link in before.get("nvlinks", []) if link["active"]}
    down = sorted(link["link"] for link in after.get("nvlinks", [])
                  if not link["active"] and link["link"] in was_active)
    rising = _rising_errors(before, after, f"{node} GPU {gpu}")
    if down or rising:
        findings.append(Finding(
            kind="nvlink_degraded", node=node, gpu=gpu,
            severity="critical" if down else "warning",
            detail={"links_down": down, "rising_errors": {str(k): v for k, v in rising.items()},
                    "source": "nvml"},
        ))
    lost = sorted(int(peer) for peer, now in after.get("p2p", {}).items()
                  if not now["nvlink"] and before.get("p2p", {}).get(peer, {}).get("nvlink"))
    if lost:
        findings.append(Finding(kind="topology_mismatch", node=node, gpu=gpu, gpus=[gpu, *lost],
                                detail={"pcie_only_peers": lost, "source": "nvml"}))
    return findings


def read_counters(local_index: int) -> dict[str, Any]:
    """NVLink state and error counters of GPU ``local_index``, and its NVLink fabric state:
    the cheap reading taken before and after every cycle (``telemetry_findings`` compares
    two; agents.nvlink_fabric judges the fabric states of a node's or a domain's GPUs)."""
    try:
        with _session() as nvml:
            handle = _handle(nvml, local_index)
            links = []
            for link in range(int(nvml.NVML_NVLINK_MAX_LINKS)):
                active = _link_active(nvml, handle, link)
                if active is None:
                    continue
                links.append({"link": link, "active": active,
                              "errors": _error_counts(nvml, handle, link)})
            return {"available": True, "local_index": local_index, "nvlinks": links,
                    "fabric": _fabric(nvml, handle), "read_at": time.time()}
    except NvmlUnavailable as exc:
        return {"available": False, "reason": str(exc)}


class XidWatcher:
    """XID errors of one GPU as NVML reports them (critical XID events), drained without
    waiting. Holds its own NVML session for the agent's life; where NVML or event
    support is missing, ``drain`` returns nothing and says why in ``reason``."""

    def __init__(self, local_index: int) -> None:
        self.reason: str | None = None
        self._set: Any = None
        nvml = _nvml
        try:
            nvml.nvmlInit()
            handle = _handle(nvml, local_index)
            self._set = nvml.nvmlEventSetCreate()
            nvml.nvmlDeviceRegisterEvents(handle, nvml.nvmlEventTypeXidCriticalError, self._set)
        except Exception as exc:  # no library, no GPU, events not supported
            self.reason = f"{type(exc).__name__}: {exc}"
            self._set = None

    def drain(self, limit: int = 100) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if self._set is None:
            return events
        nvml = _nvml
        for _ in range(limit):
            try:
                data = nvml.nvmlEventSetWait_v2(self._set, 0)
            except Exception:  # NVMLError_Timeout: nothing pending
                break
            events.append({"xid": int(data.eventData), "type": int(data.eventType)})
        return events

    def close(self) -> None:
        if self._set is not None:
            with suppress(Exception):
                _nvml.nvmlEventSetFree(self._set)
            with suppress(Exception):
                _nvml.nvmlShutdown()
            self._set = None


def counter_findings(before: dict[str, Any], after: dict[str, Any], node: str, gpu: int,
                     xids: list[dict[str, Any]] | None = None) -> list[Finding]:
    """A cycle's NVML verdict on one GPU: links that went down or whose error counters
    rose (``nvlink_degraded``, even when bandwidth still looks fine) and XID errors."""
    findings = [f for f in telemetry_findings(before, after, node, gpu)
                if f.kind == "nvlink_degraded"]
    if xids:
        findings.append(Finding(kind="gpu_xid", node=node,
                                gpu=gpu, severity="critical",
                                detail={"xids": sorted({e["xid"] for e in xids}),
                                        "source": "nvml"}))
    return findings
