"""What each role costs to install and to start: a fresh virtual environment per role, built
from this checkout (non-editable, with constraints.txt, as `make` installs), its size on
disk, and the wall time, CPU time and peak memory of the role's first step.

    python -m bench.roles            # client, server, agent, and all (the one install of before)
    python -m bench.roles --keep     # reuse environments already built for this pyproject
    python -m bench.roles --against=REV   # before and after: REV's tree, by its own bench
    python -m bench.roles --against=none  # this tree alone

A role's environment and its first step may grow by at most 10 % over the baseline (BASELINE,
unless --against names another revision): the baseline's own ``bench/roles.py`` builds its
tree's environments and names their first steps, both trees' starts are timed in turn on the
same machine in the same run, and the table says how each role moved.

The environments live under .ringwatch/bench-envs/ (pip fetches from the package index the
way a user's install would; the first run takes minutes)."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parent.parent
ENVS = ROOT / ".ringwatch" / "bench-envs"
# The tree before ringwatch's one import name and its wheel-based install docs: what each
# role's size and start are held to (within GROWTH_BOUND of it).
BASELINE = "ab76013"
GROWTH_BOUND = 0.10

# role -> (what it installs, its first step: argv run in the environment's python)
ROLES: dict[str, tuple[str, list[str]]] = {
    # A Slurm prolog's call: the API is not there, so this is the cost of saying so.
    "client": ("", ["-m", "ringwatch.services.cli.main", "preflight", "--api", "http://127.0.0.1:9",
                    "--nodes", "node-000"]),
    # What `serve` loads before it binds: the app, the notifier, the store.
    "server": ("[server]", ["-c", "import api.app, services.notifier.loop, services.store.db"]),
    # What a GPU agent loads before it probes: torch.distributed, NVML, Ray.
    "agent": ("[agent,ray]", ["-c", "import agents.probe, services.scheduler.ray_backend"]),
    # Before: every role installed all of it.
    "all": ("[all]", ["-m", "ringwatch.services.cli.main", "preflight", "--api", "http://127.0.0.1:9",
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


def one_start(venv: Path, argv: list[str]) -> dict[str, float]:
    """One cold start of a role's first step, outside this checkout (so the environment's
    own install is what loads)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RINGWATCH_")}
    env["RINGWATCH_TOKEN"] = "rw_bench"
    started = time.monotonic()
    out = subprocess.run([sys.executable, "-c", _MEASURE, str(venv / "bin" / "python"), *argv],
                         cwd=ENVS, env=env, capture_output=True, text=True, timeout=300)
    wall = time.monotonic() - started
    cpu, peak_kb = out.stdout.split()
    return {"wall_s": wall, "cpu_s": float(cpu), "peak_mb": int(peak_kb) / 1024}


def median(samples: list[dict[str, float]]) -> dict[str, float]:
    """Each figure's own median."""
    return {k: round(sorted(s[k] for s in samples)[len(samples) // 2], 2) for k in samples[0]}


def first_step(venv: Path, argv: list[str], runs: int = 3) -> dict[str, float]:
    """The median of ``runs`` cold starts of the role's first step."""
    return median([one_start(venv, argv) for _ in range(runs)])


def row(role: str, extra: str, venv: Path, start: dict[str, float]) -> dict:
    has = {m: (venv / "lib").glob(f"python3*/site-packages/{m}") for m in ("torch", "ray")}
    return {"role": role, "installs": f"ringwatch{extra}", "size_mb": round(size_mb(venv)),
            "torch": any(has["torch"]), "ray": any(has["ray"]), **start}


def load_baseline(rev: str, keep: bool) -> ModuleType | None:
    """``rev``'s own bench/roles.py, run from a copy of ``rev``'s tree: its roles, its extras,
    its first steps (its module names) and its environments; None where this checkout has no
    such revision."""
    tree = ENVS / f"baseline-{rev}"
    if not (keep and (tree / "bench" / "roles.py").exists()):
        archive = subprocess.run(["git", "archive", "--format=tar", rev], cwd=ROOT,
                                 capture_output=True)
        if archive.returncode != 0:
            print(f"no baseline: git archive {rev}: {archive.stderr.decode().strip()}")
            return None
        shutil.rmtree(tree, ignore_errors=True)
        tree.mkdir(parents=True)
        subprocess.run(["tar", "-x", "-C", str(tree)], input=archive.stdout, check=True)
    spec = importlib.util.spec_from_file_location(f"bench_roles_{rev}", tree / "bench" / "roles.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not all(hasattr(module, a) for a in ("ROLES", "build", "ENVS")):
        print(f"no baseline: {rev}'s bench/roles.py has no ROLES and build() to compare with")
        return None
    module.ENVS.mkdir(parents=True, exist_ok=True)
    return module


def measure(keep: bool, baseline: ModuleType | None, runs: int = 3) -> tuple[list[dict], list[dict]]:
    """Each role of this tree, and of the baseline where there is one: the environment, and
    the median of ``runs`` cold starts of its first step, the two trees' starts taken in
    turn so that both meet the same load on a busy machine."""
    ENVS.mkdir(parents=True, exist_ok=True)
    after_envs = {role: build(role, keep) for role in ROLES}
    before_roles = baseline.ROLES if baseline is not None else {}
    before_envs = {role: baseline.build(role, keep) for role in before_roles} \
        if baseline is not None else {}
    after, before = [], []
    for role, (extra, argv) in ROLES.items():
        mine: list[dict[str, float]] = []
        theirs: list[dict[str, float]] = []
        for _ in range(runs):
            mine.append(one_start(after_envs[role], argv))
            if role in before_envs:
                theirs.append(one_start(before_envs[role], before_roles[role][1]))
        after.append(row(role, extra, after_envs[role], median(mine)))
        if theirs:
            before.append(row(role, before_roles[role][0], before_envs[role], median(theirs)))
    return after, before


def print_rows(rows: list[dict]) -> None:
    print(f"{'role':<8} {'installs':<22} {'env MB':>7} {'torch':>6} {'ray':>4} "
          f"{'start s':>8} {'CPU s':>6} {'peak MB':>8}")
    for r in rows:
        print(f"{r['role']:<8} {r['installs']:<22} {r['size_mb']:>7} {str(r['torch']):>6} "
              f"{str(r['ray']):>4} {r['wall_s']:>8} {r['cpu_s']:>6} {r['peak_mb']:>8.0f}")


def _growth(before: float, after: float) -> float:
    return (after - before) / before if before else 0.0


def print_against(rev: str, before: list[dict], after: list[dict]) -> None:
    """Each role before (``rev``) and after (this tree), and which grew past the bound: the
    environment's size, the first step's wall and CPU time and its peak memory."""
    old = {r["role"]: r for r in before}
    print(f"\nbefore ({rev}) -> after (this tree); growth over {GROWTH_BOUND:.0%} marked !")
    print(f"{'role':<8} {'env MB':>20} {'start s':>20} {'CPU s':>20} {'peak MB':>20}")
    over = []
    for r in after:
        b = old.get(r["role"])
        if b is None:
            print(f"{r['role']:<8} (not in {rev})")
            continue
        cells = []
        for key, fmt in (("size_mb", ".0f"), ("wall_s", ".2f"), ("cpu_s", ".2f"),
                         ("peak_mb", ".0f")):
            g = _growth(b[key], r[key])
            mark = "!" if g > GROWTH_BOUND else " "
            if mark == "!":
                over.append(f"{r['role']} {key} {g:+.0%}")
            cells.append(f"{b[key]:{fmt}} -> {r[key]:{fmt}} {g:+4.0%}{mark}")
        print(f"{r['role']:<8} " + " ".join(f"{c:>20}" for c in cells))
    if over:
        print(f"grew by more than {GROWTH_BOUND:.0%}: {', '.join(over)}")
    else:
        print(f"no role's environment or start grew by more than {GROWTH_BOUND:.0%}")


def main(flags: list[str]) -> None:
    keep = "--keep" in flags
    against = next((f.split("=", 1)[1] for f in flags if f.startswith("--against=")), BASELINE)
    runs = 5 if against != "none" else 3
    baseline = load_baseline(against, keep) if against != "none" else None
    after, before = measure(keep, baseline, runs)
    print_rows(after)
    print(json.dumps(after))
    if before:
        print_against(against, before, after)


if __name__ == "__main__":
    main(sys.argv[1:])
