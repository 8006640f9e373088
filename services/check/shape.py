"""What every probe group of a check runs: ops, sizes, iterations, deadline. As a caller asks
for it (``ProbeSpec``: sizes and deadline may be left to the backend) and as the plan uses it
(``ProbeShape``: every field settled for this backend)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from ringwatch.agents.collectives import DEFAULT_SIZES, default_sizes
from ringwatch.agents.spec import GroupSpec, ProbeBackend
from ringwatch.services.check.deadlines import group_deadline_s

DEFAULT_OPS: tuple[str, ...] = ("allreduce", "alltoall")


@dataclass(frozen=True)
class ProbeShape:
    """What every group of a plan runs: ops, sizes and iteration counts."""

    ops: tuple[str, ...] = DEFAULT_OPS
    sizes: tuple[int, ...] = DEFAULT_SIZES["gloo"]
    dtype: str = "float32"
    warmup: int = 5
    iters: int = 20
    deadline_s: float = 60.0
    redop: str = "sum"

    def group(self, scope: str, members: Sequence[str],
              ops: tuple[str, ...] | None = None) -> GroupSpec:
        return GroupSpec(scope=scope, members=tuple(members), ops=ops or self.ops,
                         sizes=self.sizes, dtype=self.dtype, warmup=self.warmup,
                         iters=self.iters, deadline_s=self.deadline_s, redop=self.redop)


@dataclass(frozen=True)
class ProbeSpec:
    """What a caller asks every group of a check to run. ``sizes`` None: the backend's probe
    sizes (``probe_sizes``); ``deadline_s`` None: the backend's, else worked out from the
    work (services.check.deadlines). A monitoring cycle and a preflight asked alike judge
    alike."""

    ops: tuple[str, ...] = DEFAULT_OPS
    sizes: tuple[int, ...] | None = None
    dtype: str = "float32"
    warmup: int = 5
    iters: int = 20
    # nccl-tests' -o for AllReduce and ReduceScatter: sum, max, min, or avg (nccl only).
    redop: str = "sum"
    deadline_s: float | None = None
    # NVLink domains split into partitions on purpose (RINGWATCH_NVLINK_PARTITIONED): the
    # check's fabric facts then compare no cliques, judging registration and health alone.
    nvlink_partitioned: bool = False

    def shape(self, backend: ProbeBackend, ops: Sequence[str],
              sizes: Sequence[int] | None) -> ProbeShape:
        """The settled shape of groups that run ``ops`` at ``sizes`` (None: the backend's)."""
        shape = ProbeShape(ops=tuple(ops), sizes=tuple(sizes or probe_sizes(backend)),
                           dtype=self.dtype, warmup=self.warmup, iters=self.iters,
                           redop=self.redop)
        deadline = (self.deadline_s or backend.preflight_deadline_s
                    or group_deadline_s(backend.name, shape.ops, shape.sizes,
                                        warmup=shape.warmup, iters=shape.iters,
                                        repeats=backend.repeats))
        return replace(shape, deadline_s=deadline)


def probe_sizes(backend: ProbeBackend) -> tuple[int, ...]:
    """The sizes a check probes unless told: the backend's own choice where it has one, else
    one latency and one bandwidth-bound size for its kind of fabric."""
    return tuple(backend.preflight_sizes or default_sizes(backend.name))
