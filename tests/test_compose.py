"""docker-compose.yml describes the production shape (no Docker engine is needed to check it)."""

from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def load() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def test_compose_names_the_four_services() -> None:
    services = load()["services"]
    assert {"postgres", "api", "ray-head", "ray-worker"} <= set(services)


def test_postgres_has_a_healthcheck_and_api_waits_for_it() -> None:
    services = load()["services"]
    assert "pg_isready" in " ".join(services["postgres"]["healthcheck"]["test"])
    assert services["api"]["depends_on"]["postgres"]["condition"] == "service_healthy"


def test_api_migrates_before_serving() -> None:
    command = " ".join(load()["services"]["api"]["command"])
    assert command.index("db upgrade") < command.index("serve")


def test_workers_reserve_gpus_and_head_runs_the_scheduler() -> None:
    services = load()["services"]
    devices = services["ray-worker"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["capabilities"] == ["gpu"]
    assert "ringwatch scheduler" in " ".join(services["ray-head"]["command"])


def test_every_ringwatch_variable_is_a_setting() -> None:
    from services.config import Settings

    fields = {f"RINGWATCH_{name.upper()}" for name in Settings.model_fields}
    for svc in load()["services"].values():
        for var in (svc.get("environment") or {}):
            if var.startswith("RINGWATCH_"):
                assert var in fields, var
