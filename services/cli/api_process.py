"""Run ``ringwatch serve`` as a child process and know when it answers: for the demo,
the end-to-end tests and the benchmarks."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import httpx


class ApiDidNotStart(RuntimeError):
    pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_api(env: dict[str, str], *, notifier: bool = True, timeout_s: float = 60.0) -> subprocess.Popen:
    """``ringwatch serve`` on the port of ``env["RINGWATCH_API_URL"]``; returns once
    ``/healthz`` answers 200, stops the child and raises ApiDidNotStart otherwise."""
    api_url = env["RINGWATCH_API_URL"]
    args = [sys.executable, "-m", "ringwatch.services.cli.main", *serve_args(api_url, notifier)]
    return wait_ready(subprocess.Popen(args, env=env), api_url, timeout_s)


def serve_args(api_url: str, notifier: bool = True) -> list[str]:
    """The CLI arguments that serve the API on ``api_url``'s port."""
    args = ["serve", "--port", api_url.rsplit(":", 1)[1]]
    return args if notifier else [*args, "--no-notifier"]


def wait_ready(proc: subprocess.Popen, api_url: str, timeout_s: float = 60.0) -> subprocess.Popen:
    """``proc`` once its ``/healthz`` answers 200; stopped, and ApiDidNotStart, otherwise."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ApiDidNotStart(f"the API server exited with code {proc.returncode}")
        try:
            if httpx.get(f"{api_url}/healthz", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    stop(proc)
    raise ApiDidNotStart(f"the API server did not answer /healthz within {timeout_s:.0f} s")


def stop(proc: subprocess.Popen, timeout_s: float = 15.0) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
