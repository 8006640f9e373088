"""Which extra each role's modules come from (pyproject.toml's optional dependencies), so a
command whose extra is not installed says in one line the install command that gives it.

The plain install is the client; every other import a command makes is lazy, inside the
command, so a missing module surfaces here as the command starts. The command named installs
from where this ringwatch came from (the wheel, the checkout, the git URL or the index that
pip recorded, PEP 610), into this interpreter: no release is on an index yet, so a bare
``pip install 'ringwatch[server]'`` would find nothing."""

from __future__ import annotations

import json
import shlex
import sys
from importlib import metadata
from pathlib import Path
from urllib.parse import unquote, urlparse

# Top-level module -> the extra whose install brings it. numpy comes with agent and server
# alike; agent is named, as the commands that reach numpy first are the probing ones.
EXTRA_OF = {
    "torch": "agent",
    "numpy": "agent",
    "pynvml": "agent",
    "ray": "ray",
    "fastapi": "server",
    "starlette": "server",
    "uvicorn": "server",
    "sqlalchemy": "server",
    "alembic": "server",
    "psycopg": "server",
    "cryptography": "server",
    "prometheus_client": "server",
    "pgserver": "demo",
}

# The extras an extra brings with it (pyproject.toml: demo is every role and pgserver).
INCLUDES = {"demo": ("agent", "ray", "server", "demo"), "all": ("agent", "ray", "server", "demo")}

# What each command needs beyond the client, in the order a user should read it.
COMMAND_EXTRAS = {
    "demo": ("demo",),
    "serve": ("server",),
    "notifier": ("server",),
    "db": ("server",),
    "scheduler": ("agent", "ray"),
    "probe": ("agent", "ray"),
    "selftest": ("agent",),
    "token": ("server",),
}


# The checkout this code runs from, where it runs from one: its pyproject sits at the root.
SOURCE_ROOT = Path(__file__).resolve().parents[2]


def _from_source_tree() -> bool:
    try:
        return 'name = "ringwatch"' in (SOURCE_ROOT / "pyproject.toml").read_text()
    except OSError:
        return False


def _local_path(url: str) -> str | None:
    parsed = urlparse(url)
    return unquote(parsed.path) if parsed.scheme == "file" else None


def install_spec(extras: list[str]) -> list[str]:
    """The arguments after ``pip install`` that add ``extras`` to this ringwatch: from the
    wheel, directory or VCS URL pip recorded installing it from (direct_url.json), from the
    checkout this code runs in, or else from the index it came from, at its version."""
    tag = f"[{','.join(extras)}]"
    try:
        dist = metadata.distribution("ringwatch")
        direct = json.loads(dist.read_text("direct_url.json") or "null")
    except (metadata.PackageNotFoundError, ValueError):
        dist, direct = None, None
    if isinstance(direct, dict) and isinstance(direct.get("url"), str):
        url, path = direct["url"], _local_path(direct["url"])
        if "vcs_info" in direct:
            vcs = direct["vcs_info"]
            commit = f"@{vcs['commit_id']}" if vcs.get("commit_id") else ""
            return [f"ringwatch{tag} @ {vcs.get('vcs', 'git')}+{url}{commit}"]
        if "dir_info" in direct and path is not None:
            editable = ["-e"] if direct["dir_info"].get("editable") else []
            return [*editable, f"{path}{tag}"]
        if path is not None:  # a wheel or an sdist on this machine's disk
            return [f"{path}{tag}"]
        return [f"ringwatch{tag} @ {url}"]
    if _from_source_tree():
        return ["-e", f"{SOURCE_ROOT}{tag}"]
    version = dist.version if dist is not None else None
    return [f"ringwatch{tag}" + (f"=={version}" if version else "")]


def install_command(extras: list[str]) -> str:
    """A shell command that installs ``extras`` into the environment running this, as it
    would be typed: this interpreter's pip, so an environment that is not activated (a
    prolog's /opt/ringwatch/bin/ringwatch) gets it, not whichever pip is first on PATH."""
    return shlex.join([sys.executable, "-m", "pip", "install", *install_spec(extras)])


def missing_extra(exc: ModuleNotFoundError, command: str) -> str | None:
    """One line naming the install that gives ``command`` the module ``exc`` lacks; None
    where the module is not one of an extra's (a bug, not an install to fix)."""
    module = (exc.name or "").split(".")[0]
    extra = EXTRA_OF.get(module)
    if extra is None:
        return None
    if module == "pgserver":
        return ("no RINGWATCH_DATABASE_URL is set, and the embedded Postgres it would start "
                f"needs the demo role: {install_command(['demo'])} "
                "(or set RINGWATCH_DATABASE_URL)")
    extras = list(COMMAND_EXTRAS.get(command, ()))
    if not any(extra in INCLUDES.get(e, (e,)) for e in extras):
        extras.append(extra)
    line = f"{module} is not installed: {install_command(extras)}"
    if command == "token":
        line += ", or ask the API: --api URL with an admin RINGWATCH_TOKEN"
    return line
