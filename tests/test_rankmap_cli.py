"""``ringwatch check-rankmap``: offline with no API, and the full check through the real server."""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path

import httpx
import pytest

from tests.api_fixtures import fleet_batch
from tests.procs import cli, free_port, start_server, stop_server

ADMIN = "rw_admin_" + uuid.uuid4().hex


@pytest.fixture
def offline(tmp_path: Path) -> dict[str, str]:
    """An environment whose RINGWATCH_API_URL has nothing listening."""
    return {**os.environ, "RINGWATCH_API_URL": f"http://127.0.0.1:{free_port()}",
            "RINGWATCH_TOKEN": "unused", "RINGWATCH_STATE_DIR": str(tmp_path / "state")}


def write(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_sound_hostfile_offline_is_exit_3_never_ok_and_says_what_it_skipped(offline,
                                                                            tmp_path) -> None:
    hosts = write(tmp_path, "hosts", "node-a slots=4\nnode-b:4\n")
    r = cli("check-rankmap", hosts, env=offline)
    assert r.returncode == 3, r.stderr
    assert r.stdout.startswith("host checks skipped: no API: 8 rank(s) on 2 host(s)")
    assert "OK" not in r.stdout
    assert r.stdout.splitlines()[-1] == (
        "host checks skipped: no API, not run: unknown_host, unhealthy_host")
    assert "skipped the host checks" in r.stderr and "unhealthy_host" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    # No token at all: the API is not asked, and the answer is the same.
    r = cli("check-rankmap", hosts, env={**offline, "RINGWATCH_TOKEN": ""})
    assert r.returncode == 3 and "RINGWATCH_TOKEN is not set" in r.stderr
    assert r.stdout.startswith("host checks skipped: no API:")
    # JSON says the same in its fields: ok (nothing found), with the checks it skipped.
    r = cli("check-rankmap", hosts, "--json", env=offline)
    out = json.loads(r.stdout)
    assert r.returncode == 3 and out["ok"] is True
    assert out["skipped"] == ["unknown_host", "unhealthy_host"]


def test_problems_offline_are_exit_1_with_json(offline, tmp_path) -> None:
    ranks = [{"rank": r, "host": f"node-{'ab'[r % 2]}", "local_rank": r // 2} for r in range(4)]
    r = cli("check-rankmap", write(tmp_path, "ranks.json", json.dumps({"ranks": ranks})), "--json",
            env=offline)
    assert r.returncode == 1, r.stderr  # problems outrank the skipped checks
    out = json.loads(r.stdout)
    assert out["ok"] is False and out["skipped"] == ["unknown_host", "unhealthy_host"]
    (f,) = out["findings"]
    assert f["problem"] == "non_contiguous" and f["crossings"] == 4 and f["minimum_crossings"] == 2
    assert [e["host"] for e in f["suggested_order"]] == ["node-a", "node-a", "node-b", "node-b"]

    r = cli("check-rankmap", write(tmp_path, "dup", "node-a\nnode-a:0\n"), env=offline)
    assert r.returncode == 2 and "line 2" in r.stderr


@pytest.mark.parametrize("text", ["[{\"rank\": 0}]", "{oops", "node-a slots=x\n", "\n# none\n"])
def test_bad_files_are_exit_2_with_one_line(offline, tmp_path, text) -> None:
    r = cli("check-rankmap", write(tmp_path, "bad", text), env=offline)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert len(r.stderr.strip().splitlines()) == 1 and r.stderr.startswith("ringwatch check-rankmap:")
    assert r.stdout == ""


def test_unreadable_file_is_exit_2(offline, tmp_path) -> None:
    r = cli("check-rankmap", str(tmp_path / "missing.json"), env=offline)
    assert r.returncode == 2 and "cannot read" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


@pytest.fixture
def server(database_url: str, clean_db, tmp_path: Path):
    env = {**os.environ, "RINGWATCH_DATABASE_URL": database_url,
           "RINGWATCH_API_URL": f"http://127.0.0.1:{free_port()}", "RINGWATCH_TOKEN": ADMIN,
           "RINGWATCH_BOOTSTRAP_ADMIN_TOKEN": ADMIN, "RINGWATCH_STATE_DIR": str(tmp_path / "state")}
    proc = start_server(env)
    yield env
    stop_server(proc)


def test_full_check_through_the_api(server, tmp_path) -> None:
    batch = fleet_batch()
    batch["findings"] = [{"kind": "hang", "node": "node-003", "gpu": 0}]
    httpx.post(f"{server['RINGWATCH_API_URL']}/v1/measurements", json=batch,
               headers={"Authorization": f"Bearer {ADMIN}"}).raise_for_status()

    r = cli("check-rankmap", write(tmp_path, "good", "node-000:2\nnode-001:2\n"), env=server)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("OK") and "skipped" not in r.stdout + r.stderr

    r = cli("check-rankmap", write(tmp_path, "bad", "node-000:2\nnode-003:2\nnode-099:2\n"),
            "--json", env=server)
    assert r.returncode == 1, r.stderr
    out = json.loads(r.stdout)
    assert out["skipped"] == [] and r.stderr == ""
    found = {f["problem"]: f for f in out["findings"]}
    assert set(found) == {"unknown_host", "unhealthy_host"}
    assert found["unknown_host"]["node"] == "node-099"
    assert found["unhealthy_host"]["node"] == "node-003"
    assert found["unhealthy_host"]["because"]["kind"] == "hang"

    wrong_token = {**server, "RINGWATCH_TOKEN": "nope"}
    r = cli("check-rankmap", write(tmp_path, "any", "node-000\n"), env=wrong_token)
    assert r.returncode == 2 and "401" in r.stderr
