"""Read models of the fleet for the API: plain dicts, shaped once here."""

from __future__ import annotations

import base64
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy.orm import Session

from ringwatch.agents.groups import node_order, series_key, split_member
from ringwatch.services.analyzer.assess import Thresholds
from ringwatch.services.analyzer.hysteresis import LinkState, Policy, standing
from ringwatch.services.config import TOKEN_EXPIRY_WARN_S
from ringwatch.services.errors import BadInput, NodeNotFound, NotFound
from ringwatch.services.store import health as health_store
from ringwatch.services.store import measurements as store
from ringwatch.services.store import metrics as metrics_store
from ringwatch.services.store import nodes as node_store
from ringwatch.services.store import timeseries


def nodes(session: Session, *, after: str | None = None,
          limit: int | None = None) -> list[dict[str, Any]]:
    return [
        {"name": n.name, "hostname": n.hostname, "backend": n.backend, "profile": n.profile,
         "duty_cycle": n.duty_cycle, "skipped_reason": n.skipped_reason,
         "occupied": n.occupied, "last_seen_at": n.last_seen_at,
         "gpus": [{"local_index": g.local_index, "uuid": g.uuid, "pci_bus_id": g.pci_bus_id,
                   "numa_node": g.numa_node, "name": g.name} for g in gpus]}
        for n, gpus in store.list_nodes(session, after=after, limit=limit)
    ]


def node(session: Session, name: str) -> dict[str, Any]:
    """One node's inventory: its GPUs with their telemetry, its NICs (as its first rank
    read them), and its newest stored NVML counter readings; a retired node's too, with
    when it was retired."""
    found = store.get_node(session, name)
    if found is None:
        raise NodeNotFound(f"unknown node: {name}")
    n, gpus = found
    nics: list[dict[str, Any]] = next((g.telemetry["nics"] for g in gpus if g.telemetry.get("nics")), [])
    return {"name": n.name, "hostname": n.hostname, "backend": n.backend, "profile": n.profile,
            "duty_cycle": n.duty_cycle, "skipped_reason": n.skipped_reason,
            "occupied": n.occupied, "last_seen_at": n.last_seen_at, "last_probed_at": n.last_probed_at,
            "retired_at": n.retired_at,
            "gpus": [{"local_index": g.local_index, "uuid": g.uuid, "pci_bus_id": g.pci_bus_id,
                      "numa_node": g.numa_node, "name": g.name, "telemetry": g.telemetry}
                     for g in gpus],
            "nics": nics,
            "counters": [{"time": c.time, "local_index": c.local_index, **c.reading}
                         for c in store.node_counters(session, name)]}


def node_states(session: Session,
                thresholds: Callable[[str], Thresholds]) -> dict[str, Any]:
    """Every node's health in one read, for a fleet map: ``state`` is degraded where an
    open finding names the node, suspect where only a link it shares is degraded (the
    localization blamed someone else, or has not yet), ok where it has links and none is
    degraded, unknown where it has none; ``ratio`` is its worst of the two ratios the store
    keeps per node (own NVLink groups; median of its node pairs); ``excluded_by``, the kinds
    of the findings for which a preflight naming the node excludes it (empty: none)."""
    # Imported here: stored_verdict imports this module's require_nodes.
    from ringwatch.services.monitor.stored_verdict import exclusions

    excluded = exclusions(session)
    out = []
    for r in health_store.node_health(session):
        ratios = [x for x in (r.nvlink_ratio, r.net_ratio) if x is not None]
        state = ("degraded" if r.open_findings else "busy" if r.occupied
                 else "suspect" if r.degraded else "ok" if r.links else "unknown")
        out.append({"name": r.name, "backend": r.backend, "profile": r.profile,
                    "last_probed_at": r.last_probed_at, "skipped_reason": r.skipped_reason,
                    "occupied": r.occupied, "links": r.links, "degraded_links": r.degraded,
                    "open_findings": r.open_findings, "nvlink_ratio": r.nvlink_ratio,
                    "net_ratio": r.net_ratio, "ratio": min(ratios) if ratios else None,
                    "state": state, "excluded_by": excluded.get(r.name, [])})
    backends = sorted({n["backend"] for n in out if n["backend"]})
    return {"nodes": out,
            "degraded_ratio": {b: thresholds(b).degraded_ratio for b in backends}}


# GET /v1/fleet/pairs: one byte per node pair, so the whole map of 1024 nodes (523,776
# pairs) is 700 kB of base64 instead of megabytes of JSON lists. 0: not probed as a pair;
# else bit 7 set when degraded, and the low seven bits 1 + the worst ratio in hundredths
# (capped at 1.25), or 127 when no ratio is known.
PAIR_DEGRADED = 0x80
PAIR_NO_RATIO = 127
PAIR_RATIO_CAP = 1.25


def pair_index(i: int, j: int, n: int) -> int:
    """Where pair (i, j), i < j, sits in the upper triangle of n nodes, row by row."""
    return i * n - i * (i + 1) // 2 + (j - i - 1)


def pair_byte(ratio: float | None, degraded: bool) -> int:
    q = PAIR_NO_RATIO if ratio is None else 1 + round(min(max(ratio, 0.0), PAIR_RATIO_CAP) * 100)
    return q | (PAIR_DEGRADED if degraded else 0)


@dataclass
class _PairMap:
    """One database's node-pair map as last read: ``cells`` patched with the pairs updated
    since ``seen``; rebuilt whole when the node set changes, when link rows were removed
    (fewer rows, or a lower newest id: a table emptied), or once it is REBUILD_S old."""

    names: list[str]
    cells: bytearray
    seen: datetime | None
    built: float
    # health_store.link_rows_mark at the last read.
    mark: tuple[int, int] = (0, 0)


# The whole map is a scan of every node pair's link rows (seconds with all 523,776 pairs of
# 1024 nodes probed: bench.run ui); a cycle updates a few thousand, found by their
# updated_at index.
PAIR_MAP_REBUILD_S = 600.0
# Re-read this much before the newest update seen: batches stamp their rows with their
# newest measurement's time, so two scheduler batches stored close together may land a
# little out of order. One that arrives later still (shipped from a spool after an outage)
# shows at the next whole rebuild.
PAIR_MAP_OVERLAP = timedelta(seconds=10)
_pair_maps: dict[str, _PairMap] = {}
_pair_lock = threading.Lock()


# A window of the map (GET /v1/fleet/pairs?row_from=&row_to=): indices into the nodes by
# name, from inclusive, to exclusive; None: the fleet's edge.
Span = tuple[int | None, int | None]


def node_pairs(session: Session, *, max_nodes: int, rows: Span = (None, None),
               cols: Span = (None, None)) -> dict[str, Any]:
    """The node x node map of the pairs probed: whole (up to ``max_nodes`` nodes) when no
    window is asked, else the tile of ``rows`` by ``cols``."""
    if rows == (None, None) and cols == (None, None):
        return _whole_map(session, max_nodes)
    return _tile(session, max_nodes, rows, cols)


def _pair_bytes(index: dict[str, int], row: Any) -> Iterator[tuple[int, int, int]]:
    """One row of the store's node pairs (a node and its partners) as (i, j, byte) by
    index into the map's nodes, leaving out nodes the map does not know."""
    i = index.get(row.a)
    if i is None:
        return
    for b, ratio, degraded in zip(row.bs, row.ratios, row.degraded, strict=True):
        j = index.get(b)
        if j is not None and j != i:
            yield i, j, pair_byte(ratio, degraded)


def _whole_map(session: Session, max_nodes: int) -> dict[str, Any]:
    """Every node's name once, and ``cells``, the base64 of one byte per pair (above)."""
    names = store.node_names(session)
    key = str(session.get_bind().engine.url)
    if len(names) > max_nodes:
        with _pair_lock:
            _pair_maps.pop(key, None)  # not to be served again; its memory back
        raise BadInput(
            f"the fleet has {len(names)} nodes, more than RINGWATCH_MAX_PAIR_MAP_NODES "
            f"({max_nodes}) for the whole node-pair map: ask for it in tiles of up to "
            f"{max_nodes} x {max_nodes} nodes, ?row_from=0&row_to={max_nodes}&col_from=0"
            f"&col_to={max_nodes} and on (indices into the nodes by name)")
    mark = health_store.link_rows_mark(session)
    with _pair_lock:
        known = _pair_maps.get(key)
        if (known is None or known.names != names
                or mark[0] < known.mark[0] or mark[1] < known.mark[1]
                or time.monotonic() - known.built > PAIR_MAP_REBUILD_S):
            n = len(names)
            known = _PairMap(names, bytearray(n * (n - 1) // 2), None, time.monotonic())
            _pair_maps[key] = known
        known.mark = mark
        since = known.seen - PAIR_MAP_OVERLAP if known.seen else None
        index = {name: i for i, name in enumerate(names)}
        n = len(names)
        for row in health_store.node_pairs(session, since):
            if known.seen is None or row.updated_at > known.seen:
                known.seen = row.updated_at
            for i, j, byte in _pair_bytes(index, row):
                known.cells[pair_index(min(i, j), max(i, j), n)] = byte
        cells = base64.b64encode(known.cells).decode()
    return {"nodes": names, "cells": cells}


def _span(span: Span, n: int, name: str) -> tuple[int, int]:
    """A window's side as (from, to) within the fleet's ``n`` nodes."""
    lo, hi = span[0] or 0, n if span[1] is None else span[1]
    if lo > hi:
        raise BadInput(f"{name}_from ({lo}) is past {name}_to ({hi})")
    return min(lo, n), min(hi, n)


def _tile(session: Session, max_nodes: int, rows: Span, cols: Span) -> dict[str, Any]:
    """One rectangle of the map: its rows' and columns' names and ``cells``, the base64 of
    one byte per (row, column), row by row, 0 on the diagonal. No whole map is built: the
    store reads only the tile's pairs, so beside the node names the work grows with the
    tile, not with the fleet."""
    names = store.node_names(session)
    (r0, r1), (c0, c1) = _span(rows, len(names), "row"), _span(cols, len(names), "col")
    if max(r1 - r0, c1 - c0) > max_nodes:
        raise BadInput(f"a tile of the node-pair map spans at most RINGWATCH_MAX_PAIR_MAP_NODES "
                       f"({max_nodes}) rows and as many columns, not {r1 - r0} x {c1 - c0}")
    width = c1 - c0
    cells = bytearray((r1 - r0) * width)
    if cells:
        index = {name: i for i, name in enumerate(names)}
        for row in health_store.node_pairs_between(session, (names[r0], names[r1 - 1]),
                                                   (names[c0], names[c1 - 1])):
            for i, j, byte in _pair_bytes(index, row):
                for r, c in ((i, j), (j, i)):
                    if r0 <= r < r1 and c0 <= c < c1:
                        cells[(r - r0) * width + (c - c0)] = byte
    return {"node_count": len(names), "row_from": r0, "col_from": c0,
            "rows": names[r0:r1], "cols": names[c0:c1],
            "cells": base64.b64encode(cells).decode()}


def require_nodes(session: Session, names: list[str], *, include_retired: bool = False) -> None:
    """404 naming the nodes of ``names`` the fleet does not hold (``include_retired``: that
    it never held; a retired node's history is read like any other's)."""
    unknown = sorted(set(names) - store.known_nodes(session, names,
                                                    include_retired=include_retired),
                     key=node_order)
    if unknown:
        what = "unknown node(s)" if include_retired else "unknown or retired node(s)"
        raise NodeNotFound(f"{what}: {', '.join(unknown[:20])}")


def retire_nodes(session: Session, names: list[str], *, dry_run: bool = False) -> dict[str, Any]:
    """Take ``names`` out of the fleet: off its lists, counts, map, /metrics and preflight,
    and no longer counted toward RINGWATCH_MAX_NODES; their measurements, series, findings
    and GET /v1/nodes/{name} stay. A node that reports again comes back, as a new node.
    All or nothing: a name the table never held is a 404 and nothing is retired."""
    state = node_store.retired_state(session, names)
    unknown = sorted(set(names) - set(state), key=node_order)
    if unknown:
        raise NodeNotFound(f"unknown node(s): {', '.join(unknown[:20])}")
    active = sorted((n for n, at in state.items() if at is None), key=node_order)
    retired = active if dry_run else sorted(node_store.retire(session, active), key=node_order)
    return {"dry_run": dry_run, "retired": retired,
            "already_retired": sorted((n for n, at in state.items() if at is not None),
                                      key=node_order)}


def links(session: Session, *, status: str | None, scope: str | None,
          nodes: list[str] | None, after: tuple[str, ...] | None = None,
          limit: int | None = None, policy: Policy | None = None) -> list[dict[str, Any]]:
    """Each link's health (those touching any of ``nodes``, when given), with where it
    stands in the hysteresis ``policy``'s window (``hysteresis.standing``: why a link slow
    in one cycle is still ok)."""
    if nodes:
        require_nodes(session, nodes, include_retired=True)
    return [
        {**{c: getattr(link, c) for c in ("group_key", "scope", "op", "members", "nodes",
                                          "status", "size_bytes", "busbw_gbs", "expected_gbs",
                                          "ratio", "updated_at", "changed_at")},
         "standing": standing(LinkState(link.status, tuple(c == "1" for c in link.recent or ""),
                                        link.good_streak or 0), policy or Policy())}
        for link in health_store.list_links(session, status=status, scope=scope, nodes=nodes,
                                            after=after, limit=limit)
    ]


def baselines(session: Session, *, min_count: int = Thresholds.min_history, after: tuple[str, ...] | None = None,
              limit: int | None = None) -> list[dict[str, Any]]:
    """Links with a running baseline of at least ``min_count`` values."""
    return [{"group_key": r.group_key, "scope": r.scope, "op": r.op, "members": list(r.members),
             "size_bytes": r.size_bytes, "values": list(r.recent_busbw)}
            for r in health_store.list_baselines(session, min_count, after=after, limit=limit)]


def series(session: Session, members: list[str] | None, *, op: str | None,
           size_bytes: int | None, since: datetime | None, until: datetime | None, limit: int,
           group: str | None = None, resolution: str = "auto",
           retention: timeseries.Retention | None = None) -> dict[str, Any]:
    """One link's or group's series, raw or rolled up (``resolution``: raw, 1h, 1d, or auto
    to choose from the range asked)."""
    if since and until and since > until:
        raise BadInput("since is after until")
    found = None
    if members is None:
        found = store.group_by_key(session, group or "")
        if found is None:
            raise NotFound(f"no link or group with key {group!r} (see GET /v1/links)")
        members = list(found.members)
    try:
        node_names = sorted({split_member(m.strip())[0] for m in members})
    except ValueError as exc:
        raise BadInput(str(exc)) from exc
    require_nodes(session, node_names, include_retired=True)
    wanted = sorted(m.strip() for m in members)
    resolution = timeseries.pick_resolution(resolution, since, until,
                                            retention or timeseries.Retention())
    out: dict[str, Any] = {"members": wanted, "group_key": series_key(wanted),
                           "resolution": resolution, "points": []}
    # NVML readings of the members' GPUs around cycles where a counter rose (up to 64 ranks).
    out["counters"] = [
        {"time": c.time, "node": c.node, "local_index": c.local_index, **c.reading}
        for c in store.counters_of(session, wanted, since, until)] if len(wanted) <= 64 else []
    found = found or store.group_by_key(session, out["group_key"])
    if found is None:
        return out
    rows = timeseries.points(session, resolution, found.id, op=op, size_bytes=size_bytes,
                             since=since, until=until, limit=limit)
    if resolution == "raw":
        out["points"] = [
            {"time": m.time, "op": m.op, "size_bytes": m.size_bytes, "dtype": m.dtype,
             "redop": m.redop, "timing": m.timing, "transport": m.transport,
             "contended": m.contended, "time_us": m.time_us,
             "algbw_gbs": m.algbw_gbs, "busbw_gbs": m.busbw_gbs, "wrong": m.wrong}
            for m in rows]
    else:
        out["points"] = [
            {"time": r.bucket, "op": r.op, "size_bytes": r.size_bytes, "count": r.count,
             "time_us": r.time_us_median, "algbw_gbs": r.algbw_median,
             "busbw_gbs": r.busbw_median, "busbw_min": r.busbw_min, "busbw_max": r.busbw_max,
             "busbw_mean": r.busbw_mean, "wrong": r.wrong}
            for r in rows]
    return out


def shipper_states(session: Session) -> list[store.ShipperSpool]:
    """Each sending token's spools (per host it named) as its newest batch of the last day
    reported them."""
    return store.shipper_states(session)


def summary(session: Session) -> dict[str, Any]:
    counts = health_store.health_counts(session)
    open_findings = health_store.open_findings_count(session)
    # One judgement: the fleet is degraded exactly when a localized fault has an open
    # incident (what preflight and the webhooks go by), not when some link's own status is.
    if not counts and not open_findings:
        status = "unknown"
    elif open_findings:
        status = "degraded"
    else:
        status = "healthy"
    expiring = [{"id": t.id, "role": t.role, "name": t.name, "expires_at": t.expires_at}
                for t in metrics_store.token_expiries(session, TOKEN_EXPIRY_WARN_S)]
    return {"status": status, "nodes": store.node_count(session), "links": counts,
            "open_findings": open_findings, "tokens_expiring": expiring}


def _finding(f) -> dict[str, Any]:
    return {"id": f.id, "kind": f.kind, "status": f.status, "severity": f.severity,
            "nodes": f.nodes, "op": f.op, "detail": f.detail, "opened_at": f.opened_at,
            "resolved_at": f.resolved_at}


def findings(session: Session, *, status: str | None, limit: int = 500,
             before_id: int | None = None) -> list[dict[str, Any]]:
    return [_finding(f) for f in health_store.list_findings(session, status=status, limit=limit,
                                                            before_id=before_id)]


def finding(session: Session, finding_id: int) -> dict[str, Any]:
    found = health_store.get_finding(session, finding_id)
    if found is None:
        raise NotFound(f"no finding {finding_id}")
    return _finding(found)
