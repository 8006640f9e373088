"""What a probe sends and what a correct result holds: exact integer patterns as tensors.

Input patterns are small integers, so every value and every partial sum is exact in
float32, bfloat16 and float16 whatever order the backend reduces in: a correct run
compares bit for bit, and any wrong element is a real error, not rounding. The same
holds for the max and min reductions; avg (NCCL only) is exact when the world size is a
power of two, and otherwise checked within a rounding bound below 1/n (``check_tolerance``).

Kept apart from ``agents.collectives`` because it needs torch; only the real probes
(gloo, nccl) import it.
"""

from __future__ import annotations

import torch

from ringwatch.agents.collectives import DTYPES, Buffers

# The op table's dtypes by name; torch names them alike.
TORCH_DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in DTYPES}
# Every integer in [0, limit] is exactly representable (mantissa bits + 1).
_EXACT_LIMIT: dict[str, int] = {"float32": 1 << 24, "bfloat16": 1 << 8, "float16": 1 << 11}
# Non-reducing ops tag elements modulo a prime below 256: exact in every dtype, and a
# block shifted by one rank or one chunk no longer matches.
_TAG_MODULUS = 251
# Reducing ops use summands in [0, k); k stays small so partial sums stay tiny.
_MAX_SUMMAND_MODULUS = 16
# float32's unit roundoff: the rounding bound of an avg on a world that is not a power of two.
_FLOAT32_ROUNDOFF = 2.0**-24


def torch_dtype(dtype: str) -> torch.dtype:
    try:
        return TORCH_DTYPES[dtype]
    except KeyError:
        raise ValueError(f"dtype must be one of {', '.join(TORCH_DTYPES)}, got {dtype!r}") from None


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
