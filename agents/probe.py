"""ProbeAgent: one rank of the probe fabric (one GPU under nccl, one CPU slot under gloo).

The scheduler's backend makes it a Ray actor; importing this module starts nothing.
Each ``run_group`` call joins one probe group through a store the driver hosts, forms
a process group of its own for it (one actor takes part in many groups over its life,
so never the global default group), times every op nccl-tests style, checks the data
and leaves. A sick peer comes back as data, never as a crashed agent.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import socket
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ringwatch.agents import contention, inventory, nccl_log, nic_counters, profiles, telemetry
from ringwatch.agents import device as device_seam
from ringwatch.agents import transport as transport_judge
from ringwatch.agents.collectives import Buffers, check_redop, collective, plan
from ringwatch.agents.device import (
    HostDevice,
    LoopTimer,
    ProbeDevice,
    check_cuda,
    device_for,
)
from ringwatch.agents.groups import member, node_of
from ringwatch.agents.patterns import (
    check_tolerance,
    count_wrong,
    expected_output,
    make_input,
    torch_dtype,
)
from ringwatch.agents.spec import (
    TIMING_CUDA_GRAPH,
    InjectedFault,
    ProbeSetupError,
    RankInfo,
    redop_for,
)

# An injected hang sleeps this long; the driver kills the agent long before.
log = logging.getLogger(__name__)

# The agent's private folder for NCCL's debug files, under the node's temp folder, one per
# user (``-<uid>``), made 0700 (nccl_log.private_dir).
NCCL_DEBUG_DIR = "ringwatch-nccl"

_HANG_SLEEP_S = 24 * 3600.0

Work = Any  # torch's c10d Work: has .wait()
Launch = Callable[[Any, torch.Tensor, torch.Tensor, int, int], list[Work]]


# ---- store keys: the progress protocol the driver reads after a deadline ---------------


def arrived_key(rank: int) -> str:
    return f"arrived/{rank}"


def entered_key(rank: int, op: str, size: int) -> str:
    return f"entered/{rank}/{op}/{size}"


def done_key(rank: int, op: str, size: int) -> str:
    return f"done/{rank}/{op}/{size}"


# ---- launching one op on a process-group backend object -------------------------------


_REDUCE_OPS: dict[str, Any] = {
    "sum": dist.ReduceOp.SUM,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
    "avg": dist.ReduceOp.AVG,  # NCCL only; gloo refuses it (collectives.check_redop)
}


def _allreduce(redop: str) -> Launch:
    opts = dist.AllreduceOptions()
    opts.reduceOp = _REDUCE_OPS[redop]

    def launch(pg: Any, send: torch.Tensor, recv: torch.Tensor, rank: int, n: int) -> list[Work]:
        # torch's allreduce is in place: the caller passes the input as recv.
        return [pg.allreduce([recv], opts)]

    return launch


def _alltoall(pg: Any, send: torch.Tensor, recv: torch.Tensor, rank: int, n: int) -> list[Work]:
    return [pg.alltoall_base(recv, send, [], [])]


def _allgather(pg: Any, send: torch.Tensor, recv: torch.Tensor, rank: int, n: int) -> list[Work]:
    return [pg._allgather_base(recv, send)]


def _reducescatter(redop: str) -> Launch:
    opts = dist.ReduceScatterOptions()
    opts.reduceOp = _REDUCE_OPS[redop]

    def launch(pg: Any, send: torch.Tensor, recv: torch.Tensor, rank: int, n: int) -> list[Work]:
        return [pg._reduce_scatter_base(recv, send, opts)]

    return launch


def _sendrecv_gloo(
    pg: Any, send: torch.Tensor, recv: torch.Tensor, rank: int, n: int
) -> list[Work]:
    if n == 1:  # a rank cannot send to itself over gloo's pairs; nccl-tests' n=1 is a copy
        return _sendrecv_grouped(pg, send, recv, rank, n)
    # Gloo's send is asynchronous, so posting both before waiting cannot deadlock.
    return [pg.send([send], (rank + 1) % n, 0), pg.recv([recv], (rank - 1) % n, 0)]


def _sendrecv_grouped(
    pg: Any, send: torch.Tensor, recv: torch.Tensor, rank: int, n: int
) -> list[Work]:
    # A lone ncclSend followed by ncclRecv on every rank deadlocks on large messages;
    # alltoall_base with one non-empty split is torch's grouped send+recv (ncclGroupStart).
    numel = send.numel()
    in_splits = [numel if peer == (rank + 1) % n else 0 for peer in range(n)]
    out_splits = [numel if peer == (rank - 1) % n else 0 for peer in range(n)]
    return [pg.alltoall_base(recv, send, out_splits, in_splits)]


_LAUNCH: dict[str, Launch] = {
    "alltoall": _alltoall,
    "allgather": _allgather,
}
_REDUCING_LAUNCH: dict[str, Callable[[str], Launch]] = {
    "allreduce": _allreduce,
    "reducescatter": _reducescatter,
}


def launcher(op: str, backend: str, redop: str = "sum") -> Launch:
    collective(op)  # raises on an unknown op
    # Refused before any rank enters the collective: every rank refuses alike.
    check_redop(op, redop, backend=backend)
    if op == "sendrecv":
        return _sendrecv_grouped if backend == "nccl" else _sendrecv_gloo
    if op in _REDUCING_LAUNCH:
        return _REDUCING_LAUNCH[op](redop)
    return _LAUNCH[op]


def _wait(works: list[Work]) -> None:
    for w in works:
        w.wait()


class CollectiveFailed(RuntimeError):
    """A collective of this rank's group raised: the cause may be this rank or a peer."""


# ---- forming and leaving a group ------------------------------------------------------


class _AlgoEnv:
    """NCCL_ALGO as groups of this process set it: the first to enter saves what was there,
    the last to leave puts it back (ranks that share a process, as threads do, share the
    group and so the value)."""

    lock = threading.Lock()
    users = 0
    before: str | None = None


@contextlib.contextmanager
def nccl_algo(algo: str | None) -> Any:
    """NCCL_ALGO set to ``algo`` in this process while the block runs, as it was after the
    last such block ends; nothing changes for None. An actor runs one group at a time, so
    the variable is its group's alone."""
    if algo is None:
        yield
        return
    with _AlgoEnv.lock:
        if _AlgoEnv.users == 0:
            _AlgoEnv.before = os.environ.get("NCCL_ALGO")
        _AlgoEnv.users += 1
        os.environ["NCCL_ALGO"] = algo
    try:
        yield
    finally:
        with _AlgoEnv.lock:
            _AlgoEnv.users -= 1
            if _AlgoEnv.users == 0:
                if _AlgoEnv.before is None:
                    os.environ.pop("NCCL_ALGO", None)
                else:
                    os.environ["NCCL_ALGO"] = _AlgoEnv.before


def make_group(
    backend: str,
    store: dist.Store,
    rank: int,
    world_size: int,
    timeout_s: float,
    *,
    host: str = "127.0.0.1",
    device: ProbeDevice | None = None,
) -> Any:
    """A process-group backend object of its own, outside torch's global group registry."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if backend == "gloo":
        opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
        # Bind to the address Ray uses, not whatever the hostname resolves to.
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
        opts._timeout = timeout
        return dist.ProcessGroupGloo(store, rank, world_size, opts)
    if backend == "nccl":
        if device is not None:
            device.bind()
        return device_seam.cuda.process_group(store, rank, world_size, timeout)
    raise ValueError(f"backend must be gloo or nccl, got {backend!r}")


def store_server(host: str, timeout_s: float, *, listen_there_only: bool = False) -> dist.TCPStore:
    """A group's store, hosted by this process at ``host`` (where its ranks reach it), on a
    port the OS picks (``.port``).

    torch's own server listens on every interface whatever host it is named, which ranks
    on other machines need. ``listen_there_only`` (a local cluster's loopback) makes it
    listen on ``host`` alone: on a socket bound here and handed to it.
    """
    timeout = datetime.timedelta(seconds=timeout_s)
    if not listen_there_only:
        return dist.TCPStore(host, 0, None, True, wait_for_workers=False, timeout=timeout)
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    try:
        sock.bind((host, 0))
        store = dist.TCPStore(host, sock.getsockname()[1], None, True, wait_for_workers=False,
                              timeout=timeout, master_listen_fd=sock.fileno())
    except BaseException:
        sock.close()
        raise
    sock.detach()  # the store's server owns the descriptor now, and closes it when it stops
    return store


def leave_group(pg: Any, failed: bool) -> None:
    """Tear a group down; after a failure abort, so NCCL's threads stop waiting and gloo's
    peers see the connection close at once instead of at their timeout."""
    if pg is None:
        return
    fn = getattr(pg, "abort" if failed else "shutdown", None)
    if fn is not None:
        # Teardown of a broken group: nothing more to save if it fails too.
        with contextlib.suppress(Exception):
            fn()


# ---- timing ---------------------------------------------------------------------------


def _sync_point(pg: Any, device: ProbeDevice, value: float = 1.0) -> float:
    """All ranks line up here (a one-element MIN AllReduce, then the device drains), so
    timed loops start together; returns the least ``value`` any rank passed in."""
    token = torch.full((1,), float(value), device=device.torch_device)
    try:
        pg.allreduce([token], _MIN).wait()
        device.synchronize()
    except Exception as exc:
        raise CollectiveFailed(f"sync point: {type(exc).__name__}: {exc}") from exc
    return float(token.item())


_MIN = dist.AllreduceOptions()
_MIN.reduceOp = dist.ReduceOp.MIN  # type: ignore[assignment]  # the stubs name RedOpType


def run_probe(
    pg: Any,
    buf: Buffers,
    rank: int,
    *,
    backend: str = "gloo",
    device: ProbeDevice | None = None,
    warmup: int = 5,
    iters: int = 20,
    repeats: int = 1,
    slow_factor: float | None = None,
    calibrate: bool = False,
    corrupt: bool = False,
    cuda_graph: bool = True,
) -> dict[str, Any]:
    """Warm up, time ``repeats`` loops of ``iters`` iterations, then check one fresh run.

    Returns this rank's mean seconds per iteration for each repeat (``times_s``), the wall
    time of its timed sections (``timed_s``), its wrong element count (``wrong``) and how
    the loops were timed (``timing``, with ``timing_note`` when capture fell back).
    ``calibrate``: run one untimed-for-the-record loop first, which an injected slow rank
    needs to size its delay; every rank of a group must pass the same value.
    """
    device = device or HostDevice()
    launch = launcher(buf.op, backend, buf.redop)
    loops = _timed_loops(pg, buf, rank, launch, device, warmup, iters, max(1, repeats),
                         slow_factor, calibrate or slow_factor is not None, cuda_graph)
    # The timed buffers are gone by now, which keeps the peak low at 1 GiB sizes.
    wrong = _checked_run(pg, buf, rank, launch, device, corrupt)
    return {**loops, "wrong": wrong}


def _collective(launch: Launch, pg: Any, send: torch.Tensor, recv: torch.Tensor, rank: int,
                n: int) -> None:
    try:
        _wait(launch(pg, send, recv, rank, n))
    except Exception as exc:
        raise CollectiveFailed(f"{type(exc).__name__}: {exc}") from exc


def _timed_loops(
    pg: Any, buf: Buffers, rank: int, launch: Launch, device: ProbeDevice,
    warmup: int, iters: int, repeats: int, slow_factor: float | None, calibrate: bool,
    cuda_graph: bool,
) -> dict[str, Any]:
    """The warm-ups and timed loops. An in-place op (AllReduce) runs on zeros here, so
    repeated sums stay finite; the data check is a separate run, as in nccl-tests' -c.

    Warm-ups run eagerly (NCCL connects on first use, which capture cannot hold). Then the
    loop is captured in a CUDA graph where the device can; the group agrees on it, so
    either every rank replays a graph or every rank runs eagerly.
    """
    send = make_input(buf, rank, device.torch_device)
    recv = torch.zeros(buf.out_numel, dtype=torch_dtype(buf.dtype), device=device.torch_device)
    if collective(buf.op).in_place:
        send = recv

    def run() -> None:
        _collective(launch, pg, send, recv, rank, buf.world_size)

    for _ in range(warmup):
        run()
    graph = cuda_graph and device.graphs
    timer = device.loop(run, iters, graph=graph)
    if graph and _sync_point(pg, device, timer.timing == TIMING_CUDA_GRAPH) < 1:
        note = timer.note
        timer = device.loop(run, iters, graph=False)  # a peer could not capture
        timer.note = note or "a peer's CUDA graph capture failed, timed eagerly"
    _first_replay(timer)
    if calibrate:
        # An injected slow rank stretches each iteration to 1/factor of its own time with a
        # delay queued on its device, inside the graph where there is one; peers wait for it.
        # Every rank runs the same loops (calibration, one check), so collectives match.
        _sync_point(pg, device)
        own = timer.seconds_per_iter()
        use_graph = timer.timing == TIMING_CUDA_GRAPH

        def slowed(pause: float) -> LoopTimer:
            def slow_run() -> None:
                run()
                device.delay(pause)

            loop = device.loop(slow_run, iters, graph=use_graph)
            loop.note = timer.note
            return loop

        if slow_factor is not None:
            # The GPU's spin clock is measured here, not inside the capture below, where
            # its events would be recorded and never run (on an H200 a 2x fault read 1.5x).
            device.prepare_delay()
        pause = own * (1.0 / slow_factor - 1.0) if slow_factor is not None else 0.0
        slow = slowed(pause) if slow_factor is not None else None
        _sync_point(pg, device)
        # Every rank replays once here and once below, slow or not, so collectives match.
        _first_replay(slow or timer)
        # The delay overlaps the time peers spend waiting on each other, so the first guess
        # undershoots where ranks are not in step; one check loop corrects it, within a
        # factor of two either way so that one noisy loop cannot undo the fault.
        got = (slow or timer).seconds_per_iter()
        if slow_factor is not None:
            pause = min(2 * pause, max(pause / 2, pause + own / slow_factor - got))
            timer = slowed(pause)
        _first_replay(timer)
    times: list[float] = []
    timed_s = 0.0
    for _ in range(repeats):
        _sync_point(pg, device)
        t0 = time.perf_counter()
        times.append(timer.seconds_per_iter())
        timed_s += time.perf_counter() - t0
    _sync_point(pg, device)
    out: dict[str, Any] = {"times_s": times, "timed_s": timed_s, "timing": timer.timing}
    if timer.note:
        out["timing_note"] = timer.note
    return out


def _first_replay(timer: LoopTimer) -> None:
    """Replay a captured graph once, untimed. Its first launch uploads it to the device:
    on an H200 that added about 3 us to every op of a 20-op loop at small sizes, and 13 %
    at 256 MiB, to the one loop a single-repeat probe times. Every rank of the group calls
    this at the same point (they agreed on graphs), so the collectives inside still match."""
    if timer.timing == TIMING_CUDA_GRAPH:
        timer.seconds_per_iter()


def _checked_run(
    pg: Any, buf: Buffers, rank: int, launch: Launch, device: ProbeDevice, corrupt: bool
) -> int:
    """One run on the real pattern; the number of elements of this rank's output that are wrong."""
    where = device.torch_device
    send = make_input(buf, rank, where)
    if collective(buf.op).in_place:
        recv = send  # fresh for this run; the op overwrites it with the result
    else:
        # Zeroed first, as nccl-tests does, so a block nobody wrote cannot pass.
        recv = torch.zeros(buf.out_numel, dtype=send.dtype, device=where)
    _collective(launch, pg, send, recv, rank, buf.world_size)
    device.synchronize()
    if corrupt:
        # An injected corrupt rank flips one element, as a bad link or bad HBM would.
        recv.view(-1)[0] += 1
    return count_wrong(recv, expected_output(buf, rank, where), check_tolerance(buf))


# ---- the agent ------------------------------------------------------------------------


class InjectedError(RuntimeError):
    """Raised by a rank with an injected ``error`` fault, as a CUDA OOM or NCCL error would."""


def _origin(exc: BaseException) -> str:
    """Whose failure an exception shows: ``collective`` (this rank's group broke: a peer may
    be the cause), ``setup`` (this machine cannot probe) or ``local`` (this rank's own code)."""
    if isinstance(exc, CollectiveFailed):
        return "collective"
    if isinstance(exc, ProbeSetupError):
        return "setup"
    return "local"


def _nccl_log_reader() -> nccl_log.NcclLogReader | None:
    """NCCL's INIT, NET and GRAPH lines into a file of this process's own, set before its
    first communicator forms (NCCL reads them once); None where the user set NCCL_DEBUG in a
    way that leaves the transports unwritten, or where the private folder for ringwatch's
    own file cannot be had (docs/transport.md)."""
    base = Path(tempfile.gettempdir()) / f"{NCCL_DEBUG_DIR}-{os.getuid()}"
    setup = nccl_log.nccl_debug_setup(base, os.environ)
    own = "NCCL_DEBUG_FILE" in setup.env
    if own:
        folder, problem = nccl_log.private_dir(base)
        if folder is None:
            # Someone sharing the node's temp folder made it first: NCCL would write where
            # they chose, and trimming and clean-up would act on their files.
            log.warning("NCCL transports not recorded: %s", problem)
            return None
    for key, value in setup.env.items():
        os.environ.setdefault(key, value)
    if own:  # ringwatch's own files, never a user's
        _remove_dead_logs(setup.env["NCCL_DEBUG_FILE"])
    if not setup.transports_visible:
        return None
    return nccl_log.NcclLogReader.for_this_process(own=own)


def _remove_dead_logs(pattern: str) -> None:
    """The debug files ``pattern`` names for this host's agents that are gone (its ``%p`` a
    pid no process has any more). A name whose pid is not one (not ASCII digits, or past the
    largest pid) is no agent's and is left alone; only names are removed, never what a link
    points at."""
    host = nccl_log.nccl_hostname()
    for path in nccl_log.find_debug_files(pattern, host):
        pid = nccl_log.debug_file_pid(pattern, path.name, host)
        if pid is None or pid == os.getpid():
            continue
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            path.unlink(missing_ok=True)
        except (PermissionError, OverflowError):
            pass  # alive, another user's


def _rss_bytes() -> int | None:
    """This process's resident set in bytes (Linux's /proc/self/statm); None elsewhere."""
    try:
        resident = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return None
    return resident * os.sysconf("SC_PAGE_SIZE")


def _ports() -> list[nic_counters.PortSnapshot]:
    """This node's RDMA ports (sysfs under RINGWATCH_SYSFS_ROOT, default /)."""
    return nic_counters.read_ports(os.environ.get("RINGWATCH_SYSFS_ROOT", "/"))


class ProbeAgent:
    """One probe rank. The backend wraps it with ``ray.remote``; it works without Ray too
    (nothing here imports ray unless it is already loaded).

    Under nccl an agent lives for one cycle (the backend's ``acquire`` to ``release``): its
    first group makes a CUDA context on its GPU, which only the process's end gives back.
    Until then (constructed, identified, counters read) it holds nothing on the GPU."""

    def __init__(
        self,
        node: str,
        local_index: int,
        backend: str = "gloo",
        injected: list[dict[str, Any]] | None = None,
        *,
        device_index: int | None = None,
        host: str | None = None,
    ) -> None:
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be gloo or nccl, got {backend!r}")
        # One rank per CPU slot: more threads per rank would fight over the same cores.
        torch.set_num_threads(1)
        self.node = node
        self.local_index = local_index
        self.backend = backend
        # Under nccl the GPU; on a single machine playing several logical nodes the
        # backend maps logical ranks to distinct GPUs, so it may differ from local_index.
        self.device_index = local_index if device_index is None else device_index
        self._host = host
        self._xid: telemetry.XidWatcher | None = None
        self._probe_device: ProbeDevice | None = None
        # Set once a group bound the GPU: from then on this process may hold a CUDA context.
        self._cuda_context = False
        self._faults: dict[str, InjectedFault] = {}
        self.set_injected(injected or [])
        # NCCL's own log of the transports it takes, and what this node's GPU and NICs
        # offer instead (transport_fallback, docs/transport.md).
        self._nccl_log: nccl_log.NcclLogReader | None = None
        self._nvlink_peers: set[int] = set()
        self._rdma: tuple[str, ...] = ()
        # When this agent's last group left its GPU (time.monotonic()): NVML's utilization
        # reads that work for a while after (agents.contention).
        self._gpu_work_ended: float | None = None
        # Groups the backend asked to keep formed for its next round (``run_group``'s
        # ``keep``), by group id: the process group and the store it formed through, which
        # NCCL goes on reading for connections it makes later. At most the one group of
        # the round before; ``drop_group`` and any failure end it.
        self._kept: dict[str, tuple[Any, dist.Store]] = {}
        if backend == "nccl":
            # A peer that dies must surface as an error here, not as a silent hang.
            os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
            self._nccl_log = _nccl_log_reader()
            # XIDs are NVML events, seen only by a set registered when they happen, and an
            # agent lives one cycle: watching from its start covers the whole of it. NVML's
            # session holds no GPU memory and no CUDA context.
            self._xid = telemetry.XidWatcher(self.device_index)

    @property
    def member(self) -> str:
        return member(self.node, self.local_index)

    def set_injected(self, injected: list[dict[str, Any]]) -> None:
        """Replace the faults injected into this rank (dicts of agents.spec.InjectedFault)."""
        faults = [InjectedFault.from_dict(d) for d in injected]
        self._faults = {f.kind: f for f in faults}

    def check(self) -> None:
        """ProbeSetupError unless this rank can probe here (CUDA, NCCL and its GPU under nccl)."""
        if self.backend == "nccl":
            check_cuda(self.device_index)

    def identity(self) -> dict[str, Any]:
        """Who this rank is; raises ProbeSetupError where it cannot probe at all, so a
        backend refuses to start instead of reporting every rank as failed."""
        self.check()
        gpu: dict[str, Any] = {}
        if self.backend == "nccl":
            gpu = telemetry.gpu_identity(self.device_index)
            tel = gpu.setdefault("telemetry", {})
            tel.update(inventory.versions(tel.get("driver")))
            if self.local_index == 0:  # the node's NICs, once per node
                tel["nics"] = inventory.read_nics()
            self._nvlink_peers = {int(peer) for peer, row in (tel.get("p2p") or {}).items()
                                  if isinstance(row, dict) and row.get("nvlink")}
            self._rdma = tuple(sorted({p.device for p in _ports() if p.state == "ACTIVE"
                                       and p.kind in ("ib", "roce", "efa")}))
        info = RankInfo(
            node=self.node,
            local_index=self.local_index,
            hostname=socket.gethostname(),
            gpu_uuid=gpu.get("uuid"),
            pci_bus_id=gpu.get("pci_bus_id"),
            numa_node=gpu.get("numa_node"),
            gpu_name=gpu.get("name"),
            telemetry=gpu.get("telemetry", {}),
            # A CPU slot (gloo) has no hardware profile; a GPU's comes from its NVML name,
            # the instance type, or RINGWATCH_PROFILE.
            profile=profiles.detect(gpu.get("name"), inventory.product_name())
            if self.backend == "nccl" else None,
        )
        return info.to_dict()

    def counters(self) -> dict[str, Any]:
        """This GPU's NVLink state and error counters now, and the XID errors NVML
        reported since the last call: read before and after every cycle."""
        if self.backend != "nccl":
            return {"available": False, "reason": f"a {self.backend} rank has no GPU"}
        reading = telemetry.read_counters(self.device_index)
        if self._xid is None:  # set up in __init__; here only if something dropped it
            self._xid = telemetry.XidWatcher(self.device_index)
        reading["xid"] = self._xid.drain()
        if self.local_index == 0:  # the node's NIC ports and their error counters, once per node
            reading["nic"] = [p.to_dict() for p in _ports()]
        return reading

    def where(self) -> dict[str, Any]:
        """Where Ray placed this agent: its Ray node id, address and process id."""
        import ray  # only meaningful inside Ray; keeps the module importable without it

        return {
            "ray_node_id": ray.get_runtime_context().get_node_id(),
            "ip": ray.util.get_node_ip_address(),
            "pid": os.getpid(),
        }

    def _gloo_host(self) -> str:
        """The address gloo binds to: Ray's node address inside Ray, else loopback."""
        if self._host is None:
            ray = sys.modules.get("ray")  # never imported here: the agent runs without Ray
            if ray is not None and ray.is_initialized():
                self._host = str(ray.util.get_node_ip_address())
            else:
                self._host = "127.0.0.1"
        return self._host

    def _device(self) -> ProbeDevice:
        if self._probe_device is None:
            self.check()
            self._probe_device = device_for(self.backend, self.device_index)
        # The group about to form binds the GPU, which makes the primary context.
        self._cuda_context = self._cuda_context or self.backend == "nccl"
        return self._probe_device

    def prepare(self) -> str | None:
        """Make this rank's CUDA context now (nccl; nothing under gloo), so that a cycle's
        set-up is paid in the backend's ``acquire`` and counted there, not inside its first
        group's deadline. None, or why it could not: never raises, for the group that
        follows then fails with that error as a probe finding, as it always has."""
        if self.backend != "nccl":
            return None
        try:
            device = self._device()
            device.bind()
            device.synchronize()  # torch initialises CUDA lazily: this makes the context
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"[:300]
        return None

    def footprint(self) -> dict[str, Any]:
        """What this agent's process holds now: its pid, resident host memory (bytes), the
        CPU seconds it has used (all threads, user and system), whether it may hold a
        CUDA context (a group has run on its GPU: only the process's end gives that back,
        which is why the backend ends nccl agents between cycles), and the ids of the groups
        it keeps formed for the next round. Read from the process itself, so it answers on
        any node of a cluster."""
        return {"pid": os.getpid(), "rss_bytes": _rss_bytes(),
                "cpu_s": sum(os.times()[:2]), "cuda_context": self._cuda_context,
                "kept_groups": sorted(self._kept)}

    def run_group(
        self, spec: dict[str, Any], rank: int, store_host: str, store_port: int, group_id: str
    ) -> dict[str, Any]:
        """Join one probe group as ``rank``, run its ops and sizes, and report this rank's view.

        Returns ``{"rank", "member", "status": ok|error, "stage", "error", "origin",
        "probes": [...], "timed_s", "held_s"}``: ``timed_s`` the timed loops alone,
        ``held_s`` the time on the fabric from forming the group (or taking up the kept
        one) to its last op or its failure, warm-ups included; each probe holds op,
        size_bytes (used), count,
        times_s, wrong and timing; ``traffic`` (agents.contention.Traffic, where this
        rank could read its links) the other traffic on them just before the group formed.
        ``origin`` (on error) says whose failure it shows:
        ``local`` (this rank's own code raised), ``collective`` (the group broke under it)
        or ``setup`` (this machine cannot probe).

        ``spec["keep"]``: the group stays formed after it ran well, under ``group_id``, for
        the backend's next round; ``spec["reuse"]``: ``group_id`` names such a group, which
        runs again without forming (the store at ``store_port`` is this round's, for its
        progress). A group that fails is ended either way.
        """
        out: dict[str, Any] = {
            "rank": rank,
            "member": self.member,
            "status": "ok",
            "stage": "connect",
            "error": None,
            "probes": [],
            "timed_s": 0.0,
            "held_s": 0.0,
        }
        held_from: float | None = None
        deadline_s = float(spec.get("deadline_s", 60.0))
        pg = None
        pg_store: dist.Store | None = None
        failed = False
        # NCCL reads NCCL_ALGO when the communicator forms, which ProcessGroupNCCL does at
        # its first collective: the variable stays set until the group is gone.
        algo_env = contextlib.ExitStack()
        try:
            store = dist.TCPStore(
                store_host,
                store_port,
                None,
                False,
                timeout=datetime.timedelta(seconds=deadline_s),
            )
            if "hang" in self._faults:
                # Never enter: nothing written to the store, so the driver can name us.
                out["stage"] = "join"
                time.sleep(_HANG_SLEEP_S)
            store.set(arrived_key(rank), self.member)
            self._quiet_window(spec, rank, out)
            out["stage"] = "form"
            held_from = time.perf_counter()
            device = self._device()
            algo_env.enter_context(nccl_algo(spec.get("algo") if self.backend == "nccl" else None))
            if spec.get("reuse"):
                kept = self._kept.pop(group_id, None)
                if kept is None:
                    raise RuntimeError(f"group {group_id} is not kept here")
                pg, pg_store = kept
            else:
                pg_store = store
                pg = make_group(
                    self.backend,
                    dist.PrefixStore(f"{group_id}/pg", store),
                    rank,
                    len(spec["members"]),
                    deadline_s,
                    host=self._gloo_host(),
                    device=device,
                )
            if self._nccl_log is not None:
                self._nccl_log.skip()  # what NCCL wrote before this group is not this group's
            self._run_ops(spec, rank, store, pg, device, out)
            out["held_s"] = time.perf_counter() - held_from
            out["stage"] = "done"
            self._transports(spec, rank, out)
        except Exception as exc:  # a sick peer or a broken group is a result, not a crash
            failed = True
            if held_from is not None and not out["held_s"]:
                out["held_s"] = time.perf_counter() - held_from
            out["status"] = "error"
            out["origin"] = _origin(exc)
            out["error"] = f"{type(exc).__name__}: {exc}"[:2000]
            out["traceback"] = traceback.format_exc(limit=4)
        finally:
            if not failed and pg is not None and pg_store is not None and (
                    spec.get("keep") or spec.get("reuse")):
                self._kept[group_id] = (pg, pg_store)
            else:
                leave_group(pg, failed)
            algo_env.close()
            if self.backend == "nccl":
                self._gpu_work_ended = time.monotonic()
        return out

    def drop_group(self, group_id: str) -> bool:
        """End a group kept formed (``run_group``'s ``keep``); whether one was kept."""
        kept = self._kept.pop(group_id, None)
        if kept is None:
            return False
        leave_group(kept[0], False)
        return True

    def _quiet_window(self, spec: dict[str, Any], rank: int, out: dict[str, Any]) -> None:
        """The other traffic on this rank's links (``out["traffic"]``, agents.contention)
        over a short window before its group forms, its own probe not yet running: its GPU's
        NVLinks, utilization and processes under nccl, and the node's RDMA ports where it is
        its node's first rank in a group that spans nodes. With nothing to read (a gloo rank
        on a node without RDMA ports) it costs nothing; a reading that fails says nothing,
        and never fails the group."""
        try:
            window_s = float(spec.get("quiet_window_s", contention.QUIET_WINDOW_S))
            if window_s <= 0:
                return
            nodes = [node_of(m) for m in spec["members"]]
            meter = contention.TrafficMeter(
                self.device_index if self.backend == "nccl" else None, (os.getpid(),),
                nics=len(set(nodes)) > 1 and nodes.index(nodes[rank]) == rank,
                sysfs_root=os.environ.get("RINGWATCH_SYSFS_ROOT", "/"),
                own_gpu_work_at=self._gpu_work_ended)
            before = meter.sample()
            if before.empty:
                return
            time.sleep(window_s)
            after = meter.sample()
            out["traffic"] = meter.traffic(before, after, after.at - before.at,
                                           self.member).to_dict()
        except Exception:  # what cannot be read says nothing, and the group goes on
            return

    def _transports(self, spec: dict[str, Any], rank: int, out: dict[str, Any]) -> None:
        """What NCCL's log says this group's connections ran over (``transports``), and the
        node's fallbacks it shows (``transport_findings``). Never fails the group: a log
        that cannot be read says nothing."""
        if self._nccl_log is None:
            return
        try:
            summary = nccl_log.summarize(self._nccl_log.read(), rdma_devices=self._rdma)
            self._nccl_log.trim()
        except OSError:
            return
        if not summary.pairs and not summary.counts:
            return
        out["transports"] = {"counts": summary.counts, "intra_node": list(summary.intra_node),
                             "inter_node": list(summary.inter_node)}
        out["transport_findings"] = [f.to_dict() for f in transport_judge.judge_transports(
            summary, self.node, spec["members"], rank, spec.get("scope", ""), self._nvlink_peers)]

    def _run_ops(
        self, spec: dict[str, Any], rank: int, store: dist.Store, pg: Any, device: ProbeDevice,
        out: dict[str, Any],
    ) -> None:
        n = len(spec["members"])
        slow = self._faults.get("slow")
        for op in spec["ops"]:
            for size in spec["sizes"]:
                out["stage"] = f"{op}/{size}"
                store.set(entered_key(rank, op, size), "1")
                if "error" in self._faults:
                    raise InjectedError(f"injected error in {op}/{size} on {self.member}")
                buf = plan(op, size, n, spec.get("dtype", "float32"),
                           redop_for(op, spec.get("redop", "sum")))
                result = run_probe(
                    pg,
                    buf,
                    rank,
                    backend=self.backend,
                    device=device,
                    warmup=int(spec.get("warmup", 5)),
                    iters=int(spec.get("iters", 20)),
                    repeats=int(spec.get("repeats", 1)),
                    slow_factor=slow.factor if slow and slow.op in (None, op) else None,
                    calibrate=bool(spec.get("calibrate", False)),
                    corrupt="corrupt" in self._faults,
                    cuda_graph=bool(spec.get("cuda_graph", True)),
                )
                out["timed_s"] += result.pop("timed_s")
                out["probes"].append({"op": op, "size_requested": size, "redop": buf.redop,
                                      "size_bytes": buf.size_bytes, "count": buf.count, **result})
                store.set(done_key(rank, op, size), "1")
