"""Kubernetes' equivalent of the Slurm drain, as pure judgement: from ringwatch's word on its
nodes and the Kubernetes nodes as listed, what to change on each (docs/kubernetes.md,
"Remediation"). ``ringwatch kubernetes sync`` reads both and sends what this plans.

Every node gets the label ``ringwatch.io/health`` (healthy, degraded or unknown). A node
ringwatch excludes, by the judgement of the Slurm prolog and of a preflight, gets the taint
``ringwatch.io/unhealthy=<finding kind>:NoSchedule`` (or NoExecute), and loses it once it is
healthy again: excluded by nothing, with a result younger than the max age. A node ringwatch
cannot vouch for (no recent result, or not one of its nodes) keeps a taint it has and gets
none. Only that label and that taint are ever touched, and no more than a share of the nodes
carries the taint at once.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Literal

HEALTH_LABEL = "ringwatch.io/health"
TAINT_KEY = "ringwatch.io/unhealthy"
Health = Literal["healthy", "degraded", "unknown"]
EFFECTS = ("NoSchedule", "NoExecute")
DEFAULT_EFFECT = "NoSchedule"
# At most this share of the nodes listed carries the taint at once (and at least one node),
# as NVSentinel's circuit breaker caps the nodes it cordons: a fault in ringwatch itself, or
# in the fabric under every node, must not take the whole cluster out of scheduling.
DEFAULT_MAX_TAINTED_SHARE = 0.05
# A node whose newest result is older than this is unknown. Scheduled probes leave nodes
# that jobs hold alone, so a busy cluster's nodes are probed between jobs: a day.
DEFAULT_MAX_AGE_S = 86400.0
# A label or taint value: 63 characters at most, alphanumeric at both ends.
_VALUE = re.compile(r"(?:[A-Za-z0-9](?:[-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?")
# The taint's value where the finding's kind is not one a label value can hold.
OTHER_KIND = "finding"


@dataclass(frozen=True)
class Judgement:
    """ringwatch's word on one Kubernetes node: its health, the finding kind that excludes
    it (degraded only), and why, in a few words."""

    health: Health
    kind: str | None = None
    why: str = ""


def judge(state: Mapping[str, Any] | None, now: datetime, max_age_s: float) -> Judgement:
    """A node of GET /v1/fleet/nodes (None: not one of ringwatch's) as a ``Judgement``."""
    if state is None:
        return Judgement("unknown", why="not a node of ringwatch's fleet")
    excluded_by = [str(k) for k in state.get("excluded_by") or ()]
    if excluded_by:
        kind = excluded_by[0] if _VALUE.fullmatch(excluded_by[0]) else OTHER_KIND
        return Judgement("degraded", kind, why="excluded by " + ", ".join(excluded_by))
    probed = _when(state.get("last_probed_at"))
    if probed is None:
        return Judgement("unknown", why="never probed")
    age_s = (now - probed).total_seconds()
    if age_s > max_age_s:
        return Judgement("unknown", why=f"newest result {age_s / 3600:.1f} h old")
    return Judgement("healthy")


def _when(value: Any) -> datetime | None:
    if not isinstance(value, str):
        return None
    try:
        at = datetime.fromisoformat(value)
    except ValueError:
        return None
    return at if at.tzinfo else at.replace(tzinfo=UTC)


@dataclass(frozen=True)
class KubeNode:
    """What the plan reads of a Node object: its name, labels and taints (None: the field
    is absent) and the version it was read at."""

    name: str
    labels: Mapping[str, str] | None
    taints: Sequence[Mapping[str, Any]] | None
    resource_version: str

    @classmethod
    def from_object(cls, obj: Mapping[str, Any]) -> KubeNode:
        metadata, spec = obj.get("metadata") or {}, obj.get("spec") or {}
        return cls(name=str(metadata["name"]), labels=metadata.get("labels"),
                   taints=spec.get("taints"),
                   resource_version=str(metadata.get("resourceVersion", "")))

    def label(self, key: str) -> str | None:
        return (self.labels or {}).get(key)

    def value(self, key: str) -> str:
        """The label ``key``, else the node's name: what names it to ringwatch."""
        return (self.label(key) or self.name) if key else self.name

    def ours(self) -> list[tuple[int, Mapping[str, Any]]]:
        """The taints ringwatch owns, with their places in ``spec.taints``."""
        return [(i, t) for i, t in enumerate(self.taints or ()) if t.get("key") == TAINT_KEY]


def match_nodes(kube: Iterable[KubeNode], ringwatch: Iterable[str],
                name_label: str = "") -> dict[str, str]:
    """Each Kubernetes node's ringwatch name: ringwatch's name equal to the node's own name
    (or to its ``name_label``, e.g. kubernetes.io/hostname), else equal to its short name
    (before the first dot, any case) where only one node has that (as the occupancy source
    matches them). A node two of ringwatch's names match takes the exact one."""
    # Imported here, as the occupancy source is the scheduler's and imports more.
    from ringwatch.services.scheduler.occupancy import match_names

    by_value: dict[str, str | None] = {}
    for node in kube:
        value = node.value(name_label)
        by_value[value] = None if value in by_value else node.name  # two nodes: neither
    theirs = {v: n for v, n in by_value.items() if n is not None}
    out: dict[str, str] = {}
    for ours, value in sorted(match_names(ringwatch, theirs).items(),
                              key=lambda x: x[0] != x[1]):  # exact matches first
        out.setdefault(theirs[value], ours)
    return out


def taint_of(kind: str, effect: str) -> dict[str, str]:
    return {"key": TAINT_KEY, "value": kind, "effect": effect}


def _same(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    return all(a.get(k) == b.get(k) for k in ("key", "value", "effect"))


def _pointer(key: str) -> str:
    return key.replace("~", "~0").replace("/", "~1")


@dataclass
class Change:
    """What one node needs: the JSON patch, and a line per change for a person."""

    node: str
    ringwatch: str | None
    judgement: Judgement
    ops: list[dict[str, Any]] = field(default_factory=list)
    says: list[str] = field(default_factory=list)


@dataclass
class Plan:
    """Every node's judgement, the changes to make, and what the cap held back."""

    judged: dict[str, Judgement]
    changes: list[Change]
    cap: int
    tainted: int
    held_back: list[str]

    def counts(self) -> dict[str, int]:
        out = {"healthy": 0, "degraded": 0, "unknown": 0}
        for j in self.judged.values():
            out[j.health] += 1
        return out


def tainted_cap(nodes: int, share: float) -> int:
    """How many of ``nodes`` may carry the taint at once: ``share`` of them, at least one."""
    return max(1, math.floor(nodes * share + 1e-9))


def plan(nodes: Sequence[KubeNode], names: Mapping[str, str],
         states: Mapping[str, Mapping[str, Any]], *, now: datetime,
         max_age_s: float = DEFAULT_MAX_AGE_S, effect: str = DEFAULT_EFFECT,
         max_tainted_share: float = DEFAULT_MAX_TAINTED_SHARE) -> Plan:
    """What to change on ``nodes``: ``names`` maps a Kubernetes node to its ringwatch name
    (``match_nodes``), ``states`` ringwatch's nodes by name (GET /v1/fleet/nodes)."""
    if effect not in EFFECTS:
        raise ValueError(f"taint effect {effect!r}: one of {', '.join(EFFECTS)}")
    judged = {n.name: judge(states.get(names.get(n.name, "")), now, max_age_s) for n in nodes}
    cap = tainted_cap(len(nodes), max_tainted_share)
    # Nodes that carry the taint now and keep it (excluded, or ringwatch cannot say) count
    # first; new taints fill what the cap leaves, in name order.
    keeps = {n.name for n in nodes if n.ours() and judged[n.name].health != "healthy"}
    room = max(0, cap - len(keeps))
    wanted = sorted(n.name for n in nodes
                    if judged[n.name].health == "degraded" and n.name not in keeps)
    granted, held_back = set(wanted[:room]), wanted[room:]
    changes = []
    for node in nodes:
        j = judged[node.name]
        change = Change(node.name, names.get(node.name), j)
        _label(node, j.health, change)
        if j.health == "degraded" and (node.name in keeps or node.name in granted):
            _taint(node, taint_of(j.kind or OTHER_KIND, effect), change)
        elif j.health == "healthy":
            _untaint(node, change)
        elif node.ours():  # unknown: neither excluded nor found healthy
            change.says.append(f"keep taint {_show(node.ours()[0][1])}: ringwatch cannot "
                               f"vouch for it ({j.why})")
        if change.ops or change.says:
            changes.append(change)
    return Plan(judged, changes, cap, len(keeps) + len(granted), held_back)


def _show(taint: Mapping[str, Any]) -> str:
    return f"{taint.get('key')}={taint.get('value', '')}:{taint.get('effect')}"


def _label(node: KubeNode, health: str, change: Change) -> None:
    was = node.label(HEALTH_LABEL)
    if was == health:
        return
    if node.labels is None:
        change.ops.append({"op": "add", "path": "/metadata/labels",
                           "value": {HEALTH_LABEL: health}})
    else:
        change.ops.append({"op": "add", "path": "/metadata/labels/" + _pointer(HEALTH_LABEL),
                           "value": health})
    change.says.append(f"label {HEALTH_LABEL}={health}" + (f" (was {was})" if was else "")
                       + (f": {change.judgement.why}" if change.judgement.why else ""))


def _taint(node: KubeNode, taint: dict[str, str], change: Change) -> None:
    """Make ``taint`` the one taint of ours on the node. Each change to an existing entry
    first tests that it is still what was read, so a taint another controller added or
    removed meanwhile is never overwritten: the API server refuses the patch whole, and the
    next cycle reads the node again."""
    ours = node.ours()
    keep = next((i for i, t in ours if _same(t, taint)), None)
    if keep is None and ours:
        keep, was = ours[0]
        change.ops += [{"op": "test", "path": f"/spec/taints/{keep}", "value": dict(was)},
                       {"op": "replace", "path": f"/spec/taints/{keep}", "value": taint}]
        change.says.append(f"taint {_show(taint)} (was {_show(was)})")
    _remove(node, [(i, t) for i, t in ours if i != keep], change)
    if keep is not None:
        return
    if node.taints is None:  # no list to append to: made whole, on the node as it was read
        change.ops += [{"op": "test", "path": "/metadata/resourceVersion",
                        "value": node.resource_version},
                       {"op": "add", "path": "/spec/taints", "value": [taint]}]
    else:
        change.ops.append({"op": "add", "path": "/spec/taints/-", "value": taint})
    change.says.append(f"taint {_show(taint)}")


def _untaint(node: KubeNode, change: Change) -> None:
    ours = node.ours()
    _remove(node, ours, change)
    for _, t in ours:
        change.says.append(f"untaint {_show(t)}: healthy again")


def _remove(node: KubeNode, which: list[tuple[int, Mapping[str, Any]]], change: Change) -> None:
    # From the last: a removal moves only the entries after it, which are done by then.
    for i, t in sorted(which, key=lambda x: x[0], reverse=True):
        change.ops += [{"op": "test", "path": f"/spec/taints/{i}", "value": dict(t)},
                       {"op": "remove", "path": f"/spec/taints/{i}"}]
    if which and change.judgement.health != "healthy":
        change.says.append("untaint " + ", ".join(_show(t) for _, t in which) + " (a duplicate)")
