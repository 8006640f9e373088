"""Real processes for end-to-end tests: the API server and the CLI."""

from __future__ import annotations

import subprocess
import sys

from services.cli.api_process import free_port, start_api, stop

__all__ = ["cli", "free_port", "start_server", "stop_server"]


def cli(*args: str, env: dict[str, str], timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "services.cli.main", *args], env=env,
                          capture_output=True, text=True, timeout=timeout)


def start_server(env: dict[str, str], notifier: bool = False) -> subprocess.Popen:
    """``ringwatch serve`` on the port of ``RINGWATCH_API_URL``; returns once /healthz answers."""
    return start_api(env, notifier=notifier)


def stop_server(proc: subprocess.Popen) -> None:
    stop(proc)
