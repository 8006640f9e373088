"""The wheel a user installs holds one import name, ringwatch: built from this checkout and
installed into a fresh virtual environment (no dependencies: what is checked is where the
files land and which names import), ``import ringwatch`` works there, and the generic names
the repository's folders have (agents, api, services, migrations) do not import at all, so
a training environment's own packages of those names neither shadow ringwatch nor are
shadowed by it."""

from __future__ import annotations

import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    str(ROOT), "-w", str(out)], check=True, capture_output=True, timeout=600)
    (built,) = out.glob("ringwatch-*.whl")
    return built


def test_the_wheel_installs_one_top_level_name(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/", 1)[0] for n in names if not n.split("/", 1)[0].endswith(".dist-info")}
    assert tops == {"ringwatch"}
    for must in ("ringwatch/__init__.py", "ringwatch/agents/probe.py",
                 "ringwatch/services/cli/main.py", "ringwatch/api/app.py",
                 "ringwatch/migrations/env.py", "ringwatch/migrations/script.py.mako",
                 "ringwatch/api/ui/index.html"):
        assert must in names, must
    assert any(n.startswith("ringwatch/migrations/versions/0001_") for n in names)
    entry = zipfile.ZipFile(wheel).read(
        next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert "ringwatch = ringwatch.services.cli.main:main" in entry


def test_in_a_fresh_environment_only_ringwatch_imports(wheel: Path, tmp_path: Path) -> None:
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    python = env_dir / "bin" / "python"
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", str(wheel)],
                   check=True, capture_output=True, timeout=600)

    def imports(name: str) -> bool:
        # From a folder of its own, so the checkout is not on the path.
        return subprocess.run([str(python), "-c", f"import {name}"], cwd=tmp_path,
                              capture_output=True, timeout=120).returncode == 0

    assert imports("ringwatch")
    assert imports("ringwatch.agents.counter_delta")  # the standard library is all it needs
    for generic in ("agents", "api", "services", "migrations"):
        assert not imports(generic), f"`import {generic}` works from the wheel"
