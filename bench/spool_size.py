"""What a scheduler's spool holds per cycle and per day at 1024 x 8 (sim backend), as the
shipper writes a batch, against the default bound (RINGWATCH_SPOOL_MAX_BYTES): how long an
API outage the spool rides out (docs/operations.md, "Nothing is lost").

    python -m bench.run spool_size
"""

from __future__ import annotations

import json

from ringwatch.agents.sim import SimBackend
from ringwatch.services.scheduler.cycle import ProbeOptions, run_cycle
from ringwatch.services.settings import Settings

NODES = 1024
CYCLES_PER_DAY = 288  # the default 300 s interval


def batch_bytes(noise: float, seed: int) -> int:
    backend = SimBackend.from_dict({"nodes": NODES, "gpus_per_node": 8, "gpu": "H100-SXM",
                                    "noise": noise, "seed": seed})
    batch = run_cycle(backend, ProbeOptions(), skip_busy=True).to_batch()
    return len(json.dumps(batch, default=str).encode())  # as Shipper writes it


def main(flags: list[str]) -> None:
    bound = Settings().spool_max_bytes
    print(f"{NODES} x 8, one batch per cycle as the shipper writes it; default bound "
          f"{bound / (1 << 30):.0f} GiB")
    for noise in (0.03, 0.08):
        sizes = [batch_bytes(noise, seed) for seed in (1, 2)]
        per_day = max(sizes) * CYCLES_PER_DAY
        print(f"  noise {noise:.0%}: a batch {min(sizes) / 1e6:.2f}-{max(sizes) / 1e6:.2f} MB, "
              f"{per_day / 1e9:.2f} GB a day at {CYCLES_PER_DAY} cycles; the bound holds "
              f"{bound / per_day * 24:.0f} h of an outage")
