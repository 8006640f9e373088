"""The op table: what each probe collective moves, how nccl-tests counts its bandwidth,
and what a correct result holds, so every backend sizes, scores and checks ops alike.

Sizes follow nccl-tests: ``size_bytes`` is the per-rank buffer for AllReduce, AllToAll
and SendRecv, the OUTPUT for AllGather and the INPUT for ReduceScatter. Bandwidth
follows nccl-tests' doc/PERFORMANCE.md: ``algbw = size / time``, ``busbw = algbw * factor``.

Input patterns are small integers, so every value and every partial sum is exact in
float32, bfloat16 and float16 whatever order the backend reduces in: a correct run
compares bit for bit, and any wrong element is a real error, not rounding. The same
holds for the max and min reductions; avg (NCCL only) is exact when the world size is a
power of two, and otherwise checked within a rounding bound below 1/n (``check_tolerance``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from agents.spec import REDOPS, REDUCING_OPS

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
# Every integer in [0, limit] is exactly representable (mantissa bits + 1).
_EXACT_LIMIT: dict[str, int] = {"float32": 1 << 24, "bfloat16": 1 << 8, "float16": 1 << 11}
# Non-reducing ops tag elements modulo a prime below 256: exact in every dtype, and a
# block shifted by one rank or one chunk no longer matches.
_TAG_MODULUS = 251
# Reducing ops use summands in [0, k); k stays small so partial sums stay tiny.
_MAX_SUMMAND_MODULUS = 16
# Backends with an average reduction: NCCL has ncclAvg (the sim models NCCL); gloo has none.
_AVG_BACKENDS = ("nccl", "sim")
# float32's unit roundoff: the rounding bound of an avg on a world that is not a power of two.
_FLOAT32_ROUNDOFF = 2.0**-24


def dtype_size(dtype: str) -> int:
    return torch.tensor([], dtype=torch_dtype(dtype)).element_size()


def torch_dtype(dtype: str) -> torch.dtype:
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


# ---- patterns -------------------------------------------------------------------------


def _index(numel: int, device: torch.device | str) -> torch.Tensor:
    # int64: element indices of a 1 GiB float16 buffer are fine in int32 too, but the
    # sums below add rank offsets; int64 keeps them clear of overflow.
    return torch.arange(numel, dtype=torch.int64, device=device)


def _tag(
    index: torch.Tensor, rank: int | torch.Tensor, block: int | torch.Tensor = 0
) -> torch.Tensor:
    """A value that names (element, rank, block): used by the non-reducing ops."""
    return (index + 7 * rank + 13 * block) % _TAG_MODULUS


def summand_modulus(world_size: int, dtype: str) -> int:
    """Summands lie in [0, k) with (k-1) * world_size <= exact limit, so sums stay exact.

    Returns 1 when even {0, 1} summands could overflow the exact range (bfloat16 beyond
    256 ranks); the pattern then becomes one-hot, whose sum is always exactly 1.
    """
    limit = _EXACT_LIMIT[dtype]
    return max(1, min(_MAX_SUMMAND_MODULUS, limit // world_size + 1))


def _summand(index: torch.Tensor, rank: int, world_size: int, dtype: str) -> torch.Tensor:
    k = summand_modulus(world_size, dtype)
    if k == 1:
        return ((index + rank) % world_size == 0).to(torch.int64)
    return (index + rank) % k


def _sum_of_summands(index: torch.Tensor, world_size: int, dtype: str) -> torch.Tensor:
    """Closed form of sum over ranks r of _summand(index, r): O(numel), not O(numel * n)."""
    k = summand_modulus(world_size, dtype)
    if k == 1:
        return torch.ones_like(index)
    full_cycles, rest = divmod(world_size, k)
    # Ranks 0..rest-1 past the last full cycle add (a + j) % k for j < rest, a = i % k.
    table = torch.tensor(
        [sum((a + j) % k for j in range(rest)) for a in range(k)],
        dtype=torch.int64,
        device=index.device,
    )
    return full_cycles * (k * (k - 1) // 2) + table[index % k]


def _extreme_of_summands(index: torch.Tensor, world_size: int, dtype: str,
                         redop: str) -> torch.Tensor:
    """Closed form of max (or min) over ranks r of _summand(index, r), O(numel).

    Rank r holds (a + r) % k with a = i % k: the n values run a, a+1, ... and wrap past
    k - 1 to 0 exactly when a + n - 1 >= k, which then puts both k - 1 and 0 among them.
    """
    k = summand_modulus(world_size, dtype)
    if k == 1:
        # One-hot: exactly one rank holds 1, every other rank 0.
        return torch.full_like(index, 1 if redop == "max" or world_size == 1 else 0)
    a = index % k
    top = a + world_size - 1
    wraps = top >= k
    if redop == "max":
        return torch.where(wraps, torch.full_like(a, k - 1), top)
    return torch.where(wraps, torch.zeros_like(a), a)


def _reduction(index: torch.Tensor, buf: Buffers) -> torch.Tensor:
    """The exact reduction over ranks of the summand pattern at ``index``, as float64."""
    n = buf.world_size
    if buf.redop in ("max", "min"):
        return _extreme_of_summands(index, n, buf.dtype, buf.redop).double()
    total = _sum_of_summands(index, n, buf.dtype).double()
    return total / n if buf.redop == "avg" else total


def check_tolerance(buf: Buffers) -> float:
    """How far a correct output element may lie from ``expected_output``: 0 (bit-exact)
    except for avg on a world that is not a power of two, where NCCL's 1/n pre-scaling
    rounds. The bound (n + 1) * (k - 1) * u stays below 1/n, the least step by which a
    wrong summand moves the average, for groups of up to about 1000 ranks."""
    n = buf.world_size
    if buf.redop != "avg" or n & (n - 1) == 0:
        return 0.0
    k = summand_modulus(n, buf.dtype)
    return (n + 1) * max(1, k - 1) * _FLOAT32_ROUNDOFF


def make_input(buf: Buffers, rank: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The deterministic, rank-dependent input of ``rank`` for ``buf``."""
    idx = _index(buf.in_numel, device)
    if buf.op in ("allreduce", "reducescatter"):
        values = _summand(idx, rank, buf.world_size, buf.dtype)
    elif buf.op == "alltoall":
        # Block d goes to rank d: tag it with (sender, receiver).
        values = _tag(idx % buf.chunk, rank, block=idx // buf.chunk)
    else:  # allgather, sendrecv
        values = _tag(idx, rank)
    return values.to(torch_dtype(buf.dtype))


def expected_output(buf: Buffers, rank: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """What ``rank``'s output buffer must hold after a correct run of ``buf.op``."""
    n = buf.world_size
    idx = _index(buf.out_numel, device)
    if buf.op == "allreduce":
        values = _reduction(idx, buf)
    elif buf.op == "reducescatter":
        values = _reduction(idx + rank * buf.chunk, buf)
    elif buf.op == "alltoall":
        # Block s comes from rank s, which tagged it with (s, rank).
        values = _tag(idx % buf.chunk, idx // buf.chunk, block=rank)
    elif buf.op == "allgather":
        # Block s is rank s's input.
        values = _tag(idx % buf.chunk, idx // buf.chunk)
    else:  # sendrecv: the output came from rank (r - 1) % n
        values = _tag(idx, (rank - 1) % n)
    return values.to(torch_dtype(buf.dtype))


def count_wrong(output: torch.Tensor, expected: torch.Tensor, tolerance: float = 0.0) -> int:
    """Number of wrong elements; a buffer of the wrong shape is wrong everywhere.

    Exact comparison is right here because the patterns are exact integers; NaN
    compares unequal, so it counts as wrong too. ``tolerance`` (``check_tolerance``)
    is nonzero only for an average that rounds.
    """
    if output.shape != expected.shape:
        return max(output.numel(), expected.numel())
    if tolerance == 0.0:
        return int((output != expected).sum().item())
    close = (output.double() - expected.double()).abs() <= tolerance
    return int((~close).sum().item())


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
DEFAULT_SIZES: dict[str, tuple[int, ...]] = {"gpu": (64 * _KiB, 256 * _MiB),
                                             "cpu": (64 * _KiB, 4 * _MiB)}


def default_sizes(backend: str) -> tuple[int, ...]:
    return DEFAULT_SIZES["cpu" if backend == "gloo" else "gpu"]
