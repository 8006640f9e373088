"""Slurm's compressed host lists: ``node[001-004,007],gpu-a[1-2]b`` to the names in it.

``scontrol show hostnames`` does this where Slurm is installed; a prolog or a launcher
elsewhere hands ringwatch the list as Slurm wrote it (``SLURM_JOB_NODELIST``), and a sim
scenario's jobs name their nodes the same way. The standard library only: the client command
line and the agents both read it.
"""

from __future__ import annotations

import re

# A bracket group's ranges: 001-004 or 7, zero padding taken from the lower bound.
_RANGE = re.compile(r"^([0-9]+)(?:-([0-9]+))?\Z")
# No host list this large is a job's: refuse rather than expand without end.
MAX_HOSTS = 1_000_000


def split_top(text: str) -> list[str]:
    """Split at the commas outside brackets."""
    parts, depth, start = [], 0, 0
    for i, c in enumerate(text):
        if c == "[":
            depth += 1
            if depth > 1:
                raise ValueError(f"nested brackets in host list {text!r}")
        elif c == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"unbalanced ']' in host list {text!r}")
        elif c == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth:
        raise ValueError(f"unclosed '[' in host list {text!r}")
    parts.append(text[start:])
    return [p.strip() for p in parts if p.strip()]


def _numbers(group: str, whole: str) -> list[str]:
    out: list[str] = []
    for item in group.split(","):
        m = _RANGE.match(item.strip())
        if not m:
            raise ValueError(f"bad range {item!r} in host list {whole!r}")
        lo, hi = m.group(1), m.group(2) or m.group(1)
        if int(hi) < int(lo):
            raise ValueError(f"range {item!r} runs backwards in host list {whole!r}")
        if int(hi) - int(lo) >= MAX_HOSTS:
            raise ValueError(f"range {item!r} in host list {whole!r} is too large")
        width = len(lo)
        out += [str(n).zfill(width) for n in range(int(lo), int(hi) + 1)]
    return out


def _expand_one(pattern: str, whole: str) -> list[str]:
    m = re.search(r"\[([^\]]*)\]", pattern)
    if not m:
        return [pattern]
    head, tail = pattern[:m.start()], pattern[m.end():]
    rests = _expand_one(tail, whole)
    names = [f"{head}{n}{rest}" for n in _numbers(m.group(1), whole) for rest in rests]
    if len(names) > MAX_HOSTS:
        raise ValueError(f"host list {whole!r} names more than {MAX_HOSTS} hosts")
    return names


def expand_hostlist(text: str) -> list[str]:
    """Every host ``text`` names, in order, each once."""
    names: list[str] = []
    for part in split_top(text):
        names += _expand_one(part, text)
    return list(dict.fromkeys(names))
