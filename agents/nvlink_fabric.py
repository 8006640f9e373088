"""NVLink fabric state as NVML reports it per GPU, and what is wrong with it: a GPU whose
fabric registration is not complete, whose fabric health is degraded, or whose clique
differs from the rest of its NVLink domain is an ``nvlink_fabric`` finding
(docs/transport.md, "NVLink fabric state").

On NVSwitch systems a GPU registers with the fabric (the fabric manager of an HGX node, the
NVLink switch trays' manager of an NVL72 rack) before CUDA may use NVLink. NVML's GPU fabric
info says where that stands (``state``, and ``status`` once complete), which NVLink domain
the GPU is in (``cluster_uuid``), which partition of it (``clique_id``) and, from the v2
struct on, a health mask. GPUs with the same cluster UUID and clique reach each other over
NVLink, across trays on NVL72 (NCCL's multi-node NVLink); a GPU in another clique does not.

A GPU without a fabric (PCIe cards, an older driver) answers NOT_SUPPORTED or not at all:
that is no fabric, never a finding. Pure: readings in (as agents.telemetry reads them, or
the sim models them), findings out.
"""

from __future__ import annotations

import uuid
from collections import Counter, defaultdict
from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from ringwatch.agents.groups import node_order, split_member
from ringwatch.agents.spec import Finding

KIND = "nvlink_fabric"

# nvmlGpuFabricState_t, as nvml.h's "Fabric definitions" number it (nvidia-ml-py's pynvml.py
# spells the same NVML_GPU_FABRIC_STATE_* values).
STATES = {0: "NOT_SUPPORTED", 1: "NOT_STARTED", 2: "IN_PROGRESS", 3: "COMPLETED"}
NOT_SUPPORTED, COMPLETED = "NOT_SUPPORTED", "COMPLETED"
# nvmlGpuFabricInfo_v3_t.healthSummary (NVML_GPU_FABRIC_HEALTH_SUMMARY_*).
SUMMARIES = {0: "NOT_SUPPORTED", 1: "HEALTHY", 2: "UNHEALTHY", 3: "LIMITED_CAPACITY"}
BAD_SUMMARIES = frozenset({"UNHEALTHY", "LIMITED_CAPACITY"})


@dataclass(frozen=True)
class HealthField:
    """One field of the health mask: ``(mask >> shift) & width`` (NVML_GPU_FABRIC_HEALTH_GET),
    0 meaning not supported. ``nvml`` is the field's name in NVML_GPU_FABRIC_HEALTH_MASK_*."""

    name: str
    nvml: str
    shift: int
    width: int
    words: dict[int, str]
    # The words that say nothing is wrong; empty where the field is recorded, not judged.
    healthy: frozenset[str] = frozenset()

    def word(self, mask: int) -> str | None:
        value = (mask >> self.shift) & self.width
        return None if value == 0 else self.words.get(value, f"UNKNOWN_{value}")


_TRI = {1: "TRUE", 2: "FALSE"}
# The health mask's fields as nvml.h defines them (NVML_GPU_FABRIC_HEALTH_MASK_SHIFT_*,
# _WIDTH_* and the values; nvidia-ml-py 13's pynvml.py spells the same), each 2 bits but the
# 4-bit configuration field. Judged: what DCGM's NVLink health watch and gpud count as
# unhealthy or degraded (bandwidth degraded, a route recovering or unhealthy, an access
# timeout being recovered), and any configuration error. Recorded only: whether a partition is
# assigned and whether the global fabric manager is connected, which NVML documents without
# calling either a fault.
HEALTH_FIELDS = (
    HealthField("degraded_bandwidth", "DEGRADED_BW", 0, 0x3, _TRI, frozenset({"FALSE"})),
    HealthField("route_recovery", "ROUTE_RECOVERY", 2, 0x3, _TRI, frozenset({"FALSE"})),
    HealthField("route_unhealthy", "ROUTE_UNHEALTHY", 4, 0x3, _TRI, frozenset({"FALSE"})),
    HealthField("access_timeout_recovery", "ACCESS_TIMEOUT_RECOVERY", 6, 0x3, _TRI,
                frozenset({"FALSE"})),
    HealthField("incorrect_configuration", "INCORRECT_CONFIGURATION", 8, 0xF,
                {1: "NONE", 2: "INCORRECT_SYSGUID", 3: "INCORRECT_CHASSIS_SN",
                 4: "NO_PARTITION", 5: "INSUFFICIENT_NVLINKS", 6: "INCOMPATIBLE_GPU_FW",
                 7: "INVALID_LOCATION", 8: "GPU_STATE_INVALID"}, frozenset({"NONE"})),
    HealthField("partition_assigned", "PARTITION_ASSIGNED", 12, 0x3, _TRI),
    HealthField("gfm_state", "GFM_STATE", 14, 0x3, {1: "CONNECTED", 2: "DISCONNECTED"}),
)


def decode_health(mask: int | None) -> dict[str, str]:
    """The health mask's supported fields by name (``{"route_unhealthy": "FALSE", ...}``)."""
    if mask is None:
        return {}
    return {f.name: w for f in HEALTH_FIELDS if (w := f.word(int(mask))) is not None}


def reading(*, state: int, status: str, cluster_uuid: bytes, clique_id: int,
            health_mask: int | None, health_summary: int | None, api: str) -> dict[str, Any]:
    """One GPU's fabric reading from NVML's raw figures (``api`` names the struct read:
    v3, v2, or v1 for the unversioned call, which has no health mask)."""
    name = STATES.get(state, f"UNKNOWN_{state}")
    if name == NOT_SUPPORTED:
        return {"supported": False, "reason": "fabric state NOT_SUPPORTED"}
    raw = bytes(cluster_uuid)
    return {
        "supported": True,
        "api": api,
        "state": name,
        "status": status,
        "cluster_uuid": str(uuid.UUID(bytes=raw)) if any(raw) else "",
        "clique_id": int(clique_id),
        "health_mask": health_mask,
        "health": decode_health(health_mask),
        "health_summary": None if health_summary is None else SUMMARIES.get(
            health_summary, f"UNKNOWN_{health_summary}"),
    }


def has_fabric(r: Mapping[str, Any] | None) -> bool:
    """The GPU is on an NVLink fabric (whatever the state of its registration)."""
    return r is not None and r.get("supported") is True and r.get("state") != NOT_SUPPORTED


def registered(r: Mapping[str, Any]) -> bool:
    """Registration complete and succeeded (``status`` counts only once complete)."""
    return r.get("state") == COMPLETED and r.get("status") == "SUCCESS"


def health_problems(r: Mapping[str, Any]) -> list[str]:
    """The judged health fields that are not healthy, then a bad summary: e.g.
    ``["route_unhealthy", "incorrect_configuration:INSUFFICIENT_NVLINKS", "summary:UNHEALTHY"]``."""
    out = []
    for f in HEALTH_FIELDS:
        word = f.word(int(r["health_mask"])) if r.get("health_mask") is not None else None
        if f.healthy and word is not None and word not in f.healthy:
            out.append(f.name if word == "TRUE" else f"{f.name}:{word}")
    if r.get("health_summary") in BAD_SUMMARIES:
        out.append(f"summary:{r['health_summary']}")
    return out


def fabric_by_node(counters: Mapping[str, Mapping[str, Any]]
                   ) -> dict[str, dict[int, dict[str, Any]]]:
    """Readings keyed by member (``NODE/GPU``, as the scheduler collects ``counters()``)
    regrouped by node, each GPU's ``fabric`` reading; GPUs without one are left out."""
    out: dict[str, dict[int, dict[str, Any]]] = defaultdict(dict)
    for name, r in counters.items():
        fabric = r.get("fabric") if isinstance(r, Mapping) else None
        if isinstance(fabric, dict):
            node, gpu = split_member(name)
            out[node][gpu] = fabric
    return dict(out)


def fabric_findings(readings: Mapping[int, Mapping[str, Any]], node: str, *,
                    partitioned: bool = False) -> list[Finding]:
    """A node's GPUs' fabric readings (local index -> reading) judged together: one
    ``nvlink_fabric`` finding per GPU whose registration is not complete or failed, whose
    health mask says degraded, or whose cluster or clique differs from the most of the
    node's. ``partitioned``: the domain is cut into NVLink partitions by design, so cliques
    are not compared."""
    issues = _node_issues(readings, node, partitioned)
    return _findings(issues, {node: readings})


def domain_findings(readings_by_node: Mapping[str, Mapping[int, Mapping[str, Any]]], *,
                    partitioned: bool = False) -> list[Finding]:
    """``fabric_findings`` of every node, and across nodes: a GPU whose clique differs from
    the most of its cluster's GPUs (an NVL72 rack's trays share one cluster UUID). A GPU
    gets one finding naming all that is wrong with it. Where a domain is partitioned by
    design (several cliques under one cluster UUID on purpose), pass ``partitioned``."""
    issues: dict[tuple[str, int], list[_Issue]] = {}
    for node in sorted(readings_by_node, key=node_order):
        issues.update(_node_issues(readings_by_node[node], node, partitioned))
    if not partitioned:
        for key, issue in _domain_cliques(readings_by_node, issues).items():
            issues.setdefault(key, []).append(issue)
    return _findings(issues, readings_by_node)


@dataclass(frozen=True)
class _Issue:
    problem: str  # registration, health, cluster, clique
    cause: str
    expected_clique_id: int | None = None
    expected_cluster_uuid: str | None = None


K = TypeVar("K", bound=Hashable)


def _mode(values: Iterable[K]) -> K | None:
    """The most common value; None where two or more tie for it."""
    counts = Counter(values).most_common(2)
    if not counts or (len(counts) == 2 and counts[0][1] == counts[1][1]):
        return None
    return counts[0][0]


def _node_issues(readings: Mapping[int, Mapping[str, Any]], node: str,
                 partitioned: bool) -> dict[tuple[str, int], list[_Issue]]:
    fabric = {g: r for g, r in readings.items() if has_fabric(r)}
    issues: dict[tuple[str, int], list[_Issue]] = defaultdict(list)
    for g, r in sorted(fabric.items()):
        if not registered(r):
            issues[(node, g)].append(_Issue("registration", _registration_cause(g, r, fabric)))
        if bad := health_problems(r):
            issues[(node, g)].append(_Issue("health", f"GPU {g} fabric health: {', '.join(bad)}"))
    if not partitioned:
        for g, issue in _node_cliques(fabric).items():
            issues[(node, g)].append(issue)
    return dict(issues)


def _registration_cause(g: int, r: Mapping[str, Any], fabric: Mapping[int, Mapping[str, Any]]
                        ) -> str:
    if r.get("state") == COMPLETED:
        return f"GPU {g} fabric registration failed: {r.get('status')}"
    others = [o for h, o in fabric.items() if h != g]
    done = sum(1 for o in others if registered(o))
    if not others:
        tail = ""
    elif done == len(others):
        tail = f" (the other {len(others)} COMPLETED)"
    elif done == 0 and all(o.get("state") == r.get("state") for o in others):
        tail = f" (all {len(others) + 1} GPUs of the node alike)"
    else:
        tail = f" ({done} of the other {len(others)} COMPLETED)"
    return f"GPU {g} fabric registration {r.get('state')}{tail}"


def _linked(r: Mapping[str, Any]) -> bool:
    """Registered in a multi-node domain: a zero cluster UUID (one HGX node's NVSwitches)
    has no cliques to compare."""
    return registered(r) and bool(r.get("cluster_uuid"))


def _node_cliques(fabric: Mapping[int, Mapping[str, Any]]) -> dict[int, _Issue]:
    """GPUs of one node in another cluster than most of the node's, or in another clique
    than most of the node's GPUs of their cluster."""
    linked = {g: r for g, r in fabric.items() if _linked(r)}
    out: dict[int, _Issue] = {}
    clusters = {g: str(r["cluster_uuid"]) for g, r in linked.items()}
    if len(set(clusters.values())) > 1:
        main = _mode(clusters.values())
        for g, uid in sorted(clusters.items()):
            if uid == main:
                continue
            cause = (f"GPU {g} in cluster {uid[:8]}, the rest of the node in cluster {main[:8]}"
                     if main is not None else
                     f"GPU {g} in cluster {uid[:8]}; the node's GPUs split between clusters "
                     + _split(clusters.values(), lambda u: u[:8]))
            out[g] = _Issue("cluster", cause, expected_cluster_uuid=main)
    by_cluster: dict[str, dict[int, int]] = defaultdict(dict)
    for g, r in linked.items():
        if g not in out:
            by_cluster[clusters[g]][g] = int(r["clique_id"])
    for cluster, cliques in by_cluster.items():
        main_clique = _mode(cliques.values())
        for g, c in sorted(cliques.items()):
            if c == main_clique:
                continue
            cause = (f"GPU {g} in clique {c}, the node's other GPUs of cluster {cluster[:8]} "
                     f"in clique {main_clique}" if main_clique is not None else
                     f"GPU {g} in clique {c}; the node's GPUs of cluster {cluster[:8]} split "
                     f"between cliques {_split(cliques.values(), str)}")
            out[g] = _Issue("clique", cause, expected_clique_id=main_clique)
    return out


def _domain_cliques(readings_by_node: Mapping[str, Mapping[int, Mapping[str, Any]]],
                    node_issues: Mapping[tuple[str, int], list[_Issue]]
                    ) -> dict[tuple[str, int], _Issue]:
    """Across nodes, per cluster UUID: GPUs in another clique than most of the cluster's
    (GPUs their own node already set apart are left out of the count)."""
    set_apart = {k for k, found in node_issues.items()
                 if any(i.problem in ("cluster", "clique") for i in found)}
    by_cluster: dict[str, dict[tuple[str, int], int]] = defaultdict(dict)
    for node, readings in readings_by_node.items():
        for g, r in readings.items():
            if has_fabric(r) and _linked(r) and (node, g) not in set_apart:
                by_cluster[str(r["cluster_uuid"])][(node, g)] = int(r["clique_id"])
    out: dict[tuple[str, int], _Issue] = {}
    for cluster, cliques in by_cluster.items():
        nodes = {n for n, _ in cliques}
        if len(nodes) < 2:
            continue  # one node's GPUs: its own check has judged them
        main = _mode(cliques.values())
        peers = [n for (n, _), c in cliques.items() if c == main]
        where = f"{len(peers)} GPUs on {len(set(peers))} nodes"
        for (node, g), c in cliques.items():
            if c == main:
                continue
            cause = (f"GPU {g} in clique {c}, the rest of cluster {cluster[:8]} ({where}) in "
                     f"clique {main}" if main is not None else
                     f"GPU {g} in clique {c}; cluster {cluster[:8]} split between cliques "
                     f"{_split(cliques.values(), str)}")
            out[(node, g)] = _Issue("clique", cause, expected_clique_id=main)
    return out


def _split(values: Iterable[Any], label: Any) -> str:
    counts = Counter(values).most_common()
    return " and ".join(f"{label(v)} ({n} GPU{'s' if n != 1 else ''})" for v, n in counts)


def _findings(issues: Mapping[tuple[str, int], list[_Issue]],
              readings_by_node: Mapping[str, Mapping[int, Mapping[str, Any]]]) -> list[Finding]:
    out = []
    for (node, g), found in sorted(issues.items(), key=lambda kv: (node_order(kv[0][0]), kv[0][1])):
        if not found:
            continue
        r = readings_by_node[node][g]
        clique = next((i for i in found if i.problem == "clique"), None)
        cluster = next((i for i in found if i.problem == "cluster"), None)
        detail: dict[str, Any] = {
            "source": "nvml", "state": r.get("state"), "status": r.get("status"),
            "clique_id": r.get("clique_id"), "cluster_uuid": r.get("cluster_uuid"),
            "expected_clique_id": clique.expected_clique_id if clique else None,
            "health": health_problems(r), "problems": [i.problem for i in found],
            "cause": "; ".join(i.cause for i in found),
        }
        if cluster is not None:
            detail["expected_cluster_uuid"] = cluster.expected_cluster_uuid
        out.append(Finding(kind=KIND, node=node, gpu=g, severity="critical", detail=detail))
    return out
