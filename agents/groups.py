"""A group of ranks and its members: one value type that parses, keys, orders and prints
them, for the agents, the analyzer, the store and the API alike.

A member is ``NODE/LOCAL_INDEX`` (``node-003/5``); a group is its members whatever their
ring order. Its ``key`` is what the store and the API name its series by: the members
sorted and comma-joined, or ``sha256:`` and the hash of that text for a group too large
to index that way (a world group). Node names sort as people count (``node_order``).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Iterator
from functools import cached_property, lru_cache

from ringwatch.agents.places import members_text

# A node's name: hostname-like ASCII (letters, digits, ".", "_", "-"; a letter or digit
# first, no "." last: "node-000." is node-000 with the DNS root spelled out). Invisible,
# bidirectional and look-alike characters are refused by construction: five names that all
# render as "node-000" cannot be five nodes. Letters keep their case (a site's hosts may be
# upper-case), but a name is one node whatever its case: the store refuses a new name that
# differs only in case from a node it holds (services.store.nodes.twins_in_fleet).
NODE_NAME = r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,251}[A-Za-z0-9_-])?"
# A rank's index on its node: ASCII digits, no leading zero, so each index has one spelling
# (\d would take "٣" and "１", and "00" would be 0 again).
LOCAL_INDEX = r"0|[1-9][0-9]{0,5}"
# Whole-string rules (fullmatch): `$` would also match before a final newline.
_NODE = re.compile(NODE_NAME)
_MEMBER = re.compile(rf"(?P<node>{NODE_NAME})/(?P<local>{LOCAL_INDEX})")
# A group printed longer than this is printed by its size.
MAX_PRINTED = 80
# Postgres cannot index a btree key over about 2.7 kB (a 100-node group's member list).
MAX_PLAIN_KEY = 512
HASHED_KEY_PREFIX = "sha256:"


def is_node_name(name: str) -> bool:
    """Whether ``name`` is a node name (``NODE_NAME``, the whole string)."""
    return _NODE.fullmatch(name) is not None


def check_node_name(name: str) -> str:
    """``name`` when it is a node name (``NODE_NAME``); ValueError saying why otherwise."""
    if not is_node_name(name):
        raise ValueError(f"node name {name!r} is not hostname-like: 1-253 ASCII letters, "
                         "digits, '.', '_' or '-', starting with a letter or digit and not "
                         "ending with '.'")
    return name


def case_twins(names: Iterable[str]) -> list[list[str]]:
    """The names among ``names`` that are one host in more than one case (``node-000`` and
    ``NODE-000``), each set sorted: host names ignore case, so each is one node named twice."""
    by_host: dict[str, set[str]] = {}
    for name in names:
        by_host.setdefault(name.lower(), set()).add(name)
    return sorted(sorted(v) for v in by_host.values() if len(v) > 1)


def member(node: str, local_index: int) -> str:
    """A rank's name in a group: ``NODE/LOCAL_INDEX``."""
    return f"{node}/{local_index}"


@lru_cache(maxsize=1 << 17)
def split_member(name: str) -> tuple[str, int]:
    """``"node-001/3"`` -> ``("node-001", 3)``; ValueError on anything else. Kept per name:
    a check reads the same ranks' names in every group and judgement."""
    m = _MEMBER.fullmatch(name)
    if m is None:
        raise ValueError(f"member {name!r} is not NODE/LOCAL_INDEX (a node name, '/', and "
                         "its index in ASCII digits without leading zeros)")
    return m["node"], int(m["local"])


def node_of(name: str) -> str:
    """The node of a member name."""
    return split_member(name)[0]


def nodes_of(members: Iterable[str]) -> list[str]:
    """The distinct nodes of a member list, in first-seen order."""
    seen: dict[str, None] = {}
    for m in members:
        seen.setdefault(split_member(m)[0], None)
    return list(seen)


@lru_cache(maxsize=1 << 16)
def group_nodes(members: tuple[str, ...]) -> frozenset[str]:
    """The set of nodes of a group's members, kept per group: the judgement asks it of the
    same groups after every round of a check."""
    return frozenset(nodes_of(members))


_DIGIT_RUN = re.compile(r"(\d+)")


def node_order(name: str) -> tuple[str | tuple[int, str], ...]:
    """Sort key that orders node names as people count them: digit runs compare as numbers,
    so node-341 comes before node-1019 (as text it would not), and names without digits keep
    their text order. Distinct names never tie (node-01 before node-1). For node lists people
    read (a verdict's ``exclude``, a finding's nodes); identity keys stay sorted as text."""
    parts = _DIGIT_RUN.split(name)  # text, digits, text, ...: digit runs at odd positions
    return tuple((int(p), p) if i % 2 else p for i, p in enumerate(parts))


def member_order(name: str) -> tuple[tuple[str | tuple[int, str], ...], int]:
    """Sort key of a member: its node as people count, then its local index."""
    node, local = split_member(name)
    return node_order(node), local


def series_key(members: Iterable[str]) -> str:
    """The key the store and the API name a group's series by (``Group.key``)."""
    canonical = ",".join(sorted(members))
    if len(canonical) <= MAX_PLAIN_KEY:
        return canonical
    return HASHED_KEY_PREFIX + hashlib.sha256(canonical.encode()).hexdigest()


class Group:
    """A group of ranks by its members, whatever their ring order: equal, hashed, keyed and
    ordered by the sorted member list (an identity, as text); printed, and sorted for
    people with ``sort_key``, as people read node names."""

    __slots__ = ("members", "_hash", "__dict__")

    def __init__(self, members: Iterable[str]) -> None:
        self.members: tuple[str, ...] = tuple(sorted(members))
        self._hash = hash(self.members)

    @classmethod
    def parse(cls, text: str) -> Group:
        """A group from its members comma-joined (``node-000/0,node-001/0``); ValueError
        naming the first member that is not ``NODE/LOCAL_INDEX``, or for an empty list."""
        names = [m.strip() for m in text.split(",") if m.strip()]
        if not names:
            raise ValueError("a group needs at least one member (NODE/LOCAL_INDEX, comma-joined)")
        for name in names:
            split_member(name)
        return cls(names)

    @cached_property
    def nodes(self) -> tuple[str, ...]:
        """The group's distinct nodes as people count them."""
        return tuple(sorted(group_nodes(self.members), key=node_order))

    @cached_property
    def key(self) -> str:
        """Its series key: the members comma-joined, or ``sha256:`` of that text where it
        is too long to index."""
        return series_key(self.members)

    @property
    def size(self) -> int:
        return len(self.members)

    def locals_on(self, node: str) -> list[int]:
        """The local indices of its members on ``node``, ascending."""
        return sorted(local for n, local in map(split_member, self.members) if n == node)

    def sort_key(self) -> tuple[object, ...]:
        """Order for lists people read: nodes as people count, then local indices."""
        return tuple(sorted(member_order(m) for m in self.members))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Group):
            return self._hash == other._hash and self.members == other.members
        return NotImplemented

    def __hash__(self) -> int:
        return self._hash

    def __lt__(self, other: Group) -> bool:
        return self.members < other.members

    def __len__(self) -> int:
        return len(self.members)

    def __iter__(self) -> Iterator[str]:
        return iter(self.members)

    def __str__(self) -> str:
        """Members as every text surface prints them (agents.places): nodes as a host list
        with the GPUs they hold (``node-003 GPUs 2,5``, ``node-[000-015] GPUs 0-7``); a
        group too scattered for one line by its size."""
        text = members_text(self.members)
        if len(text) > MAX_PRINTED:
            return f"{len(self.members)} ranks on {len(self.nodes)} nodes"
        return text

    def __repr__(self) -> str:
        return f"Group({self.key!r})"
