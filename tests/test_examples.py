"""The shipped Kubernetes example gates a trainer on its node's verdict, as the Slurm prolog
does (tested against a real Slurm in tests/test_slurm.py; the gate itself in
tests/test_kubernetes_sync.py)."""

from __future__ import annotations

from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def test_k8s_example_gates_the_trainer_on_its_nodes_verdict_failing_open() -> None:
    from ringwatch.services.cli.main import build_parser

    pod = yaml.safe_load((ROOT / "examples" / "k8s-init-container.yaml").read_text())
    init = pod["spec"]["initContainers"][0]
    args = build_parser().parse_args(init["command"][1:])
    assert (args.command, args.kubernetes_command) == ("kubernetes", "check")
    # The prolog's default: an API that cannot answer within the bound lets the pod start.
    assert args.on_error == "open" and 0 < args.bound <= 300
    assert {e["name"] for e in init["env"]} >= {"RINGWATCH_API_URL", "RINGWATCH_TOKEN",
                                                "NODE_NAME"}
