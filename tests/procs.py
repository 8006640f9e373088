"""Real processes for end-to-end tests: the API server and the CLI."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ringwatch.services.cli.api_process import free_port, start_api, stop

__all__ = ["api_env", "cli", "free_port", "running_api", "start_server", "stop_server"]


def api_env(database_url: str, state_dir: Path, token: str) -> dict[str, str]:
    """The environment of a real API process and the CLI that talks to it: its database,
    a free port, ``token`` as the bootstrap admin token and the one the CLI sends."""
    return {**os.environ, "RINGWATCH_DATABASE_URL": database_url,
            "RINGWATCH_API_URL": f"http://127.0.0.1:{free_port()}", "RINGWATCH_TOKEN": token,
            "RINGWATCH_BOOTSTRAP_ADMIN_TOKEN": token, "RINGWATCH_STATE_DIR": str(state_dir)}


def cli(*args: str, env: dict[str, str], timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ringwatch.services.cli.main", *args], env=env,
                          capture_output=True, text=True, timeout=timeout)


def start_server(env: dict[str, str], notifier: bool = False) -> subprocess.Popen:
    """``ringwatch serve`` on the port of ``RINGWATCH_API_URL``; returns once /healthz answers."""
    return start_api(env, notifier=notifier)


def stop_server(proc: subprocess.Popen) -> None:
    stop(proc)


@contextmanager
def running_api(database_url: str, state_dir: Path, token: str) -> Iterator[dict[str, str]]:
    """A real API process on ``api_env``'s environment, stopped on leaving; yields that
    environment (for the CLI and for HTTP clients alike)."""
    env = api_env(database_url, state_dir, token)
    proc = start_server(env)
    try:
        yield env
    finally:
        stop_server(proc)
