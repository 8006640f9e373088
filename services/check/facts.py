"""The facts a check reads beside its probes: each GPU's NVML counters (NVLink state and error
counters, XID errors, NVLink fabric state) and each node's NIC port counters, read on the
check's nodes before its first round and after its last, and judged like any finding
(docs/transport.md). So a preflight, a served preflight and a monitoring cycle name the same
counter and fabric faults: all of them are the one check.

Pure but for ``read``: readings in, findings out.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

from ringwatch.agents.groups import member as member_key
from ringwatch.agents.groups import node_order, split_member
from ringwatch.agents.nvlink_fabric import domain_findings, fabric_by_node
from ringwatch.agents.spec import Finding, ProbeBackend
from ringwatch.agents.telemetry import counter_findings
from ringwatch.agents.transport import node_nic_findings

# Readings by member (``NODE/GPU``), as ``ProbeBackend.counters`` returns them.
Readings = dict[str, dict[str, Any]]


@dataclass
class Facts:
    """What the two readings of a check showed: its findings, the readings of the GPUs
    where something changed (a batch's ``counters``), and the nodes whose facts were read
    before and after (a batch's ``facts``: only these may clear a counter incident)."""

    findings: list[Finding] = field(default_factory=list)
    snapshots: list[dict[str, Any]] = field(default_factory=list)
    nodes: list[str] = field(default_factory=list)


def read(backend: ProbeBackend, nodes: Collection[str]) -> Readings:
    """The backend's counter readings of the ranks on ``nodes`` (a check's own; a backend
    may read more, which are not this check's to judge)."""
    wanted = set(nodes)
    if not wanted:
        return {}
    return {m: r for m, r in backend.counters().items() if split_member(m)[0] in wanted}


def judge_facts(before: Readings, after: Readings, *, partitioned: bool = False) -> Facts:
    """The verdict of a check's two readings (``partitioned``: NVLink domains split into
    partitions on purpose, RINGWATCH_NVLINK_PARTITIONED)."""
    findings, snapshots = judge_readings(before, after, partitioned=partitioned)
    return Facts(findings, snapshots, read_nodes(before, after))


def read_nodes(before: Mapping[str, Any], after: Mapping[str, Any]) -> list[str]:
    """The nodes whose every reading, before and after, was read: a rank that read nothing
    (its agent gone, NVML unavailable there) leaves its node's facts unread, so a clean
    verdict there says nothing."""
    complete: dict[str, bool] = {}
    for name in before.keys() | after.keys():
        node = split_member(name)[0]
        complete[node] = complete.get(node, True) and _usable(before.get(name)) and _usable(
            after.get(name))
    return sorted((n for n, ok in complete.items() if ok), key=node_order)


def _usable(reading: Any) -> bool:
    return isinstance(reading, Mapping) and bool(reading) and reading.get("available") is not False


def judge_readings(before: Readings, after: Readings, *, partitioned: bool = False
                   ) -> tuple[list[Finding], list[dict[str, Any]]]:
    """Each GPU's NVML verdict over the check (counters that rose, links that went down,
    XID errors), its node's NICs' (under one of its ranks), the NVLink fabric's across
    each domain and, for the GPUs where something changed, the two readings to store."""
    findings: list[Finding] = []
    snapshots: list[dict[str, Any]] = []
    for name, b in sorted(before.items()):
        a = after.get(name)
        if not a:
            continue
        node, gpu = split_member(name)
        # A node's NICs are read under one of its ranks: their counters' verdict is the node's.
        nic = node_nic_findings(b, a, node) if "nic" in b else []
        findings += nic
        xids = list(b.get("xid") or []) + list(a.get("xid") or [])
        found = counter_findings(b, a, node, gpu, xids)
        findings += found
        found += nic
        if found:
            snapshots.append({"node": node, "local_index": gpu, "before": b.get("nvlinks", []),
                              "after": a.get("nvlinks", []), "xid": xids,
                              "findings": [f.kind for f in found]})
    # The NVLink fabric's state (registration, health, clique) is a state, not a counter:
    # judged on the readings after the check, across the nodes of each NVLink domain.
    fabric = domain_findings(fabric_by_node(after), partitioned=partitioned)
    findings += fabric
    for f in fabric:
        reading = after.get(member_key(f.node, f.gpu)) if f.node and f.gpu is not None else None
        snapshots.append({"node": f.node, "local_index": f.gpu, "before": [], "after": [],
                          "xid": [], "fabric": (reading or {}).get("fabric"),
                          "findings": [f.kind]})
    return findings, snapshots
