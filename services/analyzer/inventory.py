"""A node's inventory against its hardware profile and the fleet: GPUs present, NVLinks
active per GPU, NICs up and at their rate, and driver, CUDA and NCCL versions the same as
the fleet's majority. Each difference is an ``inventory_mismatch`` finding on that node
(and GPU), with ``what`` naming it.

Only facts the ranks reported are checked: a sim or gloo rank has no NVML facts and no
NICs, and nothing is concluded from their absence.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable

from ringwatch.agents import profiles
from ringwatch.agents.groups import node_order
from ringwatch.agents.spec import Finding, RankInfo

KIND = "inventory_mismatch"
VERSION_KEYS = ("driver", "cuda", "nccl")
# Mismatches that make a node unfit for a job (excluded); versions are warnings.
EXCLUDING = frozenset({"gpus", "nvlinks", "nics", "nic_rate", "nic_down"})


def inventory_findings(ranks: Iterable[RankInfo]) -> list[Finding]:
    by_node: dict[str, list[RankInfo]] = defaultdict(list)
    for r in ranks:
        by_node[r.node].append(r)
    if not by_node:
        return []
    table = profiles.load()
    findings: list[Finding] = []
    majority = _majority(by_node)
    for node, rs in sorted(by_node.items(), key=lambda item: node_order(item[0])):
        prof = _profile(rs, table)
        findings += _gpus(node, rs, prof)
        findings += _nics(node, rs, prof)
        findings += _versions(node, rs, majority)
    return findings


def _profile(rs: list[RankInfo], table: dict[str, profiles.Profile]) -> profiles.Profile | None:
    name = next((r.profile for r in rs if r.profile), None)
    try:
        return profiles.get(name, table) if name else None
    except ValueError:
        return None


def _finding(node: str, what: str, reason: str, gpu: int | None = None,
             **detail: object) -> Finding:
    return Finding(kind=KIND, node=node, gpu=gpu,
                   severity="critical" if what in EXCLUDING else "warning",
                   detail={"what": what, "reason": reason, **detail})


def _gpus(node: str, rs: list[RankInfo], prof: profiles.Profile | None) -> list[Finding]:
    out = []
    counts: list[int] = [c for r in rs if isinstance(c := r.telemetry.get("gpu_count"), int)]
    if counts and prof is not None and max(counts) < prof.gpus_per_node:
        out.append(_finding(node, "gpus", f"{max(counts)} of the {prof.gpus_per_node} GPUs a "
                            f"{prof.name} node has are visible", present=max(counts),
                            rated=prof.gpus_per_node))
    elif counts and len(rs) < max(counts):
        out.append(_finding(node, "gpus", f"probe ranks on {len(rs)} of the {max(counts)} GPUs "
                            "the node has", present=len(rs), rated=max(counts)))
    for r in rs:
        active = r.telemetry.get("nvlinks_active")
        if prof is not None and isinstance(active, int) and active < prof.nvlinks_per_gpu:
            out.append(_finding(node, "nvlinks", f"GPU {r.local_index} has {active} of "
                                f"{prof.nvlinks_per_gpu} NVLinks active", gpu=r.local_index,
                                present=active, rated=prof.nvlinks_per_gpu))
    return out


def _nics(node: str, rs: list[RankInfo], prof: profiles.Profile | None) -> list[Finding]:
    nics = next((r.telemetry["nics"] for r in rs if isinstance(r.telemetry.get("nics"), list)), None)
    if nics is None or prof is None:
        return []
    out = []
    ports = [n for n in nics if n.get("link_layer") in (None, "InfiniBand", "Ethernet")]
    if len(ports) < prof.nics_per_node:
        out.append(_finding(node, "nics", f"{len(ports)} of the {prof.nics_per_node} NIC ports "
                            f"a {prof.name} node has", present=len(ports),
                            rated=prof.nics_per_node))
    down = [f"{n['device']}/{n['port']}" for n in ports if n.get("state") != "ACTIVE"]
    if down:
        out.append(_finding(node, "nic_down", f"NIC port(s) not active: {', '.join(down)}",
                            ports=down))
    slow = [f"{n['device']}/{n['port']} at {n['rate_gbps']:g} Gb/s" for n in ports
            if n.get("state") == "ACTIVE" and n.get("rate_gbps") is not None
            and n["rate_gbps"] < prof.nic_gbps]
    if slow:
        out.append(_finding(node, "nic_rate", f"NIC port(s) below the rated {prof.nic_gbps:g} "
                            f"Gb/s: {', '.join(slow)}", ports=slow, rated=prof.nic_gbps))
    return out


def _majority(by_node: dict[str, list[RankInfo]]) -> dict[str, str]:
    """Per version key, the value most nodes run (only where at least two nodes report)."""
    out = {}
    for key in VERSION_KEYS:
        seen = Counter(v for rs in by_node.values() if (v := _version(rs, key)) is not None)
        if sum(seen.values()) >= 2:
            value, count = seen.most_common(1)[0]
            if count > sum(seen.values()) / 2:
                out[key] = value
    return out


def _version(rs: list[RankInfo], key: str) -> str | None:
    return next((str(r.telemetry[key]) for r in rs if r.telemetry.get(key)), None)


def _versions(node: str, rs: list[RankInfo], majority: dict[str, str]) -> list[Finding]:
    out = []
    for key, value in majority.items():
        mine = _version(rs, key)
        if mine is not None and mine != value:
            out.append(_finding(node, key, f"{key} {mine} where the fleet runs {value}",
                                present=mine, fleet=value))
    return out
