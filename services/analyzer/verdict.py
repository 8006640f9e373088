"""The preflight verdict object (docs/formats.md, "Verdict"), built from findings."""

from __future__ import annotations

from typing import Any

from ringwatch.agents.groups import node_order
from ringwatch.agents.spec import Finding


def exclude_of(findings: list[Finding]) -> list[str]:
    """Every node a job should avoid, in ``node_order`` and unique (paths blame no node)."""
    return sorted({node for f in findings for node in f.blamed_nodes}, key=node_order)


def build_verdict(
    *,
    backend: str,
    nodes: list[str],
    findings: list[Finding],
    rounds: int,
    duration_s: float,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The verdict: healthy only when there is no finding of any kind."""
    verdict: dict[str, Any] = {
        "healthy": not findings,
        "backend": backend,
        "nodes_checked": len(set(nodes)),
        "exclude": exclude_of(findings),
        "findings": [f.to_dict() for f in findings],
        "rounds": rounds,
        "duration_s": round(duration_s, 3),
    }
    for key, value in (extra or {}).items():
        verdict.setdefault(key, value)
    return verdict
