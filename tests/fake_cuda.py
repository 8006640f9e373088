"""A CPU stand-in for ``agents.device.CudaApi``, the one seam of CUDA-only calls.

It keeps CUDA's shapes and rules where the code under test could get them wrong: events
must be recorded before they are read and give milliseconds; a device index past the
count is an error; a captured graph runs nothing until ``replay``, and its body runs
under capture's rules there (what CUDA would forbid while capturing, waiting on an event or
the device, raises); the "NCCL" process
group it forms is a real gloo group, so every host-side line of the NCCL path (launch,
sync, timing loop, data check, teardown) runs here against real collectives.
"""

from __future__ import annotations

import datetime
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

CLOCK_HZ = 1e9  # the fake GPU spins at 1 GHz


CAPTURING = "CUDA error: operation not permitted when stream is capturing"


class FakeEvent:
    def __init__(self, cuda: FakeCuda) -> None:
        self.at: float | None = None
        self._cuda = cuda

    def record(self, stream: Any = None) -> None:
        self.at = time.perf_counter()

    def synchronize(self) -> None:
        if self._cuda.capturing():
            raise RuntimeError(CAPTURING)
        if self.at is None:
            raise RuntimeError("CUDA error: synchronize on an event that was never recorded")

    def elapsed_time(self, end: FakeEvent) -> float:
        if self.at is None or end.at is None:
            raise RuntimeError("Both events must be recorded before calculating elapsed time.")
        return (end.at - self.at) * 1e3


class FakeGraph:
    """The body runs at replay (its collectives are real gloo ones), under the rules of the
    capture it stands for: Python that CUDA would have run while capturing runs here."""

    def __init__(self, body: Callable[[], None], cuda: FakeCuda) -> None:
        self._body, self._cuda = body, cuda

    def replay(self) -> None:
        self._cuda.log.append("replay")
        self._cuda._local.capturing = True
        try:
            self._body()
        finally:
            self._cuda._local.capturing = False


class FakeCuda:
    """The CudaApi surface with CPU tensors and gloo groups; records what was asked of it."""

    def __init__(self, gpus: int = 8, *, available: bool = True, nccl: bool = True,
                 capture_fails_on: frozenset[int] = frozenset()) -> None:
        self.gpus = gpus
        self._available = available
        self._nccl = nccl
        self.capture_fails_on = capture_fails_on
        self._local = threading.local()
        self.log: list[str] = []
        self.sleeps: list[int] = []
        self.bound: list[int] = []
        self.nccl_algo: list[str | None] = []

    def current(self) -> int:
        return getattr(self._local, "device", 0)

    def capturing(self) -> bool:
        return getattr(self._local, "capturing", False)

    def available(self) -> bool:
        return self._available

    def device_count(self) -> int:
        return self.gpus if self._available else 0

    def nccl_available(self) -> bool:
        return self._nccl

    def tensor_device(self, index: int) -> torch.device:
        self._check(index)
        return torch.device("cpu")

    def set_device(self, index: int) -> None:
        self._check(index)
        self._local.device = index
        self.bound.append(index)

    def synchronize(self, index: int) -> None:
        self._check(index)
        if self.capturing():
            raise RuntimeError(CAPTURING)

    def event(self) -> FakeEvent:
        return FakeEvent(self)

    def capture(self, body: Callable[[], None]) -> FakeGraph:
        if self.current() in self.capture_fails_on:
            raise RuntimeError("CUDA error: operation not permitted when stream is capturing")
        self.log.append("capture")
        return FakeGraph(body, self)

    def sleep(self, cycles: int) -> None:
        if not isinstance(cycles, int) or cycles < 1:
            raise TypeError(f"_sleep takes a positive int of cycles, got {cycles!r}")
        self.sleeps.append(cycles)
        end = time.perf_counter() + cycles / CLOCK_HZ
        while time.perf_counter() < end:
            pass

    def process_group(self, store: dist.Store, rank: int, world_size: int,
                      timeout: datetime.timedelta) -> Any:
        # What NCCL would read as its communicator forms.
        self.nccl_algo.append(os.environ.get("NCCL_ALGO"))
        opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
        opts._timeout = timeout
        return dist.ProcessGroupGloo(store, rank, world_size, opts)

    def _check(self, index: int) -> None:
        if not 0 <= index < self.device_count():
            raise RuntimeError(f"CUDA error: invalid device ordinal {index}")
