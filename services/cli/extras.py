"""Which extra each role's modules come from (pyproject.toml's optional dependencies), so a
command whose extra is not installed says in one line what installs it.

The plain ``pip install ringwatch`` is the client; every other import a command makes is
lazy, inside the command, so a missing module surfaces here as the command starts."""

from __future__ import annotations

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


def missing_extra(exc: ModuleNotFoundError, command: str) -> str | None:
    """One line naming the install that gives ``command`` the module ``exc`` lacks; None
    where the module is not one of an extra's (a bug, not an install to fix)."""
    module = (exc.name or "").split(".")[0]
    extra = EXTRA_OF.get(module)
    if extra is None:
        return None
    if module == "pgserver":
        return ("no RINGWATCH_DATABASE_URL is set, and the embedded Postgres it would start "
                "needs pip install 'ringwatch[demo]' (or set RINGWATCH_DATABASE_URL)")
    extras = list(COMMAND_EXTRAS.get(command, ()))
    if not any(extra in INCLUDES.get(e, (e,)) for e in extras):
        extras.append(extra)
    line = f"{module} is not installed: pip install 'ringwatch[{','.join(extras)}]'"
    if command == "token":
        line += ", or ask the API: --api URL with an admin RINGWATCH_TOKEN"
    return line
