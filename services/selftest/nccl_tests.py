"""nccl-tests as the yardstick: find its ``*_perf`` binaries, run the one matching a probe
with the same sizes, iterations, dtype, reduction and timing mode, and read its table.

Run so that its figures mean what ringwatch's do: ``-c 1`` (checked), ``-a 3`` (the
slowest rank's time, as ringwatch reduces over ranks), ``-G 1`` when ringwatch replayed a
CUDA graph (the timed iterations captured once and launched once), and the in-place
column for AllReduce, which torch runs in place.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

BINARIES = {
    "allreduce": "all_reduce_perf",
    "alltoall": "alltoall_perf",
    "allgather": "all_gather_perf",
    "reducescatter": "reduce_scatter_perf",
    "sendrecv": "sendrecv_perf",
}
DTYPES = {"float32": "float", "bfloat16": "bfloat16", "float16": "half"}
# Which of nccl-tests' two columns is the same experiment as ringwatch's probe.
IN_PLACE_OPS = frozenset({"allreduce"})


@dataclass(frozen=True)
class Row:
    """One line of an nccl-tests table: out-of-place then in-place figures."""

    size: int
    count: int
    dtype: str
    redop: str
    oop_time_us: float
    oop_busbw_gbs: float
    oop_wrong: int | None
    ip_time_us: float
    ip_busbw_gbs: float
    ip_wrong: int | None

    def column(self, op: str) -> tuple[float, float, int | None]:
        """(time_us, busbw_gbs, wrong) of the column that matches ringwatch's ``op``."""
        if op in IN_PLACE_OPS:
            return self.ip_time_us, self.ip_busbw_gbs, self.ip_wrong
        return self.oop_time_us, self.oop_busbw_gbs, self.oop_wrong


def find_binaries(directory: Path | None = None) -> dict[str, Path]:
    """The ``*_perf`` binaries in ``directory`` (or its ``build/``), else on PATH."""
    found: dict[str, Path] = {}
    for op, name in BINARIES.items():
        if directory is not None:
            for candidate in (directory / name, directory / "build" / name):
                if candidate.is_file():
                    found[op] = candidate
                    break
        else:
            on_path = shutil.which(name)
            if on_path:
                found[op] = Path(on_path)
    return found


def _sweeps(sizes: list[int]) -> list[tuple[int, int]]:
    """(-b, -e) ranges with ``-f 2`` that cover ``sizes``: one sweep when every size is
    the smallest times a power of two, else one run per size."""
    lo = min(sizes)
    if all(s % lo == 0 and ((s // lo) & (s // lo - 1)) == 0 for s in sizes):
        return [(lo, max(sizes))]
    return [(s, s) for s in sorted(set(sizes))]


def commands(binary: Path, *, sizes: list[int], world_size: int, warmup: int, iters: int,
             dtype: str, redop: str, graph: bool) -> list[list[str]]:
    args = ["-g", str(world_size), "-w", str(warmup), "-n", str(iters), "-c", "1",
            "-a", "3", "-d", DTYPES[dtype], "-o", redop, "-f", "2"]
    if graph:
        args += ["-G", "1"]
    return [[str(binary), "-b", str(lo), "-e", str(hi), *args] for lo, hi in _sweeps(sizes)]


def _number(text: str) -> float:
    return float(text)


def _wrong(text: str) -> int | None:
    return None if text == "N/A" else int(float(text))


def parse(output: str) -> list[Row]:
    """The data rows of an nccl-tests table (lines that are not comments and start with
    two integers); the column layout of nccl-tests 2.x."""
    rows = []
    for line in output.splitlines():
        fields = line.split()
        if len(fields) < 13 or line.lstrip().startswith("#"):
            continue
        if not (fields[0].isdigit() and fields[1].isdigit()):
            continue
        try:
            rows.append(Row(
                size=int(fields[0]), count=int(fields[1]), dtype=fields[2], redop=fields[3],
                oop_time_us=_number(fields[5]), oop_busbw_gbs=_number(fields[7]),
                oop_wrong=_wrong(fields[8]),
                ip_time_us=_number(fields[9]), ip_busbw_gbs=_number(fields[11]),
                ip_wrong=_wrong(fields[12]),
            ))
        except ValueError:
            continue  # a line that only looks like a row (a warning with numbers)
    return rows


def run(binary: Path, *, sizes: list[int], world_size: int, warmup: int, iters: int,
        dtype: str, redop: str, graph: bool, timeout_s: float = 600.0) -> list[Row]:
    """Run the sweeps; a failed run raises RuntimeError with nccl-tests' last words."""
    rows: list[Row] = []
    for cmd in commands(binary, sizes=sizes, world_size=world_size, warmup=warmup,
                        iters=iters, dtype=dtype, redop=redop, graph=graph):
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
        if proc.returncode != 0:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
            raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}: {tail[0]}")
        rows += parse(proc.stdout)
    return rows
