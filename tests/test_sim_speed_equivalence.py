"""The sim's fast paths give the very floats of its vectorized model: small groups in plain
Python, the pruned all-to-all search over large groups, op times kept per group and, on a
uniform fabric, per shape."""

import random

import numpy as np
import pytest

from ringwatch.agents.sim import CostModel, SimBackend, _Group, node_name

OPS = ("allreduce", "alltoall", "allgather", "reducescatter", "sendrecv")


def backend(nodes: int, gpus: int, seed: int, variation: float = 0.05) -> SimBackend:
    rng = random.Random(seed)
    a, b, c = rng.sample(range(nodes), 3)
    return SimBackend({"nodes": nodes, "gpus_per_node": gpus, "seed": seed,
                       "variation": variation, "faults": [
                           {"kind": "nic", "node": node_name(a), "factor": 0.6},
                           {"kind": "nvlink", "node": node_name(b), "gpus": [0, 3],
                            "factor": 0.5},
                           {"kind": "pcie_only", "node": node_name(c), "gpus": [1, 2]},
                           {"kind": "net_path", "nodes": [node_name(a), node_name(c)],
                            "factor": 0.3},
                           {"kind": "fallback", "node": node_name(b), "op": "alltoall",
                            "factor": 0.7}]})


def members(rng: random.Random, nodes: list[int], gpus: int) -> tuple[str, ...]:
    ranks = [f"{node_name(n)}/{g}" for n in nodes for g in sorted(rng.sample(range(gpus),
                                                                             rng.randint(1, gpus)))]
    if rng.random() < 0.3:
        rng.shuffle(ranks)
    return tuple(ranks)


def arrays_path(b: SimBackend, names: tuple[str, ...]) -> _Group:
    grp = b._group(names)
    big = _Group(grp.key, grp.nodes, grp.local)
    big.small = False
    return big


@pytest.mark.parametrize("seed", range(4))
def test_small_groups_model_as_the_arrays_do(seed):
    rng, b = random.Random(seed), backend(12, 8, seed)
    for _ in range(60):
        names = members(rng, rng.sample(range(12), rng.randint(1, 4)), 8)
        small, big = b._group(names), arrays_path(b, names)
        assert small.small
        for op in OPS:
            for algo in (None, "ring", "tree"):
                assert CostModel(b.fabric)._op_time(op, small, algo) == \
                    CostModel(b.fabric)._op_time(op, big, algo)


def full_table(model: CostModel, grp: _Group) -> float:
    """The all-to-all's network part over every node pair, as the model has it unpruned."""
    f, arr, n = model.f, grp.arrays, grp.n
    nic = f.nic[arr.uniq] * arr.counts / f.g
    drain = arr.counts * (n - arr.counts) / n / (nic * 1e9)
    i, j = np.triu_indices(arr.uniq.size, 1)
    return float((np.maximum(drain[i], drain[j]) / f.path_mult(arr.uniq[i], arr.uniq[j])).max())


@pytest.mark.parametrize("variation", [0.0, 0.001, 0.05, 0.9])
def test_large_all_to_all_finds_the_full_tables_slowest_flow(variation):
    rng, b = random.Random(7), backend(150, 4, 7, variation)
    for _ in range(8):
        names = members(rng, sorted(rng.sample(range(150), rng.randint(20, 150))), 4)
        grp = b._group(names)
        assert not grp.small
        nic = b.fabric.nic[grp.arrays.uniq] * grp.arrays.counts / b.fabric.g
        drain = grp.arrays.counts * (grp.n - grp.arrays.counts) / grp.n / (nic * 1e9)
        assert b.model._slowest_flow(grp, drain) == full_table(b.model, grp)


def test_op_times_are_kept_per_group_and_a_uniform_fabric_shares_them_by_shape():
    b = backend(16, 8, 3)
    names = tuple(f"{node_name(5)}/{g}" for g in range(8))
    first = b.model.op_time("allreduce", b._group(names))
    assert b.model.op_time("allreduce", b._group(names)) is first
    assert b.fabric.uniform is False and b._nominal.f.uniform is True
    other = tuple(f"{node_name(9)}/{g}" for g in range(8))
    kept = b._nominal.op_time("alltoall", b._group(names))
    assert b._nominal.op_time("alltoall", b._group(other)) is kept
    assert CostModel(b._nominal.f)._op_time("alltoall", b._group(other), None) == kept
