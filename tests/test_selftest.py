"""`ringwatch selftest`: one machine probed alone, one process per rank with no Ray, the
ranks' replies reduced as the Ray driver reduces them; nccl-tests' tables read and paired."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ringwatch.agents.spec import TIMING_CUDA_GRAPH, TIMING_HOST, InjectedFault, Measurement
from ringwatch.services.selftest import nccl_tests, report
from ringwatch.services.selftest.runner import (
    SelftestOptions,
    SelftestResult,
    WorldResult,
    run_world,
)

CLI = [sys.executable, "-m", "ringwatch.services.cli.main"]


def _row(size: int, count: int, dtype: str, redop: str, oop: tuple[float, float, float, str],
         ip: tuple[float, float, float, str]) -> str:
    """A line printed with nccl-tests 2.x's own format strings."""
    head = "%12li  %12li  %8s  %6s  %6s" % (size, count, dtype, redop, "-1")  # noqa: UP031
    cols = ""
    for t, alg, bus, wrong in (oop, ip):
        cols += "  %7s  %6s  %6s  %6s" % (f"{t:.2f}", f"{alg:.2f}", f"{bus:.2f}", wrong)  # noqa: UP031
    return head + cols


NCCL_TESTS_OUTPUT = "\n".join([
    "# nThread 1 nGpus 1 minBytes 8 maxBytes 1048576 step: 2(factor) warmup iters: 5 iters: 20",
    "#  Rank  0 Group  0 Pid   4242 on gpu-node device  0 [0000:18:00] NVIDIA H100 80GB HBM3",
    "#                                                              out-of-place                       in-place          ",
    "#       size         count      type   redop    root     time   algbw   busbw #wrong     time   algbw   busbw #wrong",
    "#        (B)    (elements)                               (us)  (GB/s)  (GB/s)            (us)  (GB/s)  (GB/s)       ",
    _row(8, 2, "float", "sum", (7.41, 0.0, 0.0, "0"), (1.02, 0.01, 0.0, "0")),
    _row(1048576, 262144, "float", "sum", (9.12, 114.98, 0.0, "0"), (1.10, 953.25, 0.0, "N/A")),
    "NCCL WARN 3 things 4 5 6 7 8 9 10 11 12 13",  # looks like a row to a careless reader
    "# Out of bounds values : 0 OK",
    "# Avg bus bandwidth    : 0 ",
])


def test_nccl_tests_table_is_read_column_by_column() -> None:
    rows = nccl_tests.parse(NCCL_TESTS_OUTPUT)
    assert [r.size for r in rows] == [8, 1048576]
    big = rows[1]
    assert (big.count, big.dtype, big.redop) == (262144, "float", "sum")
    assert (big.oop_time_us, big.oop_wrong) == (9.12, 0)
    assert (big.ip_time_us, big.ip_wrong) == (1.10, None)
    # AllReduce runs in place in torch, so its yardstick is the in-place column; the rest
    # compare with out-of-place.
    assert big.column("allreduce") == (1.10, 0.0, None)
    assert big.column("alltoall") == (9.12, 0.0, 0)


def test_nccl_tests_is_run_as_ringwatch_measures() -> None:
    binary = Path("/opt/nccl-tests/build/all_reduce_perf")
    one = nccl_tests.commands(binary, sizes=[8, 1 << 10, 1 << 20], world_size=2, warmup=5,
                              iters=20, dtype="bfloat16", redop="max", graph=True)
    assert len(one) == 1  # a power-of-two ladder is one sweep with -f 2
    args = one[0]
    flags = dict(zip(args[1::2], args[2::2], strict=False))
    assert flags["-b"] == "8" and flags["-e"] == str(1 << 20) and flags["-f"] == "2"
    assert flags["-g"] == "2" and flags["-w"] == "5" and flags["-n"] == "20"
    assert flags["-d"] == "bfloat16" and flags["-o"] == "max"
    assert flags["-c"] == "1" and flags["-a"] == "3" and flags["-G"] == "1"
    uneven = nccl_tests.commands(binary, sizes=[8, 3000], world_size=1, warmup=1, iters=1,
                                 dtype="float32", redop="sum", graph=False)
    assert [(c[2], c[4]) for c in uneven] == [("8", "8"), ("3000", "3000")]
    assert all("-G" not in c for c in uneven)


def test_find_binaries_looks_in_the_build_folder(tmp_path: Path) -> None:
    (tmp_path / "build").mkdir()
    for name in ("all_reduce_perf", "alltoall_perf"):
        (tmp_path / "build" / name).write_text("")
    found = nccl_tests.find_binaries(tmp_path)
    assert sorted(found) == ["allreduce", "alltoall"]
    assert found["allreduce"] == tmp_path / "build" / "all_reduce_perf"


def test_comparison_runs_each_binary_and_pairs_rows_by_size(tmp_path: Path) -> None:
    """The nccl-tests binaries need a GPU; an executable that prints their table and logs
    its arguments stands in for them, so the run, the parse and the pairing are all real."""
    log = tmp_path / "args.log"
    table = tmp_path / "table.txt"
    table.write_text(NCCL_TESTS_OUTPUT + "\n")
    for name in ("all_reduce_perf", "alltoall_perf"):
        exe = tmp_path / name
        exe.write_text(f"#!/bin/sh\necho \"$0 $*\" >> {log}\ncat {table}\n")
        exe.chmod(0o755)
    ms = [Measurement(scope="intra_node", members=["n/0"], op=op, size_bytes=size,
                      dtype="float32", warmup=5, iters=20, time_us=t, algbw_gbs=0.0,
                      busbw_gbs=0.0, wrong=0, timing=TIMING_CUDA_GRAPH)
          for op, size, t in (("alltoall", 8, 14.82), ("allreduce", 1048576, 2.2))]
    result = SelftestResult("n", "nccl", worlds=[WorldResult(1, ms)])
    options = SelftestOptions(ops=("allreduce", "alltoall"), sizes=(8, 1048576))
    paired = report.compare(options, result, nccl_tests.find_binaries(tmp_path))
    by = {(c.op, c.size_bytes): c for c in paired}
    assert set(by) == {("alltoall", 8), ("allreduce", 1048576)}
    assert by[("alltoall", 8)].time_ratio == pytest.approx(14.82 / 7.41)
    assert by[("allreduce", 1048576)].nccl_tests_us == 1.10  # the in-place column
    calls = log.read_text().splitlines()
    assert len(calls) == 2 and all("-G 1" in c and "-g 1" in c for c in calls)
    text = report.format_comparison(paired)
    assert "alltoall" in text and "2.00" in text


def test_a_failing_nccl_tests_run_is_reported_with_its_last_words(tmp_path: Path) -> None:
    exe = tmp_path / "alltoall_perf"
    exe.write_text("#!/bin/sh\necho 'NCCL failure common.cu:1013 unhandled cuda error' >&2\n"
                   "exit 3\n")
    exe.chmod(0o755)
    with pytest.raises(RuntimeError, match="exited 3: NCCL failure"):
        nccl_tests.run(exe, sizes=[8], world_size=1, warmup=1, iters=1, dtype="float32",
                       redop="sum", graph=False)


def test_world_of_two_gloo_ranks_runs_every_op_without_ray() -> None:
    options = SelftestOptions(backend="gloo", sizes=(8, 1 << 16), warmup=1, iters=3,
                              deadline_s=60)
    world = run_world(options, 2, "selftest-node")
    assert world.findings == []
    assert sorted({m.op for m in world.measurements}) == sorted(options.ops)
    assert len(world.measurements) == len(options.ops) * 2
    assert all(m.wrong == 0 and m.timing == TIMING_HOST for m in world.measurements)
    assert all(m.members == ["selftest-node/0", "selftest-node/1"] for m in world.measurements)


def test_rank_processes_do_not_import_ray() -> None:
    """The agent layer is what runs on a GPU host without Ray: the selftest's rank
    processes must not pull it in, so a world runs even where Ray is not installed."""
    code = (
        "import sys\n"
        "sys.modules['ray'] = None  # importing ray now raises ImportError\n"
        "from services.selftest.runner import SelftestOptions, run_world\n"
        "w = run_world(SelftestOptions(backend='gloo', ops=('allreduce','sendrecv'),"
        " sizes=(64,), warmup=1, iters=2, deadline_s=60), 1, 'n')\n"
        "print(len(w.measurements), len(w.findings))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["2", "0"]


def test_injected_corruption_fails_the_selftest() -> None:
    """A wrong element must turn PASSED into FAILED, through a real world of gloo ranks
    with one rank corrupting its output (the agent's own fault hook)."""
    options = SelftestOptions(backend="gloo", ops=("allreduce",), sizes=(1 << 12,), warmup=1,
                              iters=2, deadline_s=60,
                              faults=(InjectedFault("corrupt", "selftest-node", 1),))
    world = run_world(options, 2, "selftest-node")
    assert [(f.kind, f.gpu) for f in world.findings] == [("data_corruption", 1)]
    result = SelftestResult("selftest-node", "gloo", worlds=[world])
    assert not report.passed(result)
    text = report.format_text(result, None, None)
    assert "FAILED" in text
    # Places as every surface writes them (agents.places): the finding's GPU, the group's.
    assert "  data_corruption  selftest-node GPU 1: " in text
    assert "2 ranks: selftest-node GPUs 0-1" in text


def test_an_erroring_rank_is_an_error_and_its_peer_is_not_hung() -> None:
    options = SelftestOptions(backend="gloo", ops=("allreduce",), sizes=(1 << 12,), warmup=1,
                              iters=2, deadline_s=60,
                              faults=(InjectedFault("error", "selftest-node", 0),))
    world = run_world(options, 2, "selftest-node")
    assert [(f.kind, f.gpu) for f in world.findings] == [("probe_error", 0)]
    assert world.findings[0].detail["injected"] is True


def test_cli_selftest_on_gloo_passes_with_json() -> None:
    out = subprocess.run([*CLI, "selftest", "--backend", "gloo", "--sizes", "8,64K",
                          "--iters", "3", "--warmup", "1", "--json"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["passed"] is True and doc["backend"] == "gloo"
    sizes = {(m["op"], m["world_size"], m["size_bytes"]) for m in doc["measurements"]}
    assert len(sizes) == 5 * 2 * 2  # five ops, world sizes 1 and 2, two sizes
    assert all(m["wrong"] == 0 and m["timing"] == TIMING_HOST for m in doc["measurements"])
    assert "world size 2" in out.stderr  # progress goes to stderr


@pytest.mark.parametrize("argv, says", [
    (["selftest", "--backend", "gloo", "--world-sizes", "0"], "world sizes must be >= 1"),
    (["selftest", "--backend", "gloo", "--ops", "allreduce,bogus"], "unknown op(s) bogus"),
    (["selftest", "--backend", "gloo", "--nccl-tests", "/nonexistent"], "not a directory"),
    (["selftest", "--backend", "gloo", "--inject", '{"kind": "corrupt", "gpu": 7}'],
     "not a rank of this selftest"),
    (["selftest", "--backend", "gloo", "--inject", '{"kind": "melt"}'], "kind must be one of"),
])
def test_cli_selftest_bad_input_is_one_line_and_exit_2(argv: list[str], says: str) -> None:
    out = subprocess.run([*CLI, *argv], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert says in out.stderr and len(out.stderr.strip().splitlines()) == 1
    assert out.stdout == ""


def test_cli_selftest_on_nccl_without_a_gpu_says_so_in_one_line() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    out = subprocess.run([*CLI, "selftest"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "CUDA is not available" in lines[0]


def test_selftest_help_states_the_defaults_it_runs() -> None:
    """Its help once said allreduce,alltoall and a preflight's two sizes; it runs every op
    over the backend's quick preset, one timed loop each."""
    import contextlib
    import io

    from ringwatch.agents.spec import OPS
    from ringwatch.services.cli.main import build_parser

    parser = build_parser()
    args = parser.parse_args(["selftest"])
    assert args.ops == ",".join(OPS) and args.sizes is None and args.repeats is None
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
        parser.parse_args(["selftest", "--help"])
    text = " ".join(out.getvalue().split())
    assert f"(default: every op: {','.join(OPS)})" in text
    assert "quick preset" in text and "(default 1)" in text
