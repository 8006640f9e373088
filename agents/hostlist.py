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
    numbers = _numbers(m.group(1), whole)
    # Checked before building: two groups under the limit each can name 10^12 together.
    if len(numbers) * len(rests) > MAX_HOSTS:
        raise ValueError(f"host list {whole!r} names more than {MAX_HOSTS} hosts")
    return [f"{head}{n}{rest}" for n in numbers for rest in rests]


def expand_hostlist(text: str) -> list[str]:
    """Every host ``text`` names, in order, each once."""
    names: list[str] = []
    for part in split_top(text):
        names += _expand_one(part, text)
    return list(dict.fromkeys(names))


_TAIL = re.compile(r"^(.*?)([0-9]+)\Z")


def compress_hostlist(names: list[str]) -> str:
    """The names as Slurm writes a host list, for a person to read: runs of one prefix and
    zero-padded width with consecutive numbers become ``node-[000-153,160]``; the inverse of
    ``expand_hostlist`` for the names given (order: by prefix, then number)."""
    runs: dict[tuple[str, int], list[int]] = {}
    plain: list[str] = []
    for name in dict.fromkeys(names):
        m = _TAIL.match(name)
        if m is None:
            plain.append(name)
            continue
        runs.setdefault((m.group(1), len(m.group(2))), []).append(int(m.group(2)))
    parts = []
    for (prefix, width), numbers in sorted(runs.items()):
        numbers.sort()
        spans: list[str] = []
        start = prev = numbers[0]
        for n in [*numbers[1:], None]:
            if n is not None and n == prev + 1 and len(str(n)) <= width:
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
