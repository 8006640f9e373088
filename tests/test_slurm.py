"""The Slurm gate (services/cli/slurm.py, examples/slurm-prolog.sh, examples/nhc/).

First the rules that need no Slurm: the env file's mode, Retry-After within the bound, the
reason text. Then against a real Slurm started here as root (Debian's slurm-wlm and munge:
munged, slurmctld and two slurmd in the foreground, everything under the test's temp dir)
and a real API process: the shipped prolog drains the node ringwatch excludes with its
reason and the job does not run there; a healthy node runs it; with the API down the job
runs and the prolog says why; `ringwatch slurm resume` returns ringwatch's node once it is
healthy and leaves a node drained for another reason alone. Skipped, with the reason, where
the daemons are missing or cannot start."""

from __future__ import annotations

import ctypes
import email.utils
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from ringwatch.services.cli import slurm
from ringwatch.services.cli.errors import CliError
from tests.api_fixtures import fleet_batch
from tests.procs import api_env, cli, free_port, start_server, stop_server
from tests.test_extras import NOT_CLIENT
from tests.test_extras import ringwatch as client_only

ROOT = Path(__file__).resolve().parents[1]
ADMIN = "rw_slurm_" + uuid.uuid4().hex
NODES = ("node-000", "node-001")


def write_env_file(path: Path, values: dict[str, str], mode: int = 0o600) -> Path:
    path.write_text("".join(f"{k}={v}\n" for k, v in values.items()))
    path.chmod(mode)
    return path


# ---- the env file ---------------------------------------------------------------------------


def test_an_env_file_others_may_read_is_refused_and_the_environment_overrides_it(tmp_path) -> None:
    path = write_env_file(tmp_path / "prolog.env", {"RINGWATCH_API_URL": "http://rw.test:8420",
                                                    "RINGWATCH_TOKEN": "from-the-file"}, 0o644)
    with pytest.raises(CliError, match=r"mode 0644: it holds a token.*chmod 600"):
        slurm.load_config(str(path), {})
    path.chmod(0o640)
    with pytest.raises(CliError, match=r"mode 0640"):
        slurm.load_config(str(path), {})
    path.chmod(0o600)
    config = slurm.load_config(str(path), {})
    assert (config.api_url, config.token, config.fail_closed) == ("http://rw.test:8420",
                                                                  "from-the-file", False)
    over = slurm.load_config(str(path), {"RINGWATCH_TOKEN": "from-the-env",
                                         "RINGWATCH_SLURM_ON_ERROR": "closed"})
    assert (over.api_url, over.token, over.fail_closed) == ("http://rw.test:8420",
                                                            "from-the-env", True)


def test_a_mistyped_or_missing_setting_is_named(tmp_path) -> None:
    path = write_env_file(tmp_path / "prolog.env", {"RINGWATCH_API_URL": "http://rw.test",
                                                    "RINGWATCH_TOKEN": "t",
                                                    "RINGWATCH_SLURM_ONERROR": "closed"})
    with pytest.raises(CliError, match=r"prolog.env:3: unknown setting RINGWATCH_SLURM_ONERROR"):
        slurm.load_config(str(path), {})
    with pytest.raises(CliError, match=r"RINGWATCH_TOKEN is not set"):
        slurm.load_config(str(tmp_path / "absent.env"), {"RINGWATCH_API_URL": "http://rw.test"})
    with pytest.raises(CliError, match=r"RINGWATCH_SLURM_BOUND_S must be between"):
        slurm.load_config(str(tmp_path / "absent.env"), {"RINGWATCH_API_URL": "http://rw.test",
                                                         "RINGWATCH_TOKEN": "t",
                                                         "RINGWATCH_SLURM_BOUND_S": "-1"})


# ---- Retry-After within the bound -------------------------------------------------------------


class Clock:
    """Monotonic time that moves only when the code under test sleeps."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


DONE = {"id": "r1", "status": "done", "healthy": True, "exclude": [], "findings": []}


def answers(*responses: httpx.Response) -> tuple[httpx.MockTransport, list[httpx.Request]]:
    seen: list[httpx.Request] = []
    queue = list(responses)

    def handle(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return queue.pop(0)

    return httpx.MockTransport(handle), seen


CONFIG = slurm.GateConfig(api_url="http://rw.test", token="t", bound_s=30.0)


def test_a_429_is_asked_again_after_its_retry_after_when_that_fits_the_bound() -> None:
    clock = Clock()
    transport, seen = answers(
        httpx.Response(429, headers={"Retry-After": "7"}, json={"message": "too many waiting"}),
        httpx.Response(503, headers={"Retry-After": "4"}, json={"message": "busy"}),
        httpx.Response(200, json=DONE))
    got = slurm.ask(CONFIG, "node-001", clock() + 30, transport=transport, sleep=clock.sleep,
                    clock=clock)
    assert got.verdict == DONE and clock.slept == [7.0, 4.0]
    assert [json.loads(r.content)["nodes"] for r in seen] == [["node-001"]] * 3
    assert all(r.headers["authorization"] == "Bearer t" for r in seen)


def test_a_retry_after_past_the_bound_gives_up_at_once() -> None:
    clock = Clock()
    transport, seen = answers(
        httpx.Response(429, headers={"Retry-After": "25"}, json={"message": "too many waiting"}))
    got = slurm.ask(CONFIG, "node-001", clock() + 20, transport=transport, sleep=clock.sleep,
                    clock=clock)
    assert got.verdict is None and clock.slept == [] and len(seen) == 1
    assert "API answered 429: too many waiting" in got.why and "bound of 30 s" in got.why


def test_retry_after_as_a_date_and_refused_connections_back_off_inside_the_bound() -> None:
    now = 1_800_000_000.0
    assert slurm.retry_after_s(email.utils.formatdate(now + 12, usegmt=True), now=now) == 12.0
    assert slurm.retry_after_s(None) == slurm.retry_after_s("soon") == slurm.RETRY_DEFAULT_S

    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    clock = Clock()
    got = slurm.ask(CONFIG, "node-001", clock() + 30, transport=httpx.MockTransport(refuse),
                    sleep=clock.sleep, clock=clock)
    # A few short pauses, not the whole bound: every job start waits them while the API is down.
    assert clock.slept == list(slurm.CONNECT_PAUSES)
    assert got.verdict is None and got.why.endswith(
        f"unreachable (ConnectError), {len(slurm.CONNECT_PAUSES) + 1} tries")
    clock = Clock()
    got = slurm.ask(CONFIG, "node-001", clock() + 2, transport=httpx.MockTransport(refuse),
                    sleep=clock.sleep, clock=clock)
    assert clock.slept == [0.5, 1.0] and "nothing more within the bound" in got.why


def test_an_api_that_accepts_and_never_answers_is_cut_off_at_the_bound() -> None:
    with socket.socket() as listener:  # the kernel accepts; nobody ever reads or answers
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        config = slurm.GateConfig(api_url=f"http://127.0.0.1:{listener.getsockname()[1]}",
                                  token="t", bound_s=1.0)
        got = slurm.ask_within(config, "node-000", time.monotonic() + 1.0)
    assert got.verdict is None
    assert "bound of 1 s" in got.why or "Timeout" in got.why


# ---- the reason ---------------------------------------------------------------------------------


def finding(**fields) -> dict:
    return {"kind": "nvlink_degraded", "severity": "critical", **fields}


def test_the_reason_names_kind_place_and_headline() -> None:
    headline = {"op": "allreduce", "size_bytes": 1 << 28, "busbw_gbs": 122.0,
                "expected_gbs": 238.0, "ratio": 0.51,
                "text": "allreduce 256 MiB: 122 of 238 GB/s (0.51)"}
    verdict = {"exclude": ["node-003"], "findings": [
        finding(kind="net_path_degraded", nodes=["node-001", "node-007"]),
        finding(node="node-003", gpus=[2, 5], measured_gbs=122.0, expected_gbs=238.0,
                headline=headline)]}
    assert slurm.reason_for(verdict, "node-003") == (
        "ringwatch: nvlink_degraded node-003 GPUs 2,5 " + headline["text"])
    assert slurm.reason_for(verdict, "node-001") is None  # a path excludes neither end


def test_without_a_headline_the_reason_gives_the_measured_and_expected_figures() -> None:
    verdict = {"exclude": ["node-004"], "findings": [
        finding(kind="hang", node="node-004", gpu=1),
        finding(kind="nic_degraded", node="node-004", measured_gbs=11.5, expected_gbs=46.0,
                severity="warning")]}
    assert slurm.reason_for(verdict, "node-004") == "ringwatch: hang node-004 GPU 1 (+1 more)"
    verdict["findings"].reverse()
    verdict["findings"][1]["severity"] = "warning"
    assert slurm.reason_for(verdict, "node-004") == (
        "ringwatch: nic_degraded node-004 11.5 of 46 GB/s (+1 more)")


def test_the_reason_is_one_printable_line_of_bounded_length() -> None:
    verdict = {"exclude": ["n1"], "findings": [
        finding(kind="probe_error", node="n1", headline={"text": 'say "boom"\nnext' + "x" * 400})]}
    reason = slurm.reason_for(verdict, "n1")
    assert reason is not None and reason.startswith("ringwatch: probe_error n1 say boom next")
    assert len(reason) == slurm.MAX_REASON and reason.endswith("...")
    assert not any(c in reason for c in "\"'\n")
    assert slurm.no_answer_reason("API at http://x unreachable (ConnectError)") == (
        "ringwatch: no answer: API at http://x unreachable (ConnectError)")


# ---- a real Slurm ----------------------------------------------------------------------------


def _die_with_parent() -> None:
    """In a daemon's child before exec: SIGTERM when the test process dies, however it dies."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


@dataclass
class Slurm:
    """A running test cluster: its slurm.conf, the prolog it runs and its daemons."""

    conf: Path
    prolog_env: Path
    log: Path
    daemons: list[subprocess.Popen] = field(default_factory=list)

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def run(self, *argv: str, timeout: float = 60) -> subprocess.CompletedProcess:
        return subprocess.run(list(argv), env=self.env, capture_output=True, text=True,
                              timeout=timeout)

    def job(self, node: str, marker: Path) -> subprocess.CompletedProcess:
        """srun a job on ``node`` that leaves ``marker`` where it ran."""
        return self.run("srun", "--immediate=30", "-N1", "-w", node, "-J", "rw-test",
                        "touch", str(marker), timeout=90)

    def drained(self) -> dict[str, str]:
        out = self.run("sinfo", "-h", "-N", "-R", "-o", "%N|%E").stdout
        return dict(line.split("|", 1) for line in out.splitlines() if line)

    def states(self) -> dict[str, str]:
        out = self.run("sinfo", "-h", "-N", "-o", "%N %T").stdout
        return dict(line.split() for line in out.splitlines() if line)

    def wait_idle(self, timeout: float = 45) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if set(self.states().values()) == {"idle"} and len(self.states()) == len(NODES):
                return
            time.sleep(0.5)
        raise TimeoutError(f"nodes not idle: {self.states()}")


def _slurm_conf(d: Path, prolog: Path, munge_socket: Path) -> str:
    host = socket.gethostname()
    nodes = "".join(f"NodeName={n} NodeHostname={host} NodeAddr=127.0.0.1 Port={free_port()} "
                    "CPUs=1 State=UNKNOWN\n" for n in NODES)
    return f"""ClusterName=rwtest
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={free_port()}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={munge_socket}
SlurmUser=root
SlurmdUser=root
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool-%n
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd-%n.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
MpiDefault=none
ReturnToService=2
SlurmdParameters=config_overrides
PrologFlags=Alloc
Prolog={prolog}
{nodes}PartitionName=main Nodes=node-[000-001] Default=YES MaxTime=INFINITE State=UP
"""


def _ringwatch_command(d: Path) -> Path:
    """This checkout's ``ringwatch`` with this interpreter, by absolute path as the prolog
    calls it (slurmd gives a prolog no PATH and no environment)."""
    shim = d / "ringwatch"
    shim.write_text(f'#!/bin/sh\nPYTHONPATH="{ROOT}" exec "{sys.executable}" '
                    '-m ringwatch.services.cli.main "$@"\n')
    shim.chmod(0o755)
    return shim


def _prolog(d: Path, env_file: Path) -> Path:
    """examples/slurm-prolog.sh with its two install paths pointed at this test's."""
    text = (ROOT / "examples" / "slurm-prolog.sh").read_text()
    lines = {"RINGWATCH=/opt/ringwatch/bin/ringwatch": f"RINGWATCH={_ringwatch_command(d)}",
             "ENV_FILE=/etc/ringwatch/prolog.env": f"ENV_FILE={env_file}"}
    for old, new in lines.items():
        assert old in text, f"examples/slurm-prolog.sh no longer sets {old}"
        text = text.replace(old, new)
    path = d / "prolog.sh"
    path.write_text(text)
    path.chmod(0o755)
    return path


def _start(argv: list[str], out: Path, daemons: list[subprocess.Popen]) -> None:
    with open(out, "ab") as f:
        daemons.append(subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent))


def _stop(daemons: list[subprocess.Popen]) -> None:
    for proc in reversed(daemons):  # slurmd first, munged last
        if proc.poll() is None:
            proc.terminate()
    for proc in reversed(daemons):
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _tail(path: Path, lines: int = 8) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[Slurm]:
    missing = [c for c in ("munged", "slurmctld", "slurmd", "srun", "sinfo", "scontrol")
               if shutil.which(c) is None]
    if missing:
        pytest.skip(f"no {', '.join(missing)} (apt-get install slurm-wlm munge)")
    if os.geteuid() != 0:
        pytest.skip("starting slurmd and munged takes root")
    d = tmp_path_factory.mktemp("slurm")
    # munged wants a socket directory every user can reach, which pytest's 0700 dirs are not.
    sockets = Path(tempfile.mkdtemp(prefix="ringwatch-munge-"))
    sockets.chmod(0o755)
    (d / "munge").mkdir(mode=0o700)
    key = d / "munge" / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    env_file = write_env_file(d / "prolog.env", {})
    cluster = Slurm(conf=d / "slurm.conf", prolog_env=env_file, log=d / "prolog.log")
    cluster.conf.write_text(_slurm_conf(d, _prolog(d, env_file), sockets / "munge.socket"))
    try:
        _start(["munged", "-F", f"--key-file={key}", f"--socket={sockets / 'munge.socket'}",
                f"--pid-file={d / 'munge' / 'munged.pid'}", f"--seed-file={d / 'munge' / 'seed'}",
                f"--log-file={d / 'munge' / 'munged.log'}"], d / "munged.out", cluster.daemons)
        _wait_for(lambda: (sockets / "munge.socket").exists(), 15,
                  lambda: f"munged did not start: {_tail(d / 'munged.out')}")
        _start(["slurmctld", "-D", "-i", "-f", str(cluster.conf)], d / "slurmctld.out",
               cluster.daemons)
        for node in NODES:
            _start(["slurmd", "-D", "-N", node, "-f", str(cluster.conf)], d / f"slurmd-{node}.out",
                   cluster.daemons)
        try:
            cluster.wait_idle()
        except TimeoutError as exc:
            logs = "\n".join(_tail(p) for p in sorted(d.glob("slurm*.log")) + sorted(d.glob("*.out")))
            pytest.skip(f"Slurm did not start here ({exc}): {logs}")
        yield cluster
    finally:
        _stop(cluster.daemons)
        shutil.rmtree(sockets, ignore_errors=True)


def _wait_for(ready, timeout: float, why) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if ready():
            return
        time.sleep(0.2)
    pytest.skip(why())


@pytest.fixture
def slurm_cluster(cluster: Slurm) -> Iterator[Slurm]:
    """The cluster with every node back in service and an empty prolog log after the test."""
    yield cluster
    for node in cluster.drained():
        cluster.run("scontrol", "update", f"NodeName={node}", "State=RESUME")
    cluster.log.unlink(missing_ok=True)
    cluster.wait_idle()


@dataclass
class Api:
    url: str
    reader: str

    def post_cycle(self, slow_node: str | None = None) -> None:
        httpx.post(f"{self.url}/v1/measurements", json=fleet_batch(slow_node=slow_node),
                   headers={"Authorization": f"Bearer {ADMIN}"}, timeout=30).raise_for_status()

    def reason(self, node: str) -> str | None:
        r = httpx.post(f"{self.url}/v1/preflight", json={"nodes": [node]}, timeout=30,
                       headers={"Authorization": f"Bearer {self.reader}"})
        r.raise_for_status()
        return slurm.reason_for(r.json(), node)


def _serve(database_url: str, tmp_path: Path, **settings: str) -> tuple[subprocess.Popen, Api]:
    env = {**api_env(database_url, tmp_path, ADMIN), **settings}
    proc = start_server(env)
    token = cli("token", "create", "--role", "reader", env=env)
    assert token.returncode == 0, token.stderr
    return proc, Api(env["RINGWATCH_API_URL"], token.stdout.split()[-1])


@pytest.fixture
def api(database_url, clean_db, tmp_path) -> Iterator[Api]:
    proc, api = _serve(database_url, tmp_path)
    yield api
    stop_server(proc)


# The Slurm tests start daemons through the cluster fixture, which conftest cannot see in a
# test's code: they say so themselves, so that the fast layer leaves them out.
starts_slurm = pytest.mark.slow


def _settings(cluster: Slurm, url: str, token: str, **more: str) -> None:
    write_env_file(cluster.prolog_env, {"RINGWATCH_API_URL": url, "RINGWATCH_TOKEN": token,
                                        "RINGWATCH_SLURM_LOG": str(cluster.log), **more})


@starts_slurm
def test_a_job_does_not_run_on_the_node_ringwatch_excludes_and_runs_on_a_healthy_one(
        slurm_cluster: Slurm, api: Api, tmp_path: Path) -> None:
    _settings(slurm_cluster, api.url, api.reader)
    api.post_cycle(slow_node="node-001")
    expected = api.reason("node-001")
    assert expected is not None and expected.startswith("ringwatch: nvlink_degraded node-001")

    refused = slurm_cluster.job("node-001", tmp_path / "ran-on-node-001")
    assert refused.returncode != 0 and "Prolog failure on node node-001" in refused.stderr
    assert not (tmp_path / "ran-on-node-001").exists()
    print(slurm_cluster.run("sinfo", "-R").stdout, slurm_cluster.run("sinfo", "-R", "-o",
                                                                     "%E|%T|%N").stdout)
    assert slurm_cluster.drained() == {"node-001": expected}
    assert f"drained: {expected}" in slurm_cluster.log.read_text()

    ran = slurm_cluster.job("node-000", tmp_path / "ran-on-node-000")
    assert ran.returncode == 0, ran.stderr
    assert (tmp_path / "ran-on-node-000").exists()
    assert slurm_cluster.drained() == {"node-001": expected}  # node-000 untouched


@starts_slurm
def test_with_the_api_down_the_job_runs_and_the_prolog_says_why(
        slurm_cluster: Slurm, tmp_path: Path) -> None:
    down = f"http://127.0.0.1:{free_port()}"
    _settings(slurm_cluster, down, "rw_reader_token")
    ran = slurm_cluster.job("node-000", tmp_path / "ran")
    assert ran.returncode == 0, ran.stderr
    assert (tmp_path / "ran").exists() and slurm_cluster.drained() == {}
    said = slurm_cluster.log.read_text()
    assert f"on node-000: no answer (API at {down} unreachable (ConnectError)" in said
    assert "the job may start (fail-open)" in said

    # Fail-closed is a setting: then the node is drained, with a reason resume recognises.
    _settings(slurm_cluster, down, "rw_reader_token", RINGWATCH_SLURM_ON_ERROR="closed")
    refused = slurm_cluster.job("node-000", tmp_path / "ran-closed")
    assert refused.returncode != 0 and not (tmp_path / "ran-closed").exists()
    assert list(slurm_cluster.drained()) == ["node-000"]
    assert slurm_cluster.drained()["node-000"].startswith(
        f"ringwatch: no answer: API at {down} unreachable (ConnectError)")


@starts_slurm
def test_resume_returns_ringwatchs_node_once_healthy_and_leaves_another_reason_alone(
        slurm_cluster: Slurm, api: Api, tmp_path: Path) -> None:
    _settings(slurm_cluster, api.url, api.reader)
    api.post_cycle(slow_node="node-001")
    assert slurm_cluster.job("node-001", tmp_path / "ran").returncode != 0
    assert slurm_cluster.run("scontrol", "update", "NodeName=node-000", "State=DRAIN",
                             "Reason=DIMM replaced, burn-in pending").returncode == 0
    drained = slurm_cluster.drained()
    assert drained["node-000"] == "DIMM replaced, burn-in pending"
    assert drained["node-001"].startswith("ringwatch: nvlink_degraded node-001")

    def resume() -> subprocess.CompletedProcess:
        return cli("slurm", "resume", "--env-file", str(slurm_cluster.prolog_env),
                   env={**slurm_cluster.env, "RINGWATCH_TOKEN": ""})

    still = resume()
    assert still.returncode == 1, still.stderr
    assert "node-001: still drained: ringwatch: nvlink_degraded node-001" in still.stderr
    assert slurm_cluster.drained() == drained

    api.post_cycle()  # a clean cycle: ringwatch no longer excludes node-001
    back = resume()
    assert back.returncode == 0, back.stderr
    assert f"node-001: resumed (was: {drained['node-001']})" in back.stderr
    assert "node-000" not in back.stderr
    assert slurm_cluster.drained() == {"node-000": "DIMM replaced, burn-in pending"}
    ran = slurm_cluster.job("node-001", tmp_path / "ran-again")
    assert ran.returncode == 0 and (tmp_path / "ran-again").exists(), ran.stderr


# ---- the real API's refusals, and the NHC module ----------------------------------------------


def test_no_verdict_in_time_and_a_429_past_the_bound_let_the_node_through(
        database_url, clean_db, tmp_path: Path) -> None:
    # One waiting request per token: the second ask is a 429 with Retry-After 30.
    proc, api = _serve(database_url, tmp_path, RINGWATCH_MAX_PENDING_GATE_PREFLIGHTS_PER_TOKEN="1")
    try:
        api.post_cycle()
        time.sleep(0.1)  # results older than --max-age wait for a scheduler; none runs
        env_file = write_env_file(tmp_path / "prolog.env", {
            "RINGWATCH_API_URL": api.url, "RINGWATCH_TOKEN": api.reader,
            "RINGWATCH_SLURM_MAX_AGE_S": "0.05", "RINGWATCH_SLURM_BOUND_S": "3"})
        env = {k: v for k, v in os.environ.items() if not k.startswith("RINGWATCH_")}
        first = cli("slurm", "check", "--node", "node-000", "--env-file", str(env_file), env=env)
        assert first.returncode == 0, first.stderr
        assert "node-000: no answer (no verdict yet (request" in first.stderr
        assert "is a scheduler probing?); nothing more within the bound of 3 s" in first.stderr
        second = cli("slurm", "check", "--node", "node-000", "--env-file", str(env_file), env=env)
        assert second.returncode == 0, second.stderr
        assert ("API answered 429: this token has 1 single-node preflight request(s) waiting"
                in second.stderr)
        closed = cli("slurm", "check", "--node", "node-000", "--env-file", str(env_file),
                     "--on-error", "closed", env=env)
        assert closed.returncode == 1
        assert closed.stdout.startswith("ringwatch: no answer: API answered 429")
    finally:
        stop_server(proc)


def test_the_nhc_check_dies_with_ringwatchs_reason(api: Api, tmp_path: Path) -> None:
    api.post_cycle(slow_node="node-001")
    env_file = write_env_file(tmp_path / "prolog.env", {"RINGWATCH_API_URL": api.url,
                                                        "RINGWATCH_TOKEN": api.reader})
    # NHC's own `die` records the message and marks the check failed; here it only records.
    script = f"""
        die() {{ echo "DIE $1 $2"; return 0; }}
        RINGWATCH_NHC_BIN={_ringwatch_command(tmp_path)}
        RINGWATCH_NHC_ENV_FILE={env_file}
        source {ROOT / "examples" / "nhc" / "ringwatch.nhc"}
        HOSTNAME_S=node-000 check_ringwatch && echo "node-000 passed"
        check_ringwatch node-001 || echo "node-001 failed"
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith("RINGWATCH_")}
    r = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=120, env=env)
    assert r.stdout.splitlines() == ["node-000 passed",
                                     f"DIE 1 check_ringwatch: {api.reason('node-001')}",
                                     "node-001 failed"], r.stderr


def test_the_check_runs_with_nothing_but_the_standard_library_and_httpx(api: Api,
                                                                         tmp_path: Path) -> None:
    api.post_cycle(slow_node="node-001")
    env_file = write_env_file(tmp_path / "prolog.env", {"RINGWATCH_API_URL": api.url,
                                                        "RINGWATCH_TOKEN": api.reader})
    env = {k: v for k, v in os.environ.items() if not k.startswith("RINGWATCH_")}
    blocked = (*NOT_CLIENT, "pydantic", "pydantic_settings", "rich")
    bad = client_only("slurm", "check", "--node", "node-001", "--env-file", str(env_file),
                      env=env, blocked=blocked)
    assert bad.returncode == 1, bad.stderr
    assert bad.stdout.strip() == api.reason("node-001")
    good = client_only("slurm", "check", "--node", "node-000", "--env-file", str(env_file),
                       env=env, blocked=blocked)
    assert (good.returncode, good.stdout) == (0, ""), good.stderr


def test_a_config_error_is_exit_2_with_one_line(tmp_path: Path) -> None:
    env_file = write_env_file(tmp_path / "prolog.env", {"RINGWATCH_API_URL": "http://rw.test",
                                                        "RINGWATCH_TOKEN": "t"}, 0o604)
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("RINGWATCH_")},
           "SLURMD_NODENAME": "node-000"}
    r = cli("slurm", "prolog", "--env-file", str(env_file), env=env)
    assert r.returncode == 2 and r.stderr.count("\n") == 1
    assert r.stderr.startswith(f"ringwatch slurm: {env_file} has mode 0604")


# ---- the epilog: a fresh probe once a job has left the node ------------------------------------


def test_the_epilog_asks_for_a_probe_made_now_and_the_prolog_for_stored_results() -> None:
    clock = Clock()
    transport, seen = answers(httpx.Response(200, json=DONE), httpx.Response(200, json=DONE))
    slurm.ask(CONFIG, "node-001", clock() + 30, max_age_s=slurm.EPILOG_MAX_AGE_S,
              transport=transport, sleep=clock.sleep, clock=clock)
    slurm.ask(CONFIG, "node-001", clock() + 30, transport=transport, sleep=clock.sleep,
              clock=clock)
    bodies = [json.loads(r.content) for r in seen]
    assert bodies == [{"nodes": ["node-001"], "max_age_s": slurm.EPILOG_MAX_AGE_S},
                      {"nodes": ["node-001"], "max_age_s": slurm.MAX_AGE_S}]
    # The API's smallest: more than 0, less than any stored result's age.
    assert 0 < slurm.EPILOG_MAX_AGE_S < 0.01


def _client_env(**more: str) -> dict[str, str]:
    return {**{k: v for k, v in os.environ.items() if not k.startswith(("RINGWATCH_", "SLURM"))},
            **more}


def test_the_epilog_exits_0_and_says_why_whatever_keeps_it_from_asking(tmp_path: Path) -> None:
    bad = write_env_file(tmp_path / "bad.env", {"RINGWATCH_API_URL": "http://rw.test",
                                                "RINGWATCH_TOKEN": "t"}, 0o644)
    r = cli("slurm", "epilog", "--env-file", str(bad), env=_client_env(SLURMD_NODENAME="node-000"))
    assert r.returncode == 0, r.stderr
    assert f"ringwatch slurm epilog: not asked: {bad} has mode 0644" in r.stderr
    assert "the node is left as it is" in r.stderr

    down = f"http://127.0.0.1:{free_port()}"
    log = tmp_path / "epilog.log"
    env_file = write_env_file(tmp_path / "prolog.env", {
        "RINGWATCH_API_URL": down, "RINGWATCH_TOKEN": "t", "RINGWATCH_SLURM_LOG": str(log),
        "RINGWATCH_SLURM_ON_ERROR": "closed"})  # the epilog is fail-open whatever it says
    r = cli("slurm", "epilog", "--env-file", str(env_file), env=_client_env())
    assert r.returncode == 0 and "SLURMD_NODENAME is not set" in r.stderr
    r = cli("slurm", "epilog", "--env-file", str(env_file), "--bound", "2",
            env=_client_env(SLURMD_NODENAME="node-000", SLURM_JOB_ID="41"))
    assert r.returncode == 0, r.stderr
    said = log.read_text()
    assert f"after job 41 on node-000: no answer (API at {down} unreachable (ConnectError)" in said
    assert said.rstrip().endswith("the node is left as it is (fail-open)")


@contextmanager
def answering_scheduler(api: Api, slow_node: str) -> Iterator[list[dict]]:
    """A stand-in for `ringwatch scheduler` (which probes real fabrics): it claims each
    waiting preflight through the real API, ships a cycle in which ``slow_node`` is slow,
    and completes the request, so the API judges what it shipped. Yields the claims."""
    from ringwatch.services.scheduler.api_client import SchedulerApi

    claimed: list[dict] = []
    stop = threading.Event()
    client = SchedulerApi(api.url, ADMIN, "test-scheduler")

    def run() -> None:
        while not stop.is_set():
            request = client.claim_preflight(lease_s=60)
            if request is None:
                stop.wait(0.2)
                continue
            api.post_cycle(slow_node=slow_node)
            client.complete_preflight(request["id"])
            claimed.append(request)

    thread = threading.Thread(target=run, name="test-scheduler", daemon=True)
    thread.start()
    try:
        yield claimed
    finally:
        stop.set()
        thread.join(30)
        client.close()


def _scontrol_recorder(tmp_path: Path) -> tuple[Path, Path]:
    """A folder whose scontrol only records its arguments, one per line (RINGWATCH_SLURM_BIN)."""
    bin_dir, calls = tmp_path / "slurm-bin", tmp_path / "scontrol-calls"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" >> {calls}\n')
    (bin_dir / "scontrol").chmod(0o755)
    return bin_dir, calls


def test_the_epilog_drains_the_node_a_fresh_probe_excludes_and_leaves_a_healthy_one(
        api: Api, tmp_path: Path) -> None:
    api.post_cycle()  # every node healthy and known, results fresh for a prolog
    bin_dir, calls = _scontrol_recorder(tmp_path)
    env_file = write_env_file(tmp_path / "prolog.env", {
        "RINGWATCH_API_URL": api.url, "RINGWATCH_TOKEN": api.reader,
        "RINGWATCH_SLURM_BIN": str(bin_dir), "RINGWATCH_SLURM_LOG": str(tmp_path / "log")})
    with answering_scheduler(api, slow_node="node-001") as claimed:
        bad = cli("slurm", "epilog", "--env-file", str(env_file),
                  env=_client_env(SLURMD_NODENAME="node-001", SLURM_JOB_ID="77"))
        good = cli("slurm", "epilog", "--env-file", str(env_file),
                   env=_client_env(SLURMD_NODENAME="node-000", SLURM_JOB_ID="78"))
    assert (bad.returncode, good.returncode) == (0, 0), bad.stderr + good.stderr
    # Each asked about its own node alone, and only a probe made for it answered.
    assert [(c["nodes"], c["max_age_s"]) for c in claimed] == [
        (["node-001"], slurm.EPILOG_MAX_AGE_S), (["node-000"], slurm.EPILOG_MAX_AGE_S)]
    update, node, state, reason = calls.read_text().splitlines()
    assert (update, node, state) == ("update", "NodeName=node-001", "State=DRAIN")
    assert reason.startswith("Reason=ringwatch: nvlink_degraded node-001")
    assert f"after job 77 on node-001: drained: {reason.removeprefix('Reason=')}" in \
        (tmp_path / "log").read_text()
    assert "node-000" not in (tmp_path / "log").read_text()  # healthy: nothing to say


# ---- against the real Slurm: occupancy, and the epilog slurmd runs ------------------------------


def _sbatch(cluster: Slurm, node: str, seconds: int) -> str:
    r = cluster.run("sbatch", "--parsable", "-w", node, "-o", "/dev/null", "-J", "rw-busy",
                    "--wrap", f"sleep {seconds}")
    assert r.returncode == 0, r.stderr
    return r.stdout.strip().split(";")[0]


def _wait_until(ready, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline:
            raise AssertionError(f"not {what} within {timeout:g} s")
        time.sleep(0.3)


def _lets_jobs_start(cluster: Slurm) -> None:
    """The prolog's env file pointed at no API: fail-open, within 2 s."""
    _settings(cluster, f"http://127.0.0.1:{free_port()}", "rw_reader_token",
              RINGWATCH_SLURM_BOUND_S="2")


def test_slurm_occupancy_names_the_job_on_a_node_and_frees_it_when_the_job_ends(
        slurm_cluster: Slurm) -> None:
    from ringwatch.services.scheduler.occupancy import SlurmOccupancy, read_occupancy

    _lets_jobs_start(slurm_cluster)
    source = SlurmOccupancy(env=slurm_cluster.env)
    ours = ["node-000.cluster.example", "node-001", "node-002"]
    job = _sbatch(slurm_cluster, "node-000", 120)
    _wait_until(lambda: slurm_cluster.states().get("node-000") == "allocated", 60,
                "running job " + job)
    # ringwatch drained node-001 earlier: nothing runs there, so it is idle to the prober.
    assert slurm_cluster.run("scontrol", "update", "NodeName=node-001", "State=DRAIN",
                             "Reason=ringwatch: nvlink_degraded node-001").returncode == 0
    busy = read_occupancy(source, ours, timeout_s=30)
    assert busy.error is None, busy.error
    assert set(busy.busy) == {"node-000.cluster.example", "node-002"}
    held = busy.busy["node-000.cluster.example"]
    assert (held.source, held.job, held.state, held.unknown) == ("slurm", job, "ALLOCATED", False)
    assert busy.busy["node-002"].unknown  # not a Slurm node: it cannot vouch for it

    assert slurm_cluster.run("scancel", job).returncode == 0
    _wait_until(lambda: slurm_cluster.states().get("node-000") == "idle", 60, "idle")
    after = read_occupancy(source, ours, timeout_s=30)
    assert after.error is None and set(after.busy) == {"node-002"}


@pytest.fixture
def epilog_cluster(slurm_cluster: Slurm) -> Iterator[Slurm]:
    """The cluster with `Epilog=` the script docs/slurm.md installs (its two paths this
    test's), for this test only."""
    text = (ROOT / "docs" / "slurm.md").read_text()
    block = next(b for b in text.split("```sh\n") if "slurm epilog --env-file" in b
                 and "<<'EOF'" in b)
    script = block.split("<<'EOF'\n", 1)[1].split("\nEOF\n", 1)[0] + "\n"
    d = slurm_cluster.conf.parent
    for old, new in (("/opt/ringwatch/bin/ringwatch", str(_ringwatch_command(d))),
                     ("/etc/ringwatch/prolog.env", str(slurm_cluster.prolog_env))):
        assert old in script, f"docs/slurm.md's epilog no longer names {old}"
        script = script.replace(old, new)
    epilog = d / "epilog.sh"
    epilog.write_text(script)
    epilog.chmod(0o755)
    conf = slurm_cluster.conf.read_text()

    def reconfigure(text: str) -> None:
        slurm_cluster.conf.write_text(text)
        r = slurm_cluster.run("scontrol", "reconfigure")
        assert r.returncode == 0, r.stderr

    reconfigure(conf + f"Epilog={epilog}\n")
    try:
        shown = slurm_cluster.run("scontrol", "show", "config").stdout
        assert f"{epilog}" in shown, "slurmctld did not take the Epilog= line"
        yield slurm_cluster
    finally:
        reconfigure(conf)


def test_the_epilog_slurmd_runs_drains_the_node_a_fresh_probe_excludes(
        epilog_cluster: Slurm, api: Api, tmp_path: Path) -> None:
    cluster = epilog_cluster
    api.post_cycle()  # both nodes healthy and known: the prolog lets the jobs start
    _settings(cluster, api.url, api.reader)
    with answering_scheduler(api, slow_node="node-001") as claimed:
        ran = cluster.job("node-001", tmp_path / "ran-on-node-001")
        assert ran.returncode == 0 and (tmp_path / "ran-on-node-001").exists(), ran.stderr
        # After the job, the epilog asked, a probe answered, and node-001 is drained.
        _wait_until(lambda: "node-001" in cluster.drained(), 60, "drained by the epilog")
        reason = cluster.drained()["node-001"]
        assert reason.startswith("ringwatch: nvlink_degraded node-001"), reason
        assert re.search(rf"ringwatch slurm epilog: after job \d+ on node-001: drained: "
                         rf"{re.escape(reason)}$", cluster.log.read_text(), re.MULTILINE)

        # node-000 runs a job that ringwatch drains meanwhile (as a prolog elsewhere or an
        # operator would): its end is probed healthy, and the node stays drained (resume's).
        job = _sbatch(cluster, "node-000", 3)
        _wait_until(lambda: cluster.states().get("node-000") == "allocated", 60, "running")
        earlier = "ringwatch: nic_degraded node-000 (an earlier finding)"
        assert cluster.run("scontrol", "update", "NodeName=node-000", "State=DRAIN",
                           f"Reason={earlier}").returncode == 0
        _wait_until(lambda: any(c["nodes"] == ["node-000"] for c in claimed), 60,
                    f"probed after job {job}")
        _wait_until(lambda: cluster.states().get("node-000") == "drained", 60, "done")
    assert [c["nodes"] for c in claimed] == [["node-001"], ["node-000"]]
    assert cluster.drained() == {"node-001": reason, "node-000": earlier}
    assert "node-000" not in cluster.log.read_text()
