"""The op table: nccl-tests bandwidth math, buffer sizing, patterns, and the data check
run for real on gloo groups formed by threads of this process."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from ringwatch.agents.collectives import (
    DTYPES,
    OPS,
    algbw_gbs,
    busbw_factor,
    busbw_gbs,
    check_redop,
    dtype_size,
    plan,
)
from ringwatch.agents.patterns import (
    check_tolerance,
    count_wrong,
    expected_output,
    make_input,
    summand_modulus,
    torch_dtype,
)
from ringwatch.agents.probe import make_group, run_probe
from ringwatch.agents.spec import REDOPS, REDUCING_OPS, redop_for
from tests.threads import on_threads

ops = st.sampled_from(sorted(OPS))
dtypes = st.sampled_from(sorted(DTYPES))


# ---- bandwidth math (nccl-tests doc/PERFORMANCE.md) -----------------------------------


@given(
    op=ops,
    size=st.integers(min_value=0, max_value=1 << 34),
    time_s=st.floats(min_value=1e-7, max_value=1e3),
    n=st.integers(min_value=2, max_value=4096),
)
def test_busbw_is_algbw_times_the_nccl_tests_factor(op: str, size: int, time_s: float, n: int) -> None:
    factor = {
        "allreduce": 2 * (n - 1) / n,
        "allgather": (n - 1) / n,
        "reducescatter": (n - 1) / n,
        "alltoall": (n - 1) / n,
        "sendrecv": 1.0,
    }[op]
    assert algbw_gbs(size, time_s) == pytest.approx(size / time_s / 1e9)
    assert busbw_gbs(op, size, time_s, n) == pytest.approx(size / time_s / 1e9 * factor)


def test_known_figures() -> None:
    # 1 GiB AllReduce in 10 ms on 8 ranks: algbw 107.37 GB/s, busbw * 14/8.
    assert algbw_gbs(1 << 30, 0.01) == pytest.approx(107.374182)
    assert busbw_gbs("allreduce", 1 << 30, 0.01, 8) == pytest.approx(107.374182 * 1.75)
    assert busbw_factor("allreduce", 1) == 0.0
    assert busbw_factor("sendrecv", 2) == 1.0


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError):
        algbw_gbs(100, 0.0)
    with pytest.raises(ValueError):
        busbw_gbs("broadcast", 100, 1.0, 2)
    with pytest.raises(ValueError):
        plan("sendrecv", 1024, 0, "float32")
    with pytest.raises(ValueError):
        plan("allreduce", 1024, 2, "int8")
    # One rank is a world size like any other: SendRecv to itself, as nccl-tests on one GPU.
    assert plan("sendrecv", 1024, 1, "float32").out_numel == 256


# ---- buffer sizing (nccl-tests conventions) -------------------------------------------


@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_the_op_tables_element_sizes_are_torchs(dtype: str) -> None:
    assert dtype_size(dtype) == torch.tensor([], dtype=torch_dtype(dtype)).element_size()


@given(op=ops, size=st.integers(min_value=0, max_value=1 << 31), n=st.integers(2, 64), dtype=dtypes)
def test_plan_follows_nccl_tests_sizes(op: str, size: int, n: int, dtype: str) -> None:
    buf = plan(op, size, n, dtype)
    esize = dtype_size(dtype)
    assert buf.size_bytes == max(buf.in_numel, buf.out_numel) * esize
    assert buf.count >= 1
    if op in ("allreduce", "sendrecv"):
        assert buf.in_numel == buf.out_numel == buf.count
    elif op == "alltoall":
        assert buf.in_numel == buf.out_numel == buf.count * n
    elif op == "allgather":  # size counts the output
        assert (buf.in_numel, buf.out_numel) == (buf.count, buf.count * n)
    else:  # reducescatter: size counts the input
        assert (buf.in_numel, buf.out_numel) == (buf.count * n, buf.count)
    if size >= n * esize:
        # Rounded down, never up, once the request holds one element per block.
        assert buf.size_bytes <= size
        assert size - buf.size_bytes < n * esize + esize


def test_plan_reports_the_size_actually_used() -> None:
    # 1000 float32 elements do not split over 3 ranks: 999 are used.
    buf = plan("alltoall", 4000, 3, "float32")
    assert (buf.count, buf.size_bytes) == (333, 3996)
    # An 8-byte AllGather on 8 ranks still moves one element per rank.
    assert plan("allgather", 8, 8, "float32").size_bytes == 32


# ---- patterns: exact, rank-dependent, and what the op really produces ------------------


def _reference(op: str, inputs: list[torch.Tensor], rank: int, chunk: int) -> torch.Tensor:
    """The op's definition applied to every rank's input, summed in float64."""
    n = len(inputs)
    if op == "allreduce":
        return torch.stack([t.double() for t in inputs]).sum(0)
    if op == "reducescatter":
        return torch.stack([t.double() for t in inputs]).sum(0)[rank * chunk:(rank + 1) * chunk]
    if op == "allgather":
        return torch.cat([t.double() for t in inputs])
    if op == "alltoall":
        return torch.cat([t.double()[rank * chunk:(rank + 1) * chunk] for t in inputs])
    return inputs[(rank - 1) % n].double()  # sendrecv


@settings(max_examples=60, deadline=None)
@given(op=ops, n=st.integers(2, 9), size=st.integers(1, 4096), dtype=dtypes)
def test_expected_output_matches_the_ops_definition(op: str, n: int, size: int, dtype: str) -> None:
    buf = plan(op, size, n, dtype)
    inputs = [make_input(buf, r) for r in range(n)]
    for rank in range(n):
        want = _reference(op, inputs, rank, buf.chunk)
        got = expected_output(buf, rank)
        # Bit-exact in the narrow dtype too: the reference fits without rounding.
        assert torch.equal(got.double(), want)
    assert any(not torch.equal(inputs[0], t) for t in inputs[1:]), "pattern must depend on rank"


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("n", [2, 8, 255, 256, 1000, 5000])
def test_reduction_sums_stay_exact_at_any_world_size(dtype: str, n: int) -> None:
    buf = plan("allreduce", 64 * dtype_size(dtype), n, dtype)
    exact = sum(make_input(buf, r).double() for r in range(n))
    assert torch.equal(expected_output(buf, 0).double(), exact)
    assert exact.max() >= 1  # a pattern of zeros would check nothing
    assert summand_modulus(n, dtype) >= 1


# ---- reduction ops (nccl-tests' -o): closed forms against brute force ---------------------


def _reduce_over_ranks(buf_op: str, inputs: list[torch.Tensor], redop: str, rank: int,
                       chunk: int) -> torch.Tensor:
    """The reduction applied element by element over every rank's input, in float64."""
    stacked = torch.stack([t.double() for t in inputs])
    reduced = {"sum": stacked.sum(0), "max": stacked.amax(0), "min": stacked.amin(0),
               "avg": stacked.sum(0) / len(inputs)}[redop]
    return reduced if buf_op == "allreduce" else reduced[rank * chunk:(rank + 1) * chunk]


@settings(max_examples=80, deadline=None)
@given(op=st.sampled_from(REDUCING_OPS), redop=st.sampled_from(("max", "min")),
       n=st.integers(1, 40) | st.integers(250, 600), size=st.integers(1, 600), dtype=dtypes)
def test_max_and_min_closed_forms_match_brute_force(op: str, redop: str, n: int, size: int,
                                                     dtype: str) -> None:
    # 250..600 ranks take bfloat16 into the one-hot pattern (k == 1) and float16 near it.
    buf = plan(op, size, n, dtype, redop)
    inputs = [make_input(buf, r) for r in range(n)]
    for rank in {0, n // 2, n - 1}:
        want = _reduce_over_ranks(op, inputs, redop, rank, buf.chunk)
        got = expected_output(buf, rank)
        assert torch.equal(got.double(), want)  # exact: max and min never round
    assert check_tolerance(buf) == 0.0


@settings(max_examples=40, deadline=None)
@given(op=st.sampled_from(REDUCING_OPS), n=st.integers(1, 70), size=st.integers(1, 2048))
def test_avg_expectation_is_the_float32_mean(op: str, n: int, size: int) -> None:
    buf = plan(op, size, n, "float32", "avg")
    inputs = [make_input(buf, r) for r in range(n)]
    for rank in {0, n - 1}:
        want = _reduce_over_ranks(op, inputs, "avg", rank, buf.chunk)
        got = expected_output(buf, rank)
        assert torch.equal(got, want.float())  # the correctly rounded mean
        tol = check_tolerance(buf)
        if n & (n - 1) == 0:
            assert tol == 0.0  # a power-of-two world averages exactly
        else:
            # Any rounding NCCL's 1/n pre-scaling adds stays inside the tolerance, and the
            # least step a wrong summand moves the mean (1/n) stays outside it.
            assert 0.0 < tol < 1.0 / n
            assert count_wrong(got + tol / 2, want.float(), tol) == 0
            assert count_wrong(got + 1.0 / n, want.float(), tol) == got.numel()


def test_redops_are_validated_where_they_mean_something() -> None:
    assert REDOPS == ("sum", "max", "min", "avg")
    assert plan("allreduce", 64, 2, "float32").redop == "sum"
    assert plan("reducescatter", 64, 2, "bfloat16", "max").redop == "max"
    with pytest.raises(ValueError, match="prod"):
        plan("allreduce", 64, 2, "float32", "prod")
    with pytest.raises(ValueError, match="does not reduce"):
        plan("alltoall", 64, 2, "float32", "max")
    with pytest.raises(ValueError, match="float32"):
        plan("allreduce", 64, 2, "bfloat16", "avg")
    with pytest.raises(ValueError, match="gloo"):
        check_redop("allreduce", "avg", backend="gloo")
    check_redop("allreduce", "avg", backend="nccl")
    check_redop("reducescatter", "avg", backend="sim")
    # A group's redop applies to its reducing ops; the others run as always.
    assert [redop_for(op, "min") for op in ("allreduce", "alltoall", "reducescatter")] == [
        "min", "sum", "min"]


def test_busbw_factor_does_not_depend_on_the_redop() -> None:
    for redop in ("max", "min", "avg"):
        buf = plan("allreduce", 4096, 4, "float32", redop)
        assert buf.size_bytes == plan("allreduce", 4096, 4, "float32").size_bytes
    assert busbw_factor("allreduce", 4) == 1.5


def test_count_wrong_counts_elements() -> None:
    want = torch.arange(10, dtype=torch.bfloat16)
    got = want.clone()
    assert count_wrong(got, want) == 0
    got[3] += 1
    got[7] = float("nan")
    assert count_wrong(got, want) == 2
    assert count_wrong(got[:5], want) == 10


# ---- the real thing: ops on a gloo group of threads -------------------------------------


def on_gloo_threads(n: int, fn: Callable[[int, Any], Any], timeout_s: float = 30.0) -> list[Any]:
    """Run ``fn(rank, pg)`` on ``n`` threads that form one gloo group over a HashStore."""
    store = dist.PrefixStore(uuid.uuid4().hex, dist.HashStore())
    return on_threads(
        n, lambda r: fn(r, make_group("gloo", store, r, n, timeout_s, host="127.0.0.1")), timeout_s)


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("op", sorted(OPS))
def test_real_gloo_run_is_correct_and_one_wrong_element_is_caught(op: str, dtype: str) -> None:
    n = 2 if op == "sendrecv" else 3
    buf = plan(op, 3000, n, dtype)

    def probe(rank: int, pg: Any) -> dict[str, Any]:
        # Rank 1 flips one element of its output before the check.
        return run_probe(pg, buf, rank, warmup=1, iters=2, repeats=2, corrupt=(rank == 1))

    results = on_gloo_threads(n, probe)
    wrong = [r["wrong"] for r in results]
    assert wrong == [1 if rank == 1 else 0 for rank in range(n)]
    assert all(len(r["times_s"]) == 2 and min(r["times_s"]) > 0 for r in results)


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("redop", ["max", "min"])
@pytest.mark.parametrize("op", REDUCING_OPS)
def test_real_gloo_max_and_min_are_correct_and_one_wrong_element_is_caught(
    op: str, redop: str, dtype: str
) -> None:
    n = 3
    buf = plan(op, 3000, n, dtype, redop)

    def probe(rank: int, pg: Any) -> dict[str, Any]:
        return run_probe(pg, buf, rank, warmup=1, iters=2, corrupt=(rank == 2))

    results = on_gloo_threads(n, probe)
    assert [r["wrong"] for r in results] == [0, 0, 1]
    # The check would tell a sum from a max: the expectations differ on this buffer.
    assert not torch.equal(expected_output(buf, 0), expected_output(plan(op, 3000, n, dtype), 0))


def test_real_gloo_refuses_avg_before_entering_the_collective() -> None:
    buf = plan("allreduce", 400, 2, "float32", "avg")
    with pytest.raises(ValueError, match="avg"):
        run_probe(None, buf, 0, backend="gloo")


def test_sendrecv_of_one_rank_copies_to_itself() -> None:
    buf = plan("sendrecv", 400, 1, "float32")
    [result] = on_gloo_threads(1, lambda rank, pg: run_probe(pg, buf, rank, warmup=0, iters=1))
    assert result["wrong"] == 0 and result["timing"] == "host"


def test_sendrecv_ring_of_three() -> None:
    buf = plan("sendrecv", 400, 3, "float32")
    results = on_gloo_threads(3, lambda rank, pg: run_probe(pg, buf, rank, warmup=0, iters=1))
    assert [r["wrong"] for r in results] == [0, 0, 0]


# ---- presets ------------------------------------------------------------------------------


def test_quick_preset_has_latency_and_bandwidth_sizes() -> None:
    from ringwatch.agents.collectives import preset_sizes, size_preset

    gpu = size_preset("quick", "nccl")
    assert gpu.latency_sizes[0] == 8 and gpu.latency_sizes[-1] == 64 * 1024
    assert gpu.bandwidth_sizes == (64 << 20, 128 << 20, 256 << 20)
    assert preset_sizes("quick", "sim") == gpu.sizes
    assert max(preset_sizes("quick", "gloo")) == 4 << 20
    with pytest.raises(ValueError):
        preset_sizes("huge", "nccl")


def test_full_preset_is_nccl_tests_b8_e1g_f2() -> None:
    from ringwatch.agents.collectives import preset_sizes

    full = preset_sizes("full", "nccl")
    assert full == tuple(1 << k for k in range(3, 31))  # 8 B .. 1 GiB, factor 2: 28 sizes
    gloo = preset_sizes("full", "gloo")
    assert gloo[0] == 8 and gloo[-1] == 64 << 20 and gloo == full[: len(gloo)]
