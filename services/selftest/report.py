"""The selftest's answer as text or JSON: GPUs as NVML sees them, an nccl-tests-shaped table
per world size, the ratio to nccl-tests row by row where its binaries ran, and findings."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ringwatch.agents.places import finding_place
from ringwatch.agents.spec import TIMING_CUDA_GRAPH, Finding
from ringwatch.services.cli.output import visible
from ringwatch.services.scheduler.probe_table import format_table
from ringwatch.services.selftest import nccl_tests
from ringwatch.services.selftest.runner import SelftestOptions, SelftestResult


@dataclass(frozen=True)
class Comparison:
    """One ringwatch row beside the same experiment run by nccl-tests."""

    op: str
    world_size: int
    size_bytes: int
    ringwatch_us: float
    nccl_tests_us: float
    time_ratio: float
    ringwatch_busbw: float
    nccl_tests_busbw: float
    busbw_ratio: float | None
    timing: str | None


def compare(options: SelftestOptions, result: SelftestResult, binaries: dict[str, Path],
            progress: Any = lambda _m: None) -> list[Comparison]:
    """Run the matching nccl-tests binary per op and world size; pair rows by size."""
    out: list[Comparison] = []
    for world in result.worlds:
        for op in options.ops:
            ms = [m for m in world.measurements if m.op == op]
            if op not in binaries or not ms:
                continue
            graph = all(m.timing == TIMING_CUDA_GRAPH for m in ms)
            progress(f"nccl-tests {binaries[op].name} -g {world.world_size}")
            rows = nccl_tests.run(binaries[op], sizes=[m.size_bytes for m in ms],
                                  world_size=world.world_size, warmup=options.warmup,
                                  iters=options.iters, dtype=options.dtype,
                                  redop=options.redop if op in ("allreduce", "reducescatter")
                                  else "sum", graph=graph)
            by_size = {r.size: r for r in rows}
            for m in ms:
                row = by_size.get(m.size_bytes)
                if row is None:
                    continue
                t, busbw, _ = row.column(op)
                out.append(Comparison(op, world.world_size, m.size_bytes, m.time_us, t,
                                      m.time_us / t if t > 0 else float("inf"), m.busbw_gbs,
                                      busbw, m.busbw_gbs / busbw if busbw > 0 else None,
                                      m.timing))
    return out


def _gpu_line(g: dict[str, Any]) -> str:
    if not g.get("available"):
        return f"  NVML unavailable: {visible(str(g.get('reason')))}"
    links = g.get("nvlinks", [])
    errors = sum(v or 0 for link in links for v in link.get("errors", {}).values())
    return (f"  GPU {g['local_index']}: {g['name']}  {g['uuid']}  pci {g['pci_bus_id']}  "
            f"numa {g['numa_node']}  NVLinks {sum(1 for x in links if x['active'])}/{len(links)} "
            f"active, {errors} error count(s)")


def format_comparison(rows: list[Comparison]) -> str:
    head = (f"#{'op':>13}  {'n':>3}  {'size':>12}  {'ringwatch':>10}  {'nccl-tests':>10}  "
            f"{'ratio':>6}  {'busbw rw':>9}  {'busbw nt':>9}  {'ratio':>6}  timing")
    units = f"#{'':>13}  {'':>3}  {'(B)':>12}  {'(us)':>10}  {'(us)':>10}  {'':>6}  {'(GB/s)':>9}  {'(GB/s)':>9}"
    lines = [head, units]
    for c in rows:
        bw = f"{c.busbw_ratio:>6.2f}" if c.busbw_ratio is not None else f"{'-':>6}"
        lines.append(f"{c.op:>14}  {c.world_size:>3}  {c.size_bytes:>12}  {c.ringwatch_us:>10.2f}  "
                     f"{c.nccl_tests_us:>10.2f}  {c.time_ratio:>6.2f}  {c.ringwatch_busbw:>9.2f}  "
                     f"{c.nccl_tests_busbw:>9.2f}  {bw}  {c.timing or '-'}")
    return "\n".join(lines)


def format_text(result: SelftestResult, comparison: list[Comparison] | None,
                nccl_tests_note: str | None) -> str:
    parts = [f"# ringwatch selftest on {result.node} ({result.backend})"]
    if result.gpus:
        parts.append("\n".join(_gpu_line(g) for g in result.gpus))
    for world in result.worlds:
        timings = sorted({m.timing for m in world.measurements if m.timing})
        parts.append(f"## world size {world.world_size} ({world.wall_s:.1f} s; timed by "
                     f"{', '.join(timings) or '-'})\n" + format_table(world.measurements))
    if comparison:
        parts.append("## ringwatch / nccl-tests (time ratio < 1: ringwatch faster)\n"
                     + format_comparison(comparison))
    elif nccl_tests_note:
        parts.append(f"## nccl-tests: {visible(nccl_tests_note)}")
    findings = result.findings
    wrong = sum(m.wrong for m in result.measurements)
    verdict = "FAILED" if findings or wrong else "PASSED"
    parts.append(f"{verdict}: {len(result.measurements)} measurement(s), {wrong} wrong element(s), "
                 f"{len(findings)} finding(s)")
    for f in findings:
        parts.append(f"  {f.kind:<16} {finding_place(f.to_dict())}: {visible(_finding_detail(f))}")
    # A GPU's name, a node's, an error's text: shown, never acted on by a terminal (a field
    # that may hold a newline is made visible above, so it cannot pass for a line of its own).
    return "\n".join(visible(line) for line in "\n\n".join(parts).split("\n"))


def _finding_detail(f: Finding) -> str:
    """What a person needs from a finding's detail, on one line."""
    d = f.detail
    bits = [str(d[k]) for k in ("stage", "error") if d.get(k)]
    if d.get("ops"):
        bits.append(f"{d.get('wrong', '?')} wrong element(s) in {', '.join(d['ops'])}")
    if d.get("peers_failed"):
        bits.append(f"(peers that saw it fail: {', '.join(d['peers_failed'])})")
    if d.get("injected"):
        bits.append("[injected]")
    other = {k: v for k, v in d.items() if k not in
             {"stage", "error", "ops", "wrong", "peers_failed", "injected", "members", "scope",
              "rank", "origin"}}
    bits += [f"{k}={v}" for k, v in sorted(other.items())]
    return " ".join(bits)


def as_json(result: SelftestResult, comparison: list[Comparison] | None,
            nccl_tests_note: str | None) -> dict[str, Any]:
    return {
        "node": result.node, "backend": result.backend,
        "passed": passed(result),
        "gpus": result.gpus,
        "measurements": [dict(m.to_dict(), world_size=len(m.members)) for m in result.measurements],
        "findings": [f.to_dict() for f in result.findings],
        "nccl_tests": [asdict(c) for c in comparison or []],
        "nccl_tests_note": nccl_tests_note,
    }


def passed(result: SelftestResult) -> bool:
    return not result.findings and not any(m.wrong for m in result.measurements)


