"""The API process's own metrics, served by /metrics behind the fleet's: requests by method,
route template and status code, their latency, the exceptions no handler expected, and the
process's CPU, memory and file descriptors.

Each API replica counts its own requests (Prometheus tells them apart by ``instance``),
unlike the fleet's families, which every replica reads alike from the database.
"""

from __future__ import annotations

import re
import time
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    ProcessCollector,
    disable_created_metrics,
)
from starlette.routing import Mount, compile_path

METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})
# The route label of a request whose path matches no route.
UNMATCHED = "unmatched"
# From a cached /healthz to a preflight that waits for a scheduler (minutes).
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
                   60.0, 300.0)


class ApiMetrics:
    """The registry /metrics renders for this process, and the families requests add to."""

    def __init__(self) -> None:
        # No ``_created`` series beside each counter: Prometheus would store them as
        # series of their own, and rate() needs none of them.
        disable_created_metrics()
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)
        self.requests = Counter(
            "ringwatch_http_requests", "HTTP requests answered by this API process, by "
            "method, route template and status code.", ["method", "route", "code"],
            registry=self.registry)
        self.duration = Histogram(
            "ringwatch_http_request_duration_seconds", "Seconds from a request's arrival to "
            "its answer's last byte, by method and route template.", ["method", "route"],
            buckets=LATENCY_BUCKETS, registry=self.registry)
        self.exceptions = Counter(
            "ringwatch_http_request_exceptions", "Requests whose handler raised an error no "
            "handler expected (answered 500 with a reference to the server log).",
            ["method", "route"], registry=self.registry)


class RouteTemplates:
    """The route templates of an app, to label a request that reached no route: one refused
    before routing (401, 413), or served by a mount (the web page's files). Built at its
    first use, when every route is registered."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self._table: list[tuple[re.Pattern[str], str]] | None = None

    def _build(self) -> list[tuple[re.Pattern[str], str]]:
        templates = list(self.app.openapi().get("paths", {}))
        for route in self.app.routes:
            path = getattr(route, "path", None)
            if isinstance(route, Mount) and path:
                templates.append(path + "/{path:path}")
            elif path:
                templates.append(path)
        return [(compile_path(t)[0], t.replace(":path}", "}")) for t in templates]

    def match(self, path: str) -> str:
        if self._table is None:
            self._table = self._build()
        return next((t for regex, t in self._table if regex.match(path)), UNMATCHED)


class RequestMetrics:
    """ASGI middleware: count and time every HTTP request. It reads only the status of the
    answer, so it may stand outside every other middleware and see their answers too.

    The route label is the template of the route the router chose (``/v1/nodes/{name}``),
    never the raw path, so its values are as few as the routes."""

    def __init__(self, app: Any, metrics: ApiMetrics, templates: RouteTemplates) -> None:
        self.app = app
        self.metrics = metrics
        self.templates = templates

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        path = scope["path"]  # routing rewrites the scope of a mount
        status = 500  # unless an answer started before an error

        async def send_noting_status(message: dict[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        method = scope["method"] if scope["method"] in METHODS else "other"
        try:
            await self.app(scope, receive, send_noting_status)
        except Exception:
            self.metrics.exceptions.labels(method, self._route(scope, path)).inc()
            raise
        finally:
            route = self._route(scope, path)
            self.metrics.requests.labels(method, route, str(status)).inc()
            self.metrics.duration.labels(method, route).observe(time.perf_counter() - started)

    def _route(self, scope: dict[str, Any], path: str) -> str:
        chosen = getattr(scope.get("route"), "path", None)
        return chosen if isinstance(chosen, str) else self.templates.match(path)
