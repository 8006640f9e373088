"""The faults in the order of the table, running them, and the table itself."""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable, Iterable

from bench.chaos import attacks, inputs, processes, waiting, webhooks
from bench.chaos.harness import Row

Fault = Callable[[str | None], Row]

FAULTS: dict[str, tuple[str, Fault]] = {
    "schemathesis": ("schemathesis (live OpenAPI)", inputs.schemathesis),
    "roles": ("role matrix over every route", inputs.role_matrix),
    "hostile": ("oversized and hostile inputs", inputs.hostile_inputs),
    "attacks": ("one agent's attacks", attacks.agent_attacks),
    "ssrf": ("SSRF attempts on webhook URLs", webhooks.ssrf),
    "replay": ("replayed signatures", webhooks.replayed_signature),
    "notifiers": ("two notifiers, slow and dead receivers", processes.two_notifiers),
    "kill-api": ("kill -9 API mid-ingest", processes.kill_api_mid_ingest),
    "kill-after-ack": ("kill -9 API right after the ack", processes.kill_api_after_ack),
    "kill-notifier": ("kill -9 notifier mid-delivery, request unanswered",
                      processes.kill_notifier_mid_delivery),
    "kill-notifier-burst": ("kill -9 notifier mid-burst", processes.kill_notifier_mid_burst),
    "kill-scheduler": ("kill -9 scheduler mid-preflight", processes.kill_scheduler_mid_preflight),
    "postgres": ("Postgres restarted under load", processes.postgres_restart),
    "waiters": ("128 waiting preflights", waiting.waiters),
}


def run_fault(name: str, admin_url: str | None = None) -> Row:
    """One fault; a harness error is a row that missed, with the error in its note."""
    title, fault = FAULTS[name]
    started = time.monotonic()
    try:
        row = fault(admin_url)
    except Exception as exc:
        traceback.print_exc()
        row = Row(title, False, note=f"harness error: {type(exc).__name__}: {exc}"[:400])
    row.seconds = time.monotonic() - started
    return row


def run(names: Iterable[str], admin_url: str | None = None,
        each: Callable[[Row], None] | None = None) -> list[Row]:
    rows = []
    for name in names:
        row = run_fault(name, admin_url)
        rows.append(row)
        if each is not None:
            each(row)
    return rows


HEADER = ("fault", "survived", "results lost", "events lost", "events doubled", "s", "note")


def _cells(row: Row) -> tuple[str, ...]:
    def count(n: int | None) -> str:
        return "-" if n is None else str(n)

    survived = "not run" if row.survived is None else ("yes" if row.survived else "NO")
    return (row.fault, survived, count(row.results_lost), count(row.events_lost),
            count(row.events_doubled), f"{row.seconds:.0f}", row.note)


def format_table(rows: list[Row]) -> str:
    """Plain aligned text, the note last and unpadded."""
    lines = [HEADER, *(_cells(r) for r in rows)]
    widths = [max(len(line[i]) for line in lines) for i in range(len(HEADER) - 1)]
    out = []
    for line in lines:
        cols = [c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths, strict=False))]
        out.append("  ".join([*cols, line[-1]]).rstrip())
    missed = [r.fault for r in rows if r.survived is not None and not r.met]
    skipped = [r.fault for r in rows if r.survived is None]
    out.append("")
    out.append(f"{len(rows) - len(missed) - len(skipped)} of {len(rows)} met the target "
               "(survived, 0 lost, 0 doubled)"
               + (f"; missed: {', '.join(missed)}" if missed else "")
               + (f"; not run: {', '.join(skipped)}" if skipped else ""))
    return "\n".join(out)
