"""Rank tables and the checks that need no fleet state (docs/rankmaps.md).

Pure functions, no database: the CLI runs them when no API answers, and the service
adds the host checks on top of them.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from itertools import islice
from typing import Any

from ringwatch.agents.groups import is_node_name
from ringwatch.agents.spec import Finding
from ringwatch.services.errors import BadInput

# A host is named by the fleet's node-name rule (agents.groups.NODE_NAME), as the API
# takes a rank table's hosts.
MAX_RANKS = 262_144
MAX_INDEX = 2**31 - 1
MAX_SLOTS = 4096
# Long lists in a finding (missing ranks, missing local ranks) are cut to this many.
MAX_LISTED = 64
# What only the fleet's state can answer; reported under "skipped" when checked offline.
HOST_CHECKS = ("unknown_host", "unhealthy_host")
GPU_INDEX_CHECK = "gpu_local_index"


@dataclass(frozen=True)
class RankEntry:
    """One row of a job's rank table."""

    rank: int
    host: str
    local_rank: int
    gpu_uuid: str | None = None

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"rank": self.rank, "host": self.host, "local_rank": self.local_rank}
        if self.gpu_uuid is not None:
            d["gpu_uuid"] = self.gpu_uuid
        return d


# -- parsing ----------------------------------------------------------------------------


def parse_rank_table(text: str) -> list[RankEntry]:
    """A rank table as JSON (a list of entries, ``{"ranks": [...]}`` or ``{"hostfile": "..."}``)
    or as a hostfile; JSON is told apart by its first character."""
    if text.lstrip().startswith(("[", "{")):
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as exc:
            raise BadInput(f"not valid JSON: {exc}") from None
        return parse_json_table(obj)
    return parse_hostfile(text)


def parse_json_table(obj: Any) -> list[RankEntry]:
    if isinstance(obj, dict):
        keys = set(obj) & {"ranks", "hostfile"}
        if len(keys) != 1 or set(obj) - keys:
            raise BadInput('a JSON rank table is a list of entries, {"ranks": [...]} '
                           'or {"hostfile": "..."}')
        if "hostfile" in obj:
            if not isinstance(obj["hostfile"], str):
                raise BadInput("hostfile must be the hostfile's text")
            return parse_hostfile(obj["hostfile"])
        obj = obj["ranks"]
    if not isinstance(obj, list):
        raise BadInput('a JSON rank table is a list of entries or {"ranks": [...]}')
    if not obj:
        raise BadInput("the rank table is empty")
    if len(obj) > MAX_RANKS:
        raise BadInput(f"the rank table has {len(obj)} entries; at most {MAX_RANKS} are checked")
    return [_entry(e, i) for i, e in enumerate(obj)]


_FIELDS = frozenset({"rank", "host", "local_rank", "gpu_uuid"})


def _entry(e: Any, i: int) -> RankEntry:
    where = f"entry {i}"
    if not isinstance(e, dict):
        raise BadInput(f"{where}: expected an object with rank, host and local_rank")
    unknown = sorted(set(e) - _FIELDS)
    if unknown:
        raise BadInput(f"{where}: unknown field(s) {', '.join(map(repr, unknown))}")
    for name in ("rank", "host", "local_rank"):
        if name not in e:
            raise BadInput(f"{where}: missing {name}")
    for name in ("rank", "local_rank"):
        v = e[name]
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= MAX_INDEX:
            raise BadInput(f"{where}: {name} must be a whole number >= 0, got {v!r}")
    host = e["host"]
    if not isinstance(host, str) or not is_node_name(host):
        raise BadInput(f"{where}: host must be a node name (hostname-like ASCII, not ending "
                       f"with '.'), got {host!r}")
    uuid = e.get("gpu_uuid")
    if uuid is not None and (not isinstance(uuid, str) or not 0 < len(uuid) <= 64):
        raise BadInput(f"{where}: gpu_uuid must be a string of 1 to 64 characters, got {uuid!r}")
    return RankEntry(e["rank"], host, e["local_rank"], uuid)


def parse_hostfile(text: str) -> list[RankEntry]:
    """A Slurm/MPI-style hostfile: ``host slots=N``, ``host:N`` or ``host`` (one slot) a line.

    Ranks follow the file's order. A host's local ranks count on across its lines, so the
    one-line-per-task form (a host named once for each of its ranks) reads as intended.
    """
    entries: list[RankEntry] = []
    next_local: dict[str, int] = {}
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        host, slots = _hostfile_line(line, lineno)
        first, base = next_local.get(host, 0), len(entries)
        entries.extend(RankEntry(base + k, host, first + k) for k in range(slots))
        next_local[host] = first + slots
        if len(entries) > MAX_RANKS:
            raise BadInput(f"the hostfile names more than {MAX_RANKS} ranks")
    if not entries:
        raise BadInput("the hostfile names no hosts")
    return entries


def _hostfile_line(line: str, lineno: int) -> tuple[str, int]:
    host, *options = line.split()
    slots = 1
    if ":" in host:
        host, _, count = host.rpartition(":")
        slots = _slots(count, lineno)
    for opt in options:
        key, eq, value = opt.partition("=")
        if not eq:
            raise BadInput(f"line {lineno}: expected 'HOST slots=N', 'HOST:N' or 'HOST', got {line!r}")
        if key == "slots":
            slots = _slots(value, lineno)
        elif key not in ("max_slots", "max-slots"):  # Open MPI's cap: no rank placement in it
            raise BadInput(f"line {lineno}: unknown option {key!r} (expected slots=N)")
    if not is_node_name(host):
        raise BadInput(f"line {lineno}: {host!r} is not a node name (hostname-like ASCII, not "
                       "ending with '.')")
    return host, slots


def _slots(text: str, lineno: int) -> int:
    if not text.isdigit() or not 1 <= int(text) <= MAX_SLOTS:
        raise BadInput(f"line {lineno}: slots must be a whole number from 1 to {MAX_SLOTS}, "
                       f"got {text!r}")
    return int(text)


# -- the checks -------------------------------------------------------------------------


def rank_mapping(problem: str, node: str | None = None, severity: str = "critical",
                 **detail: Any) -> Finding:
    """A ``rank_mapping`` finding; ``problem`` and the detail appear at its top level."""
    return Finding(kind="rank_mapping", node=node, severity=severity,
                   detail={"problem": problem, **detail})


def structural_findings(entries: Sequence[RankEntry]) -> list[Finding]:
    """Everything the table shows by itself, in a fixed order."""
    return [*duplicate_ranks(entries), *missing_ranks(entries), *duplicate_gpus(entries),
            *local_rank_gaps(entries), *non_contiguous(entries)]


def duplicate_ranks(entries: Sequence[RankEntry]) -> list[Finding]:
    by_rank: dict[int, list[RankEntry]] = defaultdict(list)
    for e in entries:
        by_rank[e.rank].append(e)
    return [
        rank_mapping("duplicate_rank", rank=rank,
                     entries=[{"host": e.host, "local_rank": e.local_rank} for e in same])
        for rank, same in sorted(by_rank.items()) if len(same) > 1
    ]


def missing_ranks(entries: Sequence[RankEntry]) -> list[Finding]:
    """Ranks must be 0..N-1 with none left out, N being one past the highest rank (a
    duplicate is its own finding, not a hole at the end)."""
    present = sorted({e.rank for e in entries})
    world_size = present[-1] + 1
    count = world_size - len(present)
    if count == 0:
        return []
    return [rank_mapping("missing_rank", world_size=world_size, missing_count=count,
                         missing=list(islice(_gaps(present, world_size), MAX_LISTED)))]


def _gaps(present: Sequence[int], end: int) -> Iterator[int]:
    """The numbers in 0..end-1 not in ``present`` (sorted, distinct), lazily."""
    expected = 0
    for value in present:
        yield from range(expected, value)
        expected = value + 1
    yield from range(expected, end)


def duplicate_gpus(entries: Sequence[RankEntry]) -> list[Finding]:
    """Two ranks on one GPU: the same host and local rank, or the same GPU UUID."""
    by_slot: dict[tuple[str, int], list[int]] = defaultdict(list)
    by_uuid: dict[str, list[RankEntry]] = defaultdict(list)
    for e in entries:
        by_slot[(e.host, e.local_rank)].append(e.rank)
        if e.gpu_uuid is not None:
            by_uuid[e.gpu_uuid].append(e)
    out = [rank_mapping("duplicate_gpu", node=host, local_rank=local_rank, ranks=sorted(ranks))
           for (host, local_rank), ranks in by_slot.items() if len(ranks) > 1]
    for uuid, same in by_uuid.items():
        slots = sorted({(e.host, e.local_rank) for e in same})
        if len(same) < 2 or len(slots) == 1:  # one slot shared: reported above already
            continue
        hosts = {h for h, _ in slots}
        out.append(rank_mapping("duplicate_gpu", node=slots[0][0] if len(hosts) == 1 else None,
                                gpu_uuid=uuid, ranks=sorted(e.rank for e in same),
                                slots=[f"{h}/{i}" for h, i in slots]))
    return out


def local_rank_gaps(entries: Sequence[RankEntry]) -> list[Finding]:
    """A host's local ranks should be 0..k-1 with no gaps."""
    by_host: dict[str, set[int]] = {}
    for e in entries:
        by_host.setdefault(e.host, set()).add(e.local_rank)
    out = []
    for host, local_set in by_host.items():
        local_ranks = sorted(local_set)
        if local_ranks[-1] == len(local_ranks) - 1:
            continue
        out.append(rank_mapping(
            "local_rank_mismatch", node=host, severity="warning", local_ranks=local_ranks,
            missing_local_ranks=list(islice(_gaps(local_ranks, local_ranks[-1]), MAX_LISTED))))
    return out


def ring_order(entries: Iterable[RankEntry]) -> list[RankEntry]:
    """The ring a collective walks: rank 0, 1, ..., N-1 and back to 0."""
    return sorted(entries, key=lambda e: e.rank)


def ring_crossings(hosts: Sequence[str]) -> int:
    """How often the ring through ``hosts`` (in rank order, closing back) changes host."""
    n = len(hosts)
    if n < 2:
        return 0
    return sum(1 for i in range(n) if hosts[i] != hosts[(i + 1) % n])


def minimum_crossings(n_hosts: int) -> int:
    """A ring over H > 1 hosts leaves each host once at least: H crossings."""
    return n_hosts if n_hosts > 1 else 0


def suggested_order(entries: Sequence[RankEntry]) -> list[RankEntry]:
    """The table renumbered so each host's ranks are contiguous: hosts in the order the
    ring first reaches them, local ranks ascending."""
    ring = ring_order(entries)
    position = {host: i for i, host in enumerate(dict.fromkeys(e.host for e in ring))}
    ordered = sorted(ring, key=lambda e: (position[e.host], e.local_rank))
    return [replace(e, rank=i) for i, e in enumerate(ordered)]


def non_contiguous(entries: Sequence[RankEntry]) -> list[Finding]:
    hosts = [e.host for e in ring_order(entries)]
    crossings = ring_crossings(hosts)
    least = minimum_crossings(len(set(hosts)))
    if crossings <= least:
        return []
    return [rank_mapping("non_contiguous", severity="warning", crossings=crossings,
                         minimum_crossings=least,
                         suggested_order=[e.to_dict() for e in suggested_order(entries)])]


# -- the answer -------------------------------------------------------------------------


def fleet_checks(entries: Sequence[RankEntry]) -> list[str]:
    """The checks that need the fleet's state, as named under ``skipped``."""
    checks = list(HOST_CHECKS)
    if any(e.gpu_uuid is not None for e in entries):
        checks.append(GPU_INDEX_CHECK)
    return checks


def report(entries: Sequence[RankEntry], findings: Sequence[Finding],
           skipped: Sequence[str] = ()) -> dict[str, Any]:
    return {"ok": not findings, "ranks": len(entries), "hosts": len({e.host for e in entries}),
            "findings": [f.to_dict() for f in findings], "skipped": list(skipped)}


def check_offline(entries: Sequence[RankEntry]) -> dict[str, Any]:
    """What the table shows by itself; the fleet checks are listed as skipped."""
    return report(entries, structural_findings(entries), skipped=fleet_checks(entries))
