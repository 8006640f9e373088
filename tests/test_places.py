"""One way to write where something is (agents.places), on every text surface: node lists as
Slurm host lists, GPU sets as ranges, a node's GPUs as ``node-003 GPUs 2,5``."""

from __future__ import annotations

import os
from datetime import UTC, datetime, timedelta
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from ringwatch.agents.hostlist import compress_hostlist, expand_hostlist
from ringwatch.agents.places import finding_place, gpu_set, members_text, node_list, place
from ringwatch.services.cli import slurm
from ringwatch.services.cli.output import print_verdict
from ringwatch.services.cli.status import FleetStatus, plain
from ringwatch.services.notifier.channels import render_slack
from ringwatch.services.scheduler.probe_table import format_table
from tests.procs import cli

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "scenario.json"


def test_node_lists_and_gpu_sets_read_one_way() -> None:
    assert node_list(["node-004", "node-002", "node-003", "node-009"]) == "node-[002-004,009]"
    assert node_list(["node-9", "node-10", "node-11"]) == "node-[9-11]"  # unpadded: one run
    assert node_list(["node-099", "node-100"]) == "node-[099-100]"
    assert node_list(["gpu-b", "node-001", "gpu-a"]) == "node-001,gpu-a,gpu-b"
    assert gpu_set([2, 5]) == "2,5" and gpu_set([1, 0]) == "0-1" and gpu_set([0, 1, 2, 3, 6]) == "0-3,6"
    assert place(["node-003"], [2, 5]) == "node-003 GPUs 2,5"
    assert place(["node-004"], [1]) == "node-004 GPU 1"
    assert finding_place({"node": "node-003", "gpus": [5, 2]}) == "node-003 GPUs 2,5"
    assert finding_place({"node": "node-004", "gpu": 0}) == "node-004 GPU 0"
    assert finding_place({"nodes": ["node-007", "node-001"]}) == "node-[001,007]"
    assert finding_place({"kind": "fabric_below_rated"}) == ""
    # A stored record's odd value is shown as it is, never a crash.
    assert finding_place({"node": "n1", "gpus": [1, "x"]}) == "n1 GPUs 1,x"
    assert finding_place({"node": "n1", "gpus": "abc"}) == "n1 GPUs abc"
    assert members_text(["node-001/1", "node-000/0", "node-000/1", "node-001/0"]) == (
        "node-[000-001] GPUs 0-1")
    assert members_text(["node-002/3", "node-000/0"]) == "node-000 GPU 0; node-002 GPU 3"


def test_a_long_node_list_is_cut_with_a_count_of_the_rest() -> None:
    names = [f"node-{i:03d}" for i in range(0, 300, 2)]
    cut = node_list(names, width=30)
    shown, more = cut.rsplit(" +", 1)
    assert len(shown) <= 30 and more.endswith(" more")
    assert len(expand_hostlist(shown)) + int(more.split()[0]) == len(names)
    assert node_list(names[:2], width=30) == "node-[000,002]"


@settings(deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["node-", "n"]), st.integers(0, 1500),
                          st.sampled_from([1, 2, 4])), max_size=40))
def test_a_printed_node_list_expands_to_its_nodes(parts) -> None:
    names = [f"{p}{n:0{w}d}" for p, n, w in parts]
    assert sorted(expand_hostlist(compress_hostlist(names))) == sorted(set(names))


def test_the_cli_verdict_writes_places_one_way() -> None:
    r = cli("preflight", "--fabric", str(EXAMPLE), env=dict(os.environ))
    assert r.returncode == 1, r.stderr
    lines = r.stdout.splitlines()
    assert lines[1] == "exclude: node-[002-004,009,011]"
    places = {line.split()[0]: line.split(None, 1)[1] for line in lines[2:]}
    assert places["hang"].startswith("node-004 GPU 1 [")
    assert places["nvlink_degraded"].startswith("node-003 GPUs 2,5 allreduce")
    assert places["topology_mismatch"].startswith("node-002 GPUs 0-1 ")
    assert places["net_path_degraded"].startswith("node-[001,007] ")


def test_the_verdicts_other_node_lists(capsys) -> None:
    print_verdict({"healthy": False, "nodes_checked": 8, "backend": "nccl", "rounds": 1,
                   "duration_s": 1.0, "exclude": [], "findings": [],
                   "suspects": ["node-005", "node-006"], "unprobed": ["node-1", "node-2"],
                   "contended": ["node-007"]}, as_json=False)
    out = capsys.readouterr().out
    assert "slow in an earlier cycle, not in the latest; --confirm re-probes them): node-[005-006]" in out
    assert "no fresh results for: node-[1-2]" in out
    assert "(a job's): node-007" in out


def test_status_writes_an_incidents_place_one_way() -> None:
    now = datetime.now(UTC)
    incidents = [
        {"id": 1, "kind": "nvlink_degraded", "severity": "critical", "nodes": ["node-003"],
         "detail": {"gpus": [2, 5]}, "opened_at": (now - timedelta(minutes=5)).isoformat()},
        {"id": 2, "kind": "hang", "severity": "critical", "nodes": ["node-004"],
         "detail": {"gpu": 1}, "opened_at": now.isoformat()},
        {"id": 3, "kind": "net_path_degraded", "severity": "critical",
         "nodes": ["node-007", "node-001"], "detail": {}, "opened_at": now.isoformat()},
        {"id": 4, "kind": "fabric_below_rated", "severity": "critical",
         "nodes": [f"node-{i:03d}" for i in range(0, 400, 3)], "detail": {},
         "opened_at": now.isoformat()},
    ]
    status = FleetStatus("http://api", {"status": "degraded", "nodes": 400, "links": {}},
                         incidents, {}, {}, now)
    rows = {line.split()[0]: line for line in plain(status).splitlines()[-4:]}
    assert "node-003 GPUs 2,5" in rows["1"] and "node-004 GPU 1" in rows["2"]
    assert "node-[001,007]" in rows["3"]
    assert "node-[000,003," in rows["4"] and " more" in rows["4"]


def test_the_drain_reason_the_webhook_and_the_probe_table_write_places_one_way() -> None:
    from ringwatch.agents.spec import Measurement

    verdict = {"exclude": ["node-003"], "findings": [
        {"kind": "nvlink_degraded", "node": "node-003", "gpus": [2, 5], "severity": "critical"}]}
    assert slurm.reason_for(verdict, "node-003") == "ringwatch: nvlink_degraded node-003 GPUs 2,5"
    path = {"kind": "net_path_degraded", "nodes": ["node-001", "node-007"], "severity": "critical"}
    assert slurm.clean_reason(f"ringwatch: x {finding_place(path)}") == "ringwatch: x node-[001,007]"
    assert render_slack("health.degraded", 1, {"finding": path})["text"] == (
        "[ringwatch] health.degraded: net_path_degraded node-[001,007]")
    assert render_slack("health.degraded", 1, {"finding": verdict["findings"][0]})["text"] == (
        "[ringwatch] health.degraded: nvlink_degraded node-003 GPUs 2,5")
    m = Measurement(op="allreduce", scope="inter_node", size_bytes=1 << 20, dtype="float32",
                    members=["node-000/0", "node-000/1", "node-001/0", "node-001/1"], warmup=1,
                    iters=1, time_us=1.0, algbw_gbs=1.0, busbw_gbs=1.0, wrong=0)
    assert format_table([m]).splitlines()[0] == (
        "# allreduce  inter_node  4 ranks: node-[000-001] GPUs 0-1")
