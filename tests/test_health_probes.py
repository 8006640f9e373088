"""What a supervisor's probes and Prometheus see of the API through a database outage, and
the notifier's LISTEN coming back after Postgres restarts.

/healthz is liveness (the process answers; a database outage is no reason to restart it),
/readyz is readiness (the database answers at this code's migration, else 503 naming why),
and /metrics answers 200 throughout: the process's own families always, the fleet's only
while the database can be read, ``ringwatch_database_up`` saying which.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import yaml
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import text

from bench.chaos.private_pg import PrivatePostgres
from ringwatch.api.app import create_app
from ringwatch.services.notifier import service as webhooks
from ringwatch.services.settings import Settings
from ringwatch.services.store import db
from ringwatch.services.store.events import OUTBOX_CHANNEL
from tests.api_fixtures import TEST_SECRET_KEY, WEBHOOK_SECRET, WEBHOOK_TEST_SETTINGS
from tests.procs import api_env, free_port, start_server, stop_server

ROOT = Path(__file__).resolve().parents[1]
# Families read from the database, and the process's own.
FLEET = {"ringwatch_links", "ringwatch_nodes", "ringwatch_node_healthy",
         "ringwatch_preflight_requests", "ringwatch_metrics_collect_seconds"}
OWN = {"process_cpu_seconds", "process_resident_memory_bytes", "ringwatch_http_requests"}


def families(body: str) -> dict[str, list[float]]:
    """The families of a Prometheus text scrape, each with its samples' values."""
    return {f.name: [s.value for s in f.samples] for f in text_string_to_metric_families(body)}


def nowhere() -> str:
    """A database URL nothing listens at (connections are refused at once)."""
    return f"postgresql://nobody@127.0.0.1:{free_port()}/none"


def app_without_database() -> TestClient:
    """The real app on an engine whose database cannot be reached."""
    factory = db.make_session_factory(db.make_engine(nowhere()))
    return TestClient(create_app(Settings(database_url="unused", metrics_cache_s=0,
                                          **WEBHOOK_TEST_SETTINGS), factory))


def eventually(check: Callable[[], bool], timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


# -- the rule ------------------------------------------------------------------------------

def test_schema_state_is_ready_only_at_this_codes_migration(admin_url: str) -> None:
    head = db.head_revision()
    previous = db._scripts().get_revision(head).down_revision
    name = f"rw_ready_{uuid.uuid4().hex[:10]}"
    url = db.create_database(admin_url, name)
    engine = db.make_engine(url)
    try:
        ok, why = db.schema_state(engine)
        assert not ok and "(none)" in why and head in why and "ringwatch db upgrade" in why
        db.upgrade(url, previous)
        ok, why = db.schema_state(engine)
        assert not ok and f"at migration {previous}, this code needs {head}" in why
        db.upgrade(url)
        assert db.schema_state(engine) == (True, "")
        with engine.begin() as conn:  # as a newer ringwatch would leave it
            conn.execute(text("UPDATE alembic_version SET version_num = 'f00dfacef00d'"))
        ok, why = db.schema_state(engine)  # and no record of how it got there
        assert not ok and "f00dfacef00d" in why and head in why
    finally:
        engine.dispose()
        db.drop_database(admin_url, name)

    gone = nowhere()
    ok, why = db.schema_state(db.make_engine(gone))
    # An unauthenticated prober reads it: the error's class, not its text (host, port).
    assert not ok and why == "the database is unreachable (OperationalError)"


# -- the API in-process --------------------------------------------------------------------

def test_readyz_and_healthz_need_no_token(api) -> None:
    assert api.get("/healthz").json() == {"ok": True}
    r = api.get("/readyz")
    assert r.status_code == 200 and r.json() == {"status": "ok"}
    paths = api.get("/openapi.json").json()["paths"]
    assert "security" not in paths["/readyz"]["get"]


def test_without_its_database_the_api_is_alive_unready_and_still_scraped() -> None:
    client = app_without_database()
    assert client.get("/healthz").status_code == 200
    r = client.get("/readyz")
    assert r.status_code == 503
    assert r.json() == {"error": "not_ready",
                        "message": "the database is unreachable (OperationalError)"}

    r = client.get("/metrics")
    assert r.status_code == 200, r.text
    got = families(r.text)
    assert got["ringwatch_database_up"] == [0.0]
    assert set(got) >= OWN, sorted(got)
    assert not FLEET & set(got), sorted(FLEET & set(got))
    # The failed /readyz above is counted among the process's requests.
    assert any(f.name == "ringwatch_http_requests" and any(
        s.labels == {"method": "GET", "route": "/readyz", "code": "503"} for s in f.samples)
        for f in text_string_to_metric_families(r.text))
    om = client.get("/metrics", headers={"Accept": "application/openmetrics-text"})
    assert om.status_code == 200 and om.text.endswith("# EOF\n")
    assert "ringwatch_database_up 0.0" in om.text


def test_with_its_database_the_scrape_has_the_fleet_and_database_up(api) -> None:
    got = families(api.get("/metrics").text)
    assert got["ringwatch_database_up"] == [1.0]
    assert set(got) >= FLEET | OWN


# -- the manifests -------------------------------------------------------------------------

def test_the_manifests_probe_readiness_and_liveness_apart() -> None:
    """Kubernetes takes an API replica out of its Service on /readyz and restarts it only on
    /healthz; compose starts what waits on the API once /readyz answers."""
    from ringwatch.api.routers.meta import router

    routes = {r.path for r in router.routes}  # type: ignore[attr-defined]
    assert {"/healthz", "/readyz"} <= routes
    deployment = next(d for d in yaml.safe_load_all((ROOT / "deploy/kubernetes/base/api.yaml")
                                                    .read_text())
                      if d and d["kind"] == "Deployment")
    (api,) = deployment["spec"]["template"]["spec"]["containers"]
    assert api["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    assert api["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}

    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    check = " ".join(compose["api"]["healthcheck"]["test"])
    assert "http://127.0.0.1:8420/readyz" in check
    assert "--port 8420" in " ".join(compose["api"]["command"])
    for waiting in ("agent-token", "tls-proxy", "prometheus"):
        assert compose[waiting]["depends_on"]["api"]["condition"] == "service_healthy"


# -- real processes, a real Postgres stopped and started --------------------------------------

@contextmanager
def private_database() -> Iterator[tuple[PrivatePostgres, str]]:
    """A Postgres cluster of this test's own (to stop and start) with a migrated database."""
    with PrivatePostgres() as pg:
        url = db.create_database(pg.url, "ringwatch")
        db.upgrade(url)
        yield pg, url


@pytest.mark.slow
def test_a_real_api_through_a_database_outage(tmp_path: Path) -> None:
    with private_database() as (pg, url):
        env = {**api_env(url, tmp_path / "state", "rw_health_admin"),
               "RINGWATCH_METRICS_CACHE_S": "0"}
        base = env["RINGWATCH_API_URL"]
        proc = start_server(env)
        try:
            assert httpx.get(f"{base}/readyz").status_code == 200
            assert families(httpx.get(f"{base}/metrics").text)["ringwatch_database_up"] == [1.0]

            pg.stop()
            r = httpx.get(f"{base}/readyz", timeout=10)
            assert r.status_code == 503 and "unreachable" in r.json()["message"], r.text
            assert httpx.get(f"{base}/healthz", timeout=10).status_code == 200
            scrape = httpx.get(f"{base}/metrics", timeout=10)
            assert scrape.status_code == 200, scrape.text
            got = families(scrape.text)
            assert got["ringwatch_database_up"] == [0.0]
            assert set(got) >= OWN and not FLEET & set(got)

            pg.start()
            assert eventually(lambda: httpx.get(f"{base}/readyz").status_code == 200)
            got = families(httpx.get(f"{base}/metrics").text)
            assert got["ringwatch_database_up"] == [1.0] and set(got) >= FLEET
            assert proc.poll() is None
        finally:
            stop_server(proc)


def listening(url: str) -> bool:
    """Whether a session of the database LISTENs on the outbox's channel (pg_stat_activity
    shows a session's latest statement)."""
    engine = db.make_engine(url)
    try:
        with engine.connect() as conn:
            return bool(conn.execute(text(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                "AND query = :q"), {"q": f"LISTEN {OUTBOX_CHANNEL}"}).scalar())
    except Exception:  # down, or starting
        return False
    finally:
        engine.dispose()


def delivered_in(factory, rx, hook: int, count: int) -> float:
    """Seconds from a test event's commit to its delivery (the ``count``-th received)."""
    with db.transaction(factory) as s:
        webhooks.send_test(s, hook)
    started = time.monotonic()
    assert len(rx.wait_for(count, timeout_s=30)) >= count, "not delivered within 30 s"
    return time.monotonic() - started


@pytest.mark.slow
def test_the_notifier_listens_again_after_postgres_restarts(tmp_path: Path) -> None:
    from ringwatch.services.notifier.receiver import WebhookReceiver

    settings = Settings(database_url="unused", **WEBHOOK_TEST_SETTINGS)
    with private_database() as (pg, url), WebhookReceiver(WEBHOOK_SECRET) as rx:
        engine = db.make_engine(url)
        factory = db.make_session_factory(engine)
        with db.transaction(factory) as s:
            hook = webhooks.create(s, settings, rx.url, WEBHOOK_SECRET, ["health.degraded"],
                                   "json")["id"]
        # Polling every 5 minutes: within the test only a NOTIFY can wake it.
        env = {**os.environ, "RINGWATCH_DATABASE_URL": url, "RINGWATCH_NOTIFIER_POLL_S": "300",
               "RINGWATCH_SECRET_KEY": TEST_SECRET_KEY, "RINGWATCH_STATE_DIR": str(tmp_path),
               "RINGWATCH_WEBHOOK_ALLOWED_NETWORKS": '["127.0.0.0/8"]'}
        log = tmp_path / "notifier.log"
        with log.open("wb") as out:
            proc = subprocess.Popen([sys.executable, "-m", "ringwatch.services.cli.main", "notifier"],
                                    env=env, stdout=out, stderr=subprocess.STDOUT)
        try:
            assert eventually(lambda: listening(url)), log.read_text()
            assert delivered_in(factory, rx, hook, 1) <= 5.0

            engine.dispose()
            pg.restart(down_s=2.0)
            assert eventually(lambda: listening(url)), \
                f"no LISTEN 30 s after the restart:\n{log.read_text()}"
            took = delivered_in(factory, rx, hook, 2)
            assert took <= 5.0, f"{took:.1f} s:\n{log.read_text()}"
            assert proc.poll() is None
        finally:
            proc.terminate()
            proc.wait(timeout=30)
            engine.dispose()
    said = log.read_text()
    assert "unavailable" in said and "again after" in said, said
