"""Liveness and Prometheus metrics."""

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse
from sqlalchemy import text

from api.deps import SessionDep
from services.analyzer import fleet

router = APIRouter(tags=["meta"])


@router.get("/healthz")
def healthz(session: SessionDep) -> dict:
    """Liveness: the API answers and its database does."""
    session.execute(text("SELECT 1"))
    return {"ok": True}


@router.get("/metrics", response_class=PlainTextResponse)
def metrics(session: SessionDep) -> str:
    """Prometheus text exposition of link health."""
    s = fleet.summary(session)
    lines = [
        "# HELP ringwatch_links Probed links and groups by health status.",
        "# TYPE ringwatch_links gauge",
        *[f'ringwatch_links{{status="{k}"}} {v}' for k, v in sorted(s["links"].items())],
        "# HELP ringwatch_open_findings Open findings.",
        "# TYPE ringwatch_open_findings gauge",
        f"ringwatch_open_findings {s['open_findings']}",
        "# HELP ringwatch_nodes Nodes seen.",
        "# TYPE ringwatch_nodes gauge",
        f"ringwatch_nodes {s['nodes']}",
    ]
    return "\n".join(lines) + "\n"
