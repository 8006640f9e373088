"""`ringwatch preflight --fabric` end to end through the CLI process: the verdict contract."""

from __future__ import annotations

import json
import os
from pathlib import Path

from tests.procs import cli
from tests.scenarios import DESIGN_SCENARIO


def scenario(tmp_path: Path, body: dict) -> str:
    path = tmp_path / "fabric.json"
    path.write_text(json.dumps(body))
    return str(path)


def test_the_shipped_example_scenario_gives_its_verdict() -> None:
    """examples/scenario.json, as the README runs it (the design scenario of the tests)."""
    example = Path(__file__).resolve().parents[1] / "examples" / "scenario.json"
    assert json.loads(example.read_text()) == DESIGN_SCENARIO
    r = cli("preflight", "--fabric", str(example), "--json", env=dict(os.environ))
    assert r.returncode == 1, r.stderr
    v = json.loads(r.stdout)
    assert v["backend"] == "sim" and v["nodes_checked"] == 16 and v["healthy"] is False
    assert v["exclude"] == ["node-002", "node-003", "node-004", "node-009", "node-011"]
    where = {(f["kind"], f.get("node") or tuple(f.get("nodes", []))) for f in v["findings"]}
    assert where == {("nvlink_degraded", "node-003"), ("nic_degraded", "node-011"),
                     ("net_path_degraded", ("node-001", "node-007")), ("hang", "node-004"),
                     ("data_corruption", "node-009"), ("topology_mismatch", "node-002")}
    assert v["rounds"] >= 1 and v["duration_s"] > 0 and "wall_s" in v


def test_healthy_fabric_exits_0_and_nodes_limit_the_check(tmp_path: Path) -> None:
    path = scenario(tmp_path, {"nodes": 8, "gpus_per_node": 4, "seed": 3})
    r = cli("preflight", "--fabric", path, "--json", env=dict(os.environ))
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["exclude"] == []
    r = cli("preflight", "--fabric", path, "--nodes", "node-001,node-002", "--json", env=dict(os.environ))
    assert r.returncode == 0 and json.loads(r.stdout)["nodes_checked"] == 2


def test_bad_scenarios_exit_2_with_one_line(tmp_path: Path) -> None:
    for body in ({"nodes": 0}, {"nodes": 4, "faults": [{"kind": "gremlin", "node": "node-001"}]},
                 {"nodes": 4, "faults": [{"kind": "nic", "node": "node-009", "factor": 0.5}]}):
        r = cli("preflight", "--fabric", scenario(tmp_path, body), env=dict(os.environ))
        assert r.returncode == 2, (body, r.stdout)
        assert len(r.stderr.strip().splitlines()) == 1
    r = cli("preflight", "--fabric", str(tmp_path / "missing.json"), env=dict(os.environ))
    assert r.returncode == 2
    r = cli("preflight", "--fabric", scenario(tmp_path, {"nodes": 4}), "--nodes", "node-042",
            env=dict(os.environ))
    assert r.returncode == 2 and "node-042" in r.stderr


def test_probe_redop_reaches_the_output_and_avg_on_gloo_is_exit_2(tmp_path: Path) -> None:
    path = scenario(tmp_path, {"nodes": 2, "gpus_per_node": 2, "seed": 1})
    r = cli("probe", "--fabric", path, "--ops", "allreduce,alltoall", "--redop", "avg", "--json",
            env=dict(os.environ))
    assert r.returncode == 0, r.stderr
    got = {(m["op"], m["redop"]) for m in json.loads(r.stdout)["measurements"]}
    assert got == {("allreduce", "avg"), ("alltoall", "sum")}
    # Refused before any cluster starts: one line on stderr naming the reason.
    for argv in (("--local", "1", "--backend", "gloo", "--redop", "avg"),
                 ("--fabric", path, "--redop", "avg", "--dtype", "bfloat16"),
                 ("--fabric", path, "--redop", "max", "--ops", "alltoall")):
        r = cli("probe", *argv, env=dict(os.environ))
        assert r.returncode == 2, (argv, r.stdout)
        assert len(r.stderr.strip().splitlines()) == 1 and "redop" in r.stderr


def test_the_cli_hands_its_settings_to_the_check(tmp_path: Path) -> None:
    """The check reads no settings itself: the process that runs it passes its budget (and
    thresholds) down, so RINGWATCH_CHECK_MAX_ROUNDS still bounds `ringwatch preflight`."""
    path = scenario(tmp_path, {"nodes": 8, "gpus_per_node": 4, "seed": 3})
    r = cli("preflight", "--fabric", path, "--json",
            env={**os.environ, "RINGWATCH_CHECK_MAX_ROUNDS": "2"})
    v = json.loads(r.stdout)
    assert v["rounds"] == 2 and v["stopped_by"] == "rounds (2)" and v["complete"] is False


def test_command_s_is_the_whole_command_and_wall_s_the_checks_rounds(tmp_path: Path,
                                                                       monkeypatch, capsys) -> None:
    """A preflight that probes says how long the command took, its cluster's start and
    teardown included (``command_s``), beside its rounds' wall time (``wall_s``, what the
    wall budget bounds): docs/formats.md. A backend that takes a second to stop shows it."""
    import time

    from ringwatch.services.cli import commands
    from ringwatch.services.cli.main import build_parser

    made = commands.make_backend

    def slow_to_stop(args, progress):
        backend = made(args, progress)
        stop = backend.close

        def close() -> None:
            time.sleep(1.0)
            stop()

        backend.close = close
        return backend

    monkeypatch.setattr(commands, "make_backend", slow_to_stop)
    args = build_parser().parse_args(["preflight", "--fabric", scenario(
        tmp_path, {"nodes": 4, "gpus_per_node": 2, "seed": 3}), "--json"])
    args.started = outer = time.monotonic()
    assert commands.cmd_preflight(args) == 0
    elapsed = time.monotonic() - outer
    v = json.loads(capsys.readouterr().out)
    assert 0 < v["wall_s"] < v["command_s"] <= elapsed + 0.001
    assert v["command_s"] - v["wall_s"] >= 1.0  # the teardown: the command's, not the rounds'
