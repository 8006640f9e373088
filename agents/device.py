"""Where a probe's tensors live and how its timed loop is clocked: a CUDA GPU (CUDA graph
replay timed by events, as nccl-tests ``-G``, falling back to events around an eager loop)
or the host (wall clock, for gloo on CPU).

Every call that only works with CUDA or NCCL goes through one object, ``cuda`` (a
``CudaApi``): set_device, streams, events, synchronize, graph capture, the GPU-side delay
and forming an NCCL process group. Nothing else in the agent layer touches ``torch.cuda``.
On a machine without a GPU a test puts a CPU stand-in there, so every host-side line of
the NCCL path (launch, sync, timing loop, data check, teardown) runs with a gloo group.
"""

from __future__ import annotations

import datetime
import time
import warnings
from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.distributed as dist

from ringwatch.agents.spec import (
    TIMING_CUDA_EVENTS,
    TIMING_CUDA_GRAPH,
    TIMING_HOST,
    ProbeSetupError,
)

Run = Callable[[], None]


# ---- the seam: every CUDA-only call --------------------------------------------------


class CudaApi:
    """The CUDA and NCCL calls of the agent layer, one method each (torch.cuda underneath)."""

    def available(self) -> bool:
        return torch.cuda.is_available()

    def device_count(self) -> int:
        return torch.cuda.device_count()

    def nccl_available(self) -> bool:
        return dist.is_nccl_available()

    def tensor_device(self, index: int) -> torch.device:
        return torch.device("cuda", index)

    def set_device(self, index: int) -> None:
        torch.cuda.set_device(index)

    def synchronize(self, index: int) -> None:
        torch.cuda.synchronize(index)

    def event(self) -> Any:
        """An event with timing: ``record()``, ``synchronize()``, ``elapsed_time(end)`` in ms."""
        return torch.cuda.Event(enable_timing=True)

    def capture(self, body: Run) -> Any:
        """``body``'s kernels captured in one CUDA graph (nothing runs yet); ``replay()`` runs
        them on the current stream. Thread-local capture mode, as nccl-tests uses: NCCL may
        allocate while its first captured op connects."""
        graph = torch.cuda.CUDAGraph()
        with warnings.catch_warnings():
            # In-place AllReduce on one rank is no work for NCCL: its graph is empty, rightly.
            warnings.filterwarnings("ignore", message="The CUDA Graph is empty")
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                body()
        return graph

    def sleep(self, cycles: int) -> None:
        """Spin the current stream for ``cycles`` GPU clock cycles (stream-ordered delay)."""
        torch.cuda._sleep(cycles)

    def process_group(self, store: dist.Store, rank: int, world_size: int,
                      timeout: datetime.timedelta) -> Any:
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, world_size, opts)


cuda: CudaApi = CudaApi()


def check_cuda(device_index: int = 0) -> None:
    """ProbeSetupError with one line unless this torch can run NCCL on GPU ``device_index``."""
    if not cuda.available():
        build = torch.__version__
        raise ProbeSetupError(
            f"CUDA is not available to this torch ({build}"
            f"{', a CPU-only build' if torch.version.cuda is None else ', no GPU or driver visible'}): "
            "the nccl backend needs a CUDA build of torch and an NVIDIA driver (install the "
            "CUDA wheel of torch that matches your driver, or use --backend gloo on CPU)")
    if not cuda.nccl_available():
        raise ProbeSetupError(f"this torch ({torch.__version__}) was built without NCCL")
    count = cuda.device_count()
    if not 0 <= device_index < count:
        raise ProbeSetupError(
            f"GPU {device_index} is not present: CUDA sees {count} GPU(s) here, and NCCL runs "
            "one rank per GPU (it refuses two ranks on one GPU)")


# ---- devices -------------------------------------------------------------------------


class LoopTimer(Protocol):
    """Times ``iters`` runs of one body, as often as asked."""

    timing: str
    note: str | None

    def seconds_per_iter(self) -> float:
        ...


class ProbeDevice(Protocol):
    """What a probe needs from where it runs; ``HostDevice`` and ``CudaDevice`` implement it."""

    torch_device: torch.device
    # True where the timed loop can be captured in a CUDA graph.
    graphs: bool

    def bind(self) -> None:
        """Make this device current for the calling thread (before forming a group)."""
        ...

    def synchronize(self) -> None:
        """Wait until all work queued on this device is done."""
        ...

    def loop(self, body: Run, iters: int, *, graph: bool) -> LoopTimer:
        """A timer of ``iters`` runs of ``body``; ``graph`` asks for CUDA graph capture."""
        ...

    def delay(self, seconds: float) -> None:
        """Hold this device's work queue for ``seconds`` (an injected slow rank)."""
        ...

    def prepare_delay(self) -> None:
        """Measure what ``delay`` needs now, before a loop that delays is captured: work
        timed inside a capture is recorded, not run."""
        ...


def _host_sleep(seconds: float) -> None:
    """Sleep precisely: the scheduler's sleep for most of it, a spin for the last 2 ms."""
    end = time.perf_counter() + seconds
    if seconds > 0.002:
        time.sleep(seconds - 0.002)
    while time.perf_counter() < end:
        pass


class _HostLoop:
    timing = TIMING_HOST
    note: str | None = None

    def __init__(self, body: Run, iters: int) -> None:
        self._body, self._iters = body, iters

    def seconds_per_iter(self) -> float:
        t0 = time.perf_counter()
        for _ in range(self._iters):
            self._body()
        return (time.perf_counter() - t0) / self._iters


class HostDevice:
    """CPU tensors, wall-clock timing: gloo ops are complete when their ``wait`` returns."""

    torch_device = torch.device("cpu")
    graphs = False

    def bind(self) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def loop(self, body: Run, iters: int, *, graph: bool) -> LoopTimer:
        return _HostLoop(body, iters)

    def delay(self, seconds: float) -> None:
        _host_sleep(seconds)

    def prepare_delay(self) -> None:
        pass


class _CudaLoop:
    """Events around one graph replay of all iterations, or around an eager loop."""

    def __init__(self, api: CudaApi, body: Run, iters: int, graph: bool) -> None:
        self._api, self._iters = api, iters

        def eager() -> None:  # a closure, not a bound method: graph -> loop -> graph would
            for _ in range(iters):  # be a cycle that keeps the process group alive
                body()

        self._eager = eager
        self._graph: Any = None
        self.timing = TIMING_CUDA_EVENTS
        self.note: str | None = None
        if graph:
            try:
                self._graph = api.capture(eager)
                self.timing = TIMING_CUDA_GRAPH
            except Exception as exc:  # an old NCCL, blocking wait, a driver without capture
                self.note = f"CUDA graph capture failed, timed eagerly: {type(exc).__name__}: {exc}"[:300]

    def seconds_per_iter(self) -> float:
        start, end = self._api.event(), self._api.event()
        start.record()
        if self._graph is not None:
            self._graph.replay()
        else:
            self._eager()
        end.record()
        end.synchronize()
        return float(start.elapsed_time(end)) / 1e3 / self._iters


class CudaDevice:
    """GPU ``index``: CUDA tensors, graph-replay or event timing, a stream-ordered delay."""

    graphs = True

    def __init__(self, index: int) -> None:
        self.index = index
        self.torch_device = cuda.tensor_device(index)
        self._cycles_per_s: float | None = None

    def bind(self) -> None:
        cuda.set_device(self.index)

    def synchronize(self) -> None:
        cuda.synchronize(self.index)

    def loop(self, body: Run, iters: int, *, graph: bool) -> LoopTimer:
        return _CudaLoop(cuda, body, iters, graph)

    def delay(self, seconds: float) -> None:
        if seconds > 0:
            cuda.sleep(max(1, int(seconds * self._clock())))

    def prepare_delay(self) -> None:
        self._clock()

    def _clock(self) -> float:
        """GPU spin cycles per second, measured once: the clock under load, not the spec sheet's."""
        if self._cycles_per_s is None:
            cycles = 2_000_000
            cuda.sleep(cycles)  # warm the kernel up
            start, end = cuda.event(), cuda.event()
            start.record()
            cuda.sleep(cycles)
            end.record()
            end.synchronize()
            self._cycles_per_s = cycles / (float(start.elapsed_time(end)) / 1e3)
        return self._cycles_per_s


def device_for(backend: str, device_index: int) -> ProbeDevice:
    """The device a rank of ``backend`` probes on."""
    if backend == "nccl":
        return CudaDevice(device_index)
    return HostDevice()
