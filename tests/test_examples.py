"""The shipped examples work against a running API."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import httpx
import pytest
import yaml

from tests.api_fixtures import fleet_batch
from tests.procs import free_port, start_server, stop_server

ROOT = Path(__file__).resolve().parents[1]
ADMIN = "rw_ex_" + uuid.uuid4().hex


@pytest.fixture
def server(database_url, clean_db, tmp_path):
    env = {**os.environ, "RINGWATCH_DATABASE_URL": database_url,
           "RINGWATCH_API_URL": f"http://127.0.0.1:{free_port()}", "RINGWATCH_TOKEN": ADMIN,
           "RINGWATCH_BOOTSTRAP_ADMIN_TOKEN": ADMIN, "RINGWATCH_STATE_DIR": str(tmp_path),
           # The prolog calls `ringwatch`; run this checkout's CLI with this interpreter.
           "RINGWATCH_BIN": str(tmp_path / "ringwatch")}
    shim = tmp_path / "ringwatch"
    shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m services.cli.main "$@"\n')
    shim.chmod(0o755)
    proc = start_server(env)
    yield env
    stop_server(proc)


def prolog(env: dict[str, str], nodelist: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(ROOT / "examples" / "slurm-prolog.sh")], capture_output=True,
                          text=True, timeout=120, cwd=ROOT,
                          env={**env, "SLURM_JOB_NODELIST": nodelist, "SLURM_JOB_ID": "42",
                               "PATH": os.environ["PATH"]})


def test_slurm_prolog_blocks_an_unhealthy_node_set(server) -> None:
    api, headers = server["RINGWATCH_API_URL"], {"Authorization": f"Bearer {ADMIN}"}
    # A fault that lasts two cycles opens an incident (the default hysteresis) ...
    for _ in range(2):
        httpx.post(f"{api}/v1/measurements", json=fleet_batch(slow_node="node-001"),
                   headers=headers).raise_for_status()
    r = prolog(server, "node-000,node-001,node-002,node-003")
    assert r.returncode == 1, r.stderr
    assert "exclude: node-001" in r.stderr and "job 42" in r.stderr

    # ... and two clean cycles close it.
    for _ in range(2):
        httpx.post(f"{api}/v1/measurements", json=fleet_batch(), headers=headers).raise_for_status()
    r = prolog(server, "node-000,node-001,node-002,node-003")
    assert r.returncode == 0, r.stderr


def test_slurm_prolog_expands_a_compressed_list_without_scontrol_and_leaves_no_file(
        server, tmp_path) -> None:
    api, headers = server["RINGWATCH_API_URL"], {"Authorization": f"Bearer {ADMIN}"}
    for _ in range(2):
        httpx.post(f"{api}/v1/measurements", json=fleet_batch(slow_node="node-002"),
                   headers=headers).raise_for_status()
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    # No scontrol on this PATH (none is installed here): ringwatch expands the list itself.
    r = prolog({**server, "TMPDIR": str(scratch)}, "node-00[0-3]")
    assert r.returncode == 1, r.stderr
    assert "exclude: node-002" in r.stderr
    # The preflight's stderr went to a private file, removed on the way out, as after a
    # preflight that could not answer.
    assert list(scratch.iterdir()) == []
    r = prolog({**server, "TMPDIR": str(scratch),
                "RINGWATCH_API_URL": f"http://127.0.0.1:{free_port()}"}, "node-00[0-3]")
    assert r.returncode == 2 and list(scratch.iterdir()) == []
    assert "/tmp/ringwatch-prolog.$$" not in (ROOT / "examples" / "slurm-prolog.sh").read_text()


def test_slurm_prolog_without_an_answer_fails_closed(server) -> None:
    r = prolog({**server, "RINGWATCH_API_URL": f"http://127.0.0.1:{free_port()}"}, "node-000")
    assert r.returncode == 2 and "could not answer" in r.stderr
    r = prolog({**server, "RINGWATCH_API_URL": f"http://127.0.0.1:{free_port()}",
                "RINGWATCH_FAIL_OPEN": "1"}, "node-000")
    assert r.returncode == 0


def test_k8s_example_gates_the_trainer_on_preflight() -> None:
    pod = yaml.safe_load((ROOT / "examples" / "k8s-init-container.yaml").read_text())
    init = pod["spec"]["initContainers"][0]
    assert init["command"][:2] == ["ringwatch", "preflight"]
    assert {e["name"] for e in init["env"]} >= {"RINGWATCH_API_URL", "RINGWATCH_TOKEN"}
