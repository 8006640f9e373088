"""SIGTERM and SIGINT as a stop request to a long-running command (the scheduler, the
notifier, the Kubernetes sync): the work under way finishes and the process exits 0."""

from __future__ import annotations

import queue
import signal
import threading
from collections.abc import Callable

from ringwatch.services import logs


def stop_on_signals(stop: threading.Event, who: str | None = None,
                    then: Callable[[], None] | None = None) -> None:
    """SIGTERM (and SIGINT) set ``stop``, say so once for ``who`` (``ringwatch <who>:
    SIGTERM received; stopping after the work under way``) and call ``then`` (a wake-up of
    a loop that waits on something other than ``stop``). Call from the main thread.

    The handler only puts the signal on a queue that a thread of its own reads and acts
    on. A handler runs in the main thread between two of its bytecodes, and may do so while
    that thread holds ``stop``'s own lock on its way into ``stop.wait``: setting the event
    there waits for a lock its own thread holds, for good (a scheduler sent SIGTERM once
    hung so). ``queue.SimpleQueue.put`` takes no lock such code could hold."""
    signals: queue.SimpleQueue[int] = queue.SimpleQueue()

    def act() -> None:
        first = True
        while True:
            signum = signals.get()
            if first and who is not None:
                logs.say(f"ringwatch {who}: {signal.Signals(signum).name} received; "
                         "stopping after the work under way", logger=f"ringwatch.{who}")
            first = False
            stop.set()
            if then is not None:
                then()

    threading.Thread(target=act, name="ringwatch-stop", daemon=True).start()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, _frame: signals.put(signum))
