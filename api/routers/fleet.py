"""Reading the fleet: nodes, links, series, findings and the summary."""

from datetime import datetime
from typing import Literal

from fastapi import APIRouter, Query

from api.deps import ReaderDep, SessionDep, SettingsDep
from api.schemas import HealthOut, LinkOut, NodeOut, SeriesOut
from services.errors import BadInput
from services.monitor import fleet

router = APIRouter(prefix="/v1", tags=["fleet"])


@router.get("/nodes", response_model=list[NodeOut])
def get_nodes(session: SessionDep, _: ReaderDep) -> list[dict]:
    """Every node ringwatch has seen, with its ranks (GPUs)."""
    return fleet.nodes(session)


@router.get("/links", response_model=list[LinkOut])
def get_links(
    session: SessionDep,
    _: ReaderDep,
    status: Literal["ok", "degraded"] | None = None,
    scope: Literal["intra_node", "gpu_pair", "inter_node", "world"] | None = None,
    node: str | None = None,
) -> list[dict]:
    """Current health of every probed link or group, filtered by status, scope or node."""
    return fleet.links(session, status=status, scope=scope, node=node)


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
    op: str | None = None,
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
    """Fleet summary: links by status and open findings."""
    return fleet.summary(session)


@router.get("/findings")
def get_findings(session: SessionDep, _: ReaderDep,
                 status: Literal["open", "resolved"] | None = None) -> list[dict]:
    """Findings (incidents), newest first."""
    return fleet.findings(session, status=status)
