"""The op table: what each probe collective moves and how nccl-tests counts its bandwidth,
so every backend sizes and scores ops alike; and the size sweeps a probe runs.

Sizes follow nccl-tests: ``size_bytes`` is the per-rank buffer for AllReduce, AllToAll
and SendRecv, the OUTPUT for AllGather and the INPUT for ReduceScatter. Bandwidth
follows nccl-tests' doc/PERFORMANCE.md: ``algbw = size / time``, ``busbw = algbw * factor``.

Plain arithmetic, free of torch, so the sim, the planner and the command line size and
score ops without importing it; the tensors a probe sends and checks are in
``agents.patterns``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ringwatch.agents.spec import REDOPS, REDUCING_OPS

# Bytes per element of each dtype a probe can run in (``agents.patterns`` maps them to torch's).
DTYPES: dict[str, int] = {"float32": 4, "bfloat16": 2, "float16": 2}
# Backends with an average reduction: NCCL has ncclAvg (the sim models NCCL); gloo has none.
_AVG_BACKENDS = ("nccl", "sim")


def dtype_size(dtype: str) -> int:
    try:
        return DTYPES[dtype]
    except KeyError:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}") from None


@dataclass(frozen=True)
class Buffers:
    """How one op at one requested size is laid out on one rank (nccl-tests' columns)."""

    op: str
    world_size: int
    dtype: str
    count: int  # nccl-tests' "count" column: the element count the op is called with
    in_numel: int
    out_numel: int
    size_bytes: int  # nccl-tests' "size" column: the size actually used after rounding
    redop: str = "sum"  # nccl-tests' "redop" column; "sum" for ops that do not reduce

    @property
    def chunk(self) -> int:
        """Elements per peer block of the chunked ops (nccl-tests passes this as count)."""
        return self.count


@dataclass(frozen=True)
class Collective:
    """One row of the op table."""

    name: str
    # busbw = algbw * factor(world_size), nccl-tests doc/PERFORMANCE.md.
    factor: Callable[[int], float]
    # True where the buffer is split into world_size blocks (count is per block).
    chunked: bool
    # True where torch runs the op in place (input buffer becomes the output).
    in_place: bool
    min_ranks: int = 1

    def buffers(self, size_bytes: int, world_size: int, dtype: str, redop: str = "sum") -> Buffers:
        return plan(self.name, size_bytes, world_size, dtype, redop)


def _allreduce_factor(n: int) -> float:
    return 2.0 * (n - 1) / n


def _fraction_factor(n: int) -> float:
    return (n - 1) / n


OPS: dict[str, Collective] = {
    "allreduce": Collective("allreduce", _allreduce_factor, chunked=False, in_place=True),
    "alltoall": Collective("alltoall", _fraction_factor, chunked=True, in_place=False),
    "allgather": Collective("allgather", _fraction_factor, chunked=True, in_place=False),
    "reducescatter": Collective("reducescatter", _fraction_factor, chunked=True, in_place=False),
    # At one rank SendRecv is a copy to itself, as nccl-tests runs it on one GPU.
    "sendrecv": Collective("sendrecv", lambda n: 1.0, chunked=False, in_place=False),
}


def collective(op: str) -> Collective:
    try:
        return OPS[op]
    except KeyError:
        raise ValueError(f"op must be one of {', '.join(OPS)}, got {op!r}") from None


def busbw_factor(op: str, world_size: int) -> float:
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    return collective(op).factor(world_size)


def algbw_gbs(size_bytes: int, time_s: float) -> float:
    """nccl-tests' algorithm bandwidth in GB/s (1e9 bytes per second)."""
    if time_s <= 0:
        raise ValueError(f"time must be positive, got {time_s}")
    return size_bytes / time_s / 1e9


def busbw_gbs(op: str, size_bytes: int, time_s: float, world_size: int) -> float:
    """nccl-tests' bus bandwidth: algbw times the op's factor for this world size."""
    return algbw_gbs(size_bytes, time_s) * busbw_factor(op, world_size)


def check_redop(op: str, redop: str, dtype: str = "float32", backend: str | None = None) -> None:
    """ValueError unless ``op`` can run ``redop`` in ``dtype`` (on ``backend``, when given)."""
    if redop not in REDOPS:
        why = " (prod overflows the exact patterns, so it is not probed)" if redop == "prod" else ""
        raise ValueError(f"redop must be one of {', '.join(REDOPS)}, got {redop!r}{why}")
    if redop != "sum" and op not in REDUCING_OPS:
        raise ValueError(f"{op} does not reduce: its redop must be sum (not applicable), got {redop!r}")
    if redop == "avg" and backend is not None and backend not in _AVG_BACKENDS:
        raise ValueError(f"redop avg needs NCCL's ReduceOp.AVG; the {backend} backend has no "
                         "average reduction (use sum, max or min)")
    if redop == "avg" and dtype != "float32":
        # In a narrow dtype an average rounds by more than the step between correct values.
        raise ValueError(f"redop avg is probed in float32 only, got {dtype}")


def plan(op: str, size_bytes: int, world_size: int, dtype: str, redop: str = "sum") -> Buffers:
    """Lay out ``op`` at ``size_bytes`` on ``world_size`` ranks, nccl-tests style.

    Chunked ops round the element count down to a multiple of the world size, but
    never below one element per block, so even an 8-byte probe moves data.
    """
    coll = collective(op)
    check_redop(op, redop, dtype)
    if world_size < coll.min_ranks:
        raise ValueError(f"{op} needs at least {coll.min_ranks} ranks, got {world_size}")
    if size_bytes < 0:
        raise ValueError(f"size must be >= 0, got {size_bytes}")
    esize = dtype_size(dtype)
    elements = max(1, size_bytes // esize)
    n = world_size
    if not coll.chunked:
        return Buffers(op, n, dtype, elements, elements, elements, elements * esize, redop)
    block = max(1, elements // n)
    full = block * n
    in_numel, out_numel = {
        "alltoall": (full, full),
        "allgather": (block, full),
        "reducescatter": (full, block),
    }[op]
    return Buffers(op, n, dtype, block, in_numel, out_numel, max(in_numel, out_numel) * esize,
                   redop)


# ---- size presets ---------------------------------------------------------------------


@dataclass(frozen=True)
class SizePreset:
    """A size sweep: latency sizes (time dominated by fixed cost) then bandwidth sizes."""

    name: str
    latency_sizes: tuple[int, ...]
    bandwidth_sizes: tuple[int, ...]

    @property
    def sizes(self) -> tuple[int, ...]:
        return self.latency_sizes + self.bandwidth_sizes


_KiB, _MiB, _GiB = 1 << 10, 1 << 20, 1 << 30


def _doubling(lo: int, hi: int) -> tuple[int, ...]:
    """lo, 2*lo, ... up to hi: nccl-tests' ``-b lo -e hi -f 2``."""
    sizes = []
    size = lo
    while size <= hi:
        sizes.append(size)
        size *= 2
    return tuple(sizes)


def _full(cap: int) -> SizePreset:
    sizes = _doubling(8, cap)
    return SizePreset("full", tuple(s for s in sizes if s <= 64 * _KiB),
                      tuple(s for s in sizes if s > 64 * _KiB))


# The arithmetic behind these is in docs/probes.md ("Presets"). GPU figures are for
# NVLink/IB-class links; gloo moves ~1 GB/s through CPU memory, so its sweep stops early.
SIZE_PRESETS: dict[tuple[str, str], SizePreset] = {
    ("quick", "gpu"): SizePreset("quick", (8, 64, 512, 4 * _KiB, 64 * _KiB),
                                 (64 * _MiB, 128 * _MiB, 256 * _MiB)),
    ("quick", "cpu"): SizePreset("quick", (8, 512, 4 * _KiB, 64 * _KiB), (1 * _MiB, 4 * _MiB)),
    ("full", "gpu"): _full(1 * _GiB),
    ("full", "cpu"): _full(64 * _MiB),
}


def size_preset(name: str, backend: str) -> SizePreset:
    """The ``quick`` or ``full`` sweep for a backend: gloo gets the CPU sweep; nccl and the
    sim (which models GPUs) the GPU one."""
    kind = "cpu" if backend == "gloo" else "gpu"
    try:
        return SIZE_PRESETS[(name, kind)]
    except KeyError:
        raise ValueError(f"preset must be quick or full, got {name!r}") from None


def preset_sizes(name: str, backend: str) -> tuple[int, ...]:
    return size_preset(name, backend).sizes


# What one monitoring cycle or preflight probes when nobody says: one latency size (not
# judged, but stored as a series) and one size that is bandwidth-bound on every scope of
# the fabric, so a NIC or NVLink that lost bandwidth cannot hide behind latency.
# The one table of them, per backend. gloo moves ~1 GB/s through CPU memory, so its
# bandwidth size is small; the sim models GPUs, and its latency size is 1 MiB: large
# enough that bandwidth, not latency, dominates even an 8192-rank group's modeled time.
DEFAULT_SIZES: dict[str, tuple[int, ...]] = {"nccl": (64 * _KiB, 256 * _MiB),
                                             "gloo": (64 * _KiB, 4 * _MiB),
                                             "sim": (1 * _MiB, 256 * _MiB)}


def default_sizes(backend: str) -> tuple[int, ...]:
    """What a check on ``backend`` probes when nobody says (``DEFAULT_SIZES``)."""
    try:
        return DEFAULT_SIZES[backend]
    except KeyError:
        raise ValueError(f"backend must be one of {', '.join(DEFAULT_SIZES)}, "
                         f"got {backend!r}") from None
