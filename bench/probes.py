"""Probe fidelity and cost on gloo: ringwatch's busbw beside a plain torch.distributed
reference for the same ops, sizes and rank count; the cost of forming and leaving a group;
the wall time of a ``quick`` cycle on the local 3x2 cluster."""

from __future__ import annotations

import statistics
import time
from pathlib import Path

from bench import plain_collectives
from ringwatch.agents.collectives import preset_sizes
from ringwatch.agents.spec import GroupSpec
from ringwatch.services.scheduler.cycle import ProbeOptions, run_cycle
from ringwatch.services.scheduler.ray_backend import RayBackend

OPS = ("allreduce", "alltoall", "allgather", "reducescatter")
SIZES = (1 << 20, 1 << 22)
WARMUP, ITERS, TRIALS = 5, 20, 3


def main(flags: list[str]) -> None:
    temp = Path(".ringwatch") / "ray"
    with RayBackend("gloo", local_nodes=2, ranks_per_node=2, temp_dir=temp) as backend:
        members = tuple(r.member for r in backend.ranks())
        ours = ringwatch_busbw(backend, members)
        overhead(backend, members)
    ref = reference_busbw(len(members))
    print(f"\nbusbw GB/s, {len(members)} gloo ranks, median of {TRIALS} trials "
          f"(warmup {WARMUP}, iters {ITERS}):")
    print(f"  {'op':<14}{'size':>10}{'ringwatch':>12}{'plain torch':>13}{'ratio':>8}")
    for op in OPS:
        for size in SIZES:
            a, b = ours[(op, size)], ref[(op, size)]
            print(f"  {op:<14}{size:>10}{a:>12.3f}{b:>13.3f}{a / b:>8.2f}")
    with RayBackend("gloo", local_nodes=3, ranks_per_node=2, temp_dir=temp) as backend:
        quick_cycle(backend)
        hang_and_error(backend)


def ringwatch_busbw(backend: RayBackend, members: tuple[str, ...]) -> dict[tuple[str, int], float]:
    samples: dict[tuple[str, int], list[float]] = {}
    for _ in range(TRIALS):
        rr = backend.run_round([GroupSpec("world", members, ops=OPS, sizes=SIZES, warmup=WARMUP,
                                          iters=ITERS, deadline_s=300)])
        for m in rr.measurements:
            samples.setdefault((m.op, m.size_bytes), []).append(m.busbw_gbs)
    return {k: statistics.median(v) for k, v in samples.items()}


def reference_busbw(n: int) -> dict[tuple[str, int], float]:
    samples: dict[tuple[str, int], list[float]] = {}
    cases = [(op, s) for op in OPS for s in SIZES]
    for _ in range(TRIALS):
        for k, v in plain_collectives.measure(cases, n, WARMUP, ITERS).items():
            samples.setdefault(k, []).append(v)
    return {k: statistics.median(v) for k, v in samples.items()}


def overhead(backend: RayBackend, members: tuple[str, ...], trials: int = 10) -> None:
    """Wall time of a group whose only work is one 8-byte allreduce: forming, the store,
    the driver's round trip and leaving, nearly all of it overhead; and of the same group
    run again in the next round, kept formed by its ranks (docs/probes.md)."""
    group = GroupSpec("world", members, ops=("allreduce",), sizes=(8,), warmup=0, iters=1,
                      deadline_s=60)

    def timed() -> float:
        t0 = time.monotonic()
        backend.run_round([group])
        return time.monotonic() - t0

    formed = []
    for _ in range(trials):
        backend.release()  # ends the group kept from the round before
        formed.append(timed())
    kept = [timed() for _ in range(trials)]
    backend.release()
    for what, walls in (("form + run 8 B + leave a", formed), ("run 8 B on a kept", kept)):
        print(f"{what} {len(members)}-rank group: median "
              f"{statistics.median(walls) * 1000:.0f} ms, min {min(walls) * 1000:.0f} ms")


def quick_cycle(backend: RayBackend) -> None:
    options = ProbeOptions(sizes=preset_sizes("quick", "gloo"), warmup=5, iters=20)
    walls, fabric = [], []
    for _ in range(3):
        c = run_cycle(backend, options)
        walls.append(c.wall_time_s)
        fabric.append(c.fabric_time_s)
    print(f"quick cycle on local 3x2 gloo ({len(options.sizes)} sizes x 2 ops, {c.rounds} rounds, "
          f"{len(c.measurements)} measurements): wall median {statistics.median(walls):.2f} s, "
          f"fabric (each round's slowest group, forming to last op) "
          f"{statistics.median(fabric):.2f} s")


HANG_DEADLINE_S = 6.0


def hang_and_error(backend: RayBackend) -> None:
    """How long a round takes to name a hung rank (its deadline, then the rank's replacement)
    and an erroring one beside it (at once): the contract is deadline + 10 s."""
    pairs = [GroupSpec("intra_node", (f"node-00{i}/0", f"node-00{i}/1"), sizes=(1 << 20,),
                       warmup=2, iters=10, deadline_s=HANG_DEADLINE_S) for i in range(3)]
    from ringwatch.agents.spec import InjectedFault

    for label, faults in (("a hang", [InjectedFault("hang", "node-001", 1)]),
                          ("a hang and an error", [InjectedFault("hang", "node-001", 1),
                                                   InjectedFault("error", "node-000", 1)])):
        backend.set_injected(faults)
        result = backend.run_round(pairs)
        named = sorted(f"{f.kind} {f.node}/{f.gpu}" for f in result.findings)
        print(f"round with {label} (deadline {HANG_DEADLINE_S:g} s): named {', '.join(named)} "
              f"in {result.wall_time_s:.1f} s wall (contract: < {HANG_DEADLINE_S + 10:g} s)")
        backend.set_injected([])
        backend.run_round(pairs)  # the replacement settles before the next
