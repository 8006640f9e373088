"""The CLI on a real local Ray cluster with gloo: injected faults reach the output."""

from __future__ import annotations

import json
import os
import time

import pytest

from tests.procs import cli

pytestmark = pytest.mark.ray


def env(tmp_path) -> dict[str, str]:
    return {**os.environ, "RINGWATCH_STATE_DIR": str(tmp_path)}


def test_preflight_names_the_injected_slow_node(tmp_path) -> None:
    outer = time.monotonic()
    r = cli("preflight", "--local", "3", "--gpus-per-node", "2", "--json",
            "--inject", '{"kind": "slow", "node": "node-001", "gpu": 0, "factor": 0.3}',
            env=env(tmp_path), timeout=300)
    elapsed = time.monotonic() - outer
    assert r.returncode == 1, r.stderr
    verdict = json.loads(r.stdout)
    assert verdict["backend"] == "gloo" and verdict["nodes_checked"] == 3
    assert verdict["exclude"] == ["node-001"]
    assert verdict["rounds"] >= 2 and verdict["duration_s"] > 0
    # The rounds inside the command, the command (Ray's start and stop too) inside what the
    # caller waited (docs/formats.md): one of each, never the rounds for the command.
    assert 0 < verdict["wall_s"] < verdict["command_s"] <= elapsed


def test_probe_reports_an_injected_hang_by_name(tmp_path) -> None:
    r = cli("probe", "--local", "2", "--gpus-per-node", "1", "--json", "--ops", "allreduce",
            "--sizes", "64K", "--iters", "2", "--warmup", "1",
            "--inject", '{"kind": "hang", "node": "node-001", "gpu": 0}',
            env=env(tmp_path), timeout=300)
    assert r.returncode == 1, r.stderr
    out = json.loads(r.stdout)
    assert out["backend"] == "gloo"
    assert out["injected"] == [{"kind": "hang", "node": "node-001", "gpu": 0, "factor": 1.0}]
    hangs = [f for f in out["findings"] if f["kind"] == "hang"]
    assert {(f["node"], f["gpu"]) for f in hangs} == {("node-001", 0)}
    assert hangs[0]["injected"] is True
