"""The gloo backend end to end: a real local Ray cluster of 2 logical nodes x 2 ranks,
real process groups, injected slow, hang and corrupt ranks. One cluster per module."""

from __future__ import annotations

import dataclasses
import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from ringwatch.agents.spec import KEPT_WARMUP, GroupSpec, InjectedFault, Measurement
from ringwatch.services.scheduler.ray_backend import (
    RayBackend,
    _GroupRun,
    fabric_time_s,
    held_s,
    ray_temp_dir,
)

N0 = ("node-000/0", "node-000/1")
N1 = ("node-001/0", "node-001/1")
WORLD = N0 + N1


def intra(ops: tuple[str, ...] = ("allreduce", "alltoall"), **kw: object) -> list[GroupSpec]:
    base: dict[str, object] = {"sizes": (1 << 20,), "warmup": 2, "iters": 10, **kw}
    return [GroupSpec("intra_node", N0, ops=ops, **base),  # type: ignore[arg-type]
            GroupSpec("intra_node", N1, ops=ops, **base)]  # type: ignore[arg-type]


def by_group(ms: list[Measurement], op: str) -> dict[tuple[str, ...], Measurement]:
    return {tuple(m.members): m for m in ms if m.op == op}


@pytest.fixture(scope="module")
def backend(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RayBackend]:
    messages: list[str] = []
    with RayBackend("gloo", local_nodes=2, ranks_per_node=2,
                    temp_dir=tmp_path_factory.mktemp("ray"), progress=messages.append) as b:
        b.messages = messages  # type: ignore[attr-defined]
        yield b


@pytest.fixture(autouse=True)
def healthy(request: pytest.FixtureRequest) -> Iterator[None]:
    """Every Ray test starts and ends with no injected faults and one repeat."""
    yield
    if "backend" in request.fixturenames:
        b = request.getfixturevalue("backend")
        b.set_injected([])
        b.repeats = 1


# ---- without Ray ----------------------------------------------------------------------


def test_ray_temp_dir_stays_short(tmp_path: Path) -> None:
    short = Path("/tmp") / f"rw-test-{uuid.uuid4().hex[:8]}"
    try:
        assert ray_temp_dir(short) == short and short.is_dir()
    finally:
        short.rmdir()
    deep = tmp_path / ("x" * 80) / "ray"
    assert ray_temp_dir(deep) == Path("/tmp") / f"rw-{os.getuid()}"


def test_exactly_one_place_to_run() -> None:
    with pytest.raises(ValueError):
        RayBackend("gloo")
    with pytest.raises(ValueError):
        RayBackend("mpi", local_nodes=1)


# ---- a healthy cluster ----------------------------------------------------------------


@pytest.mark.ray
def test_ranks_are_named_and_logical_nodes_are_distinct_ray_nodes(backend: RayBackend) -> None:
    assert [r.member for r in backend.ranks()] == list(WORLD)
    assert all(r.hostname for r in backend.ranks())
    where = backend.placement()
    ray_node = {m: w["ray_node_id"] for m, w in where.items()}
    assert ray_node[N0[0]] == ray_node[N0[1]]
    assert ray_node[N1[0]] == ray_node[N1[1]]
    assert ray_node[N0[0]] != ray_node[N1[0]]
    assert len({w["pid"] for w in where.values()}) == 4  # one process per rank


@pytest.mark.ray
def test_healthy_rounds_give_sane_measurements(backend: RayBackend) -> None:
    rounds = [
        intra(),
        [GroupSpec("inter_node", (N0[0], N1[0]), sizes=(1 << 20,), warmup=2, iters=10),
         GroupSpec("inter_node", (N0[1], N1[1]), sizes=(1 << 20,), warmup=2, iters=10)],
        [GroupSpec("world", WORLD, sizes=(1 << 20,), warmup=2, iters=10)],
    ]
    for groups in rounds:
        result = backend.run_round(groups)
        assert result.findings == []
        assert len(result.measurements) == 2 * len(groups)
        assert {tuple(m.members) for m in result.measurements} == {g.members for g in groups}
        for m in result.measurements:
            assert m.scope == groups[0].scope
            assert m.wrong == 0
            assert m.busbw_gbs > 0 and m.time_us > 0
            assert m.size_bytes == 1 << 20  # 1 MiB splits evenly over 2 and 4 ranks
            assert m.algbw_gbs == pytest.approx(m.size_bytes / (m.time_us * 1e-6) / 1e9)
        assert 0 < result.fabric_time_s <= result.wall_time_s
        # The fabric time is the slowest group's whole time on it, forming and warm-ups
        # included: at least the timed loops of any of its ops.
        assert result.fabric_time_s >= max(m.time_us * 1e-6 * m.iters
                                           for m in result.measurements)


def test_a_groups_fabric_time_is_its_slowest_ranks_held_time_within_the_wall() -> None:
    spec = GroupSpec("intra_node", ("node-000/0", "node-000/1", "node-000/2"))
    run = _GroupRun(spec, "g", None, deadline=110.0, launched=100.0)
    run.replies = {0: {"held_s": 0.5, "timed_s": 0.2}, 1: {"held_s": 0.75, "timed_s": 0.3},
                   2: {"timed_s": 0.25}}  # an agent that reports its timed loops alone
    assert held_s(run) == 0.75
    # A figure that is no duration counts for nothing; none is more than the wall.
    run.replies[2] = {"held_s": float("nan")}
    assert held_s(run) == 0.75
    run.replies[2] = {"held_s": 1e9}
    assert fabric_time_s([run], 3.0) == 3.0
    # Past its deadline, a group held the fabric from its launch to the deadline.
    run.replies = {0: {"held_s": 0.5}}
    run.expired = True
    assert held_s(run) == 10.0
    assert fabric_time_s([run], 12.0) == 10.0
    assert fabric_time_s([], 1.0) == 0.0


@pytest.mark.ray
def test_all_five_ops_in_bfloat16_with_repeats(backend: RayBackend) -> None:
    backend.repeats = 3
    ops = ("allreduce", "alltoall", "allgather", "reducescatter", "sendrecv")
    spec = GroupSpec("world", WORLD, ops=ops, sizes=(4096, 100_000), dtype="bfloat16",
                     warmup=1, iters=3)
    result = backend.run_round([spec])
    assert result.findings == []
    assert [(m.op, m.dtype) for m in result.measurements] == [
        (op, "bfloat16") for op in ops for _ in spec.sizes]
    for m in result.measurements:
        assert m.wrong == 0
        assert m.stats is not None
        assert m.stats["min"] <= m.stats["median"] <= m.stats["max"]
        assert m.time_us == pytest.approx(m.stats["median"])
    # 100000 bytes of bfloat16 over 4 ranks: 12500 elements per block, rounded down.
    sizes = {m.op: m.size_bytes for m in result.measurements if m.size_bytes > 4096}
    assert sizes["alltoall"] == sizes["allgather"] == sizes["reducescatter"] == 100_000
    assert sizes["allreduce"] == sizes["sendrecv"] == 100_000


@pytest.mark.ray
def test_overlapping_or_unknown_groups_are_refused(backend: RayBackend) -> None:
    with pytest.raises(ValueError):
        backend.run_round([GroupSpec("world", WORLD), GroupSpec("intra_node", N0)])
    with pytest.raises(ValueError):
        backend.run_round([GroupSpec("intra_node", ("node-009/0", "node-009/1"))])


@pytest.mark.ray
def test_redop_reaches_the_agents_and_the_measurements(backend: RayBackend) -> None:
    spec = GroupSpec("world", WORLD, ops=("allreduce", "reducescatter", "alltoall"),
                     sizes=(4096,), warmup=1, iters=2, redop="min")
    result = backend.run_round([spec])
    assert result.findings == []
    assert [(m.op, m.redop, m.wrong) for m in result.measurements] == [
        ("allreduce", "min", 0), ("reducescatter", "min", 0), ("alltoall", "sum", 0)]
    assert result.measurements[0].to_dict()["redop"] == "min"
    # gloo has no average: refused before any agent is called.
    with pytest.raises(ValueError, match="avg"):
        backend.run_round([dataclasses.replace(spec, redop="avg")])


# ---- injected faults ------------------------------------------------------------------


@pytest.mark.ray
def test_injected_slow_rank_slows_its_group(backend: RayBackend) -> None:
    backend.set_injected([InjectedFault("slow", "node-001", 0, factor=0.25)])
    assert [f.kind for f in backend.injected] == ["slow"]
    result = backend.run_round(intra(ops=("allreduce",), iters=20))
    got = by_group(result.measurements, "allreduce")
    # Relative only: the slow group runs at about a quarter of the healthy peer's bandwidth,
    # so even a loaded machine's noise leaves a wide margin.
    assert got[N1].busbw_gbs < 0.8 * got[N0].busbw_gbs
    assert all(m.wrong == 0 for m in result.measurements)


@pytest.mark.ray
def test_injected_hang_is_named_and_the_next_round_is_healthy(backend: RayBackend) -> None:
    backend.set_injected([InjectedFault("hang", "node-001", 1)])
    hung = backend.run_round(intra(deadline_s=6.0))
    assert [(f.kind, f.node, f.gpu) for f in hung.findings] == [("hang", "node-001", 1)]
    detail = hung.findings[0].detail
    assert detail["injected"] is True and detail["stage"] == "join"
    assert detail["members"] == list(N1)
    # The healthy group still measured; the hung one did not.
    assert {tuple(m.members) for m in hung.measurements} == {N0}
    # Named only once its deadline passed (how soon after, replacement included, is a
    # figure of `make bench`: probes).
    assert hung.wall_time_s >= 6.0
    # The hung group held the fabric to its deadline, as a hang costs in the sim.
    assert 6.0 <= hung.fabric_time_s <= hung.wall_time_s
    assert any("replacing" in msg for msg in backend.messages)  # type: ignore[attr-defined]

    after = backend.run_round(intra())
    assert after.findings == []
    assert {tuple(m.members) for m in after.measurements} == {N0, N1}
    assert all(m.wrong == 0 and m.busbw_gbs > 0 for m in after.measurements)
    # The replacement runs on the same logical node, under the same name.
    where = backend.placement()
    assert where[N1[1]]["ray_node_id"] == where[N1[0]]["ray_node_id"]
    assert [r.member for r in backend.ranks()] == list(WORLD)


@pytest.mark.ray
def test_an_error_and_a_hang_side_by_side_are_told_apart(backend: RayBackend) -> None:
    # node-000/1 raises inside its first op; node-001/1 never enters its group.
    backend.set_injected([InjectedFault("error", "node-000", 1), InjectedFault("hang", "node-001", 1)])
    result = backend.run_round(intra(deadline_s=6.0))
    kinds = sorted((f.kind, f.node, f.gpu) for f in result.findings)
    assert kinds == [("hang", "node-001", 1), ("probe_error", "node-000", 1)]
    error = next(f for f in result.findings if f.kind == "probe_error")
    assert "InjectedError" in error.detail["error"] and error.detail["injected"] is True
    assert error.detail["stage"] == "allreduce/1048576"
    # The peer saw its collective break: listed, not blamed, and never called a hang.
    assert error.detail["peers_failed"] == [N0[0]]
    hang = next(f for f in result.findings if f.kind == "hang")
    assert hang.detail["stage"] == "join" and hang.detail["injected"] is True
    assert result.measurements == []

    backend.set_injected([])
    after = backend.run_round(intra())
    assert after.findings == [] and len(after.measurements) == 4


@pytest.mark.ray
def test_injected_corruption_is_a_data_corruption_finding(backend: RayBackend) -> None:
    backend.set_injected([InjectedFault("corrupt", "node-000", 1)])
    result = backend.run_round([GroupSpec("world", WORLD, sizes=(65536,), warmup=1, iters=2)])
    assert [(f.kind, f.node, f.gpu) for f in result.findings] == [
        ("data_corruption", "node-000", 1)]
    assert result.findings[0].detail["injected"] is True
    # One flipped element per op on the one corrupt rank, summed over ranks.
    assert [m.wrong for m in result.measurements] == [1, 1]


# ---- GPUs -----------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                    reason="needs 2 CUDA GPUs with NCCL")
def test_nccl_intra_node_round(tmp_path: Path) -> None:
    gpus = torch.cuda.device_count()
    with RayBackend("nccl", local_nodes=1, ranks_per_node=gpus, temp_dir=tmp_path) as b:
        members = tuple(r.member for r in b.ranks())
        ops = ("allreduce", "alltoall", "allgather", "reducescatter")
        result = b.run_round([GroupSpec("intra_node", members, ops=ops, sizes=(1 << 24,))])
        assert result.findings == []
        assert all(m.wrong == 0 and m.busbw_gbs > 0 for m in result.measurements)
        for redop in ("max", "min", "avg"):
            spec = GroupSpec("intra_node", members, ops=("allreduce", "reducescatter"),
                             sizes=(1 << 20, 1 << 24), redop=redop)
            result = b.run_round([spec])
            assert result.findings == []
            assert all(m.wrong == 0 and m.redop == redop for m in result.measurements)
        assert all(r.gpu_uuid for r in b.ranks())


# ---- the text table -----------------------------------------------------------------------


def test_format_table_is_nccl_tests_shaped() -> None:
    from ringwatch.services.scheduler.probe_table import format_table

    def m(op: str, size: int, members: tuple[str, ...], wrong: int = 0) -> Measurement:
        return Measurement(op=op, scope="intra_node", members=list(members), size_bytes=size,
                           dtype="float32", warmup=5, iters=20, time_us=1000.0,
                           algbw_gbs=size / 1e-3 / 1e9, busbw_gbs=size / 1e-3 / 1e9, wrong=wrong)

    text = format_table([m("allreduce", 1 << 20, N0), m("allreduce", 4096, N0),
                         m("alltoall", 1 << 20, N0, wrong=3), m("allreduce", 1 << 20, N1)])
    blocks = text.split("\n\n")
    assert len(blocks) == 3  # allreduce on N0, alltoall on N0, allreduce on N1
    first = blocks[0].splitlines()
    assert first[0] == "# allreduce  intra_node  2 ranks: node-000 GPUs 0-1"
    assert "busbw" in first[1] and "#wrong" in first[1] and "(GB/s)" in first[2]
    # Rows by size: 4096 B is 1024 float32 elements, then 1 MiB is 262144.
    assert first[3].split()[:5] == ["4096", "1024", "float32", "sum", "allreduce"]
    assert first[4].split()[:2] == ["1048576", "262144"]
    assert "redop" in first[1]
    assert blocks[1].splitlines()[3].split()[-1] == "3"
    # nccl-tests shows "none" where the op does not reduce; a max run shows max.
    assert blocks[1].splitlines()[3].split()[3] == "none"
    maxed = format_table([dataclasses.replace(m("allreduce", 4096, N0), redop="max")])
    assert maxed.splitlines()[3].split()[3] == "max"
    assert format_table([]) == "# no measurements"
    # Where NCCL's log said what the group ran over, the block's title says it too.
    via = format_table([dataclasses.replace(m("allreduce", 4096, N0), transport="net_ib,p2p_nvlink")])
    assert via.splitlines()[0].endswith("node-000 GPUs 0-1  via NET/IB, P2P over NVLink")
    assert "via" not in first[0]


# ---- naming the rank that stalled, from a real store ------------------------------------


def test_hang_suspects_reads_progress_from_the_store() -> None:
    import datetime

    import torch.distributed as dist

    from ringwatch.agents.outcome import hang_suspects
    from ringwatch.agents.probe import arrived_key, done_key, entered_key

    store = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=5))
    spec = GroupSpec("world", WORLD, ops=("allreduce", "alltoall"), sizes=(4096,))
    # Rank 3 never arrived: it alone is named, at "join".
    for r in range(3):
        store.set(arrived_key(r), "1")
    assert hang_suspects(store, spec, [0, 1, 2, 3]) == ([3], "join")
    # Everyone arrived, all finished allreduce, rank 2 never entered alltoall.
    store.set(arrived_key(3), "1")
    for r in range(4):
        store.set(entered_key(r, "allreduce", 4096), "1")
        store.set(done_key(r, "allreduce", 4096), "1")
        if r != 2:
            store.set(entered_key(r, "alltoall", 4096), "1")
    assert hang_suspects(store, spec, [0, 1, 2, 3]) == ([2], "alltoall/4096")
    # Stuck inside the same collective: the waiting peers cannot be told apart.
    store.set(entered_key(2, "alltoall", 4096), "1")
    assert hang_suspects(store, spec, [0, 1, 2, 3]) == ([0, 1, 2, 3], "alltoall/4096")


# ---- groups kept formed between rounds ------------------------------------------------


def kept(backend: RayBackend) -> dict[str, list[str]]:
    return {m: fp["kept_groups"] for m, fp in backend.footprints().items()}


@pytest.mark.ray
def test_a_group_measured_again_runs_without_forming_and_others_end_it(backend: RayBackend) -> None:
    backend.release()  # what the tests before kept
    assert all(ids == [] for ids in kept(backend).values())
    first = backend.run_round(intra(ops=("allreduce",)))
    again = backend.run_round(intra(ops=("allreduce",)))
    # Formed in the first round (its full warm-up), run again as it stood in the second.
    assert {m.warmup for m in first.measurements} == {2}
    assert {m.warmup for m in again.measurements} == {KEPT_WARMUP}
    assert again.findings == [] and len(again.measurements) == 2
    assert all(m.wrong == 0 and m.busbw_gbs > 0 for m in again.measurements)
    held = kept(backend)
    assert all(len(ids) == 1 for ids in held.values()), held
    assert held[N0[0]] == held[N0[1]] != held[N1[0]] == held[N1[1]]

    # A round of other groups ends the ones it does not measure before forming its own:
    # each rank holds one group at most.
    cross = [GroupSpec("inter_node", (N0[0], N1[0]), ops=("allreduce",), sizes=(1 << 20,),
                       warmup=2, iters=10),
             GroupSpec("inter_node", (N0[1], N1[1]), ops=("allreduce",), sizes=(1 << 20,),
                       warmup=2, iters=10)]
    other = backend.run_round(cross)
    assert {m.warmup for m in other.measurements} == {2} and other.findings == []
    now = kept(backend)
    assert all(len(ids) == 1 for ids in now.values()), now
    assert now[N0[0]] == now[N1[0]] and not set(now[N0[0]]) & set(held[N0[0]])

    # The end of a cycle ends them all.
    backend.release()
    assert all(ids == [] for ids in kept(backend).values())


@pytest.mark.ray
def test_a_group_that_failed_is_not_kept_and_forms_anew(backend: RayBackend) -> None:
    backend.release()
    backend.set_injected([InjectedFault("error", "node-000", 1)])
    failed = backend.run_round(intra(ops=("allreduce",)))
    assert [(f.kind, f.node) for f in failed.findings] == [("probe_error", "node-000")]
    held = kept(backend)
    # The rank that ran its part well ended the group too; the healthy group is kept.
    assert held[N0[0]] == held[N0[1]] == []
    assert len(held[N1[0]]) == 1
    backend.set_injected([])
    after = backend.run_round(intra(ops=("allreduce",)))
    assert after.findings == []
    warmups = {tuple(m.members): m.warmup for m in after.measurements}
    assert warmups == {N0: 2, N1: KEPT_WARMUP}
    backend.release()
