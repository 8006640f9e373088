"""Liveness, readiness and Prometheus metrics."""

import threading
from typing import Annotated

from fastapi import APIRouter, Depends, Request, Response

from ringwatch.api.deps import READ_ROLES, SettingsDep, require
from ringwatch.services.errors import NotReady
from ringwatch.services.monitor import metrics as fleet_metrics
from ringwatch.services.store import db

router = APIRouter(tags=["meta"])

_read = require(READ_ROLES)
_cache_lock = threading.Lock()


def metrics_reader(request: Request, settings: SettingsDep) -> None:
    """Any valid token when RINGWATCH_METRICS_TOKEN_REQUIRED is set; none otherwise."""
    if settings.metrics_token_required:
        _read(request)


def scrape_cache(request: Request, settings: SettingsDep) -> fleet_metrics.ScrapeCache:
    """This app's cache of rendered scrapes, made on first use."""
    state = request.app.state
    with _cache_lock:
        cache = getattr(state, "metrics_cache", None)
        if cache is None:
            cache = state.metrics_cache = fleet_metrics.ScrapeCache(
                settings.metrics_cache_s, settings.metrics_link_max_age_s,
                settings.metrics_limits(), settings.alert_bounds())
    return cache


ScrapeCacheDep = Annotated[fleet_metrics.ScrapeCache, Depends(scrape_cache)]


@router.get("/healthz")
async def healthz() -> dict:
    """Liveness: this process answers (from its event loop, whatever its thread pool and
    database are doing). A database outage is not a reason to restart it: /readyz says so."""
    return {"ok": True}


@router.get("/readyz")
def readyz(request: Request) -> dict:
    """Readiness: 200 while the database answers and is at this code's migration; 503
    (not_ready) otherwise, naming why: unreachable, or at another migration and the one this
    code needs."""
    state = db.schema_state(request.app.state.session_factory.kw["bind"])
    if not state.ok:
        raise NotReady(state.why)
    return {"status": "ok"}


@router.get("/metrics", dependencies=[Depends(metrics_reader)], response_class=Response,
            responses={200: {"content": {"text/plain": {}, "application/openmetrics-text": {}},
                             "description": "Prometheus text, or OpenMetrics when asked"}})
def metrics(request: Request, cache: ScrapeCacheDep) -> Response:
    """Prometheus metrics of the fleet and of this API process: the Prometheus text format,
    or OpenMetrics when the Accept header asks for it (gzipped when Accept-Encoding allows).
    The fleet's families are read once per RINGWATCH_METRICS_CACHE_S seconds, the process's
    own at every scrape. While the database cannot be read the answer is still a 200: the
    fleet's families are left out and ringwatch_database_up is 0. With
    RINGWATCH_METRICS_TOKEN_REQUIRED set, any valid token is needed."""
    scrape = cache.get(request.app.state.session_factory, request.headers.get("accept", ""),
                       "gzip" in request.headers.get("accept-encoding", ""),
                       own=request.app.state.api_metrics.registry)
    headers = {"Vary": "Accept, Accept-Encoding"}
    if scrape.gzipped:
        headers["Content-Encoding"] = "gzip"
    return Response(scrape.body, media_type=scrape.content_type, headers=headers)
