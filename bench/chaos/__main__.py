"""``make chaos``: inject each fault into real ringwatch processes and print what survived.

    python -m bench.chaos                          # every fault
    python -m bench.chaos --only roles,kill-api    # some (--list names them)
    python -m bench.chaos --json chaos.json        # the rows as JSON too

Exit 0 when every fault that ran met the target (survived, 0 results lost, 0 events lost
or doubled), 1 when one missed, 2 on bad arguments. docs/reliability.md says what each does.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from bench.chaos import harness
from bench.chaos.suite import FAULTS, format_table, run


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.chaos", description=__doc__.split("\n")[0])
    p.add_argument("--only", help="comma-separated faults to run (default: all)")
    p.add_argument("--json", type=Path, help="also write the rows to this file")
    p.add_argument("--list", action="store_true", help="name the faults and exit")
    p.add_argument("--keep-logs", action="store_true",
                   help="keep every fault's process logs under .ringwatch/chaos/ (kept anyway "
                        "for a fault that missed)")
    args = p.parse_args(argv)
    if args.list:
        for name, (title, _) in FAULTS.items():
            print(f"{name:16} {title}")
        return 0
    names = [n.strip() for n in args.only.split(",") if n.strip()] if args.only else list(FAULTS)
    unknown = [n for n in names if n not in FAULTS]
    if unknown:
        print(f"unknown fault(s) {', '.join(unknown)}; choose from {', '.join(FAULTS)}", file=sys.stderr)
        return 2
    harness.KEEP_LOGS = args.keep_logs

    def said(row: harness.Row) -> None:
        verdict = "met" if row.met else ("not run" if row.survived is None else "MISSED")
        print(f"-- {row.fault}: {verdict} ({row.seconds:.0f} s) {row.note}", file=sys.stderr, flush=True)

    rows = run(names, each=said)
    print(format_table(rows), flush=True)
    if args.json:
        args.json.write_text(json.dumps([r.to_dict() for r in rows], indent=2) + "\n")
    return 0 if all(r.met or r.survived is None for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
