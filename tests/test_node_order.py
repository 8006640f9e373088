"""Node lists people read are in natural order: node-341 before node-1019, as they count."""

from __future__ import annotations

import re

from hypothesis import given
from hypothesis import strategies as st

from ringwatch.agents.groups import check_node_name, node_order
from ringwatch.agents.spec import Finding
from ringwatch.services.analyzer.verdict import build_verdict

# Node names (agents.groups.NODE_NAME), kept short.
names = st.from_regex(r"\A[A-Za-z0-9](?:[A-Za-z0-9._-]{0,22}[A-Za-z0-9_-])?\Z").map(check_node_name)
no_digits = st.from_regex(r"\A[A-Za-z._-]{1,24}\Z")


def test_numbers_compare_as_numbers() -> None:
    assert node_order("node-2") < node_order("node-10")
    assert node_order("node-341") < node_order("node-1019")
    assert sorted(["node-1019", "node-341", "node-2", "node-10"], key=node_order) == [
        "node-2", "node-10", "node-341", "node-1019"]


def test_mixed_names_compare_run_by_run() -> None:
    assert sorted(["gpu10-rack1", "gpu7-rack10", "gpu7-rack2", "b", "a", "node-0"],
                  key=node_order) == ["a", "b", "gpu7-rack2", "gpu7-rack10", "gpu10-rack1",
                                      "node-0"]
    # Zero-padded names (the sim's node-000...) keep their text order.
    padded = [f"node-{i:03d}" for i in range(120)]
    assert sorted(reversed(padded), key=node_order) == padded


@given(st.lists(no_digits, max_size=20))
def test_names_without_digits_keep_their_text_order(xs: list[str]) -> None:
    assert sorted(xs, key=node_order) == sorted(xs)


@given(names, names)
def test_distinct_names_never_tie(a: str, b: str) -> None:
    assert (node_order(a) == node_order(b)) == (a == b)
    # A total order: exactly one of <, ==, > holds.
    assert [node_order(a) < node_order(b), a == b, node_order(b) < node_order(a)].count(True) == 1


def test_leading_zeros_break_ties() -> None:
    assert sorted(["node-1", "node-01", "node-001"], key=node_order) == [
        "node-001", "node-01", "node-1"]


@given(st.lists(st.integers(0, 10**6), max_size=30), st.sampled_from(["node-", "n", "gpu-a"]))
def test_numbered_names_sort_by_their_number(numbers: list[int], prefix: str) -> None:
    got = sorted((f"{prefix}{n}" for n in numbers), key=node_order)
    assert [int(re.sub(r"\D", "", name)) for name in got] == sorted(numbers)


def test_a_verdict_excludes_nodes_in_natural_order() -> None:
    findings = [Finding("hang", node="node-1019", gpu=0), Finding("nvlink_degraded", node="node-341"),
                Finding("nic_degraded", node="node-99")]
    v = build_verdict(backend="sim", nodes=["node-99", "node-341", "node-1019", "node-1000"],
                      findings=findings, rounds=1, duration_s=1.0)
    assert v["exclude"] == ["node-99", "node-341", "node-1019"]
