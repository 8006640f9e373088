"""Which Ray versions the scheduler and the agents really run on: for each version, an
environment where pip resolves ringwatch's dependencies around that Ray (as a cluster's own
training environment would), and the Ray tests of this checkout run in it.

    python -m bench.compat                 # the versions in VERSIONS
    python -m bench.compat 2.40.0 2.30.0   # these

pyproject.toml's `ray` floor is the oldest version this passes on; docs/install.md lists the
runs. The environments live under .ringwatch/compat/ (pip fetches Ray from the package index;
each takes a few minutes the first time)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ENVS = ROOT / ".ringwatch" / "compat"
VERSIONS = ("2.60.0", "2.40.0", "2.30.0", "2.20.0", "2.10.0", "2.5.1")
# The tests that start real Ray clusters and run gloo collectives on them.
TESTS = ("tests/test_address_mode.py", "tests/test_probe_ray.py", "tests/test_backend_protocol.py")


def requirements() -> list[str]:
    """Every dependency of every role but Ray, and the test runner's."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = list(project["dependencies"])
    for extra, listed in project["optional-dependencies"].items():
        if extra in ("agent", "server", "demo", "dev"):
            reqs += [r for r in listed if not r.startswith("ringwatch")]
    return [r for r in reqs if not re.match(r"ray\b", r)]


def environment(version: str) -> Path:
    venv = ENVS / f"ray-{version}"
    python = venv / "bin" / "python"
    if not (venv / ".ready").exists():
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", "-c",
                        str(ROOT / "constraints.txt"), f"ray=={version}", *requirements()],
                       check=True)
        (venv / ".ready").write_text(version)
    return python


def run(version: str) -> tuple[str, str, float]:
    started = time.monotonic()
    try:
        python = environment(version)
    except subprocess.CalledProcessError:
        return version, "no install (pip could not resolve it here)", time.monotonic() - started
    # ringwatch is not installed there: the checkout is on the path of the driver and of the
    # workers Ray starts (older Ray does not hand its workers the driver's directory).
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", *TESTS],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    tail = (r.stdout.strip().splitlines() or ["(no output)"])[-1]
    return version, f"exit {r.returncode}: {tail}", time.monotonic() - started


def main(flags: list[str]) -> None:
    versions = [f for f in flags if not f.startswith("-")] or list(VERSIONS)
    ENVS.mkdir(parents=True, exist_ok=True)
    print(f"{'ray':<8} {'took s':>7}  result of {' '.join(TESTS)}")
    for version in versions:
        v, result, took = run(version)
        print(f"{v:<8} {took:>7.0f}  {result}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
