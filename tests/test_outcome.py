"""How the ranks' replies become findings: who is blamed for an error, who is a victim."""

from __future__ import annotations

from ringwatch.agents.outcome import error_findings, failed_ranks
from ringwatch.agents.spec import GroupSpec

SPEC = GroupSpec("intra_node", ("n/0", "n/1", "n/2"), ops=("allreduce",), sizes=(64,))


def _err(origin: str, stage: str = "allreduce/64", error: str = "boom") -> dict:
    return {"status": "error", "origin": origin, "stage": stage, "error": error}


def test_the_rank_whose_code_failed_is_blamed_and_its_peers_are_victims() -> None:
    replies = {0: _err("local", error="CUDA out of memory"), 1: _err("collective"),
               2: _err("collective")}
    assert set(failed_ranks(replies, {})) == {0}
    [finding] = error_findings(SPEC, replies, {}, [("error", "n/0")])
    assert (finding.kind, finding.node, finding.gpu) == ("probe_error", "n", 0)
    assert finding.detail["peers_failed"] == ["n/1", "n/2"]
    assert finding.detail["injected"] is True
    assert "out of memory" in finding.detail["error"]


def test_a_dead_agent_is_blamed_over_the_ranks_that_saw_the_collective_break() -> None:
    replies = {0: _err("collective"), 1: {"status": "ok", "probes": []}}
    blamed = failed_ranks(replies, {2: "actor died"})
    assert blamed == {2: {"stage": "agent_died", "error": "actor died", "origin": "agent_died"}}
    [finding] = error_findings(SPEC, replies, {2: "actor died"})
    assert finding.gpu == 2 and finding.detail["peers_failed"] == ["n/0"]
    assert "injected" not in finding.detail


def test_when_only_the_collective_broke_every_rank_that_saw_it_is_reported() -> None:
    replies = {0: _err("collective"), 1: _err("collective"), 2: {"status": "ok", "probes": []}}
    assert sorted(failed_ranks(replies, {})) == [0, 1]
    assert [f.gpu for f in error_findings(SPEC, replies, {})] == [0, 1]


def test_setup_errors_are_the_ranks_own() -> None:
    replies = {1: _err("setup", stage="setup", error="GPU 1 is not present")}
    assert failed_ranks(replies, {})[1]["origin"] == "setup"


def test_no_errors_no_findings() -> None:
    replies = {r: {"status": "ok", "probes": []} for r in range(3)}
    assert failed_ranks(replies, {}) == {} and error_findings(SPEC, replies, {}) == []
