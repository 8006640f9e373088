"""The real probe backends (gloo, nccl) as a Ray driver: start or join a Ray cluster,
place one ProbeAgent per rank, run rounds of disjoint groups concurrently, and turn a
group that misses its deadline into ``hang`` findings that name the ranks, replacing
their agents so the next round starts clean.

Each group gets a fresh TCPStore hosted here, on the driver. Agents write their progress
into it (``arrived/R``, ``entered/R/OP/SIZE``, ``done/R/OP/SIZE``), so after a deadline the
store itself says who never came and who stopped.

Under nccl the agents live from a cycle's ``acquire`` to its ``release``: between cycles no
agent process holds a CUDA context, communicator or memory on any GPU.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import shlex
import socket
import sys
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from ringwatch.agents import outcome
from ringwatch.agents.collectives import check_redop, plan
from ringwatch.agents.groups import node_of
from ringwatch.agents.outcome import hang_suspects, rank_progress
from ringwatch.agents.probe import ProbeAgent, store_server
from ringwatch.agents.spec import (
    BackendDefaults,
    CommKey,
    Finding,
    GroupSpec,
    InjectedFault,
    Occupant,
    ProbeSetupError,
    RankInfo,
    RoundResult,
    redop_for,
)

# Ray puts unix sockets at <temp_dir>/session_<date>_<time>_<pid>/sockets/plasma_store and
# AF_UNIX paths must fit 107 bytes; the session part is about 60 of them.
_UNIX_PATH_MAX = 107
_SESSION_SUFFIX_LEN = len("/session_2026-01-01_00-00-00_000000_4194304/sockets/plasma_store")
# Small: probes ship a few KB of results, never tensors, through Ray.
_OBJECT_STORE_BYTES = 128 * 1024 * 1024
# How long agents may take to start: a cold worker imports torch; on a busy cluster Ray
# may also wait for the CPU or GPU slot to free up.
_START_TIMEOUT_S = 300.0
# How long release() waits for Ray to register the agents it killed as dead.
_END_TIMEOUT_S = 10.0
# After a rank reports an error, how long its peers get to report theirs (a peer blocked
# in a collective with the failed rank sees it break at once under gloo; NCCL may not).
_ERROR_GRACE_S = 5.0

Progress = Callable[[str], None]


def ray_temp_dir(preferred: Path) -> Path:
    """``preferred`` if Ray's socket paths under it stay short enough, else /tmp/rw-<uid>."""
    path = preferred.expanduser().resolve()
    if len(str(path)) + _SESSION_SUFFIX_LEN > _UNIX_PATH_MAX:
        path = Path("/tmp") / f"rw-{os.getuid()}"
    path.mkdir(parents=True, exist_ok=True)
    return path


def local_node_name(index: int) -> str:
    return f"node-{index:03d}"


def _node_resource(node: str) -> str:
    """The custom resource that pins an agent to one logical node of a local cluster."""
    return f"rw-{node}"


@dataclass
class _Slot:
    """One rank's place: who it is and how to (re)start its agent there."""

    node: str
    local_index: int
    device_index: int
    options: dict[str, Any]
    handle: Any = None
    # The Ray node the agent is pinned to, on a cluster the backend joined ("" on its own).
    ray_node_id: str = ""

    @property
    def member(self) -> str:
        return f"{self.node}/{self.local_index}"


@dataclass
class _GroupRun:
    """One group of a round while it runs: its store, its calls, what came back."""

    spec: GroupSpec
    group_id: str
    store: Any
    deadline: float
    refs: dict[Any, int] = field(default_factory=dict)
    replies: dict[int, dict[str, Any]] = field(default_factory=dict)
    died: dict[int, str] = field(default_factory=dict)
    expired: bool = False
    # A rank reported an error: the group's deadline shrank to a short grace.
    errored: bool = False
    # The store the group formed through: this round's, or the round's that formed it.
    formed_through: Any = None
    # When it was launched (monotonic): a group past its deadline held the fabric until then.
    launched: float = 0.0

    def unfinished(self) -> list[int]:
        return [r for r in range(self.spec.world_size) if r not in self.replies and r not in self.died]


def held_s(run: _GroupRun) -> float:
    """How long a group held the fabric: its slowest rank's time from forming (or taking up
    its kept communicator) to its last op or its failure, as the sim models a group's time
    (an agent of an older release reports its timed loops alone; a figure that is no
    duration counts for nothing). A group that passed its deadline held it to the
    deadline, as a hang costs in the sim."""
    held = 0.0
    for reply in run.replies.values():
        x = reply.get("held_s") or reply.get("timed_s", 0.0)
        if isinstance(x, (int, float)) and math.isfinite(x) and x > held:
            held = float(x)
    return max(held, run.deadline - run.launched) if run.expired else held


def fabric_time_s(runs: Iterable[_GroupRun], wall_s: float) -> float:
    """The fabric time of groups run side by side: the longest one's (``held_s``), never
    more than the ``wall_s`` the driver saw them take, whatever a rank reports."""
    return min(wall_s, max((held_s(run) for run in runs), default=0.0))


@dataclass
class _Kept:
    """A group its ranks keep formed for the next round: its id, and the store it formed
    through (its server stays up while the group does; NCCL may connect through it again)."""

    group_id: str
    store: Any


class RayBackend(BackendDefaults):
    """gloo or nccl probes on a Ray cluster: local logical nodes or an existing cluster.
    Real links have no model: sizes, deadlines and presets are the check's defaults."""

    name: str  # "gloo" or "nccl", as constructed

    def __init__(
        self,
        backend: str = "gloo",
        *,
        local_nodes: int | None = None,
        ranks_per_node: int = 2,
        address: str | None = None,
        injected: Iterable[InjectedFault] = (),
        temp_dir: Path = Path(".ringwatch/ray"),
        progress: Progress | None = None,
        repeats: int = 1,
        cuda_graph: bool = True,
        hold_between_cycles: bool | None = None,
    ) -> None:
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be gloo or nccl, got {backend!r}")
        if (local_nodes is None) == (address is None):
            raise ValueError("give exactly one of local_nodes and address")
        if local_nodes is not None and local_nodes < 1 or ranks_per_node < 1 or repeats < 1:
            raise ValueError("local_nodes, ranks_per_node and repeats must be >= 1")
        self.name = backend
        self.repeats = repeats
        # On GPUs, capture each timed loop in one CUDA graph (nccl-tests' -G) where it works.
        self.cuda_graph = cuda_graph
        # Whether agents live on between cycles (release() then does nothing). A CUDA primary
        # context cannot be given back in-process: torch has no call that destroys it
        # (empty_cache returns only its allocator's cached blocks; the context, NCCL's
        # buffers and its proxy threads stay until the process ends). So under nccl an agent
        # is a process that ends: release() kills the agents, acquire() starts them again on
        # the cycle's nodes, paying a worker's start and CUDA's initialisation each cycle
        # (bench/agent_lifecycle.py) for a GPU that is the jobs' whole between cycles. gloo
        # holds nothing on a GPU and keeps its agents by default, sparing each cycle the
        # start; False there runs the nccl path on CPU, which is how the tests exercise it.
        self.hold_between_cycles = (backend == "gloo" if hold_between_cycles is None
                                    else hold_between_cycles)
        # The nodes the last acquire() was asked for whose agents did not start, with why:
        # probe none of their ranks this time.
        self.not_acquired: dict[str, str] = {}
        self._progress = progress or (lambda _msg: None)
        self._injected: list[InjectedFault] = list(injected)
        # Members whose hung agent was replaced: a restart clears an injected hang.
        self._hang_cleared: set[str] = set()
        self._cluster: Any = None
        self._node_id_cache: dict[str, str] = {}
        self._owns_ray = False  # never shut down a Ray connection someone else made
        self._slots: dict[str, _Slot] = {}
        self._identities: dict[str, RankInfo] = {}
        # On a cluster it joined, the ranks follow its nodes (refresh_ranks).
        self._joined = False
        self._ranks_per_node = ranks_per_node
        # When the identities were last read: a cycle right after start need not ask again.
        self._identified_at = 0.0
        self._round = 0
        # The groups of the round before, kept formed by their ranks: a group measured again
        # runs without forming anew (docs/probes.md, "Groups kept between rounds").
        self._kept: dict[CommKey, _Kept] = {}
        self._closed = False
        try:
            if local_nodes is not None:
                self._start_local(local_nodes, ranks_per_node, temp_dir)
            else:
                assert address is not None
                self._join(address, ranks_per_node)
            # Every agent starts once, to read the ranks' identities, and stays up until the
            # first release(): a one-shot check needs no acquire(). None has touched its GPU
            # yet (identity() reads NVML and counts devices; no context), so nothing is held.
            self._start_agents(list(self._slots.values()))
            self._node_ids()  # read where the agents run while they are all up
        except BaseException:
            self.close()
            raise

    # ---- cluster ------------------------------------------------------------------

    def _start_local(self, nodes: int, ranks_per_node: int, temp_dir: Path) -> None:
        from ray.cluster_utils import Cluster

        if ray.is_initialized():
            raise RuntimeError("Ray is already initialized in this process; close it first")
        # ray.cluster_utils records the cluster address under /tmp/ray whatever temp_dir says.
        Path("/tmp/ray").mkdir(parents=True, exist_ok=True)
        tmp = ray_temp_dir(temp_dir)
        # Every Ray process of the cluster, and this driver, on this machine's loopback
        # address: nothing of it listens where another machine can reach it.
        with _on_loopback():
            # Ray registers the head as this machine's current cluster, where `--address
            # auto` and `ray.init("auto")` look; this cluster is this command's alone.
            with _unregistered(lambda: self._cluster.address if self._cluster else None):
                self._cluster = Cluster(
                    initialize_head=True,
                    head_node_args={
                        # The head holds no ranks: every agent lives on a logical node.
                        "num_cpus": 0,
                        "include_dashboard": False,
                        "temp_dir": str(tmp),
                        "object_store_memory": _OBJECT_STORE_BYTES,
                        "node_ip_address": LOOPBACK,
                    },
                )
            for i in range(nodes):
                node = local_node_name(i)
                self._cluster.add_node(
                    # One core more than the agents hold: room for the node's other work.
                    num_cpus=ranks_per_node + 1,
                    resources={_node_resource(node): ranks_per_node},
                    object_store_memory=_OBJECT_STORE_BYTES,
                    node_ip_address=LOOPBACK,
                )
                for j in range(ranks_per_node):
                    # On one machine the logical nodes share its GPUs: give each rank its own.
                    self._add_slot(node, j, i * ranks_per_node + j,
                                   {"num_cpus": 1, "resources": {_node_resource(node): 1}})
            ray.init(address=self._cluster.address, include_dashboard=False, log_to_driver=False)
        self._owns_ray = True
        self._progress(f"ray: local cluster of {nodes} nodes x {ranks_per_node} ranks at {tmp}")

    def _join(self, address: str, ranks_per_node: int) -> None:
        if ray.is_initialized():
            raise RuntimeError("Ray is already initialized in this process; close it first")
        hint = ("start one with `ray start --head` on the head node and `ray start --address "
                "HEAD:6379` on each GPU node (or use the RayCluster of docs/kubernetes.md), or "
                "probe without one: --local N or --fabric FILE")
        address, named = resolve_address(address, hint)
        _check_listening(address, named, hint)
        self._owns_ray = True  # whatever ray.init leaves behind, close() shuts down
        try:
            ray.init(address=address, log_to_driver=False)
        except ConnectionError as exc:
            raise ProbeSetupError(refused(str(exc), named, hint)) from None
        except RuntimeError as exc:
            mismatch = version_mismatch(str(exc), named)
            if mismatch is None:
                raise
            raise ProbeSetupError(mismatch) from None
        self._joined = True
        self._slots = {slot.member: slot for slot in self._cluster_slots()}
        if not self._slots:
            raise RuntimeError(f"no alive Ray node at {named} has a "
                               f"{'GPU' if self.name == 'nccl' else 'CPU'}")
        self._progress(f"ray: joined {named}: {len(self._slots)} ranks")

    def _cluster_slots(self) -> list[_Slot]:
        """A slot per rank on every alive node of the joined cluster that has what probes
        need (GPUs under nccl, cores under gloo). A node is named by its host; a node already
        known keeps its name, and a node's new raylet (its worker restarted) takes the name
        of the one that died, so a node is the same node in ringwatch across restarts."""
        alive = sorted((n for n in ray.nodes() if n.get("Alive")),
                       key=lambda n: (n["NodeManagerHostname"], n["NodeID"]))
        ids = {n["NodeID"] for n in alive}
        known = {s.ray_node_id: s.node for s in self._slots.values() if s.ray_node_id in ids}
        taken = set(known.values())
        slots = []
        for info in alive:
            res = info.get("Resources", {})
            count = int(res.get("GPU", 0)) if self.name == "nccl" else min(
                self._ranks_per_node, int(res.get("CPU", 0)))
            if count == 0:
                continue
            node = known.get(info["NodeID"])
            if node is None:
                # Two raylets on one host (rare) still need distinct node names.
                host, k = info["NodeManagerHostname"], 1
                node = host
                while node in taken:
                    k += 1
                    node = f"{host}-{k}"
                taken.add(node)
            pin = NodeAffinitySchedulingStrategy(node_id=info["NodeID"], soft=False)
            for j in range(count):
                # nccl agents reserve no GPU in Ray: they must never keep a training job off
                # its GPUs, and a GPU that other Ray work holds marks the node busy instead.
                options: dict[str, Any] = {"num_cpus": 0 if self.name == "nccl" else 1,
                                           "scheduling_strategy": pin}
                slots.append(self._slot(node, j, j, options, info["NodeID"]))
        return slots

    def _add_slot(self, node: str, local_index: int, device_index: int, options: dict[str, Any]) -> None:
        slot = self._slot(node, local_index, device_index, options)
        self._slots[slot.member] = slot

    def _slot(self, node: str, local_index: int, device_index: int, options: dict[str, Any],
              ray_node_id: str = "") -> _Slot:
        if self.name == "nccl":
            # Ray would narrow CUDA_VISIBLE_DEVICES to one GPU per actor; NCCL needs to
            # see its peers to use NVLink P2P, so the agent picks cuda:<index> itself.
            options = {**options, "runtime_env": {"env_vars": {
                "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1",
                "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
            }}}
        return _Slot(node, local_index, device_index, options, ray_node_id=ray_node_id)

    def _follow_cluster(self) -> None:
        """The joined cluster's nodes as they are now: agents for nodes that joined since (a
        new GPU node's worker), none kept for nodes that left or whose worker restarted
        (their agents went with them). A new node whose agents do not start is left out
        and tried again at the next call; the others go on probing."""
        now = {slot.member: slot for slot in self._cluster_slots()}
        gone = sorted(m for m, slot in self._slots.items()
                      if m not in now or now[m].ray_node_id != slot.ray_node_id)
        for member in gone:
            slot = self._slots.pop(member)
            self._identities.pop(member, None)
            self._hang_cleared.discard(member)
            with contextlib.suppress(Exception):  # gone with its node
                ray.kill(slot.handle, no_restart=True)
        new = [slot for member, slot in now.items() if member not in self._slots]
        if gone or new:
            self._node_id_cache.clear()
        if gone:
            self._progress(f"ray: {len(gone)} rank(s) left with their node: "
                           f"{', '.join(sorted({node_of(m) for m in gone}))}")
        if not new:
            return
        nodes = ", ".join(sorted({slot.node for slot in new}))
        try:
            self._start_agents(new)
        except (ProbeSetupError, RuntimeError, ray.exceptions.RayError) as exc:
            for slot in new:
                with contextlib.suppress(Exception):
                    ray.kill(slot.handle, no_restart=True)
            self._progress(f"ray: agents on {nodes}, which joined, did not start ({exc}); "
                           "trying again next cycle")
            return
        self._slots.update({slot.member: slot for slot in new})
        self._progress(f"ray: {len(new)} rank(s) joined on {nodes}")

    # ---- agents -------------------------------------------------------------------

    def _faults_for(self, member: str) -> list[dict[str, Any]]:
        return [
            f.to_dict() for f in self._injected
            if f.member == member and not (f.kind == "hang" and member in self._hang_cleared)
        ]

    def _spawn(self, slots: list[_Slot]) -> list[Any]:
        """Start each slot's agent; the refs of their identity(), which doubles as "the agent
        is up" and "this rank can probe here"."""
        remote_agent = ray.remote(ProbeAgent)
        for slot in slots:
            slot.handle = remote_agent.options(**slot.options).remote(
                slot.node, slot.local_index, self.name, self._faults_for(slot.member),
                device_index=slot.device_index,
            )
        return [s.handle.identity.remote() for s in slots]

    def _start_agents(self, slots: list[_Slot]) -> None:
        """Start these agents, all or none: raises if any does not start."""
        refs = self._spawn(slots)
        try:
            infos = ray.get(refs, timeout=_START_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            raise RuntimeError(f"probe agents did not start within {_START_TIMEOUT_S:.0f} s: "
                               "are the CPU/GPU slots they need free?") from None
        except ray.exceptions.RayTaskError as exc:
            cause = getattr(exc, "cause", None)
            if isinstance(cause, ProbeSetupError):
                raise ProbeSetupError(str(cause)) from None
            raise
        for slot, info in zip(slots, infos, strict=True):
            self._identities[slot.member] = RankInfo(**info)
        self._identified_at = time.monotonic()

    def _start_nodes(self, slots: list[_Slot]) -> dict[str, str]:
        """Start these agents node by node: the nodes whose agents did not all start within
        _START_TIMEOUT_S, or cannot probe, with why. Their agents are stopped (one still
        waiting for its slot would otherwise take it later) and their ranks keep the
        identities read before; the other nodes' identities are read afresh."""
        refs = self._spawn(slots)
        ready = set(ray.wait(refs, num_returns=len(refs), timeout=_START_TIMEOUT_S)[0])
        failed: dict[str, str] = {}
        infos: dict[str, dict[str, Any]] = {}
        for slot, ref in zip(slots, refs, strict=True):
            if ref not in ready:
                failed.setdefault(slot.node, f"its agents did not start within "
                                  f"{_START_TIMEOUT_S:.0f} s: is the CPU/GPU slot they need free?")
                continue
            try:
                infos[slot.member] = ray.get(ref)
            except ray.exceptions.RayError as exc:  # cannot probe there, or the agent died
                cause = getattr(exc, "cause", None) or exc
                first_line = next(iter(str(cause).splitlines()), "")
                failed.setdefault(slot.node, f"{type(cause).__name__}: {first_line}"[:300])
        for slot in slots:
            if slot.node in failed:
                with contextlib.suppress(Exception):  # pending or gone: either way stopped
                    ray.kill(slot.handle, no_restart=True)
                slot.handle = None
            else:
                self._identities[slot.member] = RankInfo(**infos[slot.member])
        self._identified_at = time.monotonic()
        for node, why in sorted(failed.items()):
            self._progress(f"ray: agents on {node} not acquired: {why}")
        return failed

    def _live(self) -> list[_Slot]:
        """The slots whose agent is up now."""
        return [s for s in self._slots.values() if s.handle is not None]

    def acquire(self, nodes: Sequence[str]) -> float:
        """Start the agents of these nodes that are not up (under nccl, all of them after a
        release), on these nodes only: another node's GPUs may be a job's. Their identities
        are read again as they start. A node whose agents do not start within
        _START_TIMEOUT_S (Ray waits for the slot they need while other work holds it) or
        cannot probe is left out, named with why in ``not_acquired``; the rest go on. Under
        nccl each agent then makes its CUDA context. The seconds it took: the workers' start
        (each imports torch) and CUDA's initialisation, paid here rather than inside the
        cycle's first groups' deadlines."""
        started = time.perf_counter()
        wanted = set(nodes)
        known = {s.node for s in self._slots.values()}
        self.not_acquired = {n: "no ranks of this backend there" for n in sorted(wanted - known)}
        slots = [s for s in self._slots.values() if s.node in wanted and s.handle is None]
        if slots:
            self.not_acquired.update(self._start_nodes(slots))
        if self.name == "nccl":
            self._prepare([s for s in self._live() if s.node in wanted])
        return time.perf_counter() - started

    def _prepare(self, slots: list[_Slot]) -> None:
        """Each agent's CUDA context, made now. A rank that cannot make one stays acquired:
        its group fails with the same error, which is a probe finding about its GPU."""
        if not slots:
            return
        try:
            errors = ray.get([s.handle.prepare.remote() for s in slots], timeout=_START_TIMEOUT_S)
        except ray.exceptions.RayError as exc:  # an agent died: its group will say so
            self._progress(f"ray: preparing GPUs failed: {type(exc).__name__}")
            return
        for slot, error in zip(slots, errors, strict=True):
            if error:
                self._progress(f"ray: {slot.member} made no CUDA context: {error}")

    def release(self) -> float:
        """End every group kept formed, and every agent (unless ``hold_between_cycles``):
        the process's end is what gives its CUDA context, communicators and GPU memory back.
        Returns once Ray has registered every one dead (ray.kill ends a worker at once,
        without its exit handlers); the seconds it took (0 where no agent ends). Identities
        stay; a second call does nothing."""
        # Groups kept formed end with the cycle, whether or not the agents do (each agent
        # ends its group before it runs anything else; nothing here waits for that).
        self._drop(list(self._kept))
        live = self._live()
        if self.hold_between_cycles or not live:
            return 0.0
        started = time.perf_counter()
        self._end(live)
        return time.perf_counter() - started

    def footprints(self) -> dict[str, dict[str, Any]]:
        """What each agent that is up holds now, by member (ProbeAgent.footprint: pid,
        resident host memory, CPU seconds used, whether it may hold a CUDA context)."""
        slots = self._live()
        return dict(zip((s.member for s in slots),
                        ray.get([s.handle.footprint.remote() for s in slots], timeout=60),
                        strict=True))

    def _end(self, slots: list[_Slot]) -> None:
        self._forget(s.member for s in slots)
        handles = [s.handle for s in slots]
        for slot in slots:
            slot.handle = None
        calls = []
        for handle in handles:
            with contextlib.suppress(Exception):  # already gone with its node
                ray.kill(handle, no_restart=True)
                # Fails as soon as Ray has registered the death: what the wait below waits for.
                calls.append(handle.where.remote())
        if calls:
            ray.wait(calls, num_returns=len(calls), timeout=_END_TIMEOUT_S)

    @property
    def injected(self) -> list[InjectedFault]:
        """The faults injected into this backend, as given (reported as injected)."""
        return list(self._injected)

    def set_injected(self, faults: Iterable[InjectedFault]) -> None:
        """Replace the injected faults on every agent (a fresh hang fault arms again)."""
        self._injected = list(faults)
        self._hang_cleared.clear()
        unknown = {f.member for f in self._injected} - set(self._slots)
        if unknown:
            raise ValueError(f"injected faults name unknown ranks: {sorted(unknown)}")
        # An agent that is down gets its faults when it starts (_faults_for).
        ray.get([s.handle.set_injected.remote(self._faults_for(s.member)) for s in self._live()])

    def ranks(self) -> list[RankInfo]:
        return [self._identities[m] for m in self._slots]

    def refresh_ranks(self, max_age_s: float = 30.0) -> None:
        """On a cluster it joined, follow its nodes (``_follow_cluster``: a GPU node added
        to the cluster is probed from the next cycle on, without a restart). Then ask every
        agent for its identity again (inventory each cycle: a GPU, NVLink or NIC lost since
        the agents started shows in the next cycle's batch), unless they were read less
        than ``max_age_s`` ago (the first cycle after start)."""
        if self._joined:
            self._follow_cluster()
        if time.monotonic() - self._identified_at < max_age_s:
            return
        # Agents that are down keep what they said last; acquire() reads them as they start.
        members = [s.member for s in self._live()]
        infos = ray.get([self._slots[m].handle.identity.remote() for m in members], timeout=60)
        for m, info in zip(members, infos, strict=True):
            self._identities[m] = RankInfo(**info)
        self._identified_at = time.monotonic()

    def counters(self) -> dict[str, dict[str, Any]]:
        """Every GPU rank's NVLink counters and new XID errors (nccl only; {} on gloo)."""
        if self.name != "nccl":
            return {}
        members = [s.member for s in self._live()]  # an agent that is down reads nothing
        readings = ray.get([self._slots[m].handle.counters.remote() for m in members],
                           timeout=60)
        return dict(zip(members, readings, strict=True))

    def busy_nodes(self) -> dict[str, Occupant]:
        """Nodes where Ray shows other work holding what probes need (GPUs under nccl, cores
        under gloo): the ``ray`` occupancy source. Ray names no job, so the occupant says
        how much other Ray work holds."""
        from ray._private.state import available_resources_per_node

        resource = "GPU" if self.name == "nccl" else "CPU"
        available = available_resources_per_node()
        totals = {n["NodeID"]: n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")}
        ours: dict[str, float] = {}
        for slot in self._live():  # a released agent holds nothing
            ours[slot.node] = ours.get(slot.node, 0.0) + float(slot.options.get(f"num_{resource.lower()}s", 0))
        busy = {}
        for node, node_id in self._node_ids().items():
            total = float(totals.get(node_id, {}).get(resource, 0.0))
            free = float(available.get(node_id, {}).get(resource, 0.0))
            held = total - ours.get(node, 0.0) - free
            if held > 1e-6:
                busy[node] = Occupant(source="ray", state=f"{held:g} of {total:g} {resource}s "
                                      "held by other Ray work")
        return busy

    def _node_ids(self) -> dict[str, str]:
        """Each node's Ray node id: its slots' own on a joined cluster; on a local one where
        its agents run, read at start while all are up (a replacement stays on its node)."""
        if not self._node_id_cache:
            ids = {s.node: s.ray_node_id for s in self._slots.values() if s.ray_node_id}
            if len(ids) < len({s.node for s in self._slots.values()}):
                ids.update({node_of(m): w["ray_node_id"] for m, w in self.placement().items()})
            self._node_id_cache = ids
        return self._node_id_cache

    def placement(self) -> dict[str, dict[str, Any]]:
        """Where Ray runs each rank's agent that is up: ray_node_id, ip and pid per member."""
        slots = self._live()
        return dict(zip((s.member for s in slots),
                        ray.get([s.handle.where.remote() for s in slots]), strict=True))

    # ---- rounds -------------------------------------------------------------------

    def run_round(self, groups: list[GroupSpec]) -> RoundResult:
        """Run disjoint groups concurrently; a group past its deadline becomes hang findings."""
        self._check(groups)
        self._round += 1
        started = time.perf_counter()
        result = RoundResult()
        # A group of the round before that is not in this one ends first: each rank is in
        # one group a round, so a rank holds at most one formed group between rounds.
        wanted = {g.comm_key for g in groups}
        self._drop([key for key in self._kept if key not in wanted])
        for wave in self._waves(groups):
            wave_started = time.perf_counter()
            runs = [self._launch(spec, i) for i, spec in wave]
            self._await(runs)
            for run in runs:
                self._collect(run, result)
            self._replace([m for run in runs for m in self._to_replace(run)])
            held = time.perf_counter() - wave_started
            result.fabric_time_s += fabric_time_s(runs, held)
            result.busy_s.update({m: held for _, spec in wave for m in spec.members})
        result.wall_time_s = time.perf_counter() - started
        return result

    def _waves(self, groups: list[GroupSpec]) -> list[list[tuple[int, GroupSpec]]]:
        """Groups to run at once. On a real cluster, all of them: they share no hardware.
        The logical nodes of a local cluster share this machine's cores, and groups run side
        by side there would time each other's CPU contention, not their own links."""
        indexed = list(enumerate(groups))
        if self._cluster is None or not groups:
            return [indexed]
        widest = max(g.world_size for g in groups)
        at_once = max(1, (os.cpu_count() or 1) // widest)
        return [indexed[i:i + at_once] for i in range(0, len(indexed), at_once)]

    def _check(self, groups: list[GroupSpec]) -> None:
        """Bad group specs are the caller's bug: refuse them before anything runs."""
        seen: set[str] = set()
        for spec in groups:
            unknown = [m for m in spec.members if m not in self._slots]
            if unknown:
                raise ValueError(f"group {spec.scope} names unknown ranks {unknown}")
            if seen & set(spec.members) or len(set(spec.members)) != len(spec.members):
                raise ValueError("groups of one round must be disjoint and without repeats")
            seen.update(spec.members)
            for op in spec.ops:
                check_redop(op, redop_for(op, spec.redop), spec.dtype, backend=self.name)
                for size in spec.sizes:
                    plan(op, size, spec.world_size, spec.dtype, redop_for(op, spec.redop))

    def _launch(self, spec: GroupSpec, index: int) -> _GroupRun:
        host = ray.util.get_node_ip_address()
        # The OS picks a free port; agents learn it from the call below. A local cluster's
        # store listens on its loopback address alone, as its Ray does.
        store = store_server(host, spec.deadline_s, listen_there_only=self._cluster is not None)
        kept = self._kept.get(spec.comm_key)
        # A kept group's ranks report this round's progress through a store of its own (a
        # hang is named from it), and run it without forming it again, after a short
        # warm-up (its measurements say so).
        group_id = kept.group_id if kept is not None else (
            f"r{self._round}-g{index}-{uuid.uuid4().hex[:8]}")
        if kept is not None:
            spec = replace(spec, warmup=spec.kept_warmup)
        launched = time.monotonic()
        run = _GroupRun(spec, group_id, store, deadline=launched + spec.deadline_s,
                        formed_through=kept.store if kept is not None else store,
                        launched=launched)
        # An injected slow rank sizes its delay from one calibration loop, which every rank
        # of its group must run alike.
        calibrate = any(f.kind == "slow" and f.member in spec.members for f in self._injected)
        payload = {**spec.to_dict(), "repeats": self.repeats, "calibrate": calibrate,
                   "cuda_graph": self.cuda_graph, "keep": True, "reuse": kept is not None}
        for rank, m in enumerate(spec.members):
            ref = self._slots[m].handle.run_group.remote(payload, rank, host, store.port, run.group_id)
            run.refs[ref] = rank
        return run

    def _await(self, runs: list[_GroupRun]) -> None:
        """Collect replies until every group finished or passed its own deadline."""
        pending = {ref: run for run in runs for ref in run.refs}
        while pending:
            now = time.monotonic()
            for ref, run in list(pending.items()):
                if now >= run.deadline:
                    run.expired = True
                    del pending[ref]
            if not pending:
                break
            wait_s = min(run.deadline for run in pending.values()) - now
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=max(0.0, wait_s))
            for ref in ready:
                run = pending.pop(ref)
                rank = run.refs[ref]
                try:
                    run.replies[rank] = ray.get(ref)
                except ray.exceptions.RayError as exc:  # the agent process itself died
                    run.died[rank] = f"{type(exc).__name__}: {str(exc)[:200]}"
                if rank in run.died or run.replies[rank].get("status") == "error":
                    # Peers stuck on the failed rank need not hold the round to the deadline.
                    run.errored = True
                    run.deadline = min(run.deadline, time.monotonic() + _ERROR_GRACE_S)

    def _collect(self, run: _GroupRun, result: RoundResult) -> None:
        injected = self._injected_pairs()
        errors = outcome.error_findings(run.spec, run.replies, run.died, injected)
        result.findings.extend(errors)
        result.findings.extend(self._hang_findings(run, errors))
        result.findings.extend(outcome.corruption_findings(run.spec, run.replies, injected))
        result.findings.extend(outcome.transport_findings(run.replies))
        result.measurements.extend(outcome.measurements(run.spec, run.replies))
        self._keep(run)
        run.store = None  # closes the listening socket

    def _keep(self, run: _GroupRun) -> None:
        """Keep a group every rank of which ran it well (its ranks keep it formed); a group
        any rank failed, or that passed its deadline, is ended on the ranks that kept it."""
        key = run.spec.comm_key
        self._kept.pop(key, None)
        ok = [r for r, reply in run.replies.items() if reply.get("status") == "ok"]
        if len(ok) == run.spec.world_size and not (run.expired or run.died or run.errored):
            self._kept[key] = _Kept(run.group_id, run.formed_through)
            return
        self._end_group(run.group_id, [run.spec.members[r] for r in ok])

    def _drop(self, keys: Iterable[CommKey]) -> None:
        """End these kept groups on their ranks."""
        for key in list(keys):
            kept = self._kept.pop(key, None)
            if kept is not None:
                self._end_group(kept.group_id, list(key[0]))

    def _end_group(self, group_id: str, members: Sequence[str]) -> None:
        """Ask each live agent of ``members`` to end the group it keeps under ``group_id``.
        Not waited for: an agent runs its calls in order, so it ends the group before it
        runs the next one it is sent."""
        for m in members:
            slot = self._slots.get(m)
            if slot is not None and slot.handle is not None:
                with contextlib.suppress(Exception):  # gone with its node: nothing kept
                    slot.handle.drop_group.remote(group_id)

    def _forget(self, members: Iterable[str]) -> None:
        """Kept groups with any of these members, whose agents are ending: ended on the
        others."""
        gone = set(members)
        for key in [k for k in self._kept if not gone.isdisjoint(k[0])]:
            kept = self._kept.pop(key)
            self._end_group(kept.group_id, [m for m in key[0] if m not in gone])

    def _injected_pairs(self) -> set[tuple[str, str]]:
        return {(f.kind, f.member) for f in self._injected}

    # ---- hangs ---------------------------------------------------------------------

    def _hang_findings(self, run: _GroupRun, errors: list[Finding]) -> list[Finding]:
        """Ranks still missing at the deadline, by their progress in the group's store. Where
        a rank failed with an error, peers waiting past its step are victims, not hangs."""
        if not (run.expired and run.unfinished()):
            return []
        failed_at = [rank_progress(run.store, run.spec, f.detail["rank"]) for f in errors]
        ranks, stage = hang_suspects(run.store, run.spec, run.unfinished(),
                                     below=min(failed_at) if failed_at else None)
        if not ranks:
            return []
        self._progress(f"round {self._round}: {run.spec.scope} group hung at {stage}: "
                       f"{[run.spec.members[r] for r in ranks]}")
        injected = self._injected_pairs()
        findings = []
        for rank in ranks:
            m = run.spec.members[rank]
            slot = self._slots[m]
            detail: dict[str, Any] = {"members": list(run.spec.members), "scope": run.spec.scope,
                                      "rank": rank, "deadline_s": run.spec.deadline_s,
                                      "stage": stage}
            if ("hang", m) in injected:
                detail["injected"] = True
            findings.append(Finding(kind="hang", node=slot.node, gpu=slot.local_index,
                                    detail=detail))
        return findings

    def _to_replace(self, run: _GroupRun) -> list[str]:
        """Agents that may still be stuck in this group's collective, or are gone."""
        return [run.spec.members[r] for r in (*run.unfinished(), *run.died)] if (
            run.expired or run.died) else []

    def _replace(self, members: list[str]) -> None:
        """Kill stuck agents and start fresh ones with the same identity, before the next round."""
        if not members:
            return
        slots = [self._slots[m] for m in members]
        self._forget(members)
        for slot in slots:
            ray.kill(slot.handle, no_restart=True)
            self._hang_cleared.add(slot.member)
        self._progress(f"round {self._round}: replacing agents {members}")
        self._start_agents(slots)

    # ---- measurements ----------------------------------------------------------------

    # ---- lifetime ------------------------------------------------------------------

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._kept.clear()  # their agents end here
        for slot in self._live():
            with contextlib.suppress(Exception):  # already gone with its node
                ray.kill(slot.handle, no_restart=True)
        if self._owns_ray:  # also what a refused ray.init left connected
            ray.shutdown()
        if self._cluster is not None:
            address = self._cluster.address
            with _unregistered(lambda: address):  # stopping, Ray removes the record
                self._cluster.shutdown()
            self._cluster = None

    def __enter__(self) -> RayBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# Where a Ray head started with `ray start --head` on this machine writes its address, and
# so where Ray's own "auto" looks after RAY_ADDRESS.
RAY_CURRENT_CLUSTER = Path("/tmp/ray/ray_current_cluster")


# Where a local cluster, its driver, its agents' gloo groups and their stores listen.
LOOPBACK = "127.0.0.1"


@contextlib.contextmanager
def _on_loopback() -> Iterator[None]:
    """Let Ray keep the loopback address it is given. On Linux Ray swaps 127.0.0.1, as a
    node's address or as one to connect to, for this machine's routable address, where a
    cluster started on loopback does not answer. It keeps loopback where it runs as a
    one-machine Ray (macOS and Windows: ``ENABLE_RAY_CLUSTER`` false), which a local
    cluster is. Its processes are told their address outright, and once connected this
    driver goes by its node's: the switch is needed only while the cluster starts."""
    from ray._private import ray_constants

    before = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = before


@contextlib.contextmanager
def _unregistered(ours: Callable[[], str | None]):
    """Put this machine's current-cluster record back as it was once the cluster whose
    address ``ours`` gives has started (and registered itself there) or stopped (and
    removed the record, whoever wrote it); a record someone else wrote meanwhile stays."""
    try:
        before: str | None = RAY_CURRENT_CLUSTER.read_text()
    except OSError:
        before = None
    try:
        yield
    finally:
        try:
            now: str | None = RAY_CURRENT_CLUSTER.read_text()
        except OSError:
            now = None
        # Written by this cluster as it started, or removed by it as it stopped.
        if now != before and (now is None or now.strip() == (ours() or "")):
            with contextlib.suppress(OSError):
                if before is None:
                    RAY_CURRENT_CLUSTER.unlink()
                else:
                    RAY_CURRENT_CLUSTER.write_text(before)


def resolve_address(address: str, hint: str) -> tuple[str, str]:
    """The address to join, and how to name it: ``auto`` resolves as Ray resolves it
    (RAY_ADDRESS, else the address the newest head started on this machine with `ray start
    --head` wrote) and is named with what it resolved to and where that came from."""
    if address != "auto":
        return address, address
    if os.environ.get("RAY_ADDRESS"):
        resolved, source = os.environ["RAY_ADDRESS"], "RAY_ADDRESS"
    else:
        try:
            resolved, source = RAY_CURRENT_CLUSTER.read_text().strip(), str(RAY_CURRENT_CLUSTER)
        except OSError:
            resolved = ""
    if not resolved or resolved == "auto":
        raise ProbeSetupError(f"--address auto found no Ray cluster: RAY_ADDRESS is not set "
                              f"and no head on this machine wrote {RAY_CURRENT_CLUSTER}: {hint}")
    return resolved, f"auto ({resolved}, from {source})"


def refused(message: str, named: str, hint: str) -> str:
    """Ray's refusal to connect where something answers at the address, in one line. Ray
    says only that it failed; a cluster that asks for a token (RAY_AUTH_MODE=token) this
    process has not got is the likeliest cause, and the line says how to give it one."""
    first = re.split(r"\.(?:\s|$)", message.strip(), maxsplit=1)[0]
    if os.environ.get("RAY_AUTH_MODE", "").strip().lower() == "token":
        token = ("is RAY_AUTH_TOKEN here the cluster's token (its nodes' RAY_AUTH_TOKEN, or "
                 "`ray get-auth-token` on its head)?")
    else:
        token = ("where the cluster asks for a token (RAY_AUTH_MODE=token on its nodes), set "
                 "RAY_AUTH_MODE=token and RAY_AUTH_TOKEN to its token here too")
    return f"Ray at --address {named} did not let this process join ({first}): {token}; else {hint}"


def version_mismatch(message: str, named: str) -> str | None:
    """Ray's refusal to join a cluster of another Ray or Python version, in one line that
    says which install joins it; None for any other error."""
    if not message.startswith("Version mismatch"):
        return None
    found = re.findall(r"(Ray|Python): (\S+)", message)
    if len(found) != 4:
        return f"Ray at --address {named} refused this process: {' '.join(message.split())}"
    (_, cluster_ray), (_, cluster_py), (_, mine_ray), (_, mine_py) = found
    if cluster_ray != mine_ray:
        return (f"the Ray cluster at --address {named} runs Ray {cluster_ray}, this "
                f"environment Ray {mine_ray}: Ray joins only its own version; install "
                f"ray=={cluster_ray} beside ringwatch here "
                f"({shlex.join([sys.executable, '-m', 'pip', 'install', f'ray=={cluster_ray}'])})")
    return (f"the Ray cluster at --address {named} runs Python {cluster_py}, this "
            f"environment Python {mine_py}: Ray joins only the same Python; run the scheduler "
            f"with Python {cluster_py}")


def _check_listening(address: str, named: str, hint: str, timeout_s: float = 5.0) -> None:
    """A HOST:PORT address where nothing listens is refused at once: Ray itself would wait
    minutes for its control store before giving up (a head that has gone leaves its address
    behind)."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or "://" in address:
        return  # a ray:// client address: Ray's own connection says what is wrong
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as exc:
        raise ProbeSetupError(f"nothing answers at --address {named} ({exc.strerror or exc}): "
                              f"{hint}") from None
