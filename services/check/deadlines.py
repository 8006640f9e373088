"""How long a probe group may take before it counts as hung.

The budget is what the group's work should cost at a pessimistic bandwidth floor,
times a safety factor, plus the fixed cost of forming the group. A group that
misses it is torn down and its missing ranks named; too generous a deadline only
delays that, too tight a one cries hang on a slow-but-alive link.
"""

from __future__ import annotations

from collections.abc import Sequence

# The slowest bandwidth a live link of each backend should show (GB/s). gloo on a
# loaded CPU can fall well under 0.1 GB/s; a live NVLink or IB path stays over 1 GB/s.
FLOOR_GBS = {"gloo": 0.02, "nccl": 1.0, "sim": 1.0}
# Forming a group: the store rendezvous, and for NCCL the communicator's own set-up.
FORM_S = {"gloo": 10.0, "nccl": 30.0, "sim": 5.0}
SAFETY = 3.0


def group_deadline_s(backend: str, ops: Sequence[str], sizes: Sequence[int], *, warmup: int,
                     iters: int, repeats: int = 1) -> float:
    floor = FLOOR_GBS.get(backend, 1.0) * 1e9
    # Every op at every size, warm-ups, timed iterations and the correctness pass; an
    # AllReduce moves about twice its size per rank, the rest at most once.
    moved = sum(size * (2 if op == "allreduce" else 1) for op in ops for size in sizes)
    work_s = moved * ((warmup + iters) * repeats + 1) / floor
    return round(FORM_S.get(backend, 10.0) + SAFETY * work_s, 1)
