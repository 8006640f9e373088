"""Real processes for end-to-end tests: the API server and the CLI."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cli(*args: str, env: dict[str, str], timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "services.cli.main", *args], env=env,
                          capture_output=True, text=True, timeout=timeout)


def start_server(env: dict[str, str], notifier: bool = False) -> subprocess.Popen:
    """``ringwatch serve`` on the port of ``RINGWATCH_API_URL``; returns once /healthz answers."""
    port = env["RINGWATCH_API_URL"].rsplit(":", 1)[1]
    args = [sys.executable, "-m", "services.cli.main", "serve", "--port", port]
    proc = subprocess.Popen(args if notifier else [*args, "--no-notifier"], env=env)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"server exited with {proc.returncode}")
        try:
            if httpx.get(f"{env['RINGWATCH_API_URL']}/healthz", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.2)
    proc.kill()
    raise AssertionError("server did not start within 60 s")


def stop_server(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
