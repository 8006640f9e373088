"""The shipped Kubernetes example gates a trainer on a preflight (the Slurm prolog is tested
against a real Slurm in tests/test_slurm.py)."""

from __future__ import annotations

from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def test_k8s_example_gates_the_trainer_on_preflight() -> None:
    pod = yaml.safe_load((ROOT / "examples" / "k8s-init-container.yaml").read_text())
    init = pod["spec"]["initContainers"][0]
    assert init["command"][:2] == ["ringwatch", "preflight"]
    assert {e["name"] for e in init["env"]} >= {"RINGWATCH_API_URL", "RINGWATCH_TOKEN"}
