"""Rank-map parsing and the checks that need no fleet: examples and properties."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ringwatch.services.errors import BadInput
from ringwatch.services.rankmap import checks
from ringwatch.services.rankmap.checks import RankEntry


def contiguous(slots: list[int]) -> list[RankEntry]:
    """A sound table: host-000 holds ranks 0..k0-1, host-001 the next k1, and so on."""
    out: list[RankEntry] = []
    for h, k in enumerate(slots):
        out.extend(RankEntry(len(out), f"host-{h:03d}", i) for i in range(k))
    return out


def problems(result: dict) -> list[str]:
    return [f["problem"] for f in result["findings"]]


def only(result: dict, problem: str) -> list[dict]:
    return [f for f in result["findings"] if f["problem"] == problem]


def renumbered(entries: list[RankEntry], order: list[int]) -> list[RankEntry]:
    """The same GPUs, rank i given to entries[order[i]]."""
    return [RankEntry(i, entries[j].host, entries[j].local_rank, entries[j].gpu_uuid)
            for i, j in enumerate(order)]


slot_counts = st.lists(st.integers(1, 8), min_size=1, max_size=6)


# -- parsing ----------------------------------------------------------------------------


def test_hostfile_forms_comments_and_local_ranks() -> None:
    text = "# job 42\nnode-a slots=2\nnode-b:2   # two GPUs\n\nnode-c\nnode-c max_slots=8\n"
    assert [(e.rank, e.host, e.local_rank) for e in checks.parse_rank_table(text)] == [
        (0, "node-a", 0), (1, "node-a", 1), (2, "node-b", 0), (3, "node-b", 1),
        (4, "node-c", 0), (5, "node-c", 1)]


def test_json_list_and_wrapped_forms_agree() -> None:
    rows = [{"rank": 0, "host": "a", "local_rank": 0, "gpu_uuid": "GPU-1"},
            {"rank": 1, "host": "a", "local_rank": 1}]
    listed = checks.parse_rank_table(json.dumps(rows))
    assert listed == checks.parse_rank_table(json.dumps({"ranks": rows}))
    assert listed[0].gpu_uuid == "GPU-1" and listed[1].gpu_uuid is None
    assert checks.parse_rank_table(json.dumps({"hostfile": "a slots=2"})) == [
        RankEntry(0, "a", 0), RankEntry(1, "a", 1)]


@pytest.mark.parametrize("text,needle", [
    ("[]", "empty"),
    ("{", "not valid JSON"),
    ('{"rank": []}', '{"ranks": [...]}'),
    ('[{"rank": 0, "host": "a"}]', "missing local_rank"),
    ('[{"rank": -1, "host": "a", "local_rank": 0}]', "rank must be"),
    ('[{"rank": true, "host": "a", "local_rank": 0}]', "rank must be"),
    ('[{"rank": 0, "host": "a b", "local_rank": 0}]', "host"),
    ('[{"rank": 0, "host": "a", "local_rank": 0, "gpu": 1}]', "unknown field"),
    ('[{"rank": 0, "host": "a", "local_rank": 1.5}]', "local_rank must be"),
    ("a slots=0", "line 1: slots"),
    ("a\nb:x", "line 2: slots"),
    ("a cpus=4", "unknown option"),
    ("a slots 4", "line 1"),
    ("# nothing\n\n", "no hosts"),
])
def test_bad_tables_name_the_reason(text: str, needle: str) -> None:
    with pytest.raises(BadInput) as err:
        checks.parse_rank_table(text)
    assert needle in err.value.message


# -- examples ---------------------------------------------------------------------------


def test_each_structural_problem() -> None:
    table = [RankEntry(0, "a", 0, "GPU-x"), RankEntry(1, "a", 1, "GPU-x"), RankEntry(1, "b", 0),
             RankEntry(4, "b", 2), RankEntry(5, "b", 0)]
    result = checks.check_offline(table)
    assert result["ok"] is False and result["ranks"] == 5 and result["hosts"] == 2
    assert all(f["kind"] == "rank_mapping" for f in result["findings"])
    (dup_rank,) = only(result, "duplicate_rank")
    assert dup_rank["rank"] == 1
    (missing,) = only(result, "missing_rank")
    assert missing["missing"] == [2, 3] and missing["world_size"] == 6
    by_slot, by_uuid = only(result, "duplicate_gpu")
    assert (by_slot["node"], by_slot["local_rank"], by_slot["ranks"]) == ("b", 0, [1, 5])
    assert by_uuid["gpu_uuid"] == "GPU-x" and by_uuid["ranks"] == [0, 1]
    (gap,) = only(result, "local_rank_mismatch")
    assert gap["node"] == "b" and gap["missing_local_ranks"] == [1]
    assert result["skipped"] == ["unknown_host", "unhealthy_host", "gpu_local_index"]


def test_interleaved_hosts_are_non_contiguous_with_a_fix() -> None:
    table = checks.parse_hostfile("a\nb\na\nb\n")  # Slurm's cyclic distribution
    (f,) = checks.check_offline(table)["findings"]
    assert f["problem"] == "non_contiguous" and (f["crossings"], f["minimum_crossings"]) == (4, 2)
    assert [(e["rank"], e["host"], e["local_rank"]) for e in f["suggested_order"]] == [
        (0, "a", 0), (1, "a", 1), (2, "b", 0), (3, "b", 1)]


def test_one_host_and_a_wrapping_ring_are_minimal() -> None:
    assert checks.check_offline(contiguous([8]))["findings"] == []
    # a a b b a: the ring wraps from rank 4 back to rank 0 on the same host.
    wrapped = checks.parse_hostfile("a:2\nb:2\na\n")
    assert checks.check_offline(wrapped) == {"ok": True, "ranks": 5, "hosts": 2, "findings": [],
                                             "skipped": ["unknown_host", "unhealthy_host"]}


def test_ring_crossing_counts() -> None:
    assert checks.ring_crossings([]) == checks.ring_crossings(["a"]) == 0
    assert checks.ring_crossings(["a", "a", "b"]) == 2
    assert checks.ring_crossings(["a", "b", "a", "b", "c"]) == 5
    assert [checks.minimum_crossings(h) for h in (0, 1, 2, 7)] == [0, 0, 2, 7]


# -- properties -------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(slot_counts)
def test_a_contiguous_table_is_sound(slots: list[int]) -> None:
    result = checks.check_offline(contiguous(slots))
    assert result["ok"] and result["ranks"] == sum(slots) and result["hosts"] == len(slots)


@settings(max_examples=60, deadline=None)
@given(slot_counts, st.randoms(use_true_random=False))
def test_shuffled_table_is_exactly_non_contiguous_and_the_fix_is_minimal(slots, rnd) -> None:
    table = contiguous(slots)
    order = list(range(len(table)))
    rnd.shuffle(order)
    shuffled = renumbered(table, order)
    result = checks.check_offline(shuffled)
    crossings = checks.ring_crossings([e.host for e in checks.ring_order(shuffled)])
    least = checks.minimum_crossings(len(slots))
    assert crossings >= least
    assert problems(result) == (["non_contiguous"] if crossings > least else [])

    fixed = checks.suggested_order(shuffled)
    assert checks.ring_crossings([e.host for e in fixed]) == least
    assert sorted((e.host, e.local_rank) for e in fixed) == sorted((e.host, e.local_rank) for e in table)
    assert checks.check_offline(fixed)["findings"] == []
    if result["findings"]:
        (f,) = result["findings"]
        assert (f["crossings"], f["minimum_crossings"]) == (crossings, least)
        suggested = checks.parse_json_table(f["suggested_order"])
        assert suggested == fixed and checks.check_offline(suggested)["ok"]


@settings(max_examples=60, deadline=None)
@given(slot_counts.filter(lambda s: sum(s) >= 2), st.data())
def test_removing_a_rank_is_missing_rank(slots, data) -> None:
    table = contiguous(slots)
    gone = data.draw(st.integers(0, len(table) - 2), label="removed rank")  # not the last
    result = checks.check_offline([e for e in table if e.rank != gone])
    (f,) = only(result, "missing_rank")
    assert f["missing"] == [gone] and f["missing_count"] == 1 and f["world_size"] == len(table)
    assert set(problems(result)) <= {"missing_rank", "local_rank_mismatch"}


@settings(max_examples=60, deadline=None)
@given(slot_counts, st.data())
def test_duplicating_an_entry_is_duplicate_rank_and_gpu(slots, data) -> None:
    table = contiguous(slots)
    twin = data.draw(st.sampled_from(table), label="duplicated entry")
    position = data.draw(st.integers(0, len(table)), label="inserted at")
    result = checks.check_offline([*table[:position], twin, *table[position:]])
    (f,) = only(result, "duplicate_rank")
    assert f["rank"] == twin.rank and len(f["entries"]) == 2
    (g,) = only(result, "duplicate_gpu")
    assert (g["node"], g["local_rank"]) == (twin.host, twin.local_rank)
    assert "missing_rank" not in problems(result)


@settings(max_examples=40, deadline=None)
@given(slot_counts)
def test_hostfile_of_a_table_parses_back_to_it(slots: list[int]) -> None:
    text = "\n".join(f"host-{h:03d} slots={k}" for h, k in enumerate(slots))
    assert checks.parse_hostfile(text) == contiguous(slots)
