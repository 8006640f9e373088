"""Measurements as text, laid out like nccl-tests' output so figures compare at a glance:
one block per op and group, one row per size."""

from __future__ import annotations

from collections.abc import Iterable

from ringwatch.agents.collectives import plan
from ringwatch.agents.places import members_text
from ringwatch.agents.spec import REDUCING_OPS, Measurement
from ringwatch.agents.transport import transport_name

_HEADER = (
    f"#{'size':>11}  {'count':>12}  {'type':>8}  {'redop':>6}  {'op':>13}  {'time':>10}  "
    f"{'algbw':>8}  {'busbw':>8}  {'#wrong':>6}"
)
_UNITS = (
    f"#{'(B)':>11}  {'(elements)':>12}  {'':>8}  {'':>6}  {'':>13}  {'(us)':>10}  "
    f"{'(GB/s)':>8}  {'(GB/s)':>8}  {'':>6}"
)


def _count(m: Measurement) -> int | str:
    """nccl-tests' count column; the op table rebuilds it from the size actually used."""
    try:
        return plan(m.op, m.size_bytes, len(m.members), m.dtype).count
    except ValueError:  # an op or dtype this table does not know: show the size only
        return "-"


def _redop(m: Measurement) -> str:
    """nccl-tests' redop column: "none" for ops that do not reduce."""
    return m.redop if m.op in REDUCING_OPS else "none"


def _row(m: Measurement) -> str:
    line = (
        f"{m.size_bytes:>12}  {_count(m):>12}  {m.dtype:>8}  {_redop(m):>6}  {m.op:>13}  "
        f"{m.time_us:>10.1f}  "
        f"{m.algbw_gbs:>8.2f}  {m.busbw_gbs:>8.2f}  {m.wrong:>6}"
    )
    if m.stats:
        line += f"  (min {m.stats['min']:.1f} / max {m.stats['max']:.1f} us)"
    return line


def _groups(measurements: Iterable[Measurement]) -> dict[tuple[str, str, tuple[str, ...]], list[Measurement]]:
    groups: dict[tuple[str, str, tuple[str, ...]], list[Measurement]] = {}
    for m in measurements:
        groups.setdefault((m.op, m.scope, tuple(m.members)), []).append(m)
    return groups


def format_table(measurements: Iterable[Measurement]) -> str:
    """nccl-tests-style text: a header per (op, scope, members), rows by size."""
    blocks = []
    for (op, scope, members), ms in _groups(measurements).items():
        title = f"# {op}  {scope}  {len(members)} ranks: {members_text(members)}"
        taken = sorted({t for m in ms if m.transport for t in m.transport.split(",")})
        if taken:  # what NCCL's own log says the group ran over (docs/transport.md)
            title += f"  via {', '.join(transport_name(t) for t in taken)}"
        rows = [_row(m) for m in sorted(ms, key=lambda m: m.size_bytes)]
        blocks.append("\n".join([title, _HEADER, _UNITS, *rows]))
    if not blocks:
        return "# no measurements"
    return "\n\n".join(blocks)
