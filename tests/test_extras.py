"""Extras by role: the plain install is the client, and every client command runs with none
of the other roles' modules importable; a command whose extra is missing exits 2 naming the
install that gives it.

The client runs in an interpreter whose import system refuses every module of the agent, ray,
server and demo extras (a finder ahead of the real ones), against a real API process, so what
is tested is what a client-only environment can do, not what this test environment happens
to have loaded."""

from __future__ import annotations

import importlib.metadata as md
import json
import re
import shlex
import subprocess
import sys
import tomllib
import uuid
from pathlib import Path

import httpx
import pytest

from ringwatch.services.cli.extras import COMMAND_EXTRAS, EXTRA_OF
from tests.api_fixtures import fleet_batch
from tests.procs import api_env, start_server, stop_server

ROOT = Path(__file__).resolve().parent.parent
ADMIN = "rw_admin_" + uuid.uuid4().hex

# Runs `ringwatch ARGS` with the modules named in argv[1] unimportable.
_BLOCKED = r"""
import importlib.abc, sys

BLOCKED = set(sys.argv[1].split(","))


class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, Refuse())
from ringwatch.services.cli.main import main

sys.exit(main(sys.argv[2:]))
"""

NOT_CLIENT = tuple(EXTRA_OF)


def ringwatch(*args: str, env: dict[str, str], blocked: tuple[str, ...] = NOT_CLIENT,
              stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _BLOCKED, ",".join(blocked), *args], env=env,
                          capture_output=True, text=True, timeout=120, input=stdin)


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _extra(name: str) -> set[str]:
    """The distributions an extra installs, its own references to other extras unfolded."""
    extras = _pyproject()["project"]["optional-dependencies"]
    found: set[str] = set()
    for req in extras[name]:
        dist = re.split(r"[\[<>=!~ ;]", req, maxsplit=1)[0].lower()
        if dist == "ringwatch":
            for inner in re.search(r"\[(.*)\]", req).group(1).split(","):  # type: ignore[union-attr]
                found |= _extra(inner.strip())
        else:
            found.add(dist)
    return found


def _needs(dist: str, seen: set[str] | None = None) -> set[str]:
    """``dist`` and every distribution it requires (unconditionally), as installed here."""
    seen = set() if seen is None else seen
    name = dist.lower().replace("_", "-")
    if name in seen:
        return seen
    seen.add(name)
    try:
        requires = md.requires(name) or []
    except md.PackageNotFoundError:  # a marker kept it out here (an older Python's backport)
        return seen
    for req in requires:
        if "extra ==" in req:
            continue
        _needs(re.split(r"[\[<>=!~ ;(]", req, maxsplit=1)[0], seen)
    return seen


# -- what the packaging says ------------------------------------------------------------


def test_the_plain_install_is_the_client_without_torch_ray_or_a_server() -> None:
    base = {re.split(r"[\[<>=!~ ;]", r, maxsplit=1)[0].lower()
            for r in _pyproject()["project"]["dependencies"]}
    assert base == {"httpx", "pydantic", "pydantic-settings", "python-json-logger", "rich"}
    for dist in base:  # nor does anything the client pulls in bring them
        assert not _needs(dist) & {"torch", "ray", "numpy", "fastapi", "sqlalchemy", "pgserver"}


def test_each_module_the_cli_names_comes_with_the_extra_it_names() -> None:
    owners = md.packages_distributions()
    for module, extra in EXTRA_OF.items():
        installed_by = set().union(*(_needs(d) for d in _extra(extra)))
        dists = {d.lower().replace("_", "-") for d in owners[module]}
        assert dists & installed_by, f"{module} ({dists}) is not installed by [{extra}]"
    for extras in COMMAND_EXTRAS.values():
        assert all(e in _pyproject()["project"]["optional-dependencies"] for e in extras)


def test_all_is_every_role() -> None:
    assert _extra("all") == _extra("agent") | _extra("ray") | _extra("server") | _extra("demo")
    assert {"torch", "ray", "fastapi", "pgserver"} <= _extra("all")
    assert not {"torch", "ray"} & _extra("server")


# -- a client-only environment, against a real API --------------------------------------


@pytest.fixture
def server(database_url: str, clean_db, tmp_path: Path):
    env = api_env(database_url, tmp_path, ADMIN)
    proc = start_server(env)
    httpx.post(f"{env['RINGWATCH_API_URL']}/v1/measurements", json=fleet_batch(),
               headers={"Authorization": f"Bearer {ADMIN}"}).raise_for_status()
    yield env
    stop_server(proc)


def _client_env(server: dict[str, str], token: str = ADMIN) -> dict[str, str]:
    """What a launcher's environment holds: a token, no API URL and no database URL (--api
    says where the API is)."""
    env = {k: v for k, v in server.items() if not k.startswith("RINGWATCH_")}
    return {**env, "RINGWATCH_TOKEN": token, "RINGWATCH_STATE_DIR": server["RINGWATCH_STATE_DIR"]}


def test_every_client_command_runs_with_no_other_role_installed(server) -> None:
    api, env = server["RINGWATCH_API_URL"], _client_env(server)

    r = ringwatch("preflight", "--api", api, "--nodes", "node-[000-003]", "--json", env=env)
    assert r.returncode == 0, r.stderr
    verdict = json.loads(r.stdout)
    assert verdict["healthy"] is True and verdict["nodes"] == [f"node-00{i}" for i in range(4)]

    r = ringwatch("status", "--api", api, "--json", env=env)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["status"] == "healthy"

    table = "\n".join(f"node-00{i} slots=2" for i in range(4))
    r = ringwatch("check-rankmap", "-", "--api", api, "--json", env=env, stdin=table)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["ok"] is True

    r = ringwatch("completion", "bash", env=env)
    assert r.returncode == 0 and "-F _ringwatch ringwatch" in r.stdout

    # Tokens through the API with the admin token: made, listed, revoked.
    r = ringwatch("token", "create", "--role", "reader", "--name", "prolog", "--api", api, env=env)
    assert r.returncode == 0, r.stderr
    token_id, reader = re.search(r"token (\d+) .*: (\S+)$", r.stdout.strip()).groups()  # type: ignore[union-attr]
    r = ringwatch("token", "list", "--json", "--api", api, env=env)
    rows = {row["id"]: row for row in json.loads(r.stdout)}
    assert rows[int(token_id)]["role"] == "reader" and rows[int(token_id)]["name"] == "prolog"
    # The new reader token asks on its own.
    r = ringwatch("status", "--api", api, "--json", env=_client_env(server, reader))
    assert r.returncode == 0, r.stderr
    r = ringwatch("token", "revoke", token_id, "--api", api, env=env)
    assert r.returncode == 0 and f"revoked token {token_id} (reader, prolog)" in r.stdout
    r = ringwatch("status", "--api", api, "--json", env=_client_env(server, reader))
    assert r.returncode == 2 and "401" in r.stderr
    r = ringwatch("token", "revoke", "999999", "--api", api, env=env)
    assert r.returncode == 2 and "no token 999999" in r.stderr


def test_the_api_url_variable_is_what_api_defaults_to(server) -> None:
    env = {**_client_env(server), "RINGWATCH_API_URL": server["RINGWATCH_API_URL"]}
    r = ringwatch("status", "--json", env=env)
    assert r.returncode == 0, r.stderr
    # --api wins over the variable.
    r = ringwatch("status", "--api", "http://127.0.0.1:9", env=env)
    assert r.returncode == 2 and "http://127.0.0.1:9" in r.stderr


# This checkout's own install (make's editable one) is what the hints name here; a wheel's
# install names its wheel (tests/test_install_docs.py runs the hint it prints).
HERE = f"{sys.executable} -m pip install -e '{ROOT}"


@pytest.mark.parametrize(("argv", "install"), [
    (["probe", "--local", "2"], f"{HERE}[agent,ray]'"),
    (["scheduler", "--local", "2", "--once"], f"{HERE}[agent,ray]'"),
    (["selftest", "--backend", "gloo"], f"{HERE}[agent]'"),
    (["serve"], f"{HERE}[server]'"),
    (["notifier"], f"{HERE}[server]'"),
    (["db", "upgrade"], f"{HERE}[server]'"),
    (["token", "list"], f"{HERE}[server]', or ask the API: --api URL"),
    (["demo"], f"{HERE}[demo]'"),
])
def test_a_command_whose_extra_is_missing_names_the_install(argv, install, tmp_path) -> None:
    env = {"PATH": "/usr/bin:/bin", "RINGWATCH_STATE_DIR": str(tmp_path),
           "RINGWATCH_TOKEN": "rw_x", "RINGWATCH_DATABASE_URL": "postgresql://nobody@127.0.0.1:9/x"}
    r = ringwatch(*argv, env=env)
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1 and r.stderr.startswith(f"ringwatch {argv[0]}: ")
    assert install in r.stderr, r.stderr


def test_no_database_url_without_the_demo_extra_says_so(tmp_path) -> None:
    """The server's extra is here, pgserver is not: serve names the embedded Postgres."""
    env = {"PATH": "/usr/bin:/bin", "RINGWATCH_STATE_DIR": str(tmp_path)}
    r = ringwatch("serve", env=env, blocked=("pgserver",))
    assert r.returncode == 2 and r.stderr.count("\n") == 1
    assert "RINGWATCH_DATABASE_URL" in r.stderr and f"{HERE}[demo]'" in r.stderr


class _Installed:
    """A ringwatch distribution as importlib.metadata finds it, with the direct_url.json pip
    wrote for it (None: installed from an index, which records none)."""

    version = "0.2.0"

    def __init__(self, direct_url: dict | None) -> None:
        self.direct_url = direct_url

    def read_text(self, name: str) -> str | None:
        assert name == "direct_url.json"
        return None if self.direct_url is None else json.dumps(self.direct_url)


@pytest.mark.parametrize(("direct_url", "spec"), [
    # pip install 'dist/ringwatch-0.2.0-py3-none-any.whl[agent]', from /srv/rw
    ({"url": "file:///srv/rw/dist/ringwatch-0.2.0-py3-none-any.whl",
      "archive_info": {"hash": "sha256=00"}},
     ["/srv/rw/dist/ringwatch-0.2.0-py3-none-any.whl[server]"]),
    # pip install '.[agent]' in a checkout with a space in its path
    ({"url": "file:///home/me/my%20rw", "dir_info": {}}, ["/home/me/my rw[server]"]),
    ({"url": "file:///home/me/rw", "dir_info": {"editable": True}},
     ["-e", "/home/me/rw[server]"]),
    # pip install 'ringwatch[agent] @ git+https://git.example/rw.git'
    ({"url": "https://git.example/rw.git",
      "vcs_info": {"vcs": "git", "commit_id": "ab76013", "requested_revision": "main"}},
     ["ringwatch[server] @ git+https://git.example/rw.git@ab76013"]),
    # a wheel from an artifact store
    ({"url": "https://artifacts.example/ringwatch-0.2.0-py3-none-any.whl",
      "archive_info": {}},
     ["ringwatch[server] @ https://artifacts.example/ringwatch-0.2.0-py3-none-any.whl"]),
    # an index (a release): the same version from it
    (None, ["ringwatch[server]==0.2.0"]),
])
def test_the_install_named_is_where_this_ringwatch_came_from(direct_url, spec, monkeypatch,
                                                           tmp_path) -> None:
    from ringwatch.services.cli import extras

    monkeypatch.setattr(extras.metadata, "distribution", lambda name: _Installed(direct_url))
    monkeypatch.setattr(extras, "SOURCE_ROOT", tmp_path)  # not run from a checkout
    assert extras.install_spec(["server"]) == spec
    command = extras.install_command(["server"])
    assert shlex.split(command) == [sys.executable, "-m", "pip", "install", *spec]


def test_a_checkout_run_without_an_install_names_the_checkout(monkeypatch) -> None:
    """Run from the source tree with no ringwatch installed (or only a stale egg-info on the
    path, which records no origin): the checkout it runs from, never a bare index name."""
    from ringwatch.services.cli import extras

    def absent(name: str):
        raise md.PackageNotFoundError(name)

    monkeypatch.setattr(extras.metadata, "distribution", absent)
    assert extras.install_spec(["agent", "ray"]) == ["-e", f"{ROOT}[agent,ray]"]
    monkeypatch.setattr(extras.metadata, "distribution", lambda name: _Installed(None))
    assert extras.install_spec(["agent"]) == ["-e", f"{ROOT}[agent]"]


def test_every_client_command_says_where_the_api_is_and_what_token_it_sends() -> None:
    from ringwatch.services.cli.main import build_parser

    for argv in (["preflight"], ["status"], ["check-rankmap", "f"], ["token", "create"],
                 ["token", "list"], ["token", "revoke"]):
        r = subprocess.run([sys.executable, "-m", "ringwatch.services.cli.main", *argv, "--help"],
                           capture_output=True, text=True, timeout=60)
        text = " ".join(r.stdout.split())
        assert r.returncode == 0 and "--api URL" in text, argv
        assert "RINGWATCH_API_URL" in text and "RINGWATCH_TOKEN" in text, argv
    assert build_parser().parse_args(["status", "--api", "https://rw.example/"]).api \
        == "https://rw.example"


def test_the_ray_version_hint_installs_into_this_environment() -> None:
    """The scheduler's refusal to join another Ray names this interpreter's pip, so a
    scheduler run from an environment that is not activated is told the install that fits."""
    from ringwatch.services.scheduler.ray_backend import version_mismatch

    refusal = ("Version mismatch: The cluster was started with:\n    Ray: 2.48.0\n"
               "    Python: 3.11.7\nThis process on node 10.0.0.5 was started with:\n"
               "    Ray: 2.60.0\n    Python: 3.11.7\n")
    line = version_mismatch(refusal, "auto")
    assert line is not None and "\n" not in line
    assert line.endswith(f"({sys.executable} -m pip install ray==2.48.0)")
