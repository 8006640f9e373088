"""Slurm's compressed host lists: ``node[001-004,007],gpu-a[1-2]b`` to the names in it.

``scontrol show hostnames`` does this where Slurm is installed; a prolog or a launcher
elsewhere hands ringwatch the list as Slurm wrote it (``SLURM_JOB_NODELIST``), a sim
scenario's jobs name their nodes the same way, and the API takes host lists wherever it takes
node names. The standard library only: the client command line and the agents both read it.

Written here rather than taken from python-hostlist or ClusterShell: the count is known before
a name is built, from the ranges alone, and bounded by the caller (a request's list maximum),
across every part of the list. ClusterShell's NodeSet builds every name in a set first (ten
million in 12 s, with only an ``assert`` against 10^9) and sorts away the order given;
python-hostlist bounds each part, not the list, at a module-wide 100 000, and is GPL-2+ with
a top-level ``hostlist`` module and four commands it would add to a training environment.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterable, Iterator

# A bracket group's ranges: 001-004 or 7, zero padding taken from the lower bound. At most
# 18 digits: no host is numbered past that, and int() of a longer string is bounded work.
_RANGE = re.compile(r"([0-9]{1,18})(?:-([0-9]{1,18}))?")
_GROUP = re.compile(r"\[([^\]]*)\]")
# No host list this large is a job's: refuse rather than expand without end.
MAX_HOSTS = 1_000_000

# One bracket group: its ranges as (low, high, zero-padded width).
Ranges = list[tuple[int, int, int]]


class TooManyHosts(ValueError):
    """Host lists that name more hosts than the caller takes; said before any name is built."""


def split_top(text: str) -> list[str]:
    """Split at the commas outside brackets."""
    parts, depth, start = [], 0, 0
    for i, c in enumerate(text):
        if c == "[":
            depth += 1
            if depth > 1:
                raise ValueError(f"nested brackets in host list {_shown(text)}")
        elif c == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"unbalanced ']' in host list {_shown(text)}")
        elif c == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth:
        raise ValueError(f"unclosed '[' in host list {_shown(text)}")
    parts.append(text[start:])
    # Spaces after a comma are a person's; any other whitespace stays, for the name rule to
    # refuse ("node-000\n" is not a second spelling of node-000).
    return [p.strip(" ") for p in parts if p.strip(" ")]


def _shown(text: str) -> str:
    """``text`` quoted for an error message, cut: a request's host list may be megabytes."""
    return repr(text) if len(text) <= 80 else f"{text[:77]!r}..."


def _ranges(group: str, whole: str) -> Ranges:
    out: Ranges = []
    for item in group.split(","):
        m = _RANGE.fullmatch(item.strip(" "))
        if not m:
            raise ValueError(f"bad range {item[:40]!r} in host list {_shown(whole)}")
        lo, hi = int(m.group(1)), int(m.group(2) or m.group(1))
        if hi < lo:
            raise ValueError(f"range {item!r} runs backwards in host list {_shown(whole)}")
        out.append((lo, hi, len(m.group(1))))
    return out


def _parse(part: str, whole: str) -> tuple[list[str], list[Ranges]]:
    """A part's text between its bracket groups (one more than the groups), and the groups."""
    texts, groups, start = [], [], 0
    for m in _GROUP.finditer(part):
        texts.append(part[start:m.start()])
        groups.append(_ranges(m.group(1), whole))
        start = m.end()
    texts.append(part[start:])
    return texts, groups


def _count(groups: list[Ranges], limit: int) -> int:
    """How many names the groups make, or a number past ``limit`` once it is clear."""
    n = 1
    for ranges in groups:
        n *= sum(hi - lo + 1 for lo, hi, _ in ranges)
        if n > limit:
            break
    return n


def _names(texts: list[str], groups: list[Ranges]) -> Iterator[str]:
    numbers = [[str(n).zfill(width) for lo, hi, width in ranges for n in range(lo, hi + 1)]
               for ranges in groups]
    for picked in itertools.product(*numbers):
        yield texts[0] + "".join(n + t for n, t in zip(picked, texts[1:], strict=True))


def expand_hostlists(texts: Iterable[str], limit: int = MAX_HOSTS) -> list[str]:
    """Every host the host lists ``texts`` name, in order, each once. TooManyHosts, before a
    name is built, when they name more than ``limit`` (a name repeated counts each time);
    ValueError when one does not parse."""
    texts = list(texts)
    parsed = [(text, _parse(part, text)) for text in texts for part in split_top(text)]
    total = 0
    for text, (_, groups) in parsed:
        total += _count(groups, limit)
        if total > limit:
            raise TooManyHosts(f"host list {_shown(text)} names more than {limit} hosts"
                             if len(texts) == 1 else f"the host lists name more than {limit} "
                             f"hosts (past it at {_shown(text)})")
    names: dict[str, None] = {}
    for _, (strings, groups) in parsed:
        names.update(dict.fromkeys(_names(strings, groups)))
    return list(names)


def expand_hostlist(text: str, limit: int = MAX_HOSTS) -> list[str]:
    """Every host ``text`` names, in order, each once (``expand_hostlists`` of one)."""
    return expand_hostlists([text], limit)


_TAIL = re.compile(r"^(.*?)([0-9]+)\Z")


def compress_hostlist(names: list[str]) -> str:
    """The names as Slurm writes a host list, for a person to read: runs of one prefix and
    zero-padded width with consecutive numbers become ``node-[000-153,160]`` (unpadded ones
    ``node-[8-12]``); the inverse of ``expand_hostlist`` for the names given (order: by
    prefix, then number)."""
    runs: dict[tuple[str, int], list[int]] = {}
    plain: list[str] = []
    tails: list[tuple[str, str]] = []
    for name in dict.fromkeys(names):
        m = _TAIL.match(name)
        if m is None:
            plain.append(name)
            continue
        tails.append((m.group(1), m.group(2)))
    # A number of a zero-padded width in use joins that width's run (node-[098-100]); the
    # others are unpadded, one run whatever their digits (node-[8-12]).
    padded = {(prefix, len(d)) for prefix, d in tails if len(d) > 1 and d[0] == "0"}
    for prefix, d in tails:
        runs.setdefault((prefix, len(d) if (prefix, len(d)) in padded else 1), []).append(int(d))
    parts = []
    for (prefix, width), numbers in sorted(runs.items(), key=lambda r: (r[0][0], min(r[1]))):
        numbers.sort()
        spans: list[str] = []
        start = prev = numbers[0]
        for n in [*numbers[1:], None]:
            if n is not None and n == prev + 1:
                prev = n
                continue
            spans.append(f"{start:0{width}d}" + (f"-{prev:0{width}d}" if prev != start else ""))
            if n is not None:
                start = prev = n
        one = len(spans) == 1 and "-" not in spans[0]
        parts.append(f"{prefix}{spans[0]}" if one else f"{prefix}[{','.join(spans)}]")
    return ",".join(parts + sorted(plain))


def index_ranges(indices: list[int] | tuple[int, ...]) -> str:
    """GPU indices as a person reads them: ``0-7``, ``0,2,4-5``."""
    out: list[str] = []
    for i in sorted(set(indices)):
        if out and out[-1].split("-")[-1] == str(i - 1):
            out[-1] = f"{out[-1].split('-')[0]}-{i}"
        else:
            out.append(str(i))
    return ",".join(out)
