"""Reading the fleet: nodes, links, series, findings and the summary."""

from datetime import datetime
from typing import Annotated, Literal

from fastapi import APIRouter, Query, Request, Response

from ringwatch.api.deps import AdminDep, ReaderDep, SessionDep, SettingsDep
from ringwatch.api.pages import decode_cursor, encode_cursor, link_next
from ringwatch.api.schemas import (
    BaselineOut,
    HealthOut,
    LinkOut,
    NodeDetailOut,
    NodeNames,
    NodeOut,
    NodePairsOut,
    NodePairTileOut,
    NodesRetireIn,
    NodesRetireOut,
    NodeStatesOut,
    SeriesOut,
)
from ringwatch.services.errors import BadInput
from ringwatch.services.monitor import fleet

router = APIRouter(prefix="/v1", tags=["fleet"])


@router.get("/nodes", response_model=list[NodeOut])
def get_nodes(request: Request, response: Response, session: SessionDep, _: ReaderDep,
              after: str | None = Query(default=None, max_length=2048,
                                        description="X-Next-Cursor of the previous page, or "
                                                    "the name it ended at"),
              limit: int = Query(default=5000, ge=1, le=50_000)) -> list[dict]:
    """The nodes of the fleet (retired ones left out), by name, with their ranks (GPUs). A
    full page names the next in ``X-Next-Cursor`` and ``Link: rel="next"``."""
    out = fleet.nodes(session, after=_node_after(after), limit=limit)
    # The cursor is encoded, so it is a legal header whatever name a page ends at (one
    # stored before today's name rule, with a newline in it, would end the response).
    link_next(request, response, out, limit, encode_cursor([out[-1]["name"]]) if out else None)
    return out


def _node_after(after: str | None) -> str | None:
    """The name a page of nodes starts after: X-Next-Cursor decoded, or a plain name."""
    if after is None:
        return None
    try:
        return decode_cursor(after, 1)[0]
    except BadInput:
        return after


@router.get("/nodes/{name}", response_model=NodeDetailOut)
def get_node(name: str, session: SessionDep, _: ReaderDep) -> dict:
    """One node: its GPUs with their telemetry, its NICs and its newest NVML counter
    readings (up to 100, newest first); a retired node's too, with ``retired_at``."""
    return fleet.node(session, name)


@router.post("/nodes/retire", response_model=NodesRetireOut)
def retire_nodes(body: NodesRetireIn, session: SessionDep, _: AdminDep,
                 dry_run: bool = Query(default=False, description="say what would be "
                                                                   "retired, change nothing")
                 ) -> dict:
    """Take nodes out of the fleet (admin): they leave ``GET /v1/nodes``, the fleet map,
    the node count (and RINGWATCH_MAX_NODES), /metrics and preflight; their measurements,
    series, findings and ``GET /v1/nodes/{name}`` stay. A retired node that reports again
    comes back, as a new node. All or nothing: a name ringwatch never held is a 404."""
    return fleet.retire_nodes(session, list(body.nodes), dry_run=dry_run)


@router.get("/fleet/nodes", response_model=NodeStatesOut)
def get_node_states(session: SessionDep, settings: SettingsDep, _: ReaderDep) -> dict:
    """Every node's health in one read (the fleet map): its state (degraded: an open
    finding names it; suspect: a link it shares is degraded; ok; unknown: no links yet),
    its worst ratio of measured over expected busbw, and its link and finding counts."""
    return fleet.node_states(session, settings.thresholds)


@router.get("/fleet/pairs", response_model=NodePairsOut | NodePairTileOut)
def get_node_pairs(
    session: SessionDep,
    settings: SettingsDep,
    _: ReaderDep,
    row_from: int | None = Query(default=None, ge=0, description="a tile's first row"),
    row_to: int | None = Query(default=None, ge=0, description="the row after a tile's last"),
    col_from: int | None = Query(default=None, ge=0, description="a tile's first column"),
    col_to: int | None = Query(default=None, ge=0, description="the column after a tile's last"),
) -> dict:
    """The node x node map: every node's name, and for each node pair one byte (base64 in
    ``cells``, row by row through the upper triangle): 0 when it has not been probed as a
    pair yet, else its worst ratio in hundredths plus one (127: no ratio), with 0x80 set
    when it is degraded. One byte a pair keeps 1024 nodes' map to 700 kB.

    The whole map is sent for up to ``RINGWATCH_MAX_PAIR_MAP_NODES`` nodes (422 beyond).
    Any of ``row_from``, ``row_to``, ``col_from``, ``col_to`` (indices into the nodes by
    name; from inclusive, to exclusive, the fleet's edge where left out) asks for one tile
    instead, at any fleet size: at most that many rows by as many columns, every cell of
    the rectangle (both sides of the diagonal), with its rows' and columns' names."""
    return fleet.node_pairs(session, max_nodes=settings.max_pair_map_nodes,
                            rows=(row_from, row_to), cols=(col_from, col_to))


@router.get("/links", response_model=list[LinkOut])
def get_links(
    request: Request,
    response: Response,
    session: SessionDep,
    settings: SettingsDep,
    _: ReaderDep,
    status: Literal["ok", "degraded"] | None = None,
    scope: Literal["intra_node", "gpu_pair", "inter_node", "world"] | None = None,
    node: Annotated[NodeNames | None, Query(
        description="a node, or a Slurm host list (node-[000-015]); repeated: any of them")] = None,
    after: str | None = Query(default=None, max_length=2048,
                              description="X-Next-Cursor of the previous page"),
    limit: int = Query(default=10_000, ge=1, le=100_000),
) -> list[dict]:
    """Current health of the probed links and groups, filtered by status, scope or nodes,
    in (scope, group key, op) order, each with where it stands in the hysteresis window
    (``standing``: why a link slow in one cycle is still ok). A full page names the next in
    ``X-Next-Cursor`` and ``Link: rel="next"``."""
    out = fleet.links(session, status=status, scope=scope, nodes=node,
                      after=decode_cursor(after, 3) if after else None,
                      limit=limit, policy=settings.hysteresis())
    last = out[-1] if out else None
    link_next(request, response, out, limit,
              encode_cursor([last["scope"], last["group_key"], last["op"]]) if last else None)
    return out


@router.get("/baselines", response_model=list[BaselineOut])
def get_baselines(
    request: Request,
    response: Response,
    session: SessionDep,
    _: ReaderDep,
    after: str | None = Query(default=None, max_length=2048,
                              description="X-Next-Cursor of the previous page"),
    limit: int = Query(default=10_000, ge=1, le=100_000),
) -> list[dict]:
    """Each link's running baseline (its last busbw values at its judged size) where it
    holds enough values to be the link's own normal: what a scheduler's adaptive check,
    monitoring cycle or preflight, judges its links against, as the API judges ingested
    batches. In (scope, group key, op) order; a full page names the next in
    ``X-Next-Cursor``."""
    out = fleet.baselines(session, after=decode_cursor(after, 3) if after else None, limit=limit)
    last = out[-1] if out else None
    link_next(request, response, out, limit,
              encode_cursor([last["scope"], last["group_key"], last["op"]]) if last else None)
    return out


@router.get("/series", response_model=SeriesOut)
def get_series(
    session: SessionDep,
    settings: SettingsDep,
    _: ReaderDep,
    members: str | None = Query(default=None,
                                description="the group's members, comma-separated NODE/INDEX"),
    group: str | None = Query(default=None, max_length=600,
                              description="the group's key as GET /v1/links gives it "
                                          "(for groups too large to list in a URL)"),
    op: str | None = Query(default=None, max_length=32,
                           description="an op, or an op pinned to one algorithm: allreduce:ring "
                                       "and allreduce:tree are series apart from allreduce"),
    size_bytes: int | None = Query(default=None, gt=0),
    since: datetime | None = None,
    until: datetime | None = None,
    limit: int = Query(default=10_000, gt=0, le=100_000),
    resolution: Literal["auto", "raw", "1h", "1d"] = Query(
        default="auto", description="raw probes, hourly or daily rollups; auto: raw for up "
                                    "to 3 days still held raw, hourly up to 90 days, else daily"),
) -> dict:
    """The time series of one link or group (by ``members`` or ``group``): busbw, algbw and
    time per probe, or per hour or day (median, min, max, count)."""
    if (members is None) == (group is None):
        raise BadInput("give the group's members or its key (group), not both or neither")
    return fleet.series(session, members.split(",") if members else None, group=group, op=op,
                        size_bytes=size_bytes, since=since, until=until, limit=limit,
                        resolution=resolution, retention=settings.retention())


@router.get("/health", response_model=HealthOut)
def get_health(session: SessionDep, _: ReaderDep) -> dict:
    """Fleet summary: links by status and open findings; and ``tokens_expiring``, the
    active tokens that expire within 14 days (id, role, name, expiry), soonest first."""
    return fleet.summary(session)


@router.get("/findings")
def get_findings(request: Request, response: Response, session: SessionDep, _: ReaderDep,
                 status: Literal["open", "resolved", "retired"] | None = None,
                 after: int | None = Query(default=None, ge=1,
                                           description="the id the previous page ended at"),
                 limit: int = Query(default=500, ge=1, le=5000)) -> list[dict]:
    """Findings (incidents), newest first. A full page names the next in ``X-Next-Cursor``
    and ``Link: rel="next"``."""
    out = fleet.findings(session, status=status, limit=limit, before_id=after)
    link_next(request, response, out, limit, out[-1]["id"] if out else None)
    return out


@router.get("/findings/{finding_id}")
def get_finding(finding_id: int, session: SessionDep, _: ReaderDep) -> dict:
    """One finding (the ``url`` of its webhook events)."""
    return fleet.finding(session, finding_id)
