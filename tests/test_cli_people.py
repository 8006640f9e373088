"""The CLI for people: `ringwatch status`, shell completion, and progress that redraws on a
terminal while logs keep plain lines."""

from __future__ import annotations

import json
import os
import pty
import re
import subprocess
import sys
import uuid
from pathlib import Path

import httpx
import pytest

from tests.api_fixtures import fleet_batch
from tests.procs import cli, running_api

ADMIN = "rw_people_" + uuid.uuid4().hex
ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


@pytest.fixture
def server(database_url, clean_db, tmp_path):
    with running_api(database_url, tmp_path, ADMIN) as env:
        yield env


def on_a_terminal(args: list[str], env: dict[str, str], timeout: float = 120) -> tuple[int, str]:
    """Run the CLI with standard output and error on a pseudo-terminal; (exit code, what the
    terminal showed)."""
    master, slave = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "ringwatch.services.cli.main", *args], env=env,
                            stdout=slave, stderr=slave, stdin=subprocess.DEVNULL)
    os.close(slave)
    shown = b""
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        shown += chunk
    os.close(master)
    return proc.wait(timeout=timeout), shown.decode(errors="replace")


def _degraded_fleet(env: dict[str, str]) -> None:
    for _ in range(2):  # two slow cycles open an incident (the default hysteresis)
        httpx.post(f"{env['RINGWATCH_API_URL']}/v1/measurements",
                   json=fleet_batch(slow_node="node-001"),
                   headers={"Authorization": f"Bearer {ADMIN}"}).raise_for_status()


def test_status_summarizes_the_fleet_as_plain_text_off_a_terminal(server) -> None:
    _degraded_fleet(server)
    r = cli("status", env=server)
    assert r.returncode == 1, r.stderr  # degraded
    assert not ANSI.search(r.stdout)
    lines = r.stdout.splitlines()
    assert re.match(r"status\s+DEGRADED$", lines[0])
    assert re.search(r"^nodes\s+4$", r.stdout, re.M)
    assert re.search(r"^incidents\s+1 open$", r.stdout, re.M)
    assert re.search(r"^last cycle\s+\d+ s ago$", r.stdout, re.M)
    header = next(i for i, x in enumerate(lines) if x.startswith("ID"))
    row = lines[header + 1]
    as_json = json.loads(cli("status", "--json", env=server).stdout)
    assert as_json["status"] == "degraded" and as_json["open_incidents"] == 1
    assert as_json["incidents"][0]["nodes"] == ["node-001"]
    # The incident's headline, as /v1/findings gives it: its op, size and figures.
    headline = as_json["incidents"][0]["detail"]["headline"]
    assert "node-001" in row and "critical" in row and row.endswith(headline["text"])
    assert headline["text"].startswith(f"{headline['op']} 1 MiB: ")


def test_status_on_a_terminal_draws_tables_in_colour(server) -> None:
    _degraded_fleet(server)
    code, shown = on_a_terminal(["status"], server)
    assert code == 1
    assert ANSI.search(shown), shown
    plain = ANSI.sub("", shown)
    assert "DEGRADED" in plain and "open incidents (1)" in plain and "node-001" in plain


def test_status_without_a_token_or_api_says_so_in_one_line(server) -> None:
    r = cli("status", env={**server, "RINGWATCH_TOKEN": ""})
    assert r.returncode == 2 and "RINGWATCH_TOKEN is not set" in r.stderr
    r = cli("status", env={**server, "RINGWATCH_TOKEN": "rw_wrong"})
    assert r.returncode == 2 and "refused the token" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def _complete(script: str, line: str) -> list[str]:
    """What bash offers for ``line`` (the cursor at its end) with the completion loaded."""
    words = line.split(" ")
    probe = (f'{script}\nCOMP_WORDS=({" ".join(repr(w) for w in words)})\n'
             f'COMP_CWORD={len(words) - 1}\n_ringwatch\nprintf "%s\\n" "${{COMPREPLY[@]}}"\n')
    out = subprocess.run(["bash", "-c", probe], capture_output=True, text=True, check=True)
    return sorted(x for x in out.stdout.splitlines() if x)


def test_bash_completion_offers_the_commands_and_flags_the_cli_takes(tmp_path: Path) -> None:
    script = subprocess.run([sys.executable, "-m", "ringwatch.services.cli.main", "completion", "bash"],
                            capture_output=True, text=True, check=True).stdout
    assert _complete(script, "ringwatch pre") == ["preflight"]
    assert _complete(script, "ringwatch st") == ["status"]
    assert _complete(script, "ringwatch db ") == ["--help", "downgrade", "maintain", "stop",
                                                  "upgrade", "wait"]
    assert "--version" in _complete(script, "ringwatch --")
    assert _complete(script, "ringwatch preflight --pro") == ["--profile"]
    assert _complete(script, "ringwatch preflight --profile ") == ["ddp", "fsdp", "moe",
                                                                   "pipeline"]
    assert _complete(script, "ringwatch probe --fabric x.json --ba") == ["--backend"]
    assert "--tp" in _complete(script, "ringwatch scheduler --")
    zsh = subprocess.run([sys.executable, "-m", "ringwatch.services.cli.main", "completion", "zsh"],
                         capture_output=True, text=True, check=True).stdout
    assert zsh.startswith("autoload -U +X bashcompinit") and script in zsh


def _parsers(parser, path: tuple[str, ...] = ("ringwatch",)):
    """Every parser of the command line, by its command path."""
    import argparse

    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _parsers(sub, (*path, name))


def test_no_help_text_holds_markup() -> None:
    """Help is read on a terminal: no reST backticks or literal-block colons in any
    command's --help (the top level's came from the module docstring)."""
    from ringwatch.services.cli.main import build_parser

    helps = {" ".join(path): p.format_help() for path, p in _parsers(build_parser())}
    assert len(helps) > 30 and {"ringwatch db wait", "ringwatch slurm prolog"} <= set(helps)
    marked = {path: [line for line in text.splitlines() if "`" in line or "::" in line]
              for path, text in helps.items()}
    assert {path: lines for path, lines in marked.items() if lines} == {}
    top = subprocess.run([sys.executable, "-m", "ringwatch.services.cli.main", "--help"],
                         capture_output=True, text=True, check=True).stdout
    assert "ringwatch: the command line. Launches the processes" in top


def test_progress_redraws_one_line_on_a_terminal_and_keeps_lines_in_a_log(tmp_path) -> None:
    scenario = tmp_path / "fabric.json"
    scenario.write_text(json.dumps({"nodes": 16, "gpus_per_node": 8, "seed": 1, "faults": [
        {"kind": "nic", "node": "node-004", "factor": 0.4}]}))
    env = {**os.environ, "RINGWATCH_STATE_DIR": str(tmp_path)}
    code, shown = on_a_terminal(["preflight", "--fabric", str(scenario)], env)
    assert code == 1
    redraws = shown.count("\r\x1b[K")
    rounds = re.findall(r"preflight round (\d+)", shown)
    assert redraws >= 2 and redraws == len(rounds)
    assert re.search(r"\[\s*\d+\.\d s\] preflight round", shown)
    # The verdict starts on a line of its own, after the live line.
    assert re.search(r"preflight round \d+[^\n]*\r?\n", shown)
    log = cli("preflight", "--fabric", str(scenario), env=env)
    assert "\r" not in log.stderr and "\x1b[" not in log.stderr
    assert len(re.findall(r"^  \.\. preflight round \d+", log.stderr, re.M)) == len(rounds)
