"""docker-compose.yml describes the production shape (no Docker engine is needed to check it)."""

import re
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


def test_workers_reserve_gpus_and_head_runs_the_scheduler() -> None:
    services = load()["services"]
    devices = services["ray-worker"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["capabilities"] == ["gpu"]
    assert "ringwatch scheduler" in " ".join(services["ray-head"]["command"])


def test_every_ringwatch_variable_is_a_setting() -> None:
    from ringwatch.services.settings import Settings

    fields = {f"RINGWATCH_{name.upper()}" for name in Settings.model_fields}
    for svc in load()["services"].values():
        for var in (svc.get("environment") or {}):
            if var.startswith("RINGWATCH_"):
                assert var in fields, var


def dockerfile() -> list[tuple[str, str]]:
    """(instruction, arguments) of each Dockerfile instruction, continuation lines joined."""
    text = (ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    lines = [line.strip() for line in text.splitlines()]
    return [(w[0].upper(), w[1] if len(w) > 1 else "")
            for w in (line.split(None, 1) for line in lines if line and not line.startswith("#"))]


def test_the_database_password_is_required_wherever_it_is_used() -> None:
    text = (ROOT / "docker-compose.yml").read_text()
    uses = re.findall(r"\$\{POSTGRES_PASSWORD([^}]*)\}", text)
    assert len(uses) >= 2  # the database's own setting and the API's URL
    assert all(u.startswith(":?") and len(u) > 2 for u in uses), uses
    assert "change-me" not in text
    services = load()["services"]
    assert "${POSTGRES_PASSWORD:?" in services["postgres"]["environment"]["POSTGRES_PASSWORD"]
    assert "${POSTGRES_PASSWORD:?" in services["api"]["environment"]["RINGWATCH_DATABASE_URL"]


def test_the_image_runs_as_a_non_root_user_that_owns_the_state_dir() -> None:
    steps = dockerfile()
    users = [i for i, (op, _) in enumerate(steps) if op == "USER"]
    assert users, "the Dockerfile never leaves root"
    user = steps[users[-1]][1].split(":")[0]
    assert user not in ("root", "0")
    commands = [c.split() for op, args in steps if op == "RUN" for c in args.split("&&")]
    # The user USER names (by name or uid) is one the image creates.
    added = {c[-1]: c[c.index("--uid") + 1] if "--uid" in c else None
             for c in commands if c[0] == "useradd"}
    name = next((n for n, uid in added.items() if user in (n, uid)), None)
    assert name, f"USER {user} is not a user the Dockerfile creates"
    # The state dir (the scheduler's spool) is the user's, and the spool volume mounts there.
    state_dir = dict(a.split("=", 1) for op, a in steps if op == "ENV")["RINGWATCH_STATE_DIR"]
    assert any(c[0] == "chown" and c[1].split(":")[0] == name and state_dir in c[2:]
               for c in commands)
    mounts = [v.split(":") for v in load()["services"]["ray-head"]["volumes"]]
    assert ["spool", state_dir] in [m[:2] for m in mounts]


def test_long_running_services_restart_unless_stopped() -> None:
    one_shots = set()
    for name, svc in load()["services"].items():
        if svc.get("restart") == "no":  # the migration and the token bootstrap run once
            one_shots.add(name)
            continue
        assert svc.get("restart") == "unless-stopped", name
    assert one_shots == {"migrate", "agent-token"}


def test_the_api_is_published_where_the_operator_says_and_on_localhost_by_default() -> None:
    ports = load()["services"]["api"]["ports"]
    assert ports == ["${RINGWATCH_BIND:-127.0.0.1}:8420:8420"]
    # Only the TLS proxy publishes on every interface.
    for name, svc in load()["services"].items():
        if name != "tls-proxy":
            assert all(str(p).startswith("${RINGWATCH_BIND") for p in svc.get("ports", [])), name


def test_the_tls_proxy_is_optional_and_proxies_to_the_api() -> None:
    services = load()["services"]
    proxy = services["tls-proxy"]
    assert proxy["profiles"] == ["tls"]
    assert {"443:443"} <= set(proxy["ports"])
    config = next(v.split(":")[0] for v in proxy["volumes"] if v.startswith("./"))
    text = (ROOT / config).read_text()
    api_port = services["api"]["ports"][0].rsplit(":", 1)[1]
    assert re.search(rf"^\s*reverse_proxy\s+api:{api_port}\s*$", text, re.MULTILINE)
    assert "api" in services and proxy["depends_on"]["api"]["condition"] == "service_healthy"


def mounted(service: dict, container_path: str) -> Path:
    """The repository file or folder a service sees at ``container_path`` through its
    read-only bind mounts."""
    for volume in service.get("volumes", []):
        source, target, *mode = volume.split(":")
        if source.startswith("./") and (container_path + "/").startswith(target.rstrip("/") + "/"):
            assert mode == ["ro"], f"{volume} is not read-only"
            return ROOT / source / Path(container_path).relative_to(target)
    raise AssertionError(f"nothing is mounted at {container_path}")


def test_monitoring_is_an_optional_profile_of_prometheus_and_grafana() -> None:
    services = load()["services"]
    for name in ("prometheus", "grafana"):
        assert services[name]["profiles"] == ["monitoring"], name
        for volume in services[name]["volumes"]:
            if volume.startswith("./"):
                source, _, mode = volume.split(":")
                assert (ROOT / source).exists() and mode == "ro", volume
    # The default `docker compose up` is the one-machine shape it was.
    default = {n for n, s in services.items() if not s.get("profiles")}
    assert default == {"postgres", "migrate", "api", "agent-token", "ray-head", "ray-worker"}
    assert services["grafana"]["ports"] == ["${RINGWATCH_BIND:-127.0.0.1}:3000:3000"]


def test_prometheus_scrapes_the_apis_metrics_and_the_schedulers() -> None:
    services = load()["services"]
    prometheus = services["prometheus"]
    flag = next(a for a in prometheus["command"] if a.startswith("--config.file="))
    config = yaml.safe_load(mounted(prometheus, flag.split("=", 1)[1]).read_text())
    job, scheduler = config["scrape_configs"]
    # The scheduler serves its own on the port its command names.
    port = re.search(r"--health-port (\d+)", " ".join(services["ray-head"]["command"]))[1]
    assert scheduler["job_name"] == "ringwatch-scheduler"
    assert scheduler["static_configs"] == [{"targets": [f"ray-head:{port}"]}]
    api_port = services["api"]["ports"][0].rsplit(":", 1)[1]
    assert job["metrics_path"] == "/metrics"
    assert job["static_configs"] == [{"targets": [f"api:{api_port}"]}]
    assert prometheus["depends_on"]["api"]["condition"] == "service_healthy"
    # The API asks no token of a scrape unless told to; a token, when used, is a file.
    env = services["api"]["environment"]
    assert env["RINGWATCH_METRICS_TOKEN_REQUIRED"] == "${RINGWATCH_METRICS_TOKEN_REQUIRED:-false}"
    assert "credentials" not in job.get("authorization", {})


def test_grafana_provisions_the_prometheus_datasource_and_the_dashboard() -> None:
    services = load()["services"]
    grafana = services["grafana"]
    provisioning = mounted(grafana, "/etc/grafana/provisioning")
    [datasource] = [d for f in sorted((provisioning / "datasources").glob("*.yaml"))
                    for d in yaml.safe_load(f.read_text())["datasources"]]
    assert datasource["type"] == "prometheus"
    assert datasource["url"] == "http://prometheus:9090" and "prometheus" in services
    providers = [p for f in sorted((provisioning / "dashboards").glob("*.yaml"))
                 for p in yaml.safe_load(f.read_text())["providers"]]
    assert providers
    for provider in providers:
        folder = mounted(grafana, provider["options"]["path"])
        assert (folder / "ringwatch.json").is_file(), folder
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert mounted(grafana, home).is_file()
