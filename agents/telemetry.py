"""NVML telemetry of one GPU: identity, NVLink state and error counters, P2P topology.

Everything goes through the module-level ``_nvml`` (the ``pynvml`` module of
nvidia-ml-py): the one seam a test replaces with a fake. Without an NVML library
(CPU machines, containers without the driver) every reader answers
``{"available": False, "reason": ...}`` and nothing else changes.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, suppress
from typing import Any

import pynvml

from agents.spec import Finding

_nvml: Any = pynvml

# NVML error counters per link, under the names the output uses.
_ERROR_COUNTERS = {
    "replay": "NVML_NVLINK_ERROR_DL_REPLAY",
    "recovery": "NVML_NVLINK_ERROR_DL_RECOVERY",
    "crc_flit": "NVML_NVLINK_ERROR_DL_CRC_FLIT",
    "crc_data": "NVML_NVLINK_ERROR_DL_CRC_DATA",
}
# nvmlGpuTopologyLevel_t -> nvidia-smi topo's words, nearest first.
_TOPOLOGY_LEVELS = {0: "internal", 10: "PIX", 20: "PXB", 30: "PHB", 40: "NODE", 50: "SYS"}


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


def _nvlinks(nvml: Any, handle: Any) -> list[dict[str, Any]]:
    links = []
    for link in range(int(nvml.NVML_NVLINK_MAX_LINKS)):
        active = _link_active(nvml, handle, link)
        if active is None:
            continue
        errors = {
            name: _optional(nvml.nvmlDeviceGetNvLinkErrorCounter, handle, link, getattr(nvml, const))
            for name, const in _ERROR_COUNTERS.items()
        }
        remote = _optional(nvml.nvmlDeviceGetNvLinkRemotePciInfo, handle, link)
        links.append({
            "link": link,
            "active": active,
            "errors": errors,
            "remote_pci_bus_id": _text(remote.busId) if remote is not None else None,
            "throughput": _link_throughput(nvml, handle, link),
        })
    return links


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
    counters and throughput, and the P2P row. Counters are cumulative since driver load,
    so compare two readings (``telemetry_findings``) to see errors that are rising.
    """
    try:
        with _session() as nvml:
            handle = _handle(nvml, local_index)
            return {
                "available": True,
                "local_index": local_index,
                **_identity(nvml, handle),
                "nvlinks": _nvlinks(nvml, handle),
                "p2p": _p2p_row(nvml, handle, local_index),
            }
    except NvmlUnavailable as exc:
        return {"available": False, "reason": str(exc)}


def _rising_errors(before: dict[str, Any], after: dict[str, Any]) -> dict[int, dict[str, int]]:
    """Per link, the error counters that grew between two readings."""
    old = {link["link"]: link for link in before.get("nvlinks", [])}
    rising: dict[int, dict[str, int]] = {}
    for link in after.get("nvlinks", []):
        prev = old.get(link["link"], {}).get("errors", {})
        grew = {
            name: now - (prev.get(name) or 0)
            for name, now in link.get("errors", {}).items()
            if now is not None and now > (prev.get(name) or 0)
        }
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
    rising = _rising_errors(before, after)
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
    """NVLink state and error counters of GPU ``local_index`` alone: the cheap reading
    taken before and after every cycle (``telemetry_findings`` compares two)."""
    try:
        with _session() as nvml:
            handle = _handle(nvml, local_index)
            links = []
            for link in range(int(nvml.NVML_NVLINK_MAX_LINKS)):
                active = _link_active(nvml, handle, link)
                if active is None:
                    continue
                links.append({"link": link, "active": active, "errors": {
                    name: _optional(nvml.nvmlDeviceGetNvLinkErrorCounter, handle, link,
                                    getattr(nvml, const))
                    for name, const in _ERROR_COUNTERS.items()}})
            return {"available": True, "local_index": local_index, "nvlinks": links}
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
