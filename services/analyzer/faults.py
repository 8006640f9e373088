"""Faults as incidents are keyed: a localized finding's kind and where it is, and whether a
cycle's results could have shown it (so a cycle that did not look is no evidence either way).

Pure: findings and assessments in, keys and booleans out.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

from ringwatch.agents.groups import member, node_order, split_member
from ringwatch.agents.spec import Finding
from ringwatch.services.analyzer.assess import Assessment
from ringwatch.services.analyzer.hysteresis import AT_ONCE, Policy

# Faults the probes report themselves, per rank.
RANK_KINDS = frozenset({"hang", "probe_error", "data_corruption"})
FLEET_KIND = "fabric_below_rated"
INVENTORY_KIND = "inventory_mismatch"
# Faults inside one node (NVLink, topology): seen by its intra-node and GPU-pair groups.
NODE_KINDS = frozenset({"nvlink_degraded", "topology_mismatch"})


def fault_key(f: Finding) -> str:
    """One incident per key: the kind and the narrowest place the evidence names."""
    if f.kind in RANK_KINDS:
        where = member(f.node, f.gpu) if f.node is not None and f.gpu is not None else f.node
        return f"{f.kind}:{where}"
    if f.kind == FLEET_KIND:  # one per scope, whichever nodes it reaches this cycle
        return f"{f.kind}:{f.detail.get('scope', '')}"
    if f.kind == INVENTORY_KIND:
        where = member(f.node, f.gpu) if f.node and f.gpu is not None else f.node
        return f"{f.kind}:{f.detail.get('what', '')}:{where}"
    parts = [f.kind]
    if f.nodes:
        parts.append(",".join(sorted(f.nodes)))
    if f.node is not None:
        parts.append(f.node)
    if f.gpus:
        parts.append("gpus=" + ",".join(str(g) for g in sorted(f.gpus)))
    elif f.gpu is not None:
        parts.append(f"gpu={f.gpu}")
    return ":".join(parts)


def fault_nodes(f: Finding) -> list[str]:
    """The nodes a fault is on, in ``node_order`` (``fault_key`` keeps its own text order:
    it is the fault's identity)."""
    return sorted({f.node} if f.node else set(f.nodes or ()), key=node_order)


# Where a finding read a fact rather than timed a noisy measurement: NVML's counters, NCCL's
# own log of the transport it took, the NIC's sysfs counters.
FACTS = frozenset({"nvml", "nccl", "sysfs"})
# Facts a check reads from a node's counters before and after its probes (services.check.
# facts): NVML's (NVLink errors and links down, XIDs, fabric state) and the NICs' sysfs.
COUNTER_SOURCES = frozenset({"nvml", "sysfs"})
COUNTER_KINDS = frozenset({"nic_errors", "gpu_xid", "nvlink_fabric"})


def read_from_counters(f: Finding) -> bool:
    """A finding made from a node's counter readings (a ``nic_errors``, a ``gpu_xid``, an
    ``nvlink_fabric``, an NVML ``nvlink_degraded``), not from timed measurements."""
    return f.kind in COUNTER_KINDS or (
        f.kind != INVENTORY_KIND and f.detail.get("source") in COUNTER_SOURCES)


def policy_for(kind: str, policy: Policy, detail: dict | None = None) -> Policy:
    """Rank faults, inventory facts and what was read rather than timed (``FACTS``) open at
    once (they are facts, not noisy measurements); degradations go through the hysteresis
    ``policy``."""
    if kind in RANK_KINDS or kind == INVENTORY_KIND or (detail or {}).get("source") in FACTS:
        return AT_ONCE
    return policy


class Coverage:
    """What one cycle's results looked at: which ranks ran clean, which nodes had their
    NVLink, their NIC or a path to each other judged, and whose counters were read before
    and after (``facts``)."""

    def __init__(self, assessments: Iterable[Assessment], inventoried: Iterable[str] = (),
                 facts: Iterable[str] = ()) -> None:
        self.inventoried = set(inventoried)
        self.facts = set(facts)
        self.clean_ranks: set[str] = set()
        # Nodes with a rank in a clean group, for rank faults that name no GPU.
        self.clean_nodes: set[str] = set()
        self.local: set[str] = set()
        self.nic: set[str] = set()
        self._groups_of: dict[str, set[int]] = defaultdict(set)
        for i, a in enumerate(assessments):
            m = a.measurement
            if m.wrong == 0:
                self.clean_ranks.update(m.members)
                self.clean_nodes.update(split_member(x)[0] for x in m.members)
            if not a.judged or a.ratio is None:
                continue
            nodes = {split_member(x)[0] for x in m.members}
            if m.scope in ("intra_node", "gpu_pair"):
                self.local.update(nodes)
            elif len(nodes) >= 2:
                if len(nodes) == 2:
                    self.nic.update(nodes)
                for n in nodes:
                    self._groups_of[n].add(i)

    def covers(self, f: Finding) -> bool:
        """Whether this cycle could have shown ``f``: if it did not find it, it is clear."""
        if f.kind in RANK_KINDS:
            if f.node is None:
                return bool(f.nodes) and set(f.nodes or ()) <= self.clean_nodes
            if f.gpu is None:  # a hang or error the agent pinned on a node, not one GPU
                return f.node in self.clean_nodes
            return member(f.node, f.gpu) in self.clean_ranks
        if f.kind == INVENTORY_KIND:
            return f.node in self.inventoried
        if read_from_counters(f):  # only a check that read the node's counters twice looked
            return f.node in self.facts
        if f.kind == FLEET_KIND:
            return bool(self.local) if f.detail.get("scope") == "nvlink" else bool(self.nic)
        if f.kind in NODE_KINDS:
            return f.node in self.local
        if f.kind == "nic_degraded":
            return f.node in self.nic
        if f.kind == "transport_fallback":  # a GPU pair's in its node's groups, else between nodes
            return f.node in (self.local if f.gpus else self.nic)
        if f.kind == "net_path_degraded" and f.nodes and len(f.nodes) == 2:
            a, b = f.nodes
            return bool(self._groups_of.get(a, set()) & self._groups_of.get(b, set()))
        return False
