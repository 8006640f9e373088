"""What a new user meets in the first hour, following the README: each rough edge found
trying it that way, held by a test."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import httpx
import pytest

from ringwatch.agents.sim import SimBackend
from ringwatch.services.cli.api_process import wait_ready
from ringwatch.services.cli.hostlist import expand_hostlist
from ringwatch.services.store.db import describe_url
from tests.api_fixtures import fleet_batch
from tests.procs import api_env, cli, free_port, start_server, stop_server

ROOT = Path(__file__).resolve().parents[1]
ADMIN = "rw_first_" + uuid.uuid4().hex


@pytest.fixture
def env(database_url: str, clean_db, tmp_path: Path) -> dict[str, str]:
    return api_env(database_url, tmp_path, ADMIN)


def _tracked_text_files() -> list[Path]:
    names = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.split()
    return [ROOT / n for n in names if n.endswith((".py", ".md", ".sh", ".yml", ".yaml", ".toml"))]


# ---- the docs stand on their own ---------------------------------------------------------


def test_no_file_sends_the_reader_to_a_document_the_repository_lacks() -> None:
    # A document of this repository by name (another project's, like nccl-tests'
    # doc/PERFORMANCE.md, comes with its folder).
    named = re.compile(r"(?<![/\w.])((?:docs/)?[A-Za-z_-]+\.md)\b")
    missing = []
    for path in _tracked_text_files():
        text = path.read_text(errors="replace")
        for ref in set(named.findall(text)):
            candidates = [ROOT / ref, ROOT / "docs" / ref, path.parent / ref]
            if not any(c.exists() for c in candidates):
                missing.append(f"{path.relative_to(ROOT)}: {ref}")
    assert not missing, missing


def test_a_scenario_field_that_does_not_exist_is_refused_with_the_fields_that_do() -> None:
    with pytest.raises(ValueError, match=r"unknown scenario field\(s\): node; a scenario has "
                                         r"nodes, gpus_per_node, .*faults"):
        SimBackend({"node": 4})
    with pytest.raises(ValueError, match=r"faults\[0\]: unknown field\(s\) factr for a nic "
                                         r"fault; it takes kind, node, factor, drift, start"):
        SimBackend({"nodes": 4, "faults": [{"kind": "nic", "node": "node-001", "factr": 0.5}]})
    with pytest.raises(ValueError, match=r"unknown field\(s\) gpus for a hang fault"):
        SimBackend({"nodes": 4, "faults": [{"kind": "hang", "node": "node-001", "gpus": [0, 1]}]})
    # Every field the scenario reference documents is one the sim takes.
    SimBackend({"nodes": 4, "gpus_per_node": 2, "gpu": "H100-SXM", "nvlink_gbs": 400,
                "net_gbs": 40, "noise": 0.01, "variation": 0.01, "seed": 1, "faults": [
                    {"kind": "fallback", "node": "node-001", "op": "allreduce", "algo": "tree",
                     "factor": 0.5, "drift": 0.1, "start": 1},
                    {"kind": "error", "node": "node-002", "gpu": 1, "message": "boom"}]})


def _curls(markdown: str) -> list[list[str]]:
    """The curl commands of a document's code blocks, continuation lines joined."""
    out = []
    for block in re.findall(r"```(?:sh|bash)\n(.*?)```", markdown, re.S):
        command = ""
        for line in block.replace("\\\n", " ").splitlines():
            command += line + "\n"
            try:
                argv = shlex.split(command, comments=True)
            except ValueError:  # a quote still open: the command goes on
                continue
            if argv[:1] == ["curl"]:
                out.append(argv)
            command = ""
    return out


def test_every_documented_curl_is_understood_by_the_api(api) -> None:
    """The examples as a reader pastes them (with their tokens set): the body is read as
    JSON, never refused for a missing Content-Type."""
    api.post("/v1/measurements", json=fleet_batch(), headers=api.h["agent"]).raise_for_status()
    tokens = {"$ADMIN": api.h["admin"]["Authorization"].split()[1],
              "$RINGWATCH_TOKEN": api.h["reader"]["Authorization"].split()[1]}
    seen = 0
    for doc in sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]:
        for argv in _curls(doc.read_text()):
            method, headers, body, url = "GET", {}, None, None
            args = iter(argv[1:])
            for a in args:
                if a == "-X":
                    method = next(args)
                elif a == "-H":
                    name, _, value = next(args).partition(":")
                    for var, token in tokens.items():
                        value = value.replace(var, token)
                    headers[name.strip()] = value.strip()
                elif a in ("-d", "--data"):
                    body = next(args)
                elif a.startswith(("$RINGWATCH_API_URL", "http")):
                    # No scheduler runs here: a request that would wait for one, does not.
                    url = re.sub(r"wait=\d+", "wait=0", a.replace("$RINGWATCH_API_URL", ""))
            assert url is not None, argv
            if body is not None and "nodes" in body:
                body = json.dumps({**json.loads(body), "nodes": ["node-000", "node-001"]})
            r = api.request(method, url, content=body, headers=headers)
            seen += 1
            refused = r.status_code == 422 and r.json().get("error") == "invalid_input"
            assert not refused and r.status_code < 500, (doc.name, argv, r.text)
    assert seen >= 3


# ---- the token, where the CLI asks the API --------------------------------------------------


def test_a_missing_token_is_named_not_reported_as_a_broken_header(env, tmp_path) -> None:
    no_token = {**env, "RINGWATCH_TOKEN": ""}
    r = cli("preflight", "--nodes", "node-000", env=no_token)
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1 and "RINGWATCH_TOKEN is not set" in r.stderr
    assert "Illegal header" not in r.stderr and "LocalProtocolError" not in r.stderr
    table = tmp_path / "ranks.json"
    table.write_text(json.dumps([{"rank": 0, "host": "node-000", "local_rank": 0},
                                 {"rank": 1, "host": "node-000", "local_rank": 0}]))
    r = cli("check-rankmap", str(table), env=no_token)
    # The checks that need no API still run (a duplicate local rank), and it says why the
    # host checks did not.
    assert r.returncode == 1, r.stderr
    assert "RINGWATCH_TOKEN is not set" in r.stderr and "skipped the host checks" in r.stderr


# ---- processes say where they are ------------------------------------------------------------


def test_serve_and_db_upgrade_say_where_they_listen_and_which_database(env) -> None:
    r = cli("db", "upgrade", env=env)
    assert r.returncode == 0, r.stderr
    db_name = env["RINGWATCH_DATABASE_URL"].rsplit("/", 1)[1].split("?")[0]
    assert db_name in r.stdout and "migrated" in r.stdout and "head" in r.stdout
    again = cli("db", "upgrade", env=env)
    assert "already at" in again.stdout
    port = env["RINGWATCH_API_URL"].rsplit(":", 1)[1]
    proc = subprocess.Popen([sys.executable, "-m", "ringwatch.services.cli.main", "serve", "--port", port,
                             "--no-notifier"], env=env, stderr=subprocess.PIPE, text=True)
    try:
        wait_ready(proc, env["RINGWATCH_API_URL"])
    finally:
        proc.terminate()
        err = proc.communicate(timeout=30)[1]
    first = err.splitlines()[0]
    assert f":{port}" in first and db_name in first and "notifier off" in first


def test_a_database_url_is_printed_without_its_password() -> None:
    shown = describe_url("postgresql+psycopg://ring:s3cret-pw@db.example:6543/fleet")
    assert shown == "postgresql://ring@db.example:6543/fleet"
    local = describe_url("postgresql+psycopg://postgres@/postgres?host=/srv/state/pg")
    assert local == "postgresql://postgres@/postgres (socket in /srv/state/pg)"


def test_the_openapi_document_declares_the_token_and_types_the_preflight(api) -> None:
    doc = api.get("/openapi.json").json()
    assert doc["components"]["securitySchemes"]["bearer"] == {
        **doc["components"]["securitySchemes"]["bearer"], "type": "http", "scheme": "bearer"}
    assert doc["paths"]["/v1/nodes"]["get"]["security"] == [{"bearer": []}]
    assert "security" not in doc["paths"]["/healthz"]["get"]
    post = doc["paths"]["/v1/preflight"]["post"]
    assert set(post["responses"]) >= {"200", "202", "422"}
    for code in ("200", "202"):
        ref = post["responses"][code]["content"]["application/json"]["schema"]["$ref"]
        assert ref.endswith("/PreflightOut")
    fields = doc["components"]["schemas"]["PreflightOut"]["properties"]
    assert {"healthy", "exclude", "findings", "status", "workload"} <= set(fields)


# ---- the scheduler --------------------------------------------------------------------------


def test_the_scheduler_once_line_reports_what_the_api_found(env, tmp_path) -> None:
    scenario = tmp_path / "fabric.json"
    scenario.write_text(json.dumps({"nodes": 8, "gpus_per_node": 4, "seed": 2, "faults": [
        {"kind": "nic", "node": "node-003", "factor": 0.4},
        {"kind": "hang", "node": "node-005", "gpu": 1}]}))
    proc = start_server(env)
    try:
        r = cli("scheduler", "--fabric", str(scenario), "--once", env=env)
        opened = httpx.get(f"{env['RINGWATCH_API_URL']}/v1/findings", params={"status": "open"},
                           headers={"Authorization": f"Bearer {env['RINGWATCH_TOKEN']}"},
                           timeout=30).json()
    finally:
        stop_server(proc)
    assert r.returncode == 0, r.stderr
    line = next(x for x in r.stderr.splitlines() if "cycle 1:" in x)
    found = re.search(r"API: (\d+) finding\(s\) \(hang 1, nic_degraded 1\)", line)
    assert found and int(found.group(1)) == 2, line
    # The hang opens its incident at once (a slowdown waits for the hysteresis): the line
    # counts it with the slowdowns, as the API's open incidents do.
    assert [x["kind"] for x in opened] == ["hang"], opened
    said = re.search(r"(\d+) incident\(s\) opened", line)
    assert said and int(said.group(1)) == len(opened), line
    duty = re.search(r"duty cycle ([\d.]+)%", line)
    assert duty and float(duty.group(1)) > 0, line


@pytest.mark.ray
def test_sigterm_stops_the_scheduler_without_a_crash_report(env) -> None:
    env = {**env, "RINGWATCH_API_URL": f"http://127.0.0.1:{free_port()}"}  # nothing listens
    proc = subprocess.Popen([sys.executable, "-m", "ringwatch.services.cli.main", "scheduler", "--local",
                             "2", "--gpus-per-node", "1", "--interval", "600"], env=env,
                            stderr=subprocess.PIPE, text=True)
    lines = []
    assert proc.stderr is not None
    # With no API to hold the fleet's lease through, it runs no cycle and says why once.
    for line in proc.stderr:
        lines.append(line)
        if "no cycle runs until it answers" in line:
            break
    proc.send_signal(signal.SIGTERM)
    rest = proc.communicate(timeout=60)[1]
    assert proc.returncode == 0, rest
    assert "SIGTERM received; stopping" in rest and "ringwatch scheduler: stopped" in rest
    assert "SIGTERM received at time" not in rest and "logging.cc" not in rest
    # The API being away was said once, not at every try.
    assert sum("unreachable" in x for x in lines + rest.splitlines()) == 1


def test_an_address_where_nothing_listens_is_refused_with_how_to_start_ray(env) -> None:
    # Ray's own wait runs for minutes: past the 120 s the CLI is given here (a TimeoutExpired).
    r = cli("probe", "--address", f"127.0.0.1:{free_port()}", env=env, timeout=120)
    assert r.returncode == 2 and r.stderr.count("\n") == 1
    assert "nothing answers at --address" in r.stderr and "ray start --head" in r.stderr


def test_auto_pointing_at_a_head_that_is_gone_is_refused_the_same_way(env) -> None:
    gone = f"127.0.0.1:{free_port()}"
    r = cli("probe", "--address", "auto", env={**env, "RAY_ADDRESS": gone}, timeout=120)
    assert r.returncode == 2 and r.stderr.count("\n") == 1
    assert f"nothing answers at --address auto ({gone}, from RAY_ADDRESS)" in r.stderr


def test_an_injected_fault_outside_the_cluster_is_refused_before_it_starts(env) -> None:
    r = cli("probe", "--local", "2", "--inject", '{"kind": "slow", "node": "node-007"}', env=env)
    assert r.returncode == 2 and r.stderr.count("\n") == 1
    assert "--inject names node-007/0, not a rank of this cluster" in r.stderr
    r = cli("probe", "--local", "2", "--gpus-per-node", "2",
            "--inject", '{"kind": "hang", "node": "node-001", "gpu": 2}', env=env)
    assert r.returncode == 2 and "node-001/2" in r.stderr


# ---- the embedded database ------------------------------------------------------------------


def test_db_stop_stops_the_embedded_postgres_and_keeps_its_data(tmp_path) -> None:
    state = tmp_path / "state"
    embedded = {k: v for k, v in os.environ.items() if k != "RINGWATCH_DATABASE_URL"}
    embedded["RINGWATCH_STATE_DIR"] = str(state)
    r = cli("db", "upgrade", env=embedded)
    assert r.returncode == 0, r.stderr
    assert "socket in" in r.stdout and (state / "pg" / "postmaster.pid").exists()
    stopped = cli("db", "stop", env=embedded)
    assert stopped.returncode == 0 and "stopped the embedded Postgres" in stopped.stdout
    assert not (state / "pg" / "postmaster.pid").exists() and (state / "pg" / "PG_VERSION").exists()
    again = cli("db", "stop", env=embedded)
    assert again.returncode == 0 and "no embedded Postgres is running" in again.stdout
    # Started again, the data is there: already migrated.
    r = cli("db", "upgrade", env=embedded)
    assert "already at" in r.stdout
    cli("db", "stop", env=embedded)


def test_make_clean_stops_the_embedded_postgres_before_deleting_it() -> None:
    recipe = (ROOT / "Makefile").read_text().split("\nclean:")[1].split("\n\n")[0]
    stop_at, remove_at = recipe.find("db stop"), recipe.find("rm -rf")
    assert 0 <= stop_at < remove_at, recipe


# ---- the Slurm prolog -----------------------------------------------------------------------


@pytest.mark.parametrize("text, names", [
    ("node[001-003,007]", ["node001", "node002", "node003", "node007"]),
    ("node-00[0-1],gpu[8-10]b,login", ["node-000", "node-001", "gpu8b", "gpu9b", "gpu10b",
                                       "login"]),
    ("rack[1-2]-n[01-02]", ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"]),
    ("a,a,b", ["a", "b"]),
])
def test_slurm_host_lists_expand_as_scontrol_expands_them(text: str, names: list[str]) -> None:
    assert expand_hostlist(text) == names


@pytest.mark.parametrize("text", ["node[1-", "node]1[", "node[3-1]", "node[a-b]", "n[1[2]]"])
def test_a_malformed_host_list_is_refused(text: str) -> None:
    with pytest.raises(ValueError):
        expand_hostlist(text)


def test_the_readme_says_where_the_ringwatch_command_is() -> None:
    """After `make demo`, `ringwatch` is not on PATH: the README's commands say how to get it
    there before they use it."""
    readme = (ROOT / "README.md").read_text()
    using = readme[readme.index("## Using it"):]
    first_command = using.index("ringwatch db upgrade")
    assert ".venv/bin" in using[:first_command] and "PATH" in using[:first_command]
