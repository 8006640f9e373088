"""Every install command the docs print, run as printed in a fresh virtual environment.

No release of ringwatch is on a package index, so each command installs from this
repository: the wheel ``make wheel`` builds (once, in a copy of this working tree), the
checkout itself, or its git URL. After each install, what that role gives works there, named
through the console script (not a package name, which may move); and a missing role's
one-line hint is itself a command that works. The README's webhook registration is posted,
as written, to a real API.

The installs fetch from the package index as a user's would, with ``constraints.txt`` (the
CPU build of torch) standing in for a GPU host's own CUDA torch."""

from __future__ import annotations

import functools
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import threading
import uuid
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from ringwatch.services.notifier.receiver import WebhookReceiver
from ringwatch.services.store import db
from tests.procs import cli, free_port
from tests.test_extras import _extra
from tests.test_serve_local import _env as local_serve_env
from tests.test_serve_local import _serve, _stop

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
REPOSITORY_URL = "<repository URL>"  # the placeholder the docs write for a git URL

# What a role must not bring: the client stays free of torch, Ray and the server's stack.
NOT_CLIENT = {"torch", "ray", "numpy", "fastapi", "sqlalchemy", "psycopg", "pgserver"}


# -- what the docs print ----------------------------------------------------------------


@dataclass(frozen=True)
class Install:
    where: str  # file:line
    command: str  # as printed
    options: tuple[str, ...]  # pip's, as printed (--upgrade)
    target: str  # the requirement as printed: a wheel, ".", or a git URL, with its extras
    source: str  # wheel, checkout or git
    extras: tuple[str, ...]


_SPAN = re.compile(r"`([^`\n]*\bpip install\b[^`\n]*)`")
_EXTRAS = re.compile(r"\[([a-z,]+)\]")


def _printed_commands(path: Path) -> Iterator[tuple[str, str]]:
    """(file:line, command) for each ``pip install`` printed for a reader to type: the lines
    of ``sh`` blocks, the ``$ `` lines of other blocks (the rest of those are output), and
    inline code spans."""
    fence: str | None = None
    for number, line in enumerate(path.read_text().splitlines(), 1):
        where = f"{path.relative_to(ROOT)}:{number}"
        stripped = line.strip()
        if stripped.startswith("```"):
            fence = None if fence is not None else (stripped[3:].strip() or "text")
            continue
        if fence in ("sh", "bash", "shell"):
            candidates = [stripped]
        elif fence is not None:
            candidates = [stripped[2:]] if stripped.startswith("$ ") else []
        else:
            candidates = _SPAN.findall(line)
        for text in candidates:
            if re.search(r"\bpip install\b", text):
                yield where, text


def _pip_arguments(command: str) -> list[str] | None:
    """What follows ``pip install`` in ``command`` (pip as ``pip``, a path's ``bin/pip`` or
    ``python -m pip``); None where pip is not what runs."""
    words = shlex.split(command, comments=True)
    for i, word in enumerate(words[:-1]):
        if words[i + 1] != "install":
            continue
        if word == "pip" or word.endswith("/pip"):  # python -m pip too
            return words[i + 2:]
    return None


def _classify(where: str, command: str) -> Install | None:
    """The ringwatch install ``command`` makes; None for another package's (a Ray version)
    or a fragment naming no package (how the images install their lock files)."""
    args = _pip_arguments(command)
    assert args is not None, f"{where}: cannot read {command!r}"
    options = tuple(a for a in args if a.startswith("-"))
    targets = [a for a in args if not a.startswith("-")]
    for target in targets:
        extras = _EXTRAS.search(target)
        roles = tuple(extras.group(1).split(",")) if extras else ()
        base = _EXTRAS.sub("", target)
        if " @ git+" in target:
            source = "git"
        elif base.endswith(".whl"):
            source = "wheel"
        elif base == ".":
            source = "checkout"
        elif re.fullmatch(r"ringwatch\b.*", base):
            raise AssertionError(f"{where}: {command!r} installs ringwatch by name from a "
                                 "package index, where no release is")
        elif "…" in base:  # prose naming a role's extra ('…[server]'), not a command
            continue
        elif roles:
            raise AssertionError(f"{where}: {command!r}: ringwatch from where? (a wheel, "
                                 "'.' or a git URL; this test runs each)")
        else:
            continue
        assert len(targets) == 1, f"{where}: one ringwatch install per command: {command!r}"
        return Install(where, command, options, target, source, roles)
    return None


def doc_installs() -> list[Install]:
    found = []
    for path in DOCS:
        for where, command in _printed_commands(path):
            install = _classify(where, command)
            if install is not None:
                found.append(install)
    return found


def _by_target() -> dict[str, list[Install]]:
    groups: dict[str, list[Install]] = {}
    for install in doc_installs():
        groups.setdefault(install.target, []).append(install)
    # A plain install first; the same install with --upgrade then goes over it.
    return {t: sorted(g, key=lambda i: len(i.options)) for t, g in sorted(groups.items())}


def test_the_docs_install_every_role_from_the_wheel_and_never_by_bare_name() -> None:
    installs = doc_installs()  # raises on an install by name from an index
    wheel = "dist/ringwatch-0.2.0-py3-none-any.whl"
    version = re.search(r'^version = "(.*)"', (ROOT / "pyproject.toml").read_text(), re.M)
    assert version is not None and wheel == f"dist/ringwatch-{version.group(1)}-py3-none-any.whl"
    by_roles = {i.extras for i in installs if i.source == "wheel" and i.target.startswith(wheel)}
    assert {(), ("agent",), ("agent", "ray"), ("server",), ("demo",)} <= by_roles
    assert {i.source for i in installs} == {"wheel", "checkout", "git"}
    # The Slurm compute node's install is among them, and the README's.
    assert any(i.where.startswith("docs/slurm.md") for i in installs)
    assert any(i.where.startswith("README.md") for i in installs)


def test_a_command_that_is_not_a_ringwatch_install_is_told_apart() -> None:
    assert _classify("x", "pip install 'ray==2.48.0'") is None
    assert _classify("x", "pip install --no-deps --require-hashes") is None
    assert _classify("x", "pip install '…[server]'") is None
    with pytest.raises(AssertionError, match="from where"):
        _classify("x", "pip install 'rw/[server]'")
    with pytest.raises(AssertionError, match="by name from a package index"):
        _classify("x", "/opt/ringwatch/bin/pip install ringwatch")
    with pytest.raises(AssertionError, match="by name"):
        _classify("x", "python3 -m pip install --upgrade 'ringwatch[server]==0.2.0'")
    found = _classify("x", "/opt/rw/bin/pip install 'dist/ringwatch-0.2.0-py3-none-any.whl"
                           "[agent,ray]'  # a comment")
    assert found is not None and found.source == "wheel" and found.extras == ("agent", "ray")


# -- a copy of this working tree, its wheel built by make wheel --------------------------


def _working_tree_files() -> list[str]:
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            cwd=ROOT, capture_output=True, text=True, check=True).stdout
    # Files, and the links of ringwatch/ to the top-level folders (kept as links).
    return [n for n in listed.split("\0") if n and ((ROOT / n).is_file() or (ROOT / n).is_symlink())]


def _clean_env(**extra: str) -> dict[str, str]:
    """An environment that leaks neither this test's virtual environment nor its settings,
    with constraints.txt standing for a GPU host's own torch."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("RINGWATCH_", "PIP_CONSTRAINT", "PYTHON", "MAKE", "MFLAGS"))
           and k not in ("VIRTUAL_ENV", "CONDA_PREFIX")}
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep)
                                  if not p.startswith(str(ROOT / ".venv")))
    return {**env, "PIP_CONSTRAINT": str(ROOT / "constraints.txt"),
            "PIP_DISABLE_PIP_VERSION_CHECK": "1", **extra}


@pytest.fixture(scope="module")
def checkout(tmp_path_factory) -> Path:
    """This working tree, copied, made a git repository (the git URL's), with its wheel
    built by ``make wheel``, a stale module planted in build/ first."""
    tree = tmp_path_factory.mktemp("checkout") / "ringwatch"
    for name in _working_tree_files():
        (tree / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, tree / name, follow_symlinks=False)
    git = ["git", "-c", "user.name=test", "-c", "user.email=test@example.org", "-c",
           "init.defaultBranch=main", "-c", "commit.gpgsign=false"]
    for argv in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "this working tree"],
                 ["update-server-info"]):  # served over git's plain HTTP (served_over_http)
        subprocess.run([*git, *argv], cwd=tree, check=True, capture_output=True)
    stale = tree / "build" / "lib" / "ringwatch" / "services" / "stale_module_of_an_earlier_build.py"
    stale.parent.mkdir(parents=True)
    stale.write_text("gone = True\n")
    # Under `make test` the outer make's MAKELEVEL would have this one print its directory.
    made = subprocess.run(["make", "--no-print-directory", "wheel"], cwd=tree, env=_clean_env(),
                          capture_output=True,
                          text=True, timeout=600)
    assert made.returncode == 0, made.stdout + made.stderr
    assert made.stdout.strip().endswith("dist/ringwatch-0.2.0-py3-none-any.whl"), made.stdout
    return tree


@pytest.mark.slow
def test_make_wheel_builds_one_wheel_of_this_tree_and_nothing_an_earlier_build_left(
        checkout) -> None:
    (wheel,) = (checkout / "dist").glob("ringwatch-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert not [n for n in names if "stale_module_of_an_earlier_build" in n]
    assert any(n.endswith("services/cli/main.py") for n in names)
    assert any(n.endswith("entry_points.txt") for n in names)


@dataclass
class Venv:
    path: Path

    @property
    def python(self) -> str:
        return str(self.path / "bin" / "python")

    def run(self, *argv: str, cwd: Path, env: dict[str, str] | None = None,
            timeout: float = 600) -> subprocess.CompletedProcess:
        return subprocess.run(argv, cwd=cwd, env=env or _clean_env(), capture_output=True,
                              text=True, timeout=timeout)

    def ringwatch(self, *args: str, cwd: Path, **env: str) -> subprocess.CompletedProcess:
        return self.run(str(self.path / "bin" / "ringwatch"), *args, cwd=cwd,
                        env=_clean_env(**env), timeout=300)

    def distributions(self) -> set[str]:
        r = self.run(self.python, "-c", "import importlib.metadata as m, json; print(json.dumps("
                     "[d.metadata['Name'] for d in m.distributions()]))", cwd=self.path)
        return {_dist(n) for n in json.loads(r.stdout)}


def _dist(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def fresh_venv(where: Path) -> Venv:
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(where)], check=True,
                   env=_clean_env(), timeout=300)
    return Venv(where)


@contextmanager
def served_over_http(checkout: Path) -> Iterator[str]:
    """The checkout's git repository at an http:// URL, as a git server would give it (a
    file:// URL has no host, which the pip of a fresh Python 3.11 refuses in a requirement)."""
    handler = functools.partial(_QuietFiles, directory=str(checkout))
    with ThreadingHTTPServer(("127.0.0.1", 0), handler) as server:
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        try:
            yield f"http://127.0.0.1:{server.server_address[1]}/.git"
        finally:
            server.shutdown()
            thread.join()


class _QuietFiles(SimpleHTTPRequestHandler):
    def log_message(self, *args: object) -> None:
        pass


def _as_run_in(install: Install, venv: Venv, repository_url: str) -> list[str]:
    """The printed command with its pip the environment's, and the repository URL one that
    serves this checkout."""
    args = _pip_arguments(install.command)
    assert args is not None
    args = [a.replace(REPOSITORY_URL, repository_url) for a in args]
    return [venv.python, "-m", "pip", "install", *args]


def _role_works(venv: Venv, extras: tuple[str, ...], checkout: Path, tmp_path: Path,
                admin_url: str) -> None:
    """Each role the install names does its first thing; the plain install stays a client."""
    unfolded = set(extras)
    for extra in extras:
        if extra in ("demo", "all"):
            unfolded |= {"agent", "ray", "server"}
    installed = venv.distributions()
    assert "ringwatch" in installed
    for extra in unfolded:
        assert {_dist(d) for d in _extra(extra)} <= installed, (extra, installed)
    if not unfolded:
        assert not NOT_CLIENT & installed, NOT_CLIENT & installed

    r = venv.ringwatch("--version", cwd=tmp_path)
    assert r.returncode == 0 and r.stdout.strip() == "ringwatch 0.2.0", r.stdout + r.stderr
    r = venv.ringwatch("--help", cwd=tmp_path)
    assert r.returncode == 0 and "preflight" in r.stdout, r.stderr

    # The client: a prolog's preflight to an API that is not there is an answer, exit 2.
    r = venv.ringwatch("preflight", "--api", "http://127.0.0.1:9", "--nodes", "node-[000-001]",
                       cwd=tmp_path, RINGWATCH_TOKEN="rw_x")
    assert r.returncode == 2 and "127.0.0.1:9" in r.stderr, r.stderr
    assert "is not installed" not in r.stderr
    if "agent" in unfolded:
        probe = "probe" if "ray" in unfolded else "preflight"
        r = venv.ringwatch(probe, "--fabric", str(checkout / "examples" / "scenario.json"),
                           "--json", cwd=tmp_path)
        assert r.returncode in (0, 1), r.stderr[-2000:]
        assert json.loads(r.stdout), r.stdout[:500]  # the scenario's faults, found
    if "ray" in unfolded:
        assert venv.run(venv.python, "-c", "import ray", cwd=tmp_path).returncode == 0
    if "server" in unfolded:
        # The migrations the install carries, applied to a database of its own.
        name = f"rw_install_{uuid.uuid4().hex[:12]}"
        url = db.create_database(admin_url, name)
        try:
            r = venv.ringwatch("db", "upgrade", cwd=tmp_path, RINGWATCH_DATABASE_URL=url)
            assert r.returncode == 0, r.stderr[-2000:]
        finally:
            db.drop_database(admin_url, name)
    if "demo" in unfolded:
        assert venv.run(venv.python, "-c", "import pgserver", cwd=tmp_path).returncode == 0


@pytest.mark.slow
@pytest.mark.parametrize("target", list(_by_target()))
def test_each_install_the_docs_print_works_in_a_fresh_environment(
        target: str, checkout: Path, tmp_path: Path, admin_url: str) -> None:
    installs = _by_target()[target]
    venv = fresh_venv(tmp_path / "venv")
    with served_over_http(checkout) as repository_url:
        for install in installs:  # the plain install, then (where printed) its --upgrade
            r = venv.run(*_as_run_in(install, venv, repository_url), cwd=checkout)
            assert r.returncode == 0, f"{install.where}: {install.command}\n{r.stderr[-3000:]}"
    _role_works(venv, installs[0].extras, checkout, tmp_path, admin_url)


@pytest.mark.slow
def test_a_missing_roles_hint_is_a_command_that_works(checkout: Path, tmp_path: Path) -> None:
    """A client installed from the wheel, asked to serve: the one line names this
    environment's pip and the wheel it came from, and running it makes serve's imports."""
    venv = fresh_venv(tmp_path / "venv")
    (wheel,) = (checkout / "dist").glob("ringwatch-*.whl")
    r = venv.run(venv.python, "-m", "pip", "install", f"dist/{wheel.name}", cwd=checkout)
    assert r.returncode == 0, r.stderr[-3000:]

    closed = "postgresql://nobody@127.0.0.1:9/x"
    r = venv.ringwatch("db", "upgrade", cwd=tmp_path, RINGWATCH_DATABASE_URL=closed)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    hint = r.stderr.split(" is not installed: ", 1)[1].strip()
    assert shlex.split(hint) == [venv.python, "-m", "pip", "install", f"{wheel}[server]"]

    r = venv.run(*shlex.split(hint), cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    r = venv.ringwatch("db", "upgrade", cwd=tmp_path, RINGWATCH_DATABASE_URL=closed)
    # Past its imports: to the database, which is not there.
    assert r.returncode == 2 and "is not installed" not in r.stderr, r.stderr
    assert '"127.0.0.1", port 9' in r.stderr, r.stderr


# -- the README's webhook, as written ------------------------------------------------------


def _readme_webhook_command() -> str:
    """The README's ``curl`` that registers a webhook, its continuation lines joined."""
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```sh\n(.*?)```", text, re.S)
    (block,) = [b for b in blocks if "curl" in b and "/v1/webhooks" in b]
    return block.replace("\\\n", " ").strip()


def test_the_readme_webhook_example_registers_and_delivers_as_written(tmp_path) -> None:
    """`ringwatch serve` as the README starts it (the embedded database), the README's curl
    as printed, on the port serve listens on and the receiver's: 201, and the deliveries
    verify with the README's secret."""
    command = _readme_webhook_command()
    body = json.loads(re.search(r"-d '(\{.*?\})'", command).group(1))  # type: ignore[union-attr]
    assert body["url"] == "http://127.0.0.1:9000/hook" and "http://127.0.0.1:8420" in command

    env = local_serve_env(tmp_path / "state")
    admin = env["RINGWATCH_BOOTSTRAP_ADMIN_TOKEN"]
    try:
        with WebhookReceiver(body["secret"]) as rx:
            proc, api = _serve(env, free_port())
            try:
                run = command.replace("http://127.0.0.1:8420", api).replace(body["url"], rx.url)
                r = subprocess.run(["bash", "-c", f"{run} -sS -w '\\n%{{http_code}}'"],
                                   env={**os.environ, "ADMIN": admin}, capture_output=True,
                                   text=True, timeout=60)
                answer, status = r.stdout.rsplit("\n", 1)
                assert status == "201", answer
                created = json.loads(answer)
                assert created["events"] == body["events"] and "secret" not in created
                sent = httpx.post(f"{api}/v1/webhooks/{created['id']}/test", timeout=30,
                                  headers={"Authorization": f"Bearer {admin}"})
                assert sent.status_code < 300, sent.text
                (event,) = rx.wait_for(1, timeout_s=120)
            finally:
                _stop(proc)
    finally:
        # serve started the embedded Postgres under the test's own state folder: stopped
        # here, as `ringwatch db stop` stops it, or it outlives the test.
        cli("db", "stop", env=env)
    assert event["event"] == "webhook.test" and event["verified"]
