"""The vocabulary shared by every probe backend (nccl, gloo, sim) and the services.

Plain dataclasses only: agents know nothing of the database or HTTP, and the
scheduler ships these as JSON (``to_dict``) in the body of ``POST /v1/measurements``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from functools import cached_property
from types import MappingProxyType
from typing import Any, Literal, Protocol, get_args

from ringwatch.agents.groups import Group, member, nodes_of
from ringwatch.agents.hostlist import index_ranges

# The wire's vocabulary, each word once: a Literal type (what the API's schemas and typed
# code use) and its values as a tuple (what code iterates and validates against).
Scope = Literal["intra_node", "gpu_pair", "inter_node", "world"]
SCOPES: tuple[str, ...] = get_args(Scope)
Op = Literal["allreduce", "alltoall", "allgather", "reducescatter", "sendrecv"]
OPS: tuple[str, ...] = get_args(Op)
Backend = Literal["nccl", "gloo", "sim"]
BACKENDS: tuple[str, ...] = get_args(Backend)
# nccl-tests' reductions (-o), as a measurement may carry them; a probe runs RedOp, without
# prod, which overflows the exact patterns.
WireRedOp = Literal["sum", "prod", "min", "max", "avg"]
RedOp = Literal["sum", "max", "min", "avg"]
REDOPS: tuple[str, ...] = get_args(RedOp)
REDUCING_OPS: tuple[str, ...] = ("allreduce", "reducescatter")
# NCCL_ALGO names a probe may pin a communicator to (GroupSpec.algo).
Algo = Literal["ring", "tree"]
ALGOS: tuple[str, ...] = get_args(Algo)
FindingKind = Literal["nvlink_degraded", "nic_degraded", "net_path_degraded", "hang",
                      "data_corruption", "topology_mismatch", "rank_mapping", "probe_error",
                      "fabric_below_rated", "inventory_mismatch", "gpu_xid",
                      "transport_fallback", "nic_errors", "nvlink_fabric"]
FINDING_KINDS: tuple[str, ...] = get_args(FindingKind)
# Finding kinds whose node a job should not use (docs/formats.md, "Verdict"). A probe_error is a
# rank whose own collective raised (CUDA OOM, NCCL init or communicator error): its node
# cannot run the job's collectives either. A transport_fallback (NCCL took sockets, SHM or
# PCIe where the node has RDMA ports or NVLink up), nic_errors (a port's error counters
# rising, bandwidth still fine) and nvlink_fabric (a GPU not registered in its NVLink
# fabric, or in another clique than its domain) are why a job would crawl or fail there.
EXCLUDING_KINDS = frozenset(
    {"nvlink_degraded", "nic_degraded", "hang", "data_corruption", "topology_mismatch",
     "probe_error", "gpu_xid", "transport_fallback", "nic_errors", "nvlink_fabric"}
)

# How a measurement was timed (Measurement.timing): the timed iterations captured in one
# CUDA graph and replayed (nccl-tests -G), CUDA events around an eager loop (host launch
# gaps count), the wall clock around ops that complete on the host (gloo), the sim's model.
Timing = Literal["cuda_graph", "cuda_events", "host", "model"]
TIMINGS: tuple[str, ...] = get_args(Timing)
TIMING_CUDA_GRAPH, TIMING_CUDA_EVENTS, TIMING_HOST, TIMING_MODEL = TIMINGS


def weakest_timing(timings: list[str]) -> str:
    """A group's timing is its weakest rank's: one that fell back to events counts launch
    gaps that graph-timed ranks do not."""
    order = {t: i for i, t in enumerate(TIMINGS)}
    return max(timings, key=lambda t: order.get(t, len(order))) if timings else TIMING_HOST


def redop_for(op: str, redop: str) -> str:
    """The reduction ``op`` runs when its group asks for ``redop``: ops that do not reduce
    run as they always do, recorded as "sum" (not applicable)."""
    return redop if op in REDUCING_OPS else "sum"


def series_op(op: str, algo: str | None) -> str:
    """The op as a series names it: an op whose communicator was pinned to one algorithm
    is a series apart from NCCL's own choice, ``allreduce:ring`` beside ``allreduce``."""
    return op if algo is None else f"{op}:{algo}"


def split_series_op(name: str) -> tuple[str, str | None]:
    """``series_op`` undone: ``allreduce:tree`` is ("allreduce", "tree")."""
    op, _, algo = name.partition(":")
    return op, algo or None


def utcnow() -> datetime:
    return datetime.now(UTC)


@dataclass(frozen=True)
class RankInfo:
    """Identity of one probe rank: one GPU under nccl, one CPU slot under gloo."""

    node: str
    local_index: int
    hostname: str
    gpu_uuid: str | None = None
    pci_bus_id: str | None = None
    numa_node: int | None = None
    gpu_name: str | None = None
    # Free-form NVML facts (NVLink state, error counters, P2P row); empty without NVML.
    telemetry: dict[str, Any] = field(default_factory=dict)
    # The node's hardware profile (agents.profiles), detected or configured; None unknown.
    profile: str | None = None

    @property
    def member(self) -> str:
        return member(self.node, self.local_index)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# What makes a group the same communicator from one round to the next (``GroupSpec.
# comm_key``): its ranks in order, NCCL's algorithm (read when the communicator forms) and
# its timeout (set then too).
CommKey = tuple[tuple[str, ...], str | None, float]
# The warm-up iterations per op and size of a group its ranks kept formed from the round
# before: its connections are made (NCCL connects on first use, which is what the full
# warm-up pays for); one eager iteration still goes before a captured loop.
KEPT_WARMUP = 1


@dataclass(frozen=True)
class GroupSpec:
    """One probe group: these ranks form a process group and run these ops at these sizes."""

    scope: str
    members: tuple[str, ...]
    ops: tuple[str, ...] = ("allreduce", "alltoall")
    sizes: tuple[int, ...] = (1 << 20,)
    dtype: str = "float32"
    warmup: int = 5
    iters: int = 20
    # Wall-clock budget for the whole group (forming it, all ops, leaving it).
    deadline_s: float = 60.0
    # nccl-tests' -o: the reduction of AllReduce and ReduceScatter (other ops ignore it).
    redop: str = "sum"
    # NCCL_ALGO for this group's communicator ("ring", "tree"); None: NCCL chooses.
    algo: str | None = None

    @property
    def world_size(self) -> int:
        return len(self.members)

    @property
    def group(self) -> Group:
        """The group whatever its ring order, as ``Measurement.group``."""
        return Group(self.members)

    @property
    def kept_warmup(self) -> int:
        """The warm-ups it runs kept formed from the round before (``KEPT_WARMUP``)."""
        return min(self.warmup, KEPT_WARMUP)

    @property
    def comm_key(self) -> CommKey:
        """What a backend keeps this group formed under between rounds (``CommKey``)."""
        return self.members, self.algo, self.deadline_s

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Measurement:
    """One timed collective, in nccl-tests' terms (docs/formats.md, "Probe output")."""

    op: str
    scope: str
    members: list[str]
    size_bytes: int
    dtype: str
    warmup: int
    iters: int
    time_us: float
    algbw_gbs: float
    busbw_gbs: float
    wrong: int
    time: datetime = field(default_factory=utcnow)
    # Set by --repeats: min/median/max of time_us over repeats.
    stats: dict[str, float] | None = None
    # The reduction (nccl-tests' redop); "sum" also for ops that do not reduce.
    redop: str = "sum"
    # How it was timed (agents.device.TIMINGS): cuda_graph, cuda_events, host or model.
    timing: str | None = None
    # What the sender's hardware model says this measurement should reach (GB/s busbw),
    # where it has one (the sim's modeled fabric): a floor under the peers' expectation.
    preset_gbs: float | None = None
    # The rated busbw of the node type's hardware profile (agents.profiles), at
    # bandwidth-bound sizes: below a fraction of it the link is degraded whatever its
    # peers do.
    rated_gbs: float | None = None
    # The algorithm its communicator was told to use (NCCL_ALGO: "ring", "tree"); None
    # where the backend chose (NCCL's own tuning, gloo's fixed algorithms). A series of its
    # own: links are keyed by it (services.analyzer.assess.link_key).
    algo: str | None = None
    # The transports NCCL's log showed the group took, comma-joined in name order
    # (agents.nccl_log's classes: "net_ib,p2p_nvlink"); None where the probe cannot say.
    transport: str | None = None
    # Other traffic its links carried while it ran (agents.contention), in one line: the
    # measurement is about the job beside it, not the link. Stored and shown, never judged.
    # None: the links were quiet, or the probe cannot read them.
    contended: str | None = None

    @cached_property
    def nodes(self) -> list[str]:
        """The distinct nodes of ``members`` (``nodes_of``), worked out once: the judgement
        asks it of every measurement after every round of a check, and a world group's
        members run to thousands."""
        return nodes_of(self.members)

    @cached_property
    def series(self) -> str:
        """``series_op`` of its op and algorithm: the series it belongs to, worked out once
        (as ``nodes``)."""
        return series_op(self.op, self.algo)

    @cached_property
    def group(self) -> Group:
        """The group's identity whatever the ring order, worked out once (as ``nodes``)."""
        return Group(self.members)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["time"] = self.time.isoformat()
        for key in ("stats", "timing", "preset_gbs", "rated_gbs", "algo", "transport",
                    "contended"):
            if d[key] is None:
                del d[key]
        return d


@dataclass
class Finding:
    """Something wrong, named as precisely as the evidence allows (docs/formats.md, "Verdict")."""

    kind: str
    node: str | None = None
    gpu: int | None = None
    gpus: list[int] | None = None
    nodes: list[str] | None = None
    severity: str = "critical"
    measured_gbs: float | None = None
    expected_gbs: float | None = None
    detail: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"kind": self.kind}
        for key in ("node", "gpu", "gpus", "nodes", "measured_gbs", "expected_gbs"):
            value = getattr(self, key)
            if value is not None:
                d[key] = round(value, 3) if isinstance(value, float) else value
        d["severity"] = self.severity
        d.update(self.detail)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Finding:
        """Inverse of ``to_dict``: known keys to fields, the rest back into ``detail``.

        Tolerant of what it reads back from storage: a known key whose value has the wrong
        type (stored before ingest checked types) is kept in ``detail`` under ``invalid``,
        as text, so that one bad record cannot break every verdict that reads it."""
        fields_: dict[str, Any] = {}
        invalid: dict[str, str] = {}
        for key, value in d.items():
            if key in _FIELD_TYPES:
                if _FIELD_TYPES[key](value):
                    fields_[key] = value
                else:
                    invalid[key] = repr(value)[:200]
        detail = {k: v for k, v in d.items() if k not in _FIELD_TYPES and k != "detail"}
        if isinstance(d.get("detail"), dict):
            detail.update(d["detail"])
        elif d.get("detail") is not None:
            invalid["detail"] = repr(d["detail"])[:200]
        if invalid:
            detail["invalid"] = invalid
        fields_.setdefault("kind", "unknown")
        return cls(**fields_, detail=detail)

    @property
    def blamed_nodes(self) -> list[str]:
        """Nodes a job should avoid because of this finding (none for a path)."""
        if self.kind in EXCLUDING_KINDS and self.node is not None:
            return [self.node]
        # A node missing hardware is excluded; one on another software version is a warning.
        if self.kind == "inventory_mismatch" and self.severity == "critical" and self.node:
            return [self.node]
        return []


def _is_index(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1 << 31


def _is_gbs(v: Any) -> bool:
    return (isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
            and v >= 0)


# What each field of a Finding must hold when read back from storage.
_FIELD_TYPES: dict[str, Any] = {
    "kind": lambda v: isinstance(v, str),
    "node": lambda v: v is None or isinstance(v, str),
    "gpu": lambda v: v is None or _is_index(v),
    "gpus": lambda v: v is None or (isinstance(v, list) and all(_is_index(x) for x in v)),
    "nodes": lambda v: v is None or (isinstance(v, list) and all(isinstance(x, str) for x in v)),
    "severity": lambda v: isinstance(v, str),
    "measured_gbs": lambda v: v is None or _is_gbs(v),
    "expected_gbs": lambda v: v is None or _is_gbs(v),
}


@dataclass(frozen=True)
class InjectedFault:
    """A fault injected into a real backend for demos and tests (docs/formats.md, "Injected faults").

    ``slow``: the rank delays itself so its groups run at about ``factor`` of their
    bandwidth (only ``op``'s groups where it names one: a fallback of one collective).
    ``hang``: the rank never enters the collective. ``corrupt``: the rank
    perturbs its result so the correctness check fails. ``error``: the rank raises as it
    enters its first op, as a CUDA out-of-memory or an NCCL error would.
    """

    kind: str
    node: str
    gpu: int = 0
    factor: float = 1.0
    op: str | None = None

    KINDS = ("slow", "hang", "corrupt", "error")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> InjectedFault:
        kind = d.get("kind")
        if kind not in cls.KINDS:
            raise ValueError(f"injected fault kind must be one of {', '.join(cls.KINDS)}, got {kind!r}")
        if not isinstance(d.get("node"), str):
            raise ValueError("injected fault needs a \"node\"")
        factor = float(d.get("factor", 0.5 if kind == "slow" else 1.0))
        if kind == "slow" and not 0.0 < factor < 1.0:
            raise ValueError(f"slow factor must lie in (0, 1), got {factor}")
        op = d.get("op")
        if op is not None and (kind != "slow" or op not in OPS):
            raise ValueError(f"\"op\" names the one collective a slow fault slows, one of "
                             f"{', '.join(OPS)}; got {op!r} on a {kind} fault")
        return cls(kind=kind, node=d["node"], gpu=int(d.get("gpu", 0)), factor=factor, op=op)

    @property
    def member(self) -> str:
        return member(self.node, self.gpu)

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"kind": self.kind, "node": self.node, "gpu": self.gpu,
                             "factor": self.factor}
        if self.op is not None:
            d["op"] = self.op
        return d


@dataclass
class RoundResult:
    """What one round of groups produced."""

    measurements: list[Measurement] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)
    # Modeled or measured fabric time: the slowest group of the round, in seconds.
    fabric_time_s: float = 0.0
    wall_time_s: float = 0.0
    # Seconds each member was held by its group (for the duty cycle); absent: the round's wall.
    busy_s: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Occupant:
    """What holds a node besides ringwatch, as an occupancy source saw it
    (services.scheduler.occupancy): the workload manager (``source``), the job's id and the
    GPUs it holds where the source knows them, and the source's own word for the node's
    state. ``unknown``: the source could not vouch for the node (it failed or timed out),
    so the node counts as busy."""

    source: str
    job: str | None = None
    gpus: tuple[int, ...] | None = None
    state: str | None = None
    unknown: bool = False

    @property
    def reason(self) -> str:
        """One line for a person: why a scheduled cycle left the node alone."""
        if self.unknown:
            return f"occupancy unknown ({self.source}: {self.state or 'no answer'})"
        held = f" on GPUs {index_ranges(self.gpus)}" if self.gpus else ""
        job = f"job {self.job}" if self.job else "other work"
        state = f" ({self.state})" if self.state else ""
        return f"{job}{held}{state}, per {self.source}"

    def to_dict(self) -> dict[str, Any]:
        return {"source": self.source, "job": self.job,
                "gpus": list(self.gpus) if self.gpus is not None else None,
                "state": self.state, "unknown": self.unknown, "reason": self.reason}


class ProbeSetupError(Exception):
    """The probe cannot run on this machine at all (no CUDA, too few GPUs): a setup
    mistake to refuse up front with one line, never a fabric finding."""


# A hardware model's busbw for a measurement, in GB/s (None where it has no figure for it).
ExpectedBusbw = Callable[[Measurement], float | None]


class ProbeBackend(Protocol):
    """Everything the check, the scheduler and the CLI ask of a backend (nccl, gloo, sim):
    the whole surface is declared, so callers use plain attribute access and a backend with
    nothing to say on a member gives its neutral value (``BackendDefaults`` holds them)."""

    # The collective backend every measurement is labelled with: nccl, gloo or sim.
    name: str

    @property
    def injected(self) -> Sequence[InjectedFault]:
        """Faults injected into the ranks, reported with each batch; () where none are."""
        ...

    @property
    def repeats(self) -> int:
        """Timed loops each rank runs per op and size, the median kept (deadlines scale
        with it); 1 where one loop is trusted."""
        ...

    @property
    def preflight_sizes(self) -> tuple[int, ...] | None:
        """The sizes a check probes unless told; None: the defaults for the backend's kind
        of fabric (``agents.collectives.default_sizes``)."""
        ...

    @property
    def preflight_deadline_s(self) -> float | None:
        """A group's deadline unless told; None: worked out from the work it runs."""
        ...

    @property
    def expected_busbw(self) -> ExpectedBusbw | None:
        """The backend's own hardware model of a measurement's busbw; None: judge by the
        preset each measurement carries."""
        ...

    def ranks(self) -> list[RankInfo]:
        """Every rank this backend can probe, with its identity."""
        ...

    def refresh_ranks(self) -> None:
        """Read the ranks' identities again before a cycle, so a GPU or link lost since the
        start shows in its inventory; nothing where identities cannot change."""
        ...

    def begin_cycle(self, index: int) -> None:
        """Called by the scheduler before each monitoring cycle with the cycle's persistent
        index (the node-pair rotation position), so a modeled fabric can move its drifting
        faults and draw that cycle's noise; real backends do nothing."""
        ...

    def counters(self) -> dict[str, dict[str, Any]]:
        """Each GPU rank's NVLink counters and new XID errors by member, read around a
        cycle; {} where the ranks have none."""
        ...

    def busy_nodes(self) -> dict[str, Occupant]:
        """Nodes where other work the backend itself can see holds what probes need (Ray's
        other work; the sim's scenario jobs), with what holds them: the ``ray`` and ``sim``
        occupancy sources. {} where nothing else runs."""
        ...

    def acquire(self, nodes: Sequence[str]) -> float:
        """Set up what a cycle or a check needs on these nodes' GPUs (agents, CUDA
        contexts); the seconds it took, which count in the duty cycle. Nothing on a GPU is
        held outside an ``acquire`` ... ``release``."""
        ...

    def release(self) -> float:
        """Tear down everything held on any GPU (CUDA contexts, communicators, memory) until
        the next ``acquire``; the seconds it took. A second call does nothing."""
        ...

    @property
    def not_acquired(self) -> Mapping[str, str]:
        """The nodes the last ``acquire`` could not set up, with why (their agents did not
        start in time, or cannot probe there): a cycle leaves them out. {} where every node
        was. (``BackendDefaults`` holds it as a plain attribute a backend may set.)"""
        ...

    def run_round(self, groups: list[GroupSpec]) -> RoundResult:
        """Run disjoint groups concurrently; never raises for a sick rank (a hang is a finding)."""
        ...

    def close(self) -> None:
        """Release the ranks; a second call does nothing."""
        ...


class BackendDefaults:
    """The neutral value of every ProbeBackend member a backend may have nothing to say on:
    a backend derives from it and states only what differs. Callers still type their
    backend as ``ProbeBackend``."""

    repeats: int = 1
    preflight_sizes: tuple[int, ...] | None = None
    preflight_deadline_s: float | None = None
    expected_busbw: ExpectedBusbw | None = None
    not_acquired: Mapping[str, str] = MappingProxyType({})

    @property
    def injected(self) -> Sequence[InjectedFault]:
        return ()

    def refresh_ranks(self) -> None:
        """Nothing to read again: the ranks are as they started."""

    def begin_cycle(self, index: int) -> None:
        """Nothing to move: real links drift on their own."""

    def counters(self) -> dict[str, dict[str, Any]]:
        return {}

    def busy_nodes(self) -> dict[str, Occupant]:
        return {}

    def acquire(self, nodes: Sequence[str]) -> float:
        """Nothing to set up: the backend holds nothing on a GPU."""
        return 0.0

    def release(self) -> float:
        """Nothing to tear down."""
        return 0.0

    def close(self) -> None:
        """Nothing held."""
