"""``make bench``: run every benchmark and print its figures (nothing is asserted).

    python -m bench.run                 # all
    python -m bench.run alerts probes   # some
    python -m bench.run detection --quick
"""

from __future__ import annotations

import importlib
import os
import sys
import time

BENCHMARKS = ("probes", "nccl_path", "alerts", "detection", "weak_faults", "scenario_sets",
              "monitoring", "floors",
              "scale", "workloads", "ui", "pairs", "ingest_memory", "check_cost", "roles", "why",
              "occupancy", "agent_lifecycle", "busy_fleet", "rotation_coverage", "spool_size",
              "ingest_findings", "launch_gate")


def main(argv: list[str]) -> int:
    os.makedirs("/tmp/ray", exist_ok=True)
    names = [a for a in argv if not a.startswith("-")] or list(BENCHMARKS)
    flags = [a for a in argv if a.startswith("-")]
    for name in names:
        if name not in BENCHMARKS:
            print(f"unknown benchmark {name!r}; choose from {', '.join(BENCHMARKS)}", file=sys.stderr)
            return 2
        print(f"\n######## {name}", flush=True)
        started = time.monotonic()
        importlib.import_module(f"bench.{name}").main(flags)
        print(f"######## {name} took {time.monotonic() - started:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
