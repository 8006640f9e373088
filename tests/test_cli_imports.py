"""Starting the command line imports neither torch nor Ray unless the chosen backend needs
them: the sim, the API client and the offline checks run without either (seconds of import
and hundreds of MB saved on every command). Each check runs in a fresh interpreter, so the
test process's own imports do not count."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

HEAVY = ("torch", "ray")

# Runs the commands in-process, then prints their exit codes and the heavy modules loaded.
_RUN = r"""
import contextlib, io, json, sys
import services.cli.main as m

codes = {}
for argv in json.loads(sys.argv[1]):
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        try:
            codes[" ".join(argv[:1])] = m.main(argv)
        except SystemExit as exc:  # --help
            codes[" ".join(argv[:1])] = exc.code
heavy = sorted({name.split(".")[0] for name in sys.modules} & set(sys.argv[2].split(",")))
print(json.dumps({"codes": codes, "heavy": heavy}))
"""


def run_commands(*argvs: list[str], tmp_path: Path) -> dict:
    env = {**os.environ, "RINGWATCH_TOKEN": "", "RINGWATCH_STATE_DIR": str(tmp_path / "state")}
    r = subprocess.run([sys.executable, "-c", _RUN, json.dumps(argvs), ",".join(HEAVY)],
                       env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_importing_the_cli_loads_neither_torch_nor_ray(tmp_path: Path) -> None:
    assert run_commands(tmp_path=tmp_path) == {"codes": {}, "heavy": []}


def test_sim_and_offline_commands_run_without_torch_or_ray(tmp_path: Path) -> None:
    fabric = tmp_path / "fabric.json"
    fabric.write_text(json.dumps({"nodes": 2, "gpus_per_node": 8, "gpu": "H100-SXM", "seed": 1}))
    hosts = tmp_path / "hosts"
    hosts.write_text("node-a slots=4\nnode-b:4\n")
    got = run_commands(["preflight", "--fabric", str(fabric), "--json"],
                       ["probe", "--fabric", str(fabric), "--ops", "allreduce", "--json"],
                       ["check-rankmap", str(hosts)],
                       ["scheduler", "--help"],
                       tmp_path=tmp_path)
    # Healthy fabric, clean probe, clean table: each command ran to its end.
    assert got == {"codes": {"preflight": 0, "probe": 0, "check-rankmap": 0, "scheduler": 0},
                   "heavy": []}
