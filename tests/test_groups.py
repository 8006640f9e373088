"""One identity for a group and its members: parsed, keyed, ordered and printed alike."""

from __future__ import annotations

import hashlib

import pytest

from ringwatch.agents.groups import (
    MAX_PLAIN_KEY,
    Group,
    member,
    member_order,
    node_of,
    nodes_of,
    series_key,
    split_member,
)


def test_a_group_is_its_members_whatever_their_ring_order() -> None:
    a = Group(["node-001/1", "node-000/3", "node-000/0"])
    b = Group(("node-000/0", "node-001/1", "node-000/3"))
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    assert a.members == ("node-000/0", "node-000/3", "node-001/1")
    assert a != Group(["node-000/0", "node-000/3"])


def test_its_key_is_the_sorted_members_or_their_hash_when_too_long_to_index() -> None:
    g = Group(["node-001/0", "node-000/0"])
    assert g.key == "node-000/0,node-001/0" == series_key(["node-001/0", "node-000/0"])
    world = Group(member(f"node-{n:04d}", i) for n in range(64) for i in range(8))
    text = ",".join(world.members)
    assert len(text) > MAX_PLAIN_KEY
    assert world.key == "sha256:" + hashlib.sha256(text.encode()).hexdigest()


def test_parse_takes_the_comma_joined_key_and_refuses_what_is_not_a_member() -> None:
    assert Group.parse("node-001/0, node-000/0") == Group(["node-000/0", "node-001/0"])
    with pytest.raises(ValueError, match="node-000 "):
        Group.parse("node-000 /0")
    with pytest.raises(ValueError, match="not NODE/LOCAL_INDEX"):
        Group.parse("node-000")
    with pytest.raises(ValueError, match="at least one member"):
        Group.parse(" , ")


def test_nodes_and_order_follow_how_people_count() -> None:
    g = Group(["node-10/0", "node-2/1", "node-2/0"])
    assert g.nodes == ("node-2", "node-10")
    assert g.locals_on("node-2") == [0, 1]
    # Identity order is the text's (as keys sort); people's order is ``sort_key``.
    assert sorted([Group(["node-2/0"]), Group(["node-10/0"])]) == [Group(["node-10/0"]),
                                                                   Group(["node-2/0"])]
    assert sorted([Group(["node-10/0"]), Group(["node-2/0"])], key=Group.sort_key) == [
        Group(["node-2/0"]), Group(["node-10/0"])]
    assert sorted(["node-10/1", "node-2/7", "node-2/10"], key=member_order) == [
        "node-2/7", "node-2/10", "node-10/1"]
    assert nodes_of(["node-3/0", "node-1/0", "node-3/1"]) == ["node-3", "node-1"]
    assert node_of("node-3/4") == "node-3" and split_member("a.b-c/12") == ("a.b-c", 12)


def test_printed_as_people_read_it() -> None:
    assert str(Group(["node-003/5", "node-003/2"])) == "node-003 GPUs 2,5"
    assert str(Group(["node-1/0", "node-0/0"])) == "node-[0-1] GPU 0"
    assert str(Group(["node-1/0", "node-0/1"])) == "node-0 GPU 1; node-1 GPU 0"
    whole = Group(member(f"node-{n}", i) for n in range(16) for i in range(8))
    assert str(whole) == "node-[0-15] GPUs 0-7"
    scattered = Group(member(f"node-{n}", n % 8) for n in range(0, 64, 3))
    assert str(scattered) == "22 ranks on 22 nodes"
    assert repr(Group(["n/0"])) == "Group('n/0')"
