"""SIGTERM as a stop request (services.cli.signals), in a process of its own: the signal
handlers are the process's."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# The stop event's own lock is held, as it is on the way into stop.wait, when SIGTERM
# arrives: the handler runs in this thread before the lock is let go.
_HELD = """
import os, signal, threading
from ringwatch.services.cli.signals import stop_on_signals

stop = threading.Event()
stop_on_signals(stop, "scheduler")
with stop._cond:
    os.kill(os.getpid(), signal.SIGTERM)
    held = sum(range(1000))  # the handler has run by here
print("stopped", stop.wait(30))
os.kill(os.getpid(), signal.SIGINT)  # a second signal: set again, said once
print("still", stop.wait(30))
"""


def test_a_signal_while_the_stop_events_lock_is_held_stops_and_says_so_once() -> None:
    proc = subprocess.run([sys.executable, "-c", _HELD], cwd=ROOT, capture_output=True,
                          text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.splitlines() == ["stopped True", "still True"]
    said = [x for x in proc.stderr.splitlines() if "received; stopping" in x]
    assert len(said) == 1 and "ringwatch scheduler: SIGTERM received" in said[0], proc.stderr
