"""The images, one per role: the Dockerfile's targets, their lock files, and how compose and
the Kubernetes manifests run them. Offline: no Docker engine, no registry.

A role is what `make lock` resolves (its `-o requirements/<role>.lock` and `--extra`s), the
Dockerfile target of the same name installs that lock, and compose and the manifests name
the image `ringwatch-<role>`.
"""

from __future__ import annotations

import fnmatch
import json
import re
import shlex
import tomllib
from functools import cache
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.test_deploy import KUSTOMIZATIONS, _containers, _parse, _ringwatch_argvs, find, render

ROOT = Path(__file__).resolve().parents[1]
SHELLS = ("sh", "bash", "/bin/sh", "/bin/bash")


# -- the roles `make lock` resolves ----------------------------------------------------------


@cache
def roles() -> dict[str, dict]:
    """role -> {"extras": set, "python": "X.Y"}, from the Makefile's lock recipe."""
    text = (ROOT / "Makefile").read_text().replace("\\\n", " ")
    recipe = text.split("\nlock:", 1)[1].split("\n\n", 1)[0]
    found = {}
    for line in recipe.splitlines():
        if "pip compile" not in line:
            continue
        words = shlex.split(line)
        role = Path(words[words.index("-o") + 1]).name.removesuffix(".lock")
        found[role] = {"extras": {words[i + 1] for i, w in enumerate(words) if w == "--extra"},
                       "python": words[words.index("--python-version") + 1]}
    assert set(found) == {"api", "agent"}, found
    return found


@cache
def lock(role: str) -> dict[str, tuple[str, list[str]]]:
    """package -> (version, hashes) of requirements/<role>.lock."""
    text = (ROOT / "requirements" / f"{role}.lock").read_text().replace("\\\n", " ")
    pins = {}
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        requirement, *options = line.split()
        name, sep, version = requirement.partition("==")
        assert sep and re.fullmatch(r"[\w.]+", version), f"{role}.lock: {line!r} is no exact pin"
        pins[canonicalize_name(name)] = (version, [o.removeprefix("--hash=") for o in options])
    return pins


def test_each_lock_pins_every_package_exactly_with_its_hashes() -> None:
    for role in roles():
        pins = lock(role)
        assert len(pins) > 10, role
        for name, (version, hashes) in pins.items():
            # A local build (+cpu) is no file the index serves, and no hash could check it.
            assert "+" not in version, f"{role}.lock: {name}=={version}"
            assert hashes and all(re.fullmatch(r"sha256:[0-9a-f]{64}", h) for h in hashes), name


def test_the_api_lock_has_neither_torch_nor_ray_and_the_agent_lock_has_both() -> None:
    api, agent = lock("api"), lock("agent")
    assert not {"torch", "ray", "triton"} & set(api)
    assert not any(name.startswith("nvidia-") for name in api)
    assert {"torch", "ray", "nvidia-ml-py"} <= set(agent)
    # PyPI's Linux torch is the CUDA build: its NCCL comes with it, as a wheel the lock pins.
    assert any(name.startswith("nvidia-nccl") for name in agent)
    constraints = [Requirement(line) for line in (ROOT / "constraints.txt").read_text().splitlines()
                   if line.strip() and not line.startswith("#")]
    torch = next(c for c in constraints if c.name == "torch")
    assert agent["torch"][0] in torch.specifier, "the agent runs the torch the tests run"


def _requirements(extras: set[str]) -> list[Requirement]:
    """What pyproject asks for the client and ``extras``, extras of ringwatch itself unfolded."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = [Requirement(r) for r in project["dependencies"]]
    todo, seen = list(extras), set()
    while todo:
        extra = todo.pop()
        seen.add(extra)
        for r in map(Requirement, project["optional-dependencies"][extra]):
            if r.name == project["name"]:
                todo += sorted(r.extras - seen)
            else:
                wanted.append(r)
    return wanted


def test_each_lock_holds_what_pyproject_declares_for_its_role_at_an_allowed_version() -> None:
    """A dependency added to pyproject without `make lock` fails here, before an image misses it."""
    for role, spec in roles().items():
        pins = lock(role)
        for requirement in _requirements(spec["extras"]):
            name = canonicalize_name(requirement.name)
            assert name in pins, f"{role}.lock lacks {requirement} (run make lock)"
            assert pins[name][0] in requirement.specifier, f"{role}.lock: {name} {pins[name][0]}"


# -- the Dockerfile --------------------------------------------------------------------------


@cache
def dockerfile() -> tuple[dict[str, str], dict[str, dict]]:
    """(global ARG defaults, stage -> {"from": image, "steps": [(INSTRUCTION, arguments)]})."""
    lines = [ln for ln in (ROOT / "Dockerfile").read_text().splitlines()
             if not ln.lstrip().startswith("#")]
    args: dict[str, str] = {}
    stages: dict[str, dict] = {}
    stage: dict | None = None
    for line in "\n".join(lines).replace("\\\n", " ").splitlines():
        if not line.strip():
            continue
        op, _, rest = line.strip().partition(" ")
        op, rest = op.upper(), rest.strip()
        if op == "FROM":
            image, _, name = rest.partition(" AS ")
            stage = stages.setdefault(name.strip().lower(), {"from": image.strip(), "steps": []})
        elif stage is None:
            assert op == "ARG", line
            key, _, default = rest.partition("=")
            args[key] = default
        else:
            stage["steps"].append((op, rest))
    return args, stages


def steps(stage: str, op: str) -> list[str]:
    return [rest for o, rest in dockerfile()[1][stage]["steps"] if o == op]


def _exec_form(text: str) -> list[str]:
    argv = json.loads(text)
    assert isinstance(argv, list) and argv and all(isinstance(a, str) for a in argv), text
    return argv


def entrypoint(stage: str) -> list[str]:
    return _exec_form(steps(stage, "ENTRYPOINT")[-1])


def test_every_entrypoint_cmd_and_healthcheck_is_exec_form() -> None:
    for stage, body in dockerfile()[1].items():
        for op, rest in body["steps"]:
            if op in ("ENTRYPOINT", "CMD"):
                argv = _exec_form(rest)
                assert argv[0] not in SHELLS, f"{stage}: {op} {rest}"
            elif op == "HEALTHCHECK":
                _exec_form(rest.split(" CMD ", 1)[1])
    for role in roles():
        # tini is PID 1: SIGTERM reaches ringwatch at once, and Ray's orphans are reaped.
        assert Path(entrypoint(role)[0]).name == "tini", role
        assert entrypoint(role)[1:] == ["--"]
        assert _exec_form(steps(role, "CMD")[-1])[0] == "ringwatch", role


def _python(stage: str) -> str:
    """The X.Y of the Python the stage's ringwatch runs on."""
    args, stages = dockerfile()
    image = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], stages[stage]["from"])
    if match := re.match(r"python:(\d+\.\d+)", image):
        return match.group(1)
    (venv,) = re.findall(r"python(\d+\.\d+) -m venv", " ".join(steps(stage, "RUN")))
    return venv


def test_each_role_installs_its_lock_without_resolving_then_ringwatch_not_editable() -> None:
    text = (ROOT / "Dockerfile").read_text()
    assert not re.search(r"pip install[^\n]*(\s-e\s|--editable)", text)
    # ringwatch's wheel is built once, from the source tree, and installs into both roles.
    (wheel_stage,) = [s for s in dockerfile()[1] if any(
        re.search(r"pip wheel .*--no-deps .*--wheel-dir (\S+) \.$", r) for r in steps(s, "RUN"))]
    for role, spec in roles().items():
        copied = dict(c.split() for c in steps(role, "COPY") if len(c.split()) == 2)
        lockfile = copied[f"requirements/{role}.lock"]
        commands = [shlex.split(c) for r in steps(role, "RUN") for c in r.split("&&")]
        installs = [c for c in commands if c[:2] == ["pip", "install"] and lockfile in c]
        assert installs, f"{role} does not install requirements/{role}.lock"
        assert {"--no-deps", "--require-hashes"} <= set(installs[0]), installs
        assert installs[0][installs[0].index(lockfile) - 1] == "-r"
        assert any(f"--from={wheel_stage}" in c for c in steps(role, "COPY"))
        wheel = [c for c in commands if c[:2] == ["pip", "install"] and c[-1].endswith(".whl")]
        assert wheel and "--no-deps" in wheel[0] and "ringwatch-" in wheel[0][-1], role
        # The lock was resolved for the Python that installs it.
        assert _python(role) == spec["python"], role


def test_the_wheel_carries_the_migrations_where_ringwatch_looks_for_them(tmp_path) -> None:
    """A non-editable install (every image, and `pip install 'ringwatch[server]'`) runs
    `ringwatch db upgrade` from the migrations the wheel put beside its packages."""
    import subprocess
    import sys
    import zipfile

    from ringwatch.services.store import db

    # Installed, services/store/db.py is <site-packages>/ringwatch/services/store/db.py.
    assert Path(db.__file__).resolve().parents[2] / "migrations" == db.MIGRATIONS_DIR
    import shutil

    # Built from a copy: a build writes its build tree and metadata beside the sources.
    src = tmp_path / "src"
    src.mkdir()
    for part in ("pyproject.toml", "setup.py", "README.md", "ringwatch", "agents", "services",
                 "api", "migrations"):
        copy = shutil.copytree if (ROOT / part).is_dir() else shutil.copy
        copy(ROOT / part, src / part, **({"symlinks": True} if part == "ringwatch" else {}))  # type: ignore[operator]
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(tmp_path), str(src)], check=True, capture_output=True)
    (wheel,) = tmp_path.glob("ringwatch-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    # Installed as ringwatch.migrations, beside ringwatch.services (MIGRATIONS_DIR).
    shipped = {f"ringwatch/migrations/{p.relative_to(ROOT / 'migrations')}" for p in
               (ROOT / "migrations").rglob("*") if p.is_file() and "__pycache__" not in p.parts}
    assert shipped and shipped <= names, sorted(shipped - names)


def test_the_api_image_checks_its_health_on_the_route_and_port_it_serves() -> None:
    from ringwatch.api.routers.meta import router

    (check,) = steps("api", "HEALTHCHECK")
    script = _exec_form(check.split(" CMD ", 1)[1])[-1]
    url = re.search(r"'(http://[^']+)'", script).group(1)
    serve = _parse(_exec_form(steps("api", "CMD")[-1])[1:])
    assert url == f"http://127.0.0.1:{serve.port}/healthz"
    assert "/healthz" in {r.path for r in router.routes}  # type: ignore[attr-defined]
    assert not steps("agent", "HEALTHCHECK")


def test_the_agent_image_has_the_fabric_libraries_and_nccls_ofi_plugin() -> None:
    assert dockerfile()[1]["agent"]["from"].startswith("nvidia/cuda:")
    assert not dockerfile()[1]["api"]["from"].startswith("nvidia/")
    packages = " ".join(steps("agent", "RUN"))
    for package in ("ibverbs-providers", "ibverbs-utils", "libfabric-bin", "hwloc-nox"):
        assert f" {package} " in f" {packages} ", package
    assert re.fullmatch(r"\d+\.\d+\.\d+", dockerfile()[0]["AWS_OFI_NCCL_VERSION"])
    (build,) = [s for s in dockerfile()[1] if any("aws-ofi-nccl" in r and "--prefix=" in r
                                                 for r in steps(s, "RUN"))]
    prefix = re.search(r"--prefix=(\S+)", " ".join(steps(build, "RUN"))).group(1)
    assert f"--from={build} {prefix} {prefix}" in steps("agent", "COPY")
    env = dict(e.split("=", 1) for e in steps("agent", "ENV"))
    assert f"{prefix}/lib" in env["LD_LIBRARY_PATH"].split(":")


def _ignored(patterns: list[str], path: str) -> bool:
    """Docker's rule: the last pattern that matches the path, or a folder above it, decides."""
    parts = path.split("/")
    ignored = False
    for pattern in patterns:
        keep = pattern.startswith("!")
        pattern = pattern.removeprefix("!").strip("/")
        prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
        options = {pattern, pattern.removeprefix("**/")}
        if any(fnmatch.fnmatchcase(p, o) for p in prefixes for o in options):
            ignored = not keep
    return ignored


def test_the_dockerignore_keeps_out_the_venv_and_state_and_lets_in_what_is_copied() -> None:
    patterns = [ln.strip() for ln in (ROOT / ".dockerignore").read_text().splitlines()
                if ln.strip() and not ln.startswith("#")]
    for path in (".venv/bin/python", ".ringwatch/pg/PG_VERSION", ".git/HEAD", ".gpu/out.json",
                 "tests/test_api.py", "services/__pycache__/config.cpython-311.pyc"):
        assert _ignored(patterns, path), path
    for stage in dockerfile()[1]:
        for copy in steps(stage, "COPY"):
            if copy.startswith("--from"):
                continue
            source = ROOT / copy.split()[0]
            files = [source] if source.is_file() else [p for p in source.rglob("*.py")]
            assert files, copy
            for file in files[:20]:
                assert not _ignored(patterns, file.relative_to(ROOT).as_posix()), file


# -- compose ---------------------------------------------------------------------------------


@cache
def compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]


def role_of(image: str) -> str | None:
    name = image.rsplit("/", 1)[-1].split(":")[0]
    return name.removeprefix("ringwatch-") if name.startswith("ringwatch-") else None


def _needs(argvs: list[list[str]], script: str) -> set[str]:
    """The extras the ringwatch commands in ``argvs`` and the Ray in ``script`` need."""
    from ringwatch.services.cli.extras import COMMAND_EXTRAS

    needs = set()
    for argv in argvs:
        args = _parse(argv)
        if not getattr(args, "api", None):  # token --api is the client's
            needs |= set(COMMAND_EXTRAS.get(args.command, ()))
    if re.search(r"(^|[;&|]\s*|exec\s+)ray\s|KUBERAY_GEN_RAY_START_CMD", script):
        needs.add("ray")
    return needs


def _script(argv: list[str]) -> str:
    """A service's command with compose's $$ unescaped: the shell script, or the argv joined."""
    text = argv[-1] if argv[0] in SHELLS else shlex.join(argv)
    return text.replace("$$", "$")


def _compose_argvs(argv: list[str]) -> list[list[str]]:
    """Every `ringwatch` a service's command runs, in its script's $(...) too."""
    script = _script(argv)
    runs = _ringwatch_argvs({"command": [a.replace("$$", "$") for a in argv]})
    return runs + [shlex.split(m)[1:] for m in re.findall(r"\$\((ringwatch [^)]*)\)", script)]


def test_compose_builds_each_role_from_its_target_and_runs_what_the_role_has() -> None:
    built = {}
    for name, svc in compose().items():
        if "build" not in svc:
            continue
        target = svc["build"]["target"]
        assert target in roles() and role_of(svc["image"]) == target, name
        argv = svc["command"]
        assert isinstance(argv, list), f"{name}: a string command runs under /bin/sh -c"
        needs = _needs(_compose_argvs(argv), _script(argv))
        assert needs <= roles()[target]["extras"], f"{name} needs {needs} of {target}"
        built[name] = target
    assert set(built.values()) == set(roles())


def test_compose_services_run_under_tini_and_a_shell_ends_in_exec() -> None:
    for name, svc in compose().items():
        if "build" not in svc:
            continue
        pid1 = svc.get("entrypoint") or entrypoint(svc["build"]["target"])
        assert pid1[0] not in SHELLS or svc.get("init"), f"{name}: a shell is PID 1"
        assert Path(pid1[0]).name == "tini" or svc.get("init"), name
        argv = svc["command"]
        if argv[0] in SHELLS and svc["restart"] != "no":
            # The shell hands its place to the long-running process, so SIGTERM reaches it.
            last = [s.strip() for s in re.split(r"[;\n]|&&", _script(argv)) if s.strip()][-1]
            assert last.startswith("exec "), f"{name}: {last}"
        if svc["restart"] != "no":
            assert "stop_grace_period" in svc, name


def _depends(svc: dict, on: str) -> str:
    return svc["depends_on"][on]["condition"]


def test_compose_migrates_once_before_the_api_serves() -> None:
    services = compose()
    upgrade = ["ringwatch", "db", "upgrade"]
    (migrate,) = [n for n, s in services.items() if s.get("command") == upgrade]
    assert services[migrate]["restart"] == "no"
    api = services["api"]
    assert _depends(api, migrate) == "service_completed_successfully"
    assert _parse(api["command"][1:]).command == "serve"
    assert services[migrate]["environment"]["RINGWATCH_DATABASE_URL"] == \
        api["environment"]["RINGWATCH_DATABASE_URL"]


def test_compose_bootstraps_the_schedulers_agent_token_through_the_api() -> None:
    services = compose()
    (maker,) = [n for n, s in services.items()
                if "token create --role agent" in str(s.get("command"))]
    svc = services[maker]
    script = _script(svc["command"])
    (create,) = [a for a in _compose_argvs(svc["command"]) if a[0] == "token"]
    args = _parse(create)
    assert args.role == "agent" and args.api == "http://api:8420"
    # It asks as the admin the API was given, once the API is healthy.
    assert svc["environment"]["RINGWATCH_TOKEN"] == \
        services["api"]["environment"]["RINGWATCH_BOOTSTRAP_ADMIN_TOKEN"]
    assert _depends(svc, "api") == "service_healthy" and svc["restart"] == "no"
    written = re.search(r"^file=(\S+)$", script, re.MULTILINE).group(1)
    # The scheduler starts after it, reading the file it wrote, from the same volume.
    head = services["ray-head"]
    assert _depends(head, maker) == "service_completed_successfully"
    assert f"RINGWATCH_TOKEN=$(cat {written})" in _script(head["command"])
    assert "RINGWATCH_TOKEN" not in head["environment"]
    volume, mount = next(v.split(":")[:2] for v in svc["volumes"])
    assert written.startswith(mount + "/")
    assert f"{volume}:{mount}:ro" in head["volumes"]


# -- Kubernetes ------------------------------------------------------------------------------


def test_each_kubernetes_container_runs_its_roles_image_under_tini() -> None:
    seen = set()
    for directory in KUSTOMIZATIONS:
        for doc in render(directory):
            for c in _containers(doc):
                role = role_of(c["image"])
                assert role in roles(), f"{doc['metadata']['name']} {c['name']}: {c['image']}"
                # `command` would replace the image's entrypoint, tini, as PID 1.
                assert "command" not in c and c["args"], c["name"]
                script = " ".join(c["args"])
                needs = _needs(_ringwatch_argvs(c), script)
                assert needs <= roles()[role]["extras"], f"{c['name']} needs {needs} of {role}"
                seen.add((c["name"], role))
    assert {("api", "api"), ("notifier", "api"), ("migrate", "api"), ("ray-head", "agent"),
            ("ray-worker", "agent")} <= seen


def test_the_raycluster_and_the_images_run_the_locked_ray() -> None:
    ray = lock("agent")["ray"][0]
    for directory in KUSTOMIZATIONS:
        assert find(render(directory), "RayCluster", "ringwatch")["spec"]["rayVersion"] == ray
    for path in ("Dockerfile", "docker-compose.yml"):
        text = (ROOT / path).read_text()
        named = re.findall(r"\bray(?:\[[\w,]*\])?==([\w.]+)|rayproject/ray:([\d.]+)", text)
        assert all(ray in pair for pair in named), f"{path} names Ray {named}, the lock {ray}"


@pytest.mark.parametrize("role", ["api", "agent"])
def test_each_role_image_leaves_root_for_the_state_dirs_owner(role: str) -> None:
    users = steps(role, "USER")
    assert users and users[-1].split(":")[0] == "10001"
    runs = " && ".join(steps(role, "RUN"))
    assert re.search(r"useradd .*--uid 10001 .* ringwatch(\s|$)", runs)
    state = dict(e.split("=", 1) for e in steps(role, "ENV"))["RINGWATCH_STATE_DIR"]
    assert re.search(rf"chown ringwatch:ringwatch [^&]*{re.escape(state)}(\s|$)", runs)


# -- versions --------------------------------------------------------------------------------


def test_every_image_and_the_migration_job_carry_this_ringwatchs_version_never_latest() -> None:
    """What a node pulls is the code these manifests were written for: each ringwatch image
    is tagged with pyproject's version (what `ringwatch --version` says), in compose, in every
    kustomization's rendering and in the example, and the Dockerfile labels it so."""
    from ringwatch.services.version import ringwatch_version
    from tests.test_deploy import EXAMPLE, MIGRATE_JOB

    version = ringwatch_version()
    assert version == tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    refs = [svc["image"] for svc in compose().values() if role_of(svc.get("image", ""))]
    for directory in KUSTOMIZATIONS:
        refs += [c["image"] for doc in render(directory) for c in _containers(doc)
                 if role_of(c["image"])]
    refs += [c["image"] for doc in yaml.safe_load_all(EXAMPLE.read_text()) if doc
             for c in _containers(doc) if role_of(c["image"])]
    assert refs and {ref.rsplit(":", 1)[-1] for ref in refs} == {version}, refs
    base = yaml.safe_load((KUSTOMIZATIONS[0] / "kustomization.yaml").read_text())
    assert {i["newTag"] for i in base["images"]} == {version}
    args, _ = dockerfile()
    assert args["RINGWATCH_VERSION"] == version
    for role in roles():
        assert "RINGWATCH_VERSION" in steps(role, "ARG")
        assert 'org.opencontainers.image.version="${RINGWATCH_VERSION}"' in " ".join(
            steps(role, "LABEL")), role
    assert find(render(KUSTOMIZATIONS[0]), "Job", MIGRATE_JOB)["spec"]["ttlSecondsAfterFinished"] > 0
