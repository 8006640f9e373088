"""Where something is, written one way on every text surface (a verdict, ``ringwatch status``,
a drain reason, the selftest, the probe table, a webhook's summary): node lists as Slurm
writes host lists (``node-[000-004,007]``), GPU sets as ranges (``GPUs 0-3,6``), a node's
GPUs as ``node-003 GPUs 2,5``. JSON keeps its lists; this is text for people.

The standard library only: agents, the CLI and the services print through it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

from ringwatch.agents.hostlist import compress_hostlist, expand_hostlist, index_ranges, split_top


def node_list(names: Iterable[Any], width: int | None = None) -> str:
    """Node names as a Slurm host list; with ``width``, the parts that fit in about that
    many characters and how many nodes were left out (``node-[000-031],gpu-a +12 more``)."""
    text = compress_hostlist([str(n) for n in names])
    if width is None or len(text) <= width:
        return text
    # The most nodes, in the list's own order, whose host list fits (binary search: the
    # length grows with the nodes taken, give or take a merged range).
    try:
        ordered = [n for part in split_top(text) for n in expand_hostlist(part)]
    except ValueError:  # a name with brackets of its own (a stored record): shown whole
        return text
    lo, hi = 1, len(ordered)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if len(compress_hostlist(ordered[:mid])) <= width:
            lo = mid
        else:
            hi = mid - 1
    return f"{compress_hostlist(ordered[:lo])} +{len(ordered) - lo} more"


def _indices(values: Iterable[Any]) -> list[int] | None:
    """GPU indices as integers, or None where a stored record holds something else."""
    out = []
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int):
            return None
        out.append(v)
    return out


def gpu_set(values: Iterable[Any]) -> str:
    """GPU indices as ranges: ``0-7``, ``2,5``, ``0-3,6`` (a pair of neighbours is ``0-1``,
    two GPUs, never read as more). A value that is not an index is shown as it is."""
    values = list(values)
    indices = _indices(values)
    return index_ranges(indices) if indices is not None else ",".join(map(str, values))


def gpus_text(values: Iterable[Any]) -> str:
    """``GPU 1`` or ``GPUs 0-3,6``."""
    values = list(values)
    return f"GPU {gpu_set(values)}" if len(values) == 1 else f"GPUs {gpu_set(values)}"


def place(nodes: Iterable[Any], gpus: Iterable[Any] = (), width: int | None = None) -> str:
    """Nodes and, where known, their GPUs: ``node-003 GPUs 2,5``, ``node-004 GPU 1``,
    ``node-[001,007]``."""
    where = node_list(nodes, width)
    gpus = list(gpus)
    return f"{where} {gpus_text(gpus)}" if gpus else where


def finding_place(finding: Mapping[str, Any], width: int | None = None) -> str:
    """A finding's place (its ``node`` or ``nodes``, and its ``gpu`` or ``gpus``), as a
    verdict, a finding or an incident's detail carries them."""
    node, nodes = finding.get("node"), finding.get("nodes")
    named = [node] if node else list(nodes) if isinstance(nodes, list | tuple) else []
    gpus = finding.get("gpus")
    if isinstance(gpus, list | tuple) and gpus:
        held = gpus_text(gpus)
    elif gpus not in (None, "", [], ()):  # a stored record's odd value, shown as its text
        held = f"GPUs {gpus}"
    elif finding.get("gpu") is not None:
        held = gpus_text([finding["gpu"]])
    else:
        held = ""
    where = node_list(named, width) if named else ""
    return " ".join(p for p in (where, held) if p)


def members_text(members: Iterable[str]) -> str:
    """A group's members (``NODE/LOCAL_INDEX``) by the GPUs each node holds: nodes holding
    the same GPUs together, ``node-[000-001] GPUs 0-1``; different sets joined by ``; ``."""
    by_node: dict[str, list[int]] = {}
    for m in members:
        node, _, local = m.rpartition("/")
        if not node or not (local.isascii() and local.isdigit()):
            by_node.setdefault(m, [])
            continue
        by_node.setdefault(node, []).append(int(local))
    by_set: dict[tuple[int, ...], list[str]] = {}
    for node in sorted(by_node, key=_counting):
        by_set.setdefault(tuple(sorted(set(by_node[node]))), []).append(node)
    return "; ".join(place(nodes, held) for held, nodes in by_set.items())


def _counting(name: str) -> list[Any]:
    """Names as people count them (node-9 before node-10)."""
    return [(int(p), p) if i % 2 else p for i, p in enumerate(re.split(r"([0-9]+)", name))]
