"""The FastAPI application: routers, error mapping, and start-up wiring.

Endpoints are plain ``def`` functions: the database layer is synchronous
SQLAlchemy, and FastAPI runs sync endpoints in its thread pool, which is what
keeps a slow query from blocking the event loop.
"""

from __future__ import annotations

import logging
import uuid
from typing import Any

import psycopg
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy.exc import DataError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from sqlalchemy.orm import Session, sessionmaker
from starlette.exceptions import HTTPException as StarletteHTTPException

from ringwatch.api import errors
from ringwatch.api.auth import PUBLIC_PATHS, Authenticate
from ringwatch.api.headers import SecurityHeaders
from ringwatch.api.limits import BodyLimit, BodyPace, IngestSlots
from ringwatch.api.request_id import RequestLog
from ringwatch.api.request_metrics import ApiMetrics, RequestMetrics, RouteTemplates
from ringwatch.api.routers import (
    docs,
    fleet,
    measurements,
    meta,
    preflight,
    rankmaps,
    scheduler,
    tokens,
    ui,
    webhooks,
)
from ringwatch.api.schemas import ErrorOut, MeasurementBatch
from ringwatch.services import logs
from ringwatch.services.errors import RingwatchError
from ringwatch.services.preflight import service as preflight_service
from ringwatch.services.preflight.waiting import PreflightWaiters
from ringwatch.services.settings import Settings
from ringwatch.services.store import db
from ringwatch.services.store import tokens as token_store
from ringwatch.services.version import ringwatch_version

log = logging.getLogger(__name__)

ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorOut} for code in (401, 403, 404, 413, 422, 503)
}


def create_app(settings: Settings, session_factory: sessionmaker[Session] | None = None) -> FastAPI:
    # /docs is served from this API's own files (api/routers/docs.py), not FastAPI's page
    # from a CDN; there is no /redoc.
    app = FastAPI(title="ringwatch", version=ringwatch_version(), responses=ERROR_RESPONSES,
                  description="Health of the communication fabric of GPU training clusters.",
                  docs_url=None, redoc_url=None)
    if session_factory is None:
        url = db.resolve_database_url(settings.database_url, settings.state_dir)
        session_factory = db.make_session_factory(db.make_engine(url))
    app.state.settings = settings
    app.state.session_factory = session_factory
    # Batches stored at once; more wait up to ingest_wait_s, then get a 503 with Retry-After.
    app.state.ingest_slots = IngestSlots(settings.max_concurrent_ingests, settings.ingest_wait_s)
    # How fast a batch's body must come once it holds a slot (a slower one is a 408).
    app.state.body_pace = BodyPace(settings.ingest_body_timeout_s,
                                   settings.ingest_body_min_bytes_per_s)
    app.state.preflight_waiters = PreflightWaiters(session_factory, settings.max_waiting_preflights)
    # Preflight requests that arrive together are written together (a big job's prologs).
    app.state.preflight_submissions = preflight_service.submissions(session_factory,
                                                                    settings.api_url)
    _bootstrap_admin(settings, session_factory)
    for r in (meta.router, measurements.router, fleet.router, preflight.router,
              rankmaps.router, webhooks.router, tokens.router, scheduler.router):
        app.include_router(r)
    ui.mount(app)
    docs.mount(app)
    _install_error_handlers(app)
    _declare_openapi(app)
    # First of what reads the request: a body over the limit is refused before routing,
    # auth or parsing read it; then the token is checked before any body is parsed.
    app.add_middleware(Authenticate, session_factory=session_factory)
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes)
    # Around even those (it reads nothing of the request): security headers on every
    # answer, their 401s and 413s included.
    app.add_middleware(SecurityHeaders)
    # Outermost: every request counted and timed, whoever answered it (/metrics serves them).
    app.state.api_metrics = ApiMetrics()
    app.add_middleware(RequestMetrics, metrics=app.state.api_metrics,
                       templates=RouteTemplates(app))
    # Around that: each request's id (X-Request-ID) on its log lines and answer, and its
    # access line (api/request_id.py).
    app.add_middleware(RequestLog, templates=RouteTemplates(app))
    return app


def _declare_openapi(app: FastAPI) -> None:
    """Say in the OpenAPI document what the middleware enforces: a bearer token on every
    route but the public ones (so /docs offers an Authorize button); and the schema of the
    measurement batch, whose body the route reads itself (after taking an ingest slot)."""
    from fastapi.openapi.utils import get_openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version,
                                 description=app.description, routes=app.routes)
            components = schema.setdefault("components", {})
            batch = MeasurementBatch.model_json_schema(ref_template="#/components/schemas/{model}")
            components.setdefault("schemas", {}).update(batch.pop("$defs", {}))
            components["schemas"]["MeasurementBatch"] = batch
            components["securitySchemes"] = {"bearer": {
                "type": "http", "scheme": "bearer",
                "description": "a ringwatch token (ringwatch token create --role reader, "
                               "agent or admin)"}}
            for path, operations in schema.get("paths", {}).items():
                if path in PUBLIC_PATHS:
                    continue
                for operation in operations.values():
                    operation["security"] = [{"bearer": []}]
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _bootstrap_admin(settings: Settings, factory: sessionmaker[Session]) -> None:
    """Store the configured bootstrap admin token into an empty token table, so a new
    install can be administered; once any token exists the setting is not used again."""
    if not settings.bootstrap_admin_token:
        return
    with db.transaction(factory) as s:
        if token_store.bootstrap(s, settings.bootstrap_admin_token, settings.token_ttl_days):
            log.info("stored the bootstrap admin token (RINGWATCH_BOOTSTRAP_ADMIN_TOKEN)")


def _error(status: int, code: str, message: str, detail: list | None = None) -> JSONResponse:
    return JSONResponse(status_code=status, content=errors.body(code, message, detail))


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RingwatchError)
    async def ringwatch_error(_: Request, exc: RingwatchError) -> JSONResponse:
        return errors.response(exc)

    @app.exception_handler(PoolTimeout)
    @app.exception_handler(OperationalError)
    async def database_unavailable(_: Request, exc: PoolTimeout | OperationalError) -> JSONResponse:
        return errors.response(errors.unavailable(exc))

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        found = exc.errors()
        first = found[0] if found else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        message = f"{where}: {first.get('msg', 'invalid')}" if where else first.get("msg", "invalid")
        detail = [{"loc": list(e.get("loc", ())), "msg": e.get("msg"), "type": e.get("type")}
                  for e in found[:50]]
        return _error(422, "invalid_input", message, detail)

    @app.exception_handler(DataError)
    @app.exception_handler(psycopg.DataError)
    async def data_error(_: Request, exc: DataError | psycopg.DataError) -> JSONResponse:
        # Values the schema admits but Postgres cannot hold (a NUL byte in a string, a
        # number out of range) are the client's input, not a server fault; the COPY paths
        # raise psycopg's own error, the rest SQLAlchemy's wrapping of it.
        cause = exc.orig if isinstance(exc, DataError) else exc
        reason = str(cause).splitlines()[0] if str(cause) else "value out of range"
        return _error(422, "invalid_input", f"the database cannot store this input: {reason}")

    @app.exception_handler(UnicodeEncodeError)
    async def not_utf8(_: Request, exc: UnicodeEncodeError) -> JSONResponse:
        # JSON may carry a lone surrogate (\ud800) that no UTF-8 text can hold.
        return _error(422, "invalid_input", "the input holds text that is not valid Unicode "
                                            f"({exc.reason} at position {exc.start})")

    @app.exception_handler(Exception)
    async def unexpected(_: Request, exc: Exception) -> JSONResponse:
        # Whatever went wrong, the client gets the JSON error shape and a reference to find
        # the traceback in the server log, never a plain-text 500.
        reference = uuid.uuid4().hex[:12]
        log.error("unexpected error (reference %s)", reference, exc_info=exc)
        answer = _error(500, "internal", f"unexpected server error (reference {reference}); "
                                         "the server log has the details")
        # Answered outside RequestLog (Starlette's outermost layer): the id is put on here.
        if (rid := logs.request_id.get()) is not None:
            answer.headers["X-Request-ID"] = rid
        return answer

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return _error(exc.status_code, "http_error", str(exc.detail))
