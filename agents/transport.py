"""Why a link is slow, or is about to be, as findings (docs/transport.md):

- ``transport_fallback``: NCCL carried a node's inter-node traffic over sockets while its
  RDMA ports are up, or a GPU pair's over SHM or PCIe while NVLink joins them (read from
  NCCL's own log, agents.nccl_log; modeled by the sim's ``transport`` fault);
- ``nic_errors``: a port's error counters rose past their thresholds in a cycle, or it left
  ACTIVE (agents.nic_counters; modeled by the sim's ``nic_errors`` fault), even while its
  bandwidth is still fine.

Each carries ``cause``: one line every surface prints beside (or, without a bandwidth
figure, instead of) the headline.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from ringwatch.agents.groups import split_member
from ringwatch.agents.nccl_log import NET_TRANSPORTS, TransportSummary
from ringwatch.agents.nic_counters import NicError, PortSnapshot, nic_errors
from ringwatch.agents.places import gpus_text
from ringwatch.agents.spec import Finding

# How NCCL's own log names each transport class (agents.nccl_log's vocabulary).
NAMES = {"p2p_nvlink": "P2P over NVLink", "p2p_pcie": "P2P over PCIe", "p2p": "P2P",
         "shm": "SHM", "net_ib": "NET/IB", "net_socket": "NET/Socket", "net_ofi": "NET/OFI",
         "net_other": "NET", "nvls": "NVLS", "collnet": "CollNet"}


def transport_name(transport: str) -> str:
    return NAMES.get(transport, transport)


def transport_finding(node: str, seen: str, expected: str, scope: str, *,
                      gpus: list[int] | None = None, devices: Sequence[str] = ()) -> Finding:
    """A node (or a GPU pair of it) whose traffic NCCL carried over ``seen`` where
    ``expected`` was up: it excludes the node, as a job there would crawl the same way."""
    if gpus:
        text = f"{gpus_text(gpus)} over {transport_name(seen)}, expected {transport_name(expected)}"
    else:
        up = f" ({_devices(devices)} up)" if devices else ""
        text = f"inter-node over {transport_name(seen)}, expected {transport_name(expected)}{up}"
    return Finding(kind="transport_fallback", node=node, gpus=sorted(gpus) if gpus else None,
                   severity="critical",
                   detail={"source": "nccl", "scope": scope, "transport": seen,
                           "expected_transport": expected, "devices": list(devices),
                           "cause": text})


def nic_finding(node: str, errors: Sequence[NicError]) -> Finding | None:
    """One finding per node for the ports whose counters rose past their thresholds this
    cycle; its cause names the worst (a flap or a port gone down first, then by how far past
    its threshold). None where nothing rose."""
    if not errors:
        return None
    ranked = sorted(errors, key=_weight, reverse=True)
    worst = ranked[0]
    severity = "critical" if any(e.severity == "critical" for e in errors) else "warning"
    return Finding(kind="nic_errors", node=node, severity=severity,
                   detail={"source": "sysfs", "device": worst.device, "port": worst.port,
                           "counter": worst.counter, "cause": error_text(worst),
                           "counters": [e.to_dict() for e in ranked]})


def error_text(e: NicError) -> str:
    """``mlx5_0 port 1 symbol_error +500 in 300 s (1.67/s, threshold 0.4/s)``."""
    where = f"{e.device} port {e.port}"
    if e.counter == "state":
        return f"{where} left ACTIVE"
    limit = {"second": f"{e.threshold:.3g}/s", "ratio": f"{e.threshold:.0%} of packets",
             "interval": f"{e.threshold:.0f} a cycle"}[e.threshold_per]
    flap = " (a link flap)" if e.flap else ""
    return (f"{where} {e.counter} +{e.delta} in {e.interval_s:.0f} s "
            f"({e.rate_per_s:.3g}/s, threshold {limit}){flap}")


def node_nic_findings(before: dict[str, Any], after: dict[str, Any], node: str) -> list[Finding]:
    """A node's ``nic_errors`` over a cycle from two ``counters()`` readings' ``nic`` lists
    (PortSnapshot dicts)."""
    b = [_snapshot(p) for p in before.get("nic") or []]
    a = [_snapshot(p) for p in after.get("nic") or []]
    found = nic_finding(node, nic_errors(b, a, node)) if b and a else None
    return [found] if found else []


def _snapshot(d: dict[str, Any]) -> PortSnapshot:
    return PortSnapshot(**{**d, "unreadable": tuple(d.get("unreadable") or ())})


def _weight(e: NicError) -> tuple[int, float]:
    over = e.rate_per_s / e.threshold if e.threshold_per == "second" and e.threshold else (
        e.delta / e.threshold if e.threshold else float(e.delta))
    return (2 if e.counter == "state" else 1 if e.flap else 0, over)


def _devices(devices: Sequence[str]) -> str:
    names = list(devices)
    return names[0] if len(names) == 1 else f"{names[0]}..{names[-1]}"


def judge_transports(summary: TransportSummary, node: str, members: Sequence[str], rank: int,
                     scope: str, nvlink_peers: Iterable[int] = ()) -> list[Finding]:
    """What one rank's NCCL log of one probe group says of its node: inter-node traffic over
    sockets while the node has RDMA NICs (``summary.socket_fallback``), and, for each GPU
    pair of this node with this rank the lower one (each pair judged once), a connection
    over anything but NVLink P2P where NVML says NVLink joins them (``nvlink_peers``: this
    GPU's NVLink peers by local index)."""
    found = []
    if summary.socket_fallback:
        expected = "net_ofi" if any(n.startswith("AWS") or "OFI" in n or "Libfabric" in n
                                    for n in summary.networks) else "net_ib"
        found.append(transport_finding(node, "net_socket", expected, scope,
                                       devices=summary.rdma_devices))
    peers = set(nvlink_peers)
    gpu = split_member(members[rank])[1]
    for pair in summary.pairs:
        if rank not in pair.ranks or pair.inter_node or rank != min(pair.ranks):
            continue
        other = max(pair.ranks)
        if other >= len(members):
            continue
        other_node, other_gpu = split_member(members[other])
        slower = [t for t in pair.transports if t in ("shm", "p2p_pcie") or t in NET_TRANSPORTS]
        if other_node == node and other_gpu in peers and slower:
            found.append(transport_finding(node, slower[0], "p2p_nvlink", scope,
                                           gpus=[gpu, other_gpu]))
    return found
