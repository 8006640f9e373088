"""What each role costs to install and to start: a fresh virtual environment per role, built
from this checkout (non-editable, with constraints.txt, as `make` installs), its size on
disk, and the wall time, CPU time and peak memory of the role's first step.

    python -m bench.roles            # client, server, agent, and all (the one install of before)
    python -m bench.roles --keep     # reuse environments already built for this pyproject

The environments live under .ringwatch/bench-envs/ (pip fetches from the package index the
way a user's install would; the first run takes minutes)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ENVS = ROOT / ".ringwatch" / "bench-envs"

# role -> (what it installs, its first step: argv run in the environment's python)
ROLES: dict[str, tuple[str, list[str]]] = {
    # A Slurm prolog's call: the API is not there, so this is the cost of saying so.
    "client": ("", ["-m", "services.cli.main", "preflight", "--api", "http://127.0.0.1:9",
                    "--nodes", "node-000"]),
    # What `serve` loads before it binds: the app, the notifier, the store.
    "server": ("[server]", ["-c", "import api.app, services.notifier.loop, services.store.db"]),
    # What a GPU agent loads before it probes: torch.distributed, NVML, Ray.
    "agent": ("[agent,ray]", ["-c", "import agents.probe, services.scheduler.ray_backend"]),
    # Before: every role installed all of it.
    "all": ("[all]", ["-m", "services.cli.main", "preflight", "--api", "http://127.0.0.1:9",
                      "--nodes", "node-000"]),
}


def _stamp() -> str:
    text = (ROOT / "pyproject.toml").read_bytes() + (ROOT / "constraints.txt").read_bytes()
    return hashlib.sha256(text).hexdigest()[:12]


def build(role: str, keep: bool) -> Path:
    venv = ENVS / role
    stamp = venv / ".stamp"
    if keep and stamp.exists() and stamp.read_text() == _stamp():
        return venv
    shutil.rmtree(venv, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    # A copy of the source: a non-editable build writes its build tree beside the sources.
    src = ENVS / f"src-{role}"
    shutil.rmtree(src, ignore_errors=True)
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(
        ".venv", ".ringwatch", ".git", ".gpu", "__pycache__", "*.egg-info", "build"))
    subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--no-cache-dir",
                    "-c", str(ROOT / "constraints.txt"), f"{src}{ROLES[role][0]}"], check=True)
    shutil.rmtree(src)
    stamp.write_text(_stamp())
    return venv


def size_mb(path: Path) -> float:
    total = sum(f.lstat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())
    return total / 1e6


# Runs argv[1:] and prints its CPU seconds and peak RSS (KB): a process of its own, so no
# earlier child (pip) counts toward the peak.
_MEASURE = ("import resource, subprocess, sys; subprocess.run(sys.argv[1:], capture_output=True); "
            "r = resource.getrusage(resource.RUSAGE_CHILDREN); "
            "print(r.ru_utime + r.ru_stime, r.ru_maxrss)")


def first_step(venv: Path, argv: list[str], runs: int = 3) -> dict[str, float]:
    """The median of ``runs`` cold starts of the role's first step, outside this checkout
    (so the environment's own install is what loads)."""
    samples = []
    env = {k: v for k, v in os.environ.items() if not k.startswith("RINGWATCH_")}
    env["RINGWATCH_TOKEN"] = "rw_bench"
    for _ in range(runs):
        started = time.monotonic()
        out = subprocess.run([sys.executable, "-c", _MEASURE, str(venv / "bin" / "python"), *argv],
                             cwd=ENVS, env=env, capture_output=True, text=True, timeout=300)
        wall = time.monotonic() - started
        cpu, peak_kb = out.stdout.split()
        samples.append({"wall_s": wall, "cpu_s": float(cpu), "peak_mb": int(peak_kb) / 1024})
    samples.sort(key=lambda s: s["wall_s"])
    return samples[len(samples) // 2]


def main(flags: list[str]) -> None:
    keep = "--keep" in flags
    ENVS.mkdir(parents=True, exist_ok=True)
    rows = []
    for role, (extra, argv) in ROLES.items():
        venv = build(role, keep)
        has = {m: (venv / "lib").glob(f"python3*/site-packages/{m}") for m in ("torch", "ray")}
        rows.append({"role": role, "installs": f"ringwatch{extra}",
                     "size_mb": round(size_mb(venv)),
                     "torch": any(has["torch"]), "ray": any(has["ray"]),
                     **{k: round(v, 2) for k, v in first_step(venv, argv).items()}})
    print(f"{'role':<8} {'installs':<22} {'env MB':>7} {'torch':>6} {'ray':>4} "
          f"{'start s':>8} {'CPU s':>6} {'peak MB':>8}")
    for r in rows:
        print(f"{r['role']:<8} {r['installs']:<22} {r['size_mb']:>7} {str(r['torch']):>6} "
              f"{str(r['ray']):>4} {r['wall_s']:>8} {r['cpu_s']:>6} {r['peak_mb']:>8.0f}")
    print(json.dumps(rows))


if __name__ == "__main__":
    main(sys.argv[1:])
