"""The small HTTP server a process's health port runs on (the notifier's /healthz and
/readyz, the scheduler's /healthz and /metrics): a thread per connection, but whoever reaches
the port cannot hold one per idle connection. Each connection has READ_TIMEOUT_S to send its
request (the handler's ``timeout``), and past MAX_CONNECTIONS open at once the oldest is
dropped, so idle ones never lock a probe or a scrape out."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections import OrderedDict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

# Seconds a connection may stay silent (a probe or a scrape sends its request at once); then
# it is closed. Handlers set it as their ``timeout``.
READ_TIMEOUT_S = 5.0
# Connections served at once at most (a thread each); one more closes the oldest.
MAX_CONNECTIONS = 32


class BoundedServer(ThreadingHTTPServer):
    """A thread per connection, MAX_CONNECTIONS of them at most: a new connection past the
    bound closes the oldest (its thread, blocked on a read, then ends at once)."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler]) -> None:
        super().__init__(address, handler)
        self._open: OrderedDict[int, socket.socket] = OrderedDict()
        self._guard = threading.Lock()

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._guard:
            while len(self._open) >= MAX_CONNECTIONS:
                _, oldest = self._open.popitem(last=False)
                with contextlib.suppress(OSError):  # it closed meanwhile
                    oldest.shutdown(socket.SHUT_RDWR)
            self._open[id(request)] = request
        super().process_request(request, client_address)

    def shutdown_request(self, request: Any) -> None:
        with self._guard:
            self._open.pop(id(request), None)
        super().shutdown_request(request)
