"""Shared fixtures: a real, freshly migrated Postgres database for the whole run.

The database is created under a unique name on the configured server (or on the
embedded one when ``RINGWATCH_DATABASE_URL`` is unset), migrated with
``alembic upgrade head``, and dropped at the end: the migrations themselves are
under test, and a shared server keeps nothing of ours.
"""

from __future__ import annotations

import inspect
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import CodeType
from typing import Any

import pytest
from hypothesis import HealthCheck
from hypothesis import settings as hypothesis_settings
from sqlalchemy import text
from sqlalchemy.orm import Session, sessionmaker

from ringwatch.services.settings import Settings
from ringwatch.services.store import db
from ringwatch.services.store.models import Base

os.makedirs("/tmp/ray", exist_ok=True)  # ray.cluster_utils writes its address there

# Property tests assert what is true, never how fast: no deadline per example, and no health
# check that times the data's generation, both of which a loaded CI machine fails. Loaded
# here, before any test module, so an explicit @settings(...) inherits it.
# HYPOTHESIS_PROFILE=default brings Hypothesis' own back.
hypothesis_settings.register_profile("ci", deadline=None, print_blob=True,
                                     suppress_health_check=[HealthCheck.too_slow])
hypothesis_settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# Markers for the fast layer (``make test-fast`` deselects db, slow, ray and gpu), set here
# so that no test has to remember them:
# - db: the test's fixture closure holds one of conftest's database fixtures. Every other
#   fixture that needs Postgres (``api``, the modules' ``env``/``server``/``served``) takes
#   one of them, and tests/api_fixtures.py has builders, not fixtures.
# - slow: ray-marked; or a fixture that starts a server or a browser; or the test's own
#   code calls something that starts processes (the subprocess module, tests/procs.py's
#   CLI and server, the selftest's rank processes, the chaos suite's faults), resolved in
#   its module so an in-process ``main as cli`` does not count; or its module starts them
#   through helpers of its own, which the test's code does not show (SLOW_MODULES).
DB_FIXTURES = frozenset({"admin_url", "database_url", "session_factory", "clean_db", "session"})
SLOW_FIXTURES = frozenset({"server", "served", "browser", "cluster", "slurm_cluster"})
STARTERS = frozenset({"subprocess", "tests.procs.cli", "tests.procs.start_server",
                      "tests.procs.running_api", "ringwatch.services.selftest.runner.run_world",
                      "bench.chaos.suite.run_fault"})
SLOW_MODULES = frozenset({"test_cli_imports.py", "test_notifier_process.py",
                          "test_notifier_health.py"})


def _names(code: CodeType) -> set[str]:
    """The global and attribute names ``code`` uses, nested functions included."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, CodeType):
            names |= _names(const)
    return names


def _calls_a_starter(item: pytest.Item) -> bool:
    function = getattr(item, "function", None)
    if function is None:
        return False
    code = inspect.unwrap(function).__code__
    found = vars(item.module)  # type: ignore[attr-defined]
    for name in _names(code):
        if name not in found:
            if name == "subprocess":  # imported inside the test
                return True
            continue
        obj = found[name]
        qualified = getattr(obj, "__name__", "") if inspect.ismodule(obj) else \
            f"{getattr(obj, '__module__', '')}.{getattr(obj, '__qualname__', '')}"
        if qualified in STARTERS:
            return True
    return False


def _starts_processes(item: pytest.Item) -> bool:
    return (item.get_closest_marker("ray") is not None or item.path.name in SLOW_MODULES
            or not SLOW_FIXTURES.isdisjoint(getattr(item, "fixturenames", ()))
            or _calls_a_starter(item))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if not DB_FIXTURES.isdisjoint(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.db)
        if _starts_processes(item):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def admin_url() -> str:
    settings = Settings()
    return db.resolve_database_url(settings.database_url, settings.state_dir)


@pytest.fixture(scope="session")
def database_url(admin_url: str) -> Iterator[str]:
    name = f"rw_test_{uuid.uuid4().hex[:12]}"
    url = db.create_database(admin_url, name)
    try:
        db.upgrade(url)
        yield url
    finally:
        db.drop_database(admin_url, name)


@pytest.fixture(scope="session")
def session_factory(database_url: str) -> Iterator[sessionmaker[Session]]:
    engine = db.make_engine(database_url)
    yield db.make_session_factory(engine)
    engine.dispose()


@pytest.fixture
def clean_db(session_factory: sessionmaker[Session]) -> sessionmaker[Session]:
    """Empty every table before the test (tests that start real processes need real commits)."""
    tables = ", ".join(t.name for t in Base.metadata.sorted_tables)
    with db.transaction(session_factory) as s:
        s.execute(text(f"TRUNCATE {tables} RESTART IDENTITY CASCADE"))
    return session_factory


@pytest.fixture
def session(clean_db: sessionmaker[Session]) -> Iterator[Session]:
    with db.transaction(clean_db) as s:
        yield s


@pytest.fixture
def state_dir(tmp_path: Path) -> Path:
    return tmp_path / "state"


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch):
    """Eight CPU "GPUs" behind the agents' CUDA seam (tests/fake_cuda.py)."""
    from ringwatch.agents import device
    from tests.fake_cuda import FakeCuda

    fake = FakeCuda()
    monkeypatch.setattr(device, "cuda", fake)
    return fake


@pytest.fixture
def api(clean_db):
    """A client of the real app on a clean database, with a token per role (api_fixtures)."""
    from tests.api_fixtures import api_client

    with api_client(clean_db) as client:
        yield client


@pytest.fixture
def receiver():
    """A webhook receiver on 127.0.0.1 that verifies signatures with WEBHOOK_SECRET."""
    from ringwatch.services.notifier.receiver import WebhookReceiver
    from tests.api_fixtures import WEBHOOK_SECRET

    with WebhookReceiver(WEBHOOK_SECRET) as r:
        yield r


# Debian's chromium (apt-get install chromium); a browser a test tool downloads itself
# cannot be fetched on every machine the tests run on.
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    """A headless chromium driven by Playwright; the test skips where there is none."""
    if CHROMIUM is None:
        pytest.skip("no chromium on PATH (apt-get install chromium): the page tests need a browser")
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield b
        b.close()
