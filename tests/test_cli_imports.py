"""Starting the command line imports neither torch nor Ray unless the chosen backend needs
them: the sim, the API client and the offline checks run without either (seconds of import
and hundreds of MB saved on every command). Nor httpx (with rich) unless a command asks the
API, pydantic unless it reads settings a variable set, numpy unless it runs a check. Each
check runs in a fresh interpreter, so the test process's own imports do not count."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

HEAVY = ("torch", "ray")
# What a command that neither asks the API nor reads a set variable leaves unloaded.
CLIENT = ("httpx", "rich", "pydantic", "pydantic_settings")

# Runs the commands in-process, then prints their exit codes and the watched modules loaded.
_RUN = r"""
import contextlib, io, json, sys
import ringwatch.services.cli.main as m

codes = {}
for argv in json.loads(sys.argv[1]):
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        try:
            codes[" ".join(argv[:1])] = m.main(argv)
        except SystemExit as exc:  # --help
            codes[" ".join(argv[:1])] = exc.code
loaded = sorted({name.split(".")[0] for name in sys.modules} & set(sys.argv[2].split(",")))
print(json.dumps({"codes": codes, "loaded": loaded}))
"""


def run_commands(*argvs: list[str], tmp_path: Path, watch: tuple[str, ...] = HEAVY,
                 env: dict[str, str] | None = None) -> dict:
    """Exit codes, and which of ``watch`` the commands loaded."""
    if env is None:
        env = {**os.environ, "RINGWATCH_TOKEN": "", "RINGWATCH_STATE_DIR": str(tmp_path / "state")}
    r = subprocess.run([sys.executable, "-c", _RUN, json.dumps(argvs), ",".join(watch)],
                       env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_importing_the_cli_loads_neither_torch_nor_ray(tmp_path: Path) -> None:
    assert run_commands(tmp_path=tmp_path) == {"codes": {}, "loaded": []}


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
    # Healthy fabric, clean probe, clean table (its host checks skipped, no token): each
    # command ran to its end.
    assert got == {"codes": {"preflight": 0, "probe": 0, "check-rankmap": 3, "scheduler": 0},
                   "loaded": []}


def _no_settings_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.lower().startswith("ringwatch_")}


def _fabric(tmp_path: Path) -> str:
    path = tmp_path / "fabric.json"
    path.write_text(json.dumps({"nodes": 2, "gpus_per_node": 8, "gpu": "H100-SXM", "seed": 1}))
    return str(path)


def test_help_loads_no_client_settings_or_numpy(tmp_path: Path) -> None:
    got = run_commands(["--help"], ["preflight", "--help"], tmp_path=tmp_path,
                       watch=(*HEAVY, *CLIENT, "numpy"))
    assert got == {"codes": {"--help": 0, "preflight": 0}, "loaded": []}


def test_sim_checks_on_default_settings_load_neither_httpx_nor_pydantic(tmp_path: Path) -> None:
    fabric = _fabric(tmp_path)
    got = run_commands(["preflight", "--fabric", fabric, "--json"],
                       ["probe", "--fabric", fabric, "--ops", "allreduce", "--json"],
                       tmp_path=tmp_path, watch=(*HEAVY, *CLIENT), env=_no_settings_env())
    assert got == {"codes": {"preflight": 0, "probe": 0}, "loaded": []}


def test_a_set_variable_still_reaches_a_sim_check(tmp_path: Path) -> None:
    """The check skips Settings only where no RINGWATCH_* variable is set: one that is set,
    in any case, is read and validated as before."""
    fabric = _fabric(tmp_path)
    argv = [sys.executable, "-m", "ringwatch.services.cli.main", "preflight", "--fabric", fabric, "--json"]
    r = subprocess.run(argv, env={**_no_settings_env(), "ringwatch_check_max_rounds": "1"},
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    v = json.loads(r.stdout)
    assert (v["rounds"], v["stopped_by"], v["complete"]) == (1, "rounds (1)", False)
    # A bad setting the check does not read still refuses, as every command that loads Settings does.
    r = subprocess.run(argv, env={**_no_settings_env(), "RINGWATCH_PROBE_INTERVAL_S": "0"},
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "probe_interval_s" in r.stderr and not r.stdout
