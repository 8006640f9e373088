"""HTTP connections that end by one wall-clock deadline, for one webhook attempt.

A per-read timeout bounds only the wait for the next bytes: a receiver that trickles its
status line a byte at a time holds an attempt for as long as it likes. Here every connect,
TLS handshake, write and read waits at most until the attempt's deadline, so the attempt
as a whole (connect, request, status line and headers) ends by then, whatever the
receiver does. The deadline is fixed when the attempt's pool is made, so each attempt
opens connections of its own and shares none with another. A ``Cut`` ends attempts sooner,
from another thread: a notifier that is stopping cuts what its budget could not wait for.
"""

from __future__ import annotations

import contextlib
import socket
import ssl
import threading
import time
from collections.abc import Iterable
from typing import Any

import httpcore


class Cut:
    """Ends the attempts whose connections it tracks, at once and from any thread: their
    sockets are shut down, so a thread blocked reading or writing wakes with a network error;
    a connection opened after the cut is refused."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._streams: set[httpcore.NetworkStream] = set()
        self.done = False

    def track(self, stream: httpcore.NetworkStream) -> None:
        with self._lock:
            self._streams.add(stream)
            if self.done:
                _shut(stream)

    def forget(self, stream: httpcore.NetworkStream) -> None:
        with self._lock:
            self._streams.discard(stream)

    def now(self) -> None:
        with self._lock:
            self.done = True
            for stream in self._streams:
                _shut(stream)


def _shut(stream: httpcore.NetworkStream) -> None:
    # One its own thread closed meanwhile has nobody left to wake.
    sock = stream.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)


def attempt_pool(timeout_s: float, ssl_context: ssl.SSLContext,
                 cut: Cut | None = None) -> httpcore.ConnectionPool:
    """A connection pool for one attempt: whatever it does ends ``timeout_s`` from now, or
    when ``cut`` is."""
    backend = DeadlineBackend(time.monotonic() + timeout_s, cut)
    return httpcore.ConnectionPool(ssl_context=ssl_context, network_backend=backend)


def _remaining(deadline: float, timeout: float | None, late: type[Exception]) -> float:
    """The wait allowed now: the caller's timeout, cut at the deadline; ``late`` once past it
    (a zero timeout would make the socket non-blocking, which reads as another error)."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise late("the attempt's deadline passed")
    return left if timeout is None else min(timeout, left)


class DeadlineStream(httpcore.NetworkStream):
    def __init__(self, stream: httpcore.NetworkStream, deadline: float,
                 cut: Cut | None = None) -> None:
        self._stream = stream
        self._deadline = deadline
        self._cut = cut
        if cut is not None:
            cut.track(stream)

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return self._stream.read(max_bytes, _remaining(self._deadline, timeout,
                                                       httpcore.ReadTimeout))

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        # One sendall under one socket timeout: the whole buffer by the deadline.
        self._stream.write(buffer, _remaining(self._deadline, timeout, httpcore.WriteTimeout))

    def close(self) -> None:
        if self._cut is not None:
            self._cut.forget(self._stream)
        self._stream.close()

    def start_tls(self, ssl_context: ssl.SSLContext, server_hostname: str | None = None,
                  timeout: float | None = None) -> httpcore.NetworkStream:
        wait = _remaining(self._deadline, timeout, httpcore.ConnectTimeout)
        if self._cut is not None:  # the TLS stream below takes the socket over
            self._cut.forget(self._stream)
        return DeadlineStream(self._stream.start_tls(ssl_context, server_hostname, wait),
                              self._deadline, self._cut)

    def get_extra_info(self, info: str) -> Any:
        return self._stream.get_extra_info(info)


class DeadlineBackend(httpcore.NetworkBackend):
    """The standard blocking sockets, each wait cut at ``deadline`` (``time.monotonic()``)."""

    def __init__(self, deadline: float, cut: Cut | None = None) -> None:
        self._sockets = httpcore.SyncBackend()
        self._deadline = deadline
        self._cut = cut

    def connect_tcp(self, host: str, port: int, timeout: float | None = None,
                    local_address: str | None = None,
                    socket_options: Iterable[Any] | None = None) -> httpcore.NetworkStream:
        if self._cut is not None and self._cut.done:
            raise httpcore.ConnectError("the attempt was cut (the notifier is stopping)")
        wait = _remaining(self._deadline, timeout, httpcore.ConnectTimeout)
        stream = self._sockets.connect_tcp(host, port, wait, local_address, socket_options)
        return DeadlineStream(stream, self._deadline, self._cut)

    def connect_unix_socket(self, path: str, timeout: float | None = None,
                            socket_options: Iterable[Any] | None = None) -> httpcore.NetworkStream:
        raise httpcore.UnsupportedProtocol("webhooks are sent over TCP only")

    def sleep(self, seconds: float) -> None:
        time.sleep(max(0.0, min(seconds, self._deadline - time.monotonic())))
