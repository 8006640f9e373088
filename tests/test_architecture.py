"""The house rules of docs/architecture.md, checked over the import graph: which room may
import which, which libraries each room's role installs, what the console script loads
before it knows the command, and where SQL lives.

Every module ringwatch installs is read with ast, nothing is imported, and an import inside a
function or under ``if TYPE_CHECKING`` counts as an edge too (marked deferred). Names are
compared without a leading ``ringwatch.``, so the rules read the same whether the rooms are
imported as ``services.store`` or as ``ringwatch.services.store``. A new room, or an edge the
contract below does not allow, is a design decision: it goes into ALLOWED and into
docs/architecture.md in the same change.
"""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from functools import cache
from importlib import metadata
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# What the wheel installs (pyproject.toml), each a folder of this checkout.
PACKAGES = ("agents", "services", "api", "migrations")
NOT_INSTALLED = ("bench", "tests")
PREFIX = "ringwatch"

# The parts of services every room may lean on: constants, typed errors, the version, the
# logs, the small health port. None of them imports a feature.
CORE = ("services.config", "services.errors", "services.version", "services.logs",
        "services.health_port")

# Room -> the module prefixes it may import (besides itself). A prefix names a room
# ("services.store") or one module of it ("services.cli.output").
ALLOWED: dict[str, tuple[str, ...]] = {
    # What runs inside a training job's environment: nothing of ours.
    "agents": (),
    "services.config": (),
    "services.errors": (),
    "services.version": (),
    "services.health_port": (),
    "services.logs": ("services.config",),
    # Settings assemble the policies features define (thresholds, hysteresis, series limits,
    # retention, occupancy): the one place the defaults meet.
    "services.settings": ("services.config", "services.logs", "services.analyzer",
                          "services.monitor", "services.scheduler", "services.store"),
    # Judgement is pure: measurements in, findings out.
    "services.analyzer": ("agents", "services.config"),
    "services.check": ("agents", "services.analyzer", "services.config", "services.settings"),
    # The bottom of the server: it imports no feature.
    "services.store": ("agents", "services.errors", "services.logs", "services.settings"),
    "services.monitor": ("agents", "services.analyzer", "services.config", "services.errors",
                         "services.store"),
    "services.notifier": ("agents", *CORE, "services.settings", "services.store"),
    "services.preflight": ("agents", "services.errors", "services.monitor", "services.store"),
    "services.rankmap": ("agents", "services.errors", "services.store"),
    # A client of the API: never the store. The CLI's Slurm calls and its error type serve
    # the Slurm occupancy source.
    "services.scheduler": ("agents", "services.analyzer", "services.check", "services.config",
                           "services.health_port", "services.logs", "services.kubernetes",
                           "services.cli.errors", "services.cli.slurm"),
    "services.selftest": ("agents", "services.cli.output", "services.scheduler"),
    # A client of the Kubernetes API and of ringwatch's: never the store. It names nodes as
    # the occupancy source matches them.
    "services.kubernetes": ("agents", *CORE, "services.settings", "services.cli.errors",
                            "services.cli.output", "services.scheduler.occupancy"),
    # The console script: the composition root, which starts every process.
    "services.cli": ("agents", "api", "services"),
    # HTTP only: thin routers over the services.
    "api": ("agents", *CORE, "services.settings", "services.store", "services.monitor",
            "services.notifier", "services.preflight", "services.rankmap"),
    "migrations": ("services.settings", "services.store"),
}

# Room -> the third-party libraries it may import: the distributions its role installs
# (pyproject.toml's dependencies, "" for the plain install, and extras), with what they
# pull in. PURE: the judgement's one library.
PURE = "numpy"
LIBRARIES: dict[str, tuple[str, ...]] = {
    "agents": ("agent", "ray"),
    "services.config": ("",),
    "services.errors": ("",),
    "services.version": ("",),
    "services.health_port": ("",),
    "services.logs": ("",),
    "services.settings": ("",),
    "services.analyzer": (PURE,),
    "services.check": (PURE,),
    "services.store": ("", "server", "demo"),
    "services.monitor": ("", "server"),
    "services.notifier": ("", "server"),
    "services.preflight": ("", "server"),
    "services.rankmap": ("", "server"),
    "services.scheduler": ("", "agent", "ray"),
    # "with no Ray and no API" (services/selftest/__init__.py)
    "services.selftest": ("", "agent"),
    "services.kubernetes": ("",),
    "services.cli": ("", "all"),
    "api": ("", "server"),
    "migrations": ("", "server"),
}

# Outside the store (and the migrations), SQLAlchemy is a session, an engine or an error,
# never a statement.
SQL_ROOMS = ("services.store", "migrations")
SQLALCHEMY_NAMES = {"sqlalchemy": {"Engine", "create_engine"},
                    "sqlalchemy.orm": {"Session", "sessionmaker"},
                    "sqlalchemy.exc": None}  # None: any error
STATEMENT_CALLS = {"execute", "exec_driver_sql", "scalar", "scalars", "query"}
# The notifier LISTENs on the outbox's channel beside the delivery it wakes (a feature's
# pieces live together); that statement reads no table.
LISTEN = re.compile(r"(UN)?LISTEN\b")
# The database driver: the store's; the API maps its errors, the notifier LISTENs with it.
DRIVER_ROOMS = ("services.store", "services.notifier", "api", "migrations")

CONSOLE_SCRIPT = "services.cli.main"


@dataclass(frozen=True)
class Import:
    source: str  # the importing module, without "ringwatch."
    target: str  # the imported module, without "ringwatch."
    names: tuple[str, ...]  # what a from-import takes
    line: int
    deferred: bool  # inside a function or under TYPE_CHECKING

    def __str__(self) -> str:
        return (f"{self.source}:{self.line} imports {self.target}"
                + (f" ({', '.join(self.names)})" if self.names else "")
                + (" (deferred)" if self.deferred else ""))


def normalise(name: str) -> str:
    """``ringwatch.services.store`` and ``services.store`` are one module."""
    if name == PREFIX:
        return ""
    return name.removeprefix(PREFIX + ".")


def room(module: str) -> str:
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "services" and len(parts) > 1 else parts[0]


def is_internal(module: str) -> bool:
    return module.split(".")[0] in PACKAGES + NOT_INSTALLED


def matches(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def package_dir(name: str) -> Path:
    """A package's folder: at the top of the checkout, or under ringwatch/."""
    for base in (REPO, REPO / PREFIX):
        if (base / name).is_dir():
            return base / name
    raise AssertionError(f"no folder {name}/ in {REPO}")


@cache
def modules() -> dict[str, Path]:
    """Every module ringwatch installs, by name."""
    found: dict[str, Path] = {}
    for package in PACKAGES:
        top = package_dir(package)
        for path in sorted(top.rglob("*.py")):
            parts = [package, *path.relative_to(top).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _walk(node: ast.AST, deferred: bool) -> Iterator[tuple[ast.AST, bool]]:
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and _type_checking(child.test):
            for stmt in child.body:
                yield stmt, True
                yield from _walk(stmt, True)
            for stmt in child.orelse:
                yield stmt, deferred
                yield from _walk(stmt, deferred)
            continue
        yield child, deferred
        inner = deferred or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
        yield from _walk(child, inner)


def imports_in(source: str, module: str, is_package: bool,
               known: Iterable[str] = ()) -> list[Import]:
    """The imports of one module's text: relative ones resolved, ``from a import b`` taken
    as module ``a.b`` where that is a module of ``known``."""
    known = set(known)
    found = []
    for node, deferred in _walk(ast.parse(source), False):
        if isinstance(node, ast.Import):
            found += [Import(module, normalise(a.name), (), node.lineno, deferred)
                      for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[:len(base) - (node.level - 1)]
                target = ".".join([*base, *([node.module] if node.module else [])])
            else:
                target = normalise(node.module or "")
            for alias in node.names:
                sub = f"{target}.{alias.name}" if target else alias.name
                if sub in known:
                    found.append(Import(module, sub, (), node.lineno, deferred))
                else:
                    found.append(Import(module, target, (alias.name,), node.lineno, deferred))
    return [i for i in found if i.target]


@cache
def graph() -> tuple[Import, ...]:
    known = modules()
    return tuple(i for name, path in known.items()
                 for i in imports_in(path.read_text(), name, path.name == "__init__.py", known))


def internal_violations(imports: Iterable[Import]) -> list[str]:
    bad = []
    for i in imports:
        if not is_internal(i.target) or room(i.target) == room(i.source):
            continue
        allowed = ALLOWED.get(room(i.source), ())
        if not any(matches(i.target, p) for p in allowed):
            bad.append(f"{i}: {room(i.source)} may import {', '.join(allowed) or 'nothing of ours'}")
    return bad


# -- the third-party side: which distributions a role installs --------------------------

def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


_REQUIREMENT = re.compile(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[([^\]]*)\])?")
_EXTRA_MARKER = re.compile(r";.*\bextra\s*==")


@cache
def role_distributions(extra: str) -> frozenset[str]:
    """The distributions pyproject.toml names for ``extra`` ("" for the plain install), and
    every distribution they require in turn (as installed here)."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    wanted = project["dependencies"] if extra == "" else project["optional-dependencies"][extra]
    names: set[str] = set()
    for spec in wanted:
        m = _REQUIREMENT.match(spec)
        assert m, spec
        if canonical(m[1]) == PREFIX:  # ringwatch[agent,ray,server]
            for inner in (m[2] or "").split(","):
                names |= role_distributions(inner.strip())
        else:
            names.add(canonical(m[1]))
    return frozenset(_closure(names))


def _closure(names: set[str]) -> set[str]:
    todo, seen = list(names), set(names)
    while todo:
        try:
            requires = metadata.requires(todo.pop()) or []
        except metadata.PackageNotFoundError:
            continue
        for spec in requires:
            if _EXTRA_MARKER.search(spec):  # only with an extra of that distribution
                continue
            m = _REQUIREMENT.match(spec)
            if m and canonical(m[1]) not in seen:
                seen.add(canonical(m[1]))
                todo.append(canonical(m[1]))
    return seen


@cache
def providers() -> dict[str, frozenset[str]]:
    """Top-level import name -> the installed distributions that provide it."""
    return {name: frozenset(canonical(d) for d in dists)
            for name, dists in metadata.packages_distributions().items()}


def library_violation(i: Import, roles: Iterable[str]) -> str | None:
    top = i.target.split(".")[0]
    if is_internal(i.target) or top in sys.stdlib_module_names or top == "__future__":
        return None
    allowed = frozenset().union(*(role_distributions(r) if r != PURE else {PURE} for r in roles))
    dists = providers().get(top, frozenset())
    if not dists:
        return f"{i}: no installed distribution provides {top!r}"
    if dists.isdisjoint(allowed):
        return f"{i}: {top} comes from {', '.join(sorted(dists))}, not from this role's install"
    return None


# -- the tests ------------------------------------------------------------------------------

def test_every_installed_module_is_in_a_declared_room() -> None:
    undeclared = sorted({room(m) for m in modules() if room(m) not in ALLOWED
                         and m != "services"})
    assert undeclared == [], (
        f"rooms with no line in tests/test_architecture.py's ALLOWED and LIBRARIES: {undeclared}; "
        "declare what each may import, and describe it in docs/architecture.md")
    assert set(ALLOWED) == set(LIBRARIES)


def test_each_room_imports_only_the_rooms_it_may() -> None:
    assert internal_violations(graph()) == []


def test_nothing_installed_imports_the_benchmarks_or_the_tests() -> None:
    assert [str(i) for i in graph() if room(i.target) in NOT_INSTALLED] == []


def test_each_room_imports_only_the_libraries_its_role_installs() -> None:
    bad = [v for i in graph() if (v := library_violation(i, LIBRARIES[room(i.source)]))]
    assert bad == []


def _module_level_closure(start: str) -> set[str]:
    """The modules importing ``start`` loads before any function runs: its module-level
    imports, theirs, and each one's enclosing packages."""
    by_source: dict[str, list[Import]] = {}
    for i in graph():
        by_source.setdefault(i.source, []).append(i)
    known, seen, todo = modules(), set(), [start]
    while todo:
        name = todo.pop()
        parts = name.split(".")
        for k in range(1, len(parts) + 1):
            m = ".".join(parts[:k])
            if m in known and m not in seen:
                seen.add(m)
                todo += [i.target for i in by_source.get(m, ()) if not i.deferred
                         and i.target in known]
    return seen


def test_the_console_script_loads_only_what_the_plain_install_holds() -> None:
    """The client install (a Slurm prolog, an init container) has neither torch, Ray, numpy,
    SQLAlchemy nor FastAPI: what ``ringwatch`` loads before it reads its command line
    imports only the plain dependencies; the rest waits inside the command that needs it."""
    loaded = _module_level_closure(CONSOLE_SCRIPT)
    assert "services.cli.commands" in loaded  # the walk sees the commands
    bad = [v for i in graph() if i.source in loaded and not i.deferred
           and (v := library_violation(i, ("",)))]
    assert bad == []
    assert sorted(m for m in loaded if room(m) in ("api", "services.store")) == []


def sql_violations(imports: Iterable[Import], sources: dict[str, str]) -> list[str]:
    bad = []
    for i in imports:
        if any(matches(room(i.source), r) for r in SQL_ROOMS):
            continue
        top = i.target.split(".")[0]
        if top == "psycopg" and room(i.source) not in DRIVER_ROOMS:
            bad.append(f"{i}: the database driver outside the store")
        if top != "sqlalchemy":
            continue
        allowed = SQLALCHEMY_NAMES.get(i.target, set())
        if not i.names or (allowed is not None and not set(i.names) <= allowed):
            bad.append(f"{i}: outside services/store, SQLAlchemy is a session, an engine or "
                       "an error")
    for module, text in sources.items():
        if any(matches(room(module), r) for r in SQL_ROOMS):
            continue
        for node in ast.walk(ast.parse(text)):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in STATEMENT_CALLS and not _is_listen(node)):
                bad.append(f"{module}:{node.lineno} calls .{node.func.attr}(): SQL lives in "
                           "services/store")
    return bad


def _is_listen(call: ast.Call) -> bool:
    if not call.args:
        return False
    first = call.args[0]
    text = (first.value if isinstance(first, ast.Constant) and isinstance(first.value, str) else
            first.values[0].value if isinstance(first, ast.JoinedStr) and first.values
            and isinstance(first.values[0], ast.Constant) else None)
    return isinstance(text, str) and LISTEN.match(text) is not None


def test_sql_lives_in_the_store() -> None:
    sources = {m: p.read_text() for m, p in modules().items()}
    assert sql_violations(graph(), sources) == []


# -- the contract can fail ------------------------------------------------------------------

@pytest.mark.parametrize("prefix", ["", "ringwatch."])
def test_a_broken_rule_is_caught_under_either_name(prefix: str) -> None:
    """The same violations, whether the code says ``services`` or ``ringwatch.services``."""
    known = modules()
    text = (f"from {prefix}services.store import db\n"
            f"import {prefix}api.app\n"
            "def later():\n"
            f"    from {prefix}services.analyzer import assess\n")
    found = imports_in(text, "agents.probe", False, known)
    assert [(i.target, i.deferred) for i in found] == [
        ("services.store.db", False), ("api.app", False), ("services.analyzer.assess", True)]
    assert len(internal_violations(found)) == 3
    sql = imports_in(f"from sqlalchemy import select\nfrom {prefix}services import logs\n",
                     "services.monitor.fleet", False, known)
    assert sql[1].target == "services.logs"
    assert len(sql_violations(sql, {"services.monitor.fleet": "s.execute(q)\nc.execute('LISTEN x')"
                                    })) == 2
    relative = imports_in("from ..store import db\nfrom . import fleet\n",
                          "services.monitor.ingest", False, known)
    assert [i.target for i in relative] == ["services.store.db", "services.monitor.fleet"]


def test_the_graph_holds_the_edges_the_architecture_describes() -> None:
    """A parser that saw nothing would pass every rule: these edges are real."""
    edges = {(i.source, i.target, i.deferred) for i in graph()}
    assert ("api.routers.measurements", "services.monitor.ingest", False) in edges
    assert ("services.cli.commands", "api.app", True) in edges
    assert ("agents.probe", "ray", True) in edges
    assert any(s.startswith("services.monitor.") and matches(t, "services.store")
               for s, t, _ in edges)
    assert library_violation(Import("agents.probe", "sqlalchemy", (), 1, False),
                             LIBRARIES["agents"]) is not None
    assert library_violation(Import("services.analyzer.judge", "torch", (), 1, False),
                             LIBRARIES["services.analyzer"]) is not None
    assert library_violation(Import("api.app", "starlette", (), 1, False),
                             LIBRARIES["api"]) is None  # fastapi's own


def test_the_architecture_page_names_every_room() -> None:
    page = (REPO / "docs" / "architecture.md").read_text()
    missing = [r for r in ALLOWED if f"{PREFIX}.{r}" not in page]
    assert missing == [], f"docs/architecture.md does not describe {missing}"
