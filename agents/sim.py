"""The modeled fabric backend: alpha-beta collectives over NVLink pairs, NICs and node paths.

Built from a scenario (docs/formats.md, "Fabric scenario file"). Each group's time follows the
links its algorithm loads: a ring runs at its slowest edge, an all-to-all ends with its
slowest flow. Faults scale what they name, and may drift: lose more each monitoring cycle.
The scenario's jobs hold their nodes for a span of cycles: the sim reports them as its
occupancy, their traffic takes its share of those nodes' links, and the ranks' modeled
counters see it, so a probe through them is ``contended`` as on a real fleet.
Per-link variation and measurement noise are seeded; each cycle draws its own noise. The
analyzer sees only the measurements and the ranks' telemetry, never the fault list. Model
and figures: docs/analysis.md.
"""

from __future__ import annotations

import json
import math
import re
import time
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from ringwatch.agents.collectives import busbw_factor
from ringwatch.agents.contention import Traffic, contention
from ringwatch.agents.fabric_presets import preset
from ringwatch.agents.groups import member, split_member
from ringwatch.agents.hostlist import expand_hostlist
from ringwatch.agents.spec import (
    ALGOS,
    TIMING_MODEL,
    BackendDefaults,
    CommKey,
    Finding,
    GroupSpec,
    Measurement,
    Occupant,
    RankInfo,
    RoundResult,
    redop_for,
)
from ringwatch.agents.transport import transport_finding

FAULT_KINDS = ("nvlink", "nic", "net_path", "hang", "corrupt", "pcie_only", "error",
               "fallback", "transport", "nic_errors")
# A transport fault's "transport": what NCCL is modeled to take instead of the fabric
# (agents.nccl_log's vocabulary), and what it should have taken. Without "gpus" it is the
# node's inter-node traffic; with them, that GPU pair's.
NET_FALLBACKS = {"socket": "net_socket"}
PAIR_FALLBACKS = {"shm": "shm", "pcie": "p2p_pcie"}
# The modeled seconds between two counter reads (a check's before and after): the default
# probe interval, so a monitoring cycle's rates are a real fleet's at that interval.
COUNTER_INTERVAL_S = 300.0
# Faults that scale a rate: they take a "factor" and may drift.
RATE_KINDS = ("nvlink", "nic", "net_path", "fallback")
# NCCL's double binary tree runs each half of the data down one of two trees; its busbw at
# large sizes reaches a little less than a ring's over the same links.
TREE_BW_SHARE = 0.9
# A drifting fault's factor never falls below this: a link that drifted out is very slow,
# not gone.
DRIFT_FLOOR = 0.01
RING_OPS = ("allreduce", "allgather", "reducescatter")
# Communicator setup: a fixed part plus one bootstrap all-gather step per doubling of ranks.
SETUP_S = 0.05
SETUP_PER_DOUBLING_S = 0.005
# A mean over 20 timed iterations has no heavy tail: noise is clipped at this many sigmas.
NOISE_CLIP = 4.0
# The p2p word of a pair that has no NVLink (nvidia-smi topo: same PCIe host bridge).
PCIE_WORD = "PHB"
# Groups up to this many ranks over up to SMALL_NODES nodes (GPU pairs, a node, node pairs)
# are modeled in plain Python: numpy's per-call cost outweighs its work on so few links.
SMALL_RANKS = 64
SMALL_NODES = 8
# Parsed groups and modeled op times kept per backend and fabric; past this many entries a
# cache starts again, so a long-lived monitor's memory stays bounded.
CACHE_LIMIT = 1 << 16
_U64 = (1 << 64) - 1
# A scenario job's fields, and the links its traffic loads (docs/formats.md).
JOB_FIELDS = ("id", "nodes", "cycles", "traffic")
JOB_TRAFFIC = ("nvlink", "network")
# A job's id: what the occupancy source names it by, shown to people; one plain token.
_JOB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
# A running job's share of its GPUs' time, as NVML would read it: training keeps them busy
# between its collectives, whatever its links carry.
JOB_GPU_UTIL = 0.9
# The modeled counters' window: what a rank reads beside its group (agents.contention).
TRAFFIC_WINDOW_S = 1.0


def node_name(i: int) -> str:
    return f"node-{i:03d}"


def _splitmix(x: np.ndarray) -> np.ndarray:
    """A stateless 64-bit hash: per-path variation without an N x N table."""
    with np.errstate(over="ignore"):
        z = x + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def _alike(a: np.ndarray) -> bool:
    return a.size == 0 or bool((a == a.flat[0]).all())


def _splitmix_int(x: int) -> int:
    """``_splitmix`` of one value in plain integers: the same bits, none of numpy's per-call
    cost."""
    z = (x + 0x9E3779B97F4A7C15) & _U64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _U64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _U64
    return z ^ (z >> 31)


@dataclass
class Scenario:
    """A validated scenario file."""

    nodes: int
    gpus_per_node: int = 8
    gpu: str = "H100-SXM"
    nvlink_gbs: float | None = None
    net_gbs: float | None = None
    noise: float = 0.03
    variation: float = 0.02
    seed: int = 0
    faults: list[dict[str, Any]] = field(default_factory=list)
    jobs: list[SimJob] = field(default_factory=list)

    def running(self, cycle: int) -> tuple[SimJob, ...]:
        """The jobs running in the monitoring cycle ``begin_cycle(cycle)`` begins (``cycle``
        0-based, as begin_cycle counts; a job's ``cycles`` are 1-based), in file order."""
        return tuple(job for job in self.jobs if job.runs_in(cycle))

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Scenario:
        if not isinstance(d, dict):
            raise ValueError("a scenario is a JSON object")
        fields = list(cls.__dataclass_fields__)
        unknown = set(d) - set(fields)
        if unknown:
            raise ValueError(f"unknown scenario field(s): {', '.join(sorted(unknown))}; "
                             f"a scenario has {', '.join(fields)} (docs/formats.md)")
        s = cls(
            nodes=_int(d, "nodes", None, 1),
            gpus_per_node=_int(d, "gpus_per_node", 8, 1),
            gpu=str(d.get("gpu", "H100-SXM")),
            nvlink_gbs=_positive(d, "nvlink_gbs"),
            net_gbs=_positive(d, "net_gbs"),
            noise=_fraction(d, "noise", 0.03),
            variation=_fraction(d, "variation", 0.02),
            seed=_int(d, "seed", 0, None),
            faults=list(d.get("faults") or []),
        )
        preset(s.gpu)  # unknown GPU: ValueError naming the known ones
        if not isinstance(d.get("faults", []), list):
            raise ValueError("faults must be a list")
        for i, f in enumerate(s.faults):
            _check_fault(i, f, s.nodes, s.gpus_per_node)
        s.jobs = _jobs(d.get("jobs"), s.nodes)
        return s


@dataclass(frozen=True)
class SimJob:
    """A training job of a scenario: it holds every GPU of its ``nodes`` (indices) from
    monitoring cycle ``first`` to ``last`` (the scheduler's cycle numbers: 1-based,
    inclusive; ``last`` None: to the end), and while it runs its own traffic takes
    ``nvlink`` of each NVLink pair's and ``network`` of each NIC's bandwidth there."""

    id: str
    nodes: tuple[int, ...]
    first: int = 1
    last: int | None = None
    nvlink: float = 0.0
    network: float = 0.0

    def runs_in(self, cycle: int) -> bool:
        """Whether it runs in the cycle ``begin_cycle(cycle)`` begins: cycle number
        ``cycle + 1`` (a preflight outside a scheduler is cycle 0, number 1)."""
        number = cycle + 1
        return self.first <= number and (self.last is None or number <= self.last)

    @property
    def span(self) -> str:
        return f"{self.first}-{self.last}" if self.last is not None else f"{self.first} on"


def _int(d: dict[str, Any], key: str, default: int | None, low: int | None) -> int:
    if key not in d:
        if default is None:
            raise ValueError(f"scenario needs {key!r}")
        return default
    value = d[key]
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{key} must be an integer, got {value!r}")
    if low is not None and value < low:
        raise ValueError(f"{key} must be at least {low}, got {value}")
    return value


def _positive(d: dict[str, Any], key: str) -> float | None:
    if d.get(key) is None:
        return None
    value = d[key]
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise ValueError(f"{key} must be a positive number, got {value!r}")
    return float(value)


def _fraction(d: dict[str, Any], key: str, default: float) -> float:
    value = d.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < 1:
        raise ValueError(f"{key} must be a number in [0, 1), got {value!r}")
    return float(value)


def _node_index(where: str, name: Any, n_nodes: int) -> int:
    if not isinstance(name, str) or not name.startswith("node-") or not name[5:].isdigit():
        raise ValueError(f"{where}: node must be named node-000 ..., got {name!r}")
    i = int(name[5:])
    if name != node_name(i) or i >= n_nodes:
        raise ValueError(f"{where}: no node {name!r} in a fabric of {n_nodes} node(s)")
    return i


def _gpu_index(where: str, g: Any, gpus: int) -> int:
    if isinstance(g, bool) or not isinstance(g, int) or not 0 <= g < gpus:
        raise ValueError(f"{where}: gpu must be an integer in [0, {gpus}), got {g!r}")
    return g


def fault_fields(kind: str) -> tuple[str, ...]:
    """The fields a scenario fault of ``kind`` takes (docs/formats.md)."""
    place = ("nodes",) if kind == "net_path" else ("node",)
    gpus: tuple[str, ...] = (("gpus",) if kind in ("nvlink", "pcie_only", "transport") else
                             ("gpu",) if kind in ("hang", "corrupt", "error") else ())
    extra: tuple[str, ...] = (("factor", "drift") if kind in RATE_KINDS else ()) + (
        ("op", "algo") if kind == "fallback" else ("message",) if kind == "error" else
        ("transport",) if kind == "transport" else
        ("counter", "per_cycle", "device") if kind == "nic_errors" else ())
    return ("kind", *place, *gpus, *extra, "start")


def _check_fault(i: int, f: Any, n_nodes: int, gpus: int) -> None:
    where = f"faults[{i}]"
    if not isinstance(f, dict):
        raise ValueError(f"{where} must be an object")
    kind = f.get("kind")
    if kind not in FAULT_KINDS:
        raise ValueError(f"{where}: kind must be one of {', '.join(FAULT_KINDS)}, got {kind!r}")
    allowed = fault_fields(kind)
    # A drift on a fault that has no rate is refused below with its own reason.
    unknown = sorted(set(f) - set(allowed) - ({"drift"} if kind not in RATE_KINDS else set()))
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {', '.join(unknown)} for a {kind} fault; "
                         f"it takes {', '.join(allowed)}")
    if kind == "net_path":
        pair = f.get("nodes")
        if not isinstance(pair, list) or len(pair) != 2:
            raise ValueError(f"{where}: net_path needs \"nodes\": [a, b]")
        if _node_index(where, pair[0], n_nodes) == _node_index(where, pair[1], n_nodes):
            raise ValueError(f"{where}: net_path needs two different nodes")
    else:
        _node_index(where, f.get("node"), n_nodes)
    if kind == "transport":
        _check_transport(where, f, gpus)
    if kind == "nic_errors":
        _check_nic_errors(where, f)
    if kind in ("nvlink", "pcie_only"):
        _check_pair(where, kind, f.get("gpus"), gpus)
    if kind in ("hang", "corrupt", "error"):
        _gpu_index(where, f.get("gpu", 0), gpus)
    if kind == "fallback":
        if f.get("op", "allreduce") not in RING_OPS + ("alltoall", "sendrecv"):
            raise ValueError(f"{where}: fallback op must be an op the sim models, "
                             f"got {f.get('op')!r}")
        if f.get("algo") is not None and f.get("algo") not in ALGOS:
            raise ValueError(f"{where}: fallback algo must be one of {', '.join(ALGOS)} or "
                             f"null (the algorithm NCCL chooses), got {f.get('algo')!r}")
    start = f.get("start", 0)
    if isinstance(start, bool) or not isinstance(start, int) or start < 0:
        raise ValueError(f"{where}: start must be a non-negative integer (the monitoring "
                         f"cycle the fault begins at), got {start!r}")
    if kind in RATE_KINDS:
        factor = f.get("factor", 0.5)
        if isinstance(factor, bool) or not isinstance(factor, int | float) or not 0 < factor <= 1:
            raise ValueError(f"{where}: factor must lie in (0, 1], got {factor!r}")
        drift = f.get("drift", 0)
        if isinstance(drift, bool) or not isinstance(drift, int | float) or not 0 <= drift < 1:
            raise ValueError(f"{where}: drift must be a number in [0, 1), got {drift!r}")
    elif "drift" in f:
        raise ValueError(f"{where}: drift applies to {', '.join(RATE_KINDS)} faults only, "
                         f"not {kind}")


def _check_transport(where: str, f: dict[str, Any], gpus: int) -> None:
    pair = f.get("gpus")
    allowed = PAIR_FALLBACKS if pair is not None else NET_FALLBACKS
    if f.get("transport") not in allowed:
        what = "a GPU pair's" if pair is not None else "a node's inter-node"
        raise ValueError(f"{where}: transport for {what} traffic must be one of "
                         f"{', '.join(allowed)}, got {f.get('transport')!r}")
    if pair is not None:
        _check_pair(where, "transport", pair, gpus,
                    " (or none: the node's inter-node traffic)")


def _check_pair(where: str, kind: str, pair: Any, gpus: int, alternative: str = "") -> None:
    """A fault's ``gpus``: two different GPUs of the node."""
    if not isinstance(pair, list) or len(pair) != 2:
        raise ValueError(f"{where}: {kind} needs \"gpus\": [a, b]{alternative}")
    if _gpu_index(where, pair[0], gpus) == _gpu_index(where, pair[1], gpus):
        raise ValueError(f"{where}: {kind} needs two different gpus")


def _check_nic_errors(where: str, f: dict[str, Any]) -> None:
    from ringwatch.agents.nic_counters import THRESHOLDS

    counters = sorted({t.counter for t in THRESHOLDS if "ib" in t.kinds})
    if f.get("counter") not in counters:
        raise ValueError(f"{where}: nic_errors counter must be one of {', '.join(counters)}, "
                         f"got {f.get('counter')!r}")
    k = f.get("per_cycle")
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"{where}: nic_errors needs \"per_cycle\": a positive integer (how "
                         f"much the counter rises a cycle), got {k!r}")
    device = f.get("device", 0)
    if isinstance(device, bool) or not isinstance(device, int) or device < 0:
        raise ValueError(f"{where}: nic_errors device must be a NIC index (0: mlx5_0), "
                         f"got {device!r}")


def _jobs(entries: Any, n_nodes: int) -> list[SimJob]:
    """A scenario's ``jobs``, each checked; two jobs never hold one node in the same cycle
    (a job holds all of a node's GPUs)."""
    if entries is None:
        return []
    if not isinstance(entries, list):
        raise ValueError("jobs must be a list")
    jobs: list[SimJob] = []
    ids: dict[str, int] = {}
    held: dict[int, list[SimJob]] = {}
    for i, entry in enumerate(entries):
        where = f"jobs[{i}]"
        job = _job(where, i, entry, n_nodes)
        if job.id in ids:
            raise ValueError(f"{where}: id {job.id!r} is already jobs[{ids[job.id]}]'s")
        ids[job.id] = i
        for node in job.nodes:
            for other in held.get(node, ()):
                if _overlap(job, other):
                    raise ValueError(f"{where}: {node_name(node)} is held by {other.id} in "
                                     f"cycle(s) {other.span} too; a job holds all of a "
                                     f"node's GPUs, so two never share one")
            held.setdefault(node, []).append(job)
        jobs.append(job)
    return jobs


def _overlap(a: SimJob, b: SimJob) -> bool:
    return ((a.last is None or b.first <= a.last)
            and (b.last is None or a.first <= b.last))


def _job(where: str, i: int, d: Any, n_nodes: int) -> SimJob:
    if not isinstance(d, dict):
        raise ValueError(f"{where} must be an object")
    unknown = sorted(set(d) - set(JOB_FIELDS), key=str)
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {', '.join(map(str, unknown))}; a job "
                         f"takes {', '.join(JOB_FIELDS)}")
    job_id = d.get("id", f"job-{i}")
    if not isinstance(job_id, str) or not _JOB_ID.fullmatch(job_id):
        raise ValueError(f"{where}: id must be a name of letters, digits and . _ - (at most "
                         f"64, a letter or digit first), got {job_id!r}")
    first, last = _job_cycles(where, d.get("cycles"))
    nvlink, network = _job_traffic(where, d.get("traffic", {}))
    return SimJob(id=job_id, nodes=_job_nodes(where, d.get("nodes"), n_nodes), first=first,
                  last=last, nvlink=nvlink, network=network)


def _job_nodes(where: str, nodes: Any, n_nodes: int) -> tuple[int, ...]:
    """A host list (``node-[010-049]``) or a list of node names: the nodes' indices, each
    once, in the order named."""
    if isinstance(nodes, str):
        try:
            names: list[Any] = expand_hostlist(nodes)
        except ValueError as exc:
            raise ValueError(f"{where}: nodes: {exc}") from None
    elif isinstance(nodes, list):
        names = nodes
    else:
        raise ValueError(f"{where}: nodes must be a host list (\"node-[010-049]\") or a list "
                         f"of node names, got {nodes!r}")
    if not names:
        raise ValueError(f"{where}: nodes names no node")
    return tuple(dict.fromkeys(_node_index(where, name, n_nodes) for name in names))


def _job_cycles(where: str, cycles: Any) -> tuple[int, int | None]:
    """``[first, last]``, cycle numbers from 1, first <= last; absent: every cycle."""
    if cycles is None:
        return 1, None
    ok = (isinstance(cycles, list) and len(cycles) == 2
          and all(isinstance(c, int) and not isinstance(c, bool) and c >= 1 for c in cycles)
          and cycles[0] <= cycles[1])
    if not ok:
        raise ValueError(f"{where}: cycles must be [first, last]: two whole cycle numbers "
                         f"from 1 (the first cycle), first <= last, got {cycles!r}")
    return cycles[0], cycles[1]


def _job_traffic(where: str, traffic: Any) -> tuple[float, float]:
    """``{"nvlink": x, "network": y}``: the share of each link the job's own traffic takes,
    each in [0, 1) and 0 where absent."""
    if not isinstance(traffic, dict):
        raise ValueError(f"{where}: traffic must be an object like {{\"nvlink\": 0.5, "
                         f"\"network\": 0.6}}, got {traffic!r}")
    unknown = sorted(set(traffic) - set(JOB_TRAFFIC), key=str)
    if unknown:
        raise ValueError(f"{where}: unknown traffic kind(s) {', '.join(map(str, unknown))}; "
                         f"a job's traffic takes {', '.join(JOB_TRAFFIC)}")
    shares = []
    for kind in JOB_TRAFFIC:
        value = traffic.get(kind, 0)
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < 1:
            raise ValueError(f"{where}: traffic {kind} must be a number in [0, 1) (the share "
                             f"of the link the job takes), got {value!r}")
        shares.append(float(value))
    return shares[0], shares[1]


def fault_factor(f: dict[str, Any], cycle: int = 0) -> float:
    """A rate fault's factor at monitoring cycle ``cycle`` (0-based): ``factor`` less
    ``drift`` per cycle, never below DRIFT_FLOOR; a fault without drift keeps its factor."""
    factor = float(f.get("factor", 0.5))
    drift = float(f.get("drift", 0))
    if drift == 0:
        return factor
    return max(factor - drift * cycle, DRIFT_FLOOR)


class Fabric:
    """Link rates of the whole fleet as arrays: no per-rank objects on the hot path.

    ``cycle`` is the monitoring cycle (0-based) whose drifting faults and running jobs it
    models: a job's traffic leaves a probe ``1 - traffic`` of each link it loads, on top of
    any fault there. The per-link variation depends on the seed alone, so it is the same at
    every cycle."""

    def __init__(self, s: Scenario, cycle: int = 0) -> None:
        hw = preset(s.gpu)
        self.hw = hw
        self.n, self.g = s.nodes, s.gpus_per_node
        self.nvlink_gbs = s.nvlink_gbs or hw.nvlink_gbs
        self.net_gbs = s.net_gbs or hw.net_gbs
        self.variation = s.variation
        self.seed = s.seed
        self.cycle = cycle
        rng = np.random.default_rng([s.seed, 0])
        v = s.variation
        upper = np.triu(rng.uniform(1 - v, 1 + v, (self.n, self.g, self.g)), 1)
        self.pair = self.nvlink_gbs * (upper + np.transpose(upper, (0, 2, 1)))
        self.pcie = np.zeros((self.n, self.g, self.g), dtype=bool)
        self.nic = self.g * self.net_gbs * rng.uniform(1 - v, 1 + v, self.n)
        self.path_fault: dict[tuple[int, int], float] = {}
        self.hung: set[tuple[int, int]] = set()
        self.corrupt: set[tuple[int, int]] = set()
        # Ranks whose collective raises (a CUDA OOM, an NCCL error): probe_error, not a hang.
        self.errored: dict[tuple[int, int], str] = {}
        # (node, op, algo) -> factor: a node whose traffic of one op, under one algorithm
        # (None: the one NCCL chooses), falls back to a slower protocol or path.
        self.fallback: dict[tuple[int, str, str | None], float] = {}
        # Transports NCCL is modeled to take instead of the fabric: a node's inter-node
        # traffic, a GPU pair's (node, a, b) with a < b. Bandwidth is the rate faults' to model.
        self.net_transport: dict[int, str] = {}
        self.pair_transport: dict[tuple[int, int, int], str] = {}
        # node -> [(counter, per_cycle, device)]: NIC error counters rising by per_cycle
        # between two reads whenever traffic runs (SimBackend.counters).
        self.nic_errors: dict[int, list[tuple[str, int, int]]] = {}
        # Group key -> the transports NCCL would log for it (SimBackend._transport).
        self.transports: dict[tuple[str, ...], str] = {}
        for f in s.faults:
            self._apply(f)
        # The nodes with a PCIe pair or a pair's transport fault: only theirs are looked up
        # pair by pair (SimBackend._transport; a union of thousands of nodes runs often).
        self.odd_pair_nodes = {int(n) for n in np.nonzero(self.pcie.any(axis=(1, 2)))[0]}
        self.odd_pair_nodes |= {n for n, _, _ in self.pair_transport}
        # The jobs running this cycle, and the one holding each node.
        self.jobs = s.running(cycle)
        self.job_of: dict[int, SimJob] = {}
        for job in self.jobs:
            self._occupy(job)
        # Group key -> why its measurements are contended this cycle (SimBackend._contended).
        self.contended: dict[tuple[str, ...], str | None] = {}
        idx = np.arange(self.g)
        self.pair[:, idx, idx] = np.inf
        # Slowest pair of each whole node: what its all-to-all waits for.
        self.node_min_pair = self.pair.min(axis=(1, 2)) if self.g > 1 else np.full(self.n, np.inf)
        # Every link alike (the nominal fabric): a group's times follow from its shape alone.
        self.uniform = (self.variation == 0 and not self.path_fault and not self.fallback
                        and _alike(self.pair[:, ~np.eye(self.g, dtype=bool)])
                        and _alike(self.nic))

    def _apply(self, f: dict[str, Any]) -> None:
        if self.cycle < f.get("start", 0):
            return  # not begun yet: the fleet is healthy there
        kind = f["kind"]
        if kind == "net_path":
            a, b = sorted(int(x[5:]) for x in f["nodes"])
            self.path_fault[(a, b)] = self.path_fault.get((a, b), 1.0) * fault_factor(f, self.cycle)
            return
        node = int(f["node"][5:])
        if kind == "transport":
            if f.get("gpus") is not None:
                a, b = sorted(int(g) for g in f["gpus"])
                self.pair_transport[(node, a, b)] = PAIR_FALLBACKS[f["transport"]]
            else:
                self.net_transport[node] = NET_FALLBACKS[f["transport"]]
            return
        if kind == "nic_errors":
            self.nic_errors.setdefault(node, []).append(
                (str(f["counter"]), int(f["per_cycle"]), int(f.get("device", 0))))
            return
        if kind == "fallback":
            key = (node, str(f.get("op", "allreduce")), f.get("algo"))
            self.fallback[key] = self.fallback.get(key, 1.0) * fault_factor(f, self.cycle)
            return
        if kind == "nic":
            self.nic[node] *= fault_factor(f, self.cycle)
        elif kind in ("nvlink", "pcie_only"):
            a, b = f["gpus"]
            if kind == "pcie_only":
                # The pair's rate becomes PCIe's, with this pair's own variation kept.
                scale = self.hw.pcie_gbs / self.nvlink_gbs
                self.pcie[node, a, b] = self.pcie[node, b, a] = True
            else:
                scale = fault_factor(f, self.cycle)
            self.pair[node, a, b] *= scale
            self.pair[node, b, a] = self.pair[node, a, b]
        elif kind == "hang":
            self.hung.add((node, int(f.get("gpu", 0))))
        elif kind == "corrupt":
            self.corrupt.add((node, int(f.get("gpu", 0))))
        elif kind == "error":
            self.errored[(node, int(f.get("gpu", 0)))] = str(
                f.get("message", "modeled error: the rank's collective raised"))

    def _occupy(self, job: SimJob) -> None:
        """A running job's traffic takes its share of every NVLink pair and NIC of its
        nodes: a probe there gets the rest, times whatever a fault leaves."""
        self.job_of.update(dict.fromkeys(job.nodes, job))
        rows = np.array(job.nodes, dtype=np.int64)
        if job.nvlink:
            self.pair[rows] *= 1 - job.nvlink
        if job.network:
            self.nic[rows] *= 1 - job.network

    def path_mult(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        """Variation times fault factor of the paths a[i] <-> b[i] (symmetric)."""
        lo, hi = np.minimum(a, b).astype(np.uint64), np.maximum(a, b).astype(np.uint64)
        key = (np.uint64(self.seed & 0xFFFFFFFF) << np.uint64(40)) ^ (lo << np.uint64(20)) ^ hi
        u = (_splitmix(key) >> np.uint64(11)).astype(np.float64) / float(1 << 53)
        mult = 1 - self.variation + 2 * self.variation * u
        for (x, y), factor in self.path_fault.items():
            mult[(lo == x) & (hi == y)] *= factor
        return mult

    def path_mult_one(self, a: int, b: int) -> float:
        """``path_mult`` of the one path a <-> b, bit for bit, for the small groups."""
        lo, hi = (a, b) if a < b else (b, a)
        key = (((self.seed & 0xFFFFFFFF) << 40) ^ (lo << 20) ^ hi) & _U64
        u = float(_splitmix_int(key) >> 11) / float(1 << 53)
        mult = 1 - self.variation + 2 * self.variation * u
        factor = self.path_fault.get((lo, hi))
        return mult if factor is None else mult * factor


@dataclass
class _Arrays:
    """One group's ranks as arrays, for the vectorized model of the large groups."""

    nodes: np.ndarray  # node index per rank, in ring order
    local: np.ndarray  # local GPU index per rank
    uniq: np.ndarray  # distinct nodes of the group
    counts: np.ndarray  # ranks of each distinct node in the group


class _Group:
    """One group's ranks as lists (node and local GPU index per rank in ring order, the
    distinct nodes and each one's rank count), and as arrays when a large group needs them.
    ``key`` is its members: what its modeled op times are kept under."""

    def __init__(self, key: tuple[str, ...], nodes: list[int], local: list[int]) -> None:
        self.key, self.nodes, self.local, self.n = key, nodes, local, len(nodes)
        self.by_node: dict[int, list[int]] = {}
        for node, gpu in zip(nodes, local, strict=True):
            self.by_node.setdefault(node, []).append(gpu)
        self.uniq = sorted(self.by_node)
        self.counts = [len(self.by_node[x]) for x in self.uniq]
        # An empty group takes the arrays' path, which refuses it as it always did.
        self.small = 0 < self.n <= SMALL_RANKS and len(self.uniq) <= SMALL_NODES

    @cached_property
    def ranks(self) -> list[tuple[int, int]]:
        return list(zip(self.nodes, self.local, strict=True))

    @cached_property
    def shape(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Where its ranks sit, nodes by their order in the group: all that a uniform
        fabric's times depend on."""
        order = {node: k for k, node in enumerate(self.uniq)}
        return tuple(order[x] for x in self.nodes), tuple(self.local)

    @cached_property
    def arrays(self) -> _Arrays:
        nodes = np.array(self.nodes, dtype=np.int64)
        return _Arrays(nodes, np.array(self.local, dtype=np.int64),
                       np.array(self.uniq, dtype=np.int64),
                       np.array(self.counts, dtype=np.int64))


class CostModel:
    """Alpha-beta time of one collective on a group, from a Fabric's link rates.

    The fabric does not change under a model (a new cycle's faults build a new one), so each
    group's op time is worked out once. Small groups are modeled over the rates as lists,
    large ones over the arrays; both give the same floats."""

    def __init__(self, fabric: Fabric) -> None:
        self.f = fabric
        self._op_times: dict[tuple[Any, ...], tuple[float, float]] = {}

    @cached_property
    def _pair(self) -> list[list[list[float]]]:
        return self.f.pair.tolist()  # type: ignore[no-any-return]

    @cached_property
    def _nic(self) -> list[float]:
        return self.f.nic.tolist()  # type: ignore[no-any-return]

    @cached_property
    def _node_min_pair(self) -> list[float]:
        return self.f.node_min_pair.tolist()  # type: ignore[no-any-return]

    def ring_bw(self, grp: _Group) -> float:
        """A ring runs at its slowest edge. Each node's NICs carry its share of channels:
        one NIC per GPU (rails), so a node's cross edge has count/g of its NIC rate."""
        if grp.small:
            return self._ring_bw_small(grp)
        f, arr = self.f, grp.arrays
        a_n, a_l = arr.nodes, arr.local
        b_n, b_l = np.roll(a_n, -1), np.roll(a_l, -1)
        same = a_n == b_n
        bw = np.empty(grp.n)
        bw[same] = f.pair[a_n[same], a_l[same], b_l[same]]
        cross = ~same
        if cross.any():
            share = dict(zip(grp.uniq, (arr.counts / f.g).tolist(), strict=True))
            x, y = a_n[cross], b_n[cross]
            sx = np.array([share[i] for i in x.tolist()])
            sy = np.array([share[i] for i in y.tolist()])
            bw[cross] = np.minimum(f.nic[x] * sx, f.nic[y] * sy) * f.path_mult(x, y)
        return float(bw.min())

    def _ring_bw_small(self, grp: _Group) -> float:
        f, pair, nic = self.f, self._pair, self._nic
        share = {node: count / f.g for node, count in zip(grp.uniq, grp.counts, strict=True)}
        nodes, local = grp.nodes, grp.local
        worst = math.inf
        prev_n, prev_l = nodes[-1], local[-1]
        for a_n, a_l in zip(nodes, local, strict=True):
            if prev_n == a_n:
                bw = pair[a_n][prev_l][a_l]
            else:
                bw = (min(nic[prev_n] * share[prev_n], nic[a_n] * share[a_n])
                      * f.path_mult_one(prev_n, a_n))
            worst = min(worst, bw)
            prev_n, prev_l = a_n, a_l
        return worst

    def alltoall_time_per_byte(self, grp: _Group) -> float:
        """Seconds per byte of per-rank buffer: the slowest flow decides.

        NVLink: each rank sends 1/n of its buffer to each local peer over that pair.
        Network: a node's NICs carry count * (n - count) / n of a buffer; a flow between
        two nodes ends when the busier NIC of the two has drained, slowed by its path.
        """
        if grp.small:
            return self._alltoall_small(grp)
        f, n, arr = self.f, grp.n, grp.arrays
        worst = 0.0
        shared = arr.counts >= 2
        if shared.any():
            slowest = f.node_min_pair[arr.uniq]
            for k in np.flatnonzero(shared & (arr.counts != f.g)).tolist():
                node = grp.uniq[k]
                loc = np.array(grp.by_node[node])
                slowest[k] = f.pair[node][np.ix_(loc, loc)].min()
            nvlink = (arr.counts[shared] - 1) / n / (slowest[shared] * 1e9)
            worst = max(worst, float(nvlink.max()))
        if arr.uniq.size > 1:
            nic = f.nic[arr.uniq] * arr.counts / f.g
            drain = arr.counts * (n - arr.counts) / n / (nic * 1e9)
            worst = max(worst, self._slowest_flow(grp, drain))
        return worst

    def _slowest_flow(self, grp: _Group, drain: np.ndarray) -> float:
        """The slowest flow between two of a large group's nodes, max(drain[i], drain[j]) /
        path_mult over the node pairs, bit for bit as the whole pairwise table has it but
        from the pairs that can reach it: an unfaulted path's multiplier is at least
        1 - variation, so a pair whose busier node stays at or under the busiest node's
        slowest flow even there is skipped. Faulted paths are always worked out."""
        f, uniq, k, v = self.f, grp.arrays.uniq, len(grp.uniq), self.f.variation

        def flows(i: np.ndarray, j: np.ndarray) -> float:
            return float((np.maximum(drain[i], drain[j]) / f.path_mult(uniq[i], uniq[j])).max())

        if not (0 <= v < 1 and all(0 < x <= 1 for x in f.path_fault.values())
                and np.isfinite(drain).all() and drain.min() > 0):
            return flows(*np.triu_indices(k, 1))
        top = int(drain.argmax())
        slowest = flows(np.full(k - 1, top), np.delete(np.arange(k), top))
        heavy = np.flatnonzero(drain / (1 - v) > slowest)
        pos = {node: x for x, node in enumerate(grp.uniq)}
        faulted = [(pos[a], pos[b]) for a, b in f.path_fault if a in pos and b in pos]
        i = np.concatenate([np.repeat(heavy, k), np.array([a for a, _ in faulted], np.int64)])
        j = np.concatenate([np.tile(np.arange(k), heavy.size),
                            np.array([b for _, b in faulted], np.int64)])
        keep = i != j
        return max(slowest, flows(i[keep], j[keep])) if keep.any() else slowest

    def _alltoall_small(self, grp: _Group) -> float:
        f, n, pair, nic = self.f, grp.n, self._pair, self._nic
        worst = 0.0
        for node, count in zip(grp.uniq, grp.counts, strict=True):
            if count < 2:
                continue
            if count == f.g:
                slowest = self._node_min_pair[node]
            else:
                loc, rows = grp.by_node[node], pair[node]
                slowest = min(rows[a][b] for a in loc for b in loc)
            worst = max(worst, (count - 1) / n / (slowest * 1e9))
        drain = [c * (n - c) / n / (nic[node] * c / f.g * 1e9)
                 for node, c in zip(grp.uniq, grp.counts, strict=True)]
        for i in range(len(drain)):
            for j in range(i + 1, len(drain)):
                flow = max(drain[i], drain[j]) / f.path_mult_one(grp.uniq[i], grp.uniq[j])
                worst = max(worst, flow)
        return worst

    def tree_bw(self, grp: _Group) -> float:
        """A tree runs at its slowest edge too, but its edges are not the ring's: inside a
        node a chain over consecutive local ranks, across nodes a binary tree over the
        group's nodes in order (parent (i - 1) // 2), at ``TREE_BW_SHARE`` of the rate."""
        f, pair, nic = self.f, self._pair, self._nic
        bw = [math.inf]
        for node in grp.uniq:
            loc = sorted(grp.by_node[node])
            if len(loc) > 1:
                rows = pair[node]
                bw.append(min(rows[a][b] for a, b in zip(loc, loc[1:], strict=False)))
        if len(grp.uniq) > 1:
            share = [count / f.g for count in grp.counts]
            if grp.small:
                for c in range(1, len(grp.uniq)):
                    p = (c - 1) // 2
                    x, y = grp.uniq[c], grp.uniq[p]
                    bw.append(min(nic[x] * share[c], nic[y] * share[p])
                              * f.path_mult_one(x, y))
            else:
                arr, sh = grp.arrays, np.array(share)
                child = np.arange(1, arr.uniq.size)
                parent = (child - 1) // 2
                xs, ys = arr.uniq[child], arr.uniq[parent]
                link = np.minimum(f.nic[xs] * sh[child], f.nic[ys] * sh[parent])
                bw.append(float((link * f.path_mult(xs, ys)).min()))
        return TREE_BW_SHARE * min(bw)

    def latency(self, op: str, grp: _Group, algo: str | None = None) -> float:
        """Small-message cost: NCCL moves to trees at scale, so steps grow with log n; a
        ring told to stay a ring takes n - 1 steps each way."""
        alpha = self.f.hw.alpha_net_s if len(grp.uniq) > 1 else self.f.hw.alpha_nvlink_s
        steps = math.ceil(math.log2(max(grp.n, 2)))
        if op == "allreduce":
            return 2 * (grp.n - 1) * alpha if algo == "ring" else 2 * steps * alpha
        if op == "alltoall":
            return steps * alpha + 2e-7 * (grp.n - 1)
        return steps * alpha

    def op_time(self, op: str, grp: _Group, algo: str | None = None) -> tuple[float, float]:
        """(latency seconds, seconds per byte of size_bytes) of one iteration; ``algo``
        ("ring", "tree") for AllReduce on a communicator told to use it, None for NCCL's
        own choice."""
        key = (grp.shape if self.f.uniform else grp.key, op, algo)
        times = self._op_times.get(key)
        if times is None:
            times = self._op_time(op, grp, algo)
            if len(self._op_times) >= CACHE_LIMIT:
                self._op_times.clear()
            self._op_times[key] = times
        return times

    def _op_time(self, op: str, grp: _Group, algo: str | None) -> tuple[float, float]:
        n = grp.n
        slow = self.fallback_factor(op, grp, algo)
        if op == "alltoall":
            return self.latency(op, grp), self.alltoall_time_per_byte(grp) / slow
        if op in RING_OPS or op == "sendrecv":
            bytes_per_byte = 1.0 if op == "sendrecv" else busbw_factor(op, n)
            bw = self.tree_bw(grp) if op == "allreduce" and algo == "tree" else self.ring_bw(grp)
            return self.latency(op, grp, algo), bytes_per_byte / (bw * 1e9) / slow
        raise ValueError(f"the sim has no model for op {op!r}")

    def fallback_factor(self, op: str, grp: _Group, algo: str | None) -> float:
        """The slowest fallback of any node of the group for this op and algorithm."""
        if not self.f.fallback:
            return 1.0
        nodes = set(grp.uniq)
        factors = [v for (node, o, a), v in self.f.fallback.items()
                   if node in nodes and o == op and a == algo]
        return min(factors, default=1.0)


class SimBackend(BackendDefaults):
    """ProbeBackend over a modeled fabric; every result is labelled backend "sim". Its
    faults are the scenario's (none injected), and it holds nothing to read or release."""

    name = "sim"
    # Modeled groups finish well under a second; a hung one is given up after this.
    preflight_deadline_s = 5.0

    def __init__(self, scenario: Scenario | dict[str, Any]) -> None:
        self.scenario = scenario if isinstance(scenario, Scenario) else Scenario.from_dict(scenario)
        self.fabric = Fabric(self.scenario)
        self.model = CostModel(self.fabric)
        self._nominal = CostModel(_nominal_fabric(self.scenario))
        # Cycle 0 until begin_cycle says otherwise. SeedSequence ignores trailing zeros, so
        # this is the noise stream begin_cycle(0) draws too.
        self._cycle = 0
        self._noise_rng = np.random.default_rng([self.scenario.seed, 1])
        # Faults whose effect changes from cycle to cycle: drifting, or beginning later.
        self._cycle_dependent = any(f.get("drift", 0) or f.get("start", 0)
                                    for f in self.scenario.faults)
        self._fabric_key = self._fabric_key_at(0)
        self._index = {node_name(i): i for i in range(self.scenario.nodes)}
        self._expected_cache: dict[tuple[Any, ...], float] = {}
        self._groups: dict[tuple[str, ...], _Group] = {}
        self._places: dict[str, tuple[int, int]] = {}
        # The groups of the round before that ran without a hang or an error: kept formed.
        self._kept: set[CommKey] = set()
        self._ranks: list[RankInfo] | None = None
        # Modeled NIC error counters, (node, device, counter) -> count; raised once between
        # two reads, by the first round after a read (the traffic is what raises them).
        self._nic_counts: dict[tuple[int, int, str], int] = {}
        self._errors_counted = False
        self._counter_reads = 0

    @classmethod
    def from_file(cls, path: str | Path) -> SimBackend:
        try:
            data = json.loads(Path(path).read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"not JSON: {exc}") from exc
        return cls(data)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SimBackend:
        return cls(d)

    def __enter__(self) -> SimBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def begin_cycle(self, index: int) -> None:
        """Model monitoring cycle ``index``: drifting faults at that cycle's factor, faults
        that have not begun yet absent, and that cycle's own measurement noise (the same
        index always draws the same noise)."""
        if isinstance(index, bool) or not isinstance(index, int) or index < 0:
            raise ValueError(f"cycle index must be a non-negative integer, got {index!r}")
        key = self._fabric_key_at(index)
        if key != self._fabric_key:
            # Variation is seeded apart from the faults and jobs: only their rates move. A
            # new fabric brings a new cost model, so no op time (nor contention) of another
            # cycle's faults or jobs is served from a cache.
            self.fabric = Fabric(self.scenario, cycle=index)
            self.model = CostModel(self.fabric)
            self._fabric_key = key
        self._cycle = index
        self._noise_rng = np.random.default_rng([self.scenario.seed, 1, index])
        self._errors_counted = False

    def _fabric_key_at(self, index: int) -> tuple[int | None, tuple[str, ...]]:
        """What a cycle's fabric depends on: the cycle where faults drift or begin late, and
        the jobs running in it."""
        return (index if self._cycle_dependent else None,
                tuple(job.id for job in self.scenario.running(index)))

    def running_jobs(self) -> tuple[SimJob, ...]:
        """The scenario's jobs running in the current cycle (the first until begin_cycle)."""
        return self.fabric.jobs

    def busy_nodes(self) -> dict[str, Occupant]:
        """The sim's occupancy source: every node a running job holds, with all its GPUs."""
        gpus = tuple(range(self.fabric.g))
        return {node_name(n): Occupant(source="sim", job=job.id, gpus=gpus, state="running")
                for n, job in sorted(self.fabric.job_of.items())}

    def traffic(self, name: str) -> Traffic:
        """What rank ``name``'s counters read beside a group this cycle: the traffic of the
        job on its node (NVLink: the job's share of the GPU's NVLink rate; network: of its
        node's NICs), zeros on an idle node."""
        node, _ = split_member(name)
        return self._traffic(self._index[node], name)

    def _traffic(self, node: int, name: str) -> Traffic:
        f = self.fabric
        job = f.job_of.get(node)
        if job is None:
            return Traffic(name, TRAFFIC_WINDOW_S, nvlink_gbs=0.0, net_gbs=0.0, gpu_util=0.0,
                           processes=0)
        return Traffic(name, TRAFFIC_WINDOW_S, nvlink_gbs=job.nvlink * f.nvlink_gbs,
                       net_gbs=job.network * f.g * f.net_gbs, gpu_util=JOB_GPU_UTIL,
                       processes=1)

    def _contended(self, grp: _Group) -> str | None:
        """agents.contention's verdict on the group's ranks' traffic, kept per group for the
        fabric (so per cycle's running jobs). A node's ranks read alike, so its first rank in
        the group stands for all of them: the verdict, busiest rank named, is the one every
        rank's reading gives."""
        f = self.fabric
        if not f.job_of:
            return None
        if grp.key in f.contended:
            return f.contended[grp.key]
        found = None
        if not f.job_of.keys().isdisjoint(grp.by_node):
            first: dict[int, str] = {}
            for name, node in zip(grp.key, grp.nodes, strict=True):
                first.setdefault(node, name)
            found = contention(self._traffic(node, name) for node, name in first.items())
        if len(f.contended) >= CACHE_LIMIT:
            f.contended.clear()
        f.contended[grp.key] = found
        return found

    def ranks(self) -> list[RankInfo]:
        if self._ranks is None:
            self._ranks = [self._rank(i, g) for i in range(self.fabric.n)
                           for g in range(self.fabric.g)]
        return self._ranks

    def _rank(self, i: int, g: int) -> RankInfo:
        f = self.fabric
        odd = i in f.odd_pair_nodes
        p2p = {str(p): (PCIE_WORD if odd and f.pcie[i, g, p] else f.hw.nvlink_word)
               for p in range(f.g) if p != g}
        return RankInfo(node=node_name(i), local_index=g, hostname=node_name(i),
                        gpu_uuid=f"GPU-sim-{i:05d}-{g}", pci_bus_id=f"0000:{0x18 + g:02x}:00.0",
                        numa_node=g * 2 // max(f.g, 1), gpu_name=f.hw.name,
                        telemetry={"p2p": p2p, "sim": True}, profile=f.hw.name)

    def _group(self, members: tuple[str, ...] | list[str]) -> _Group:
        """The group of these members, parsed once: the planner asks the same groups again."""
        key = tuple(members)
        grp = self._groups.get(key)
        if grp is None:
            places, nodes, local = self._places, [], []
            for name in key:
                place = places.get(name)
                if place is None:
                    node, idx = split_member(name)
                    place = self._index[node], idx
                    # Every rank of the fleet fits: at 16384 x 8 the cache was cleared again
                    # and again, and every group's names parsed anew.
                    if len(places) >= max(CACHE_LIMIT, self.fabric.n * self.fabric.g):
                        places.clear()
                    places[name] = place
                nodes.append(place[0])
                local.append(place[1])
            grp = _Group(key, nodes, local)
            if len(self._groups) >= CACHE_LIMIT:
                self._groups.clear()
            self._groups[key] = grp
        return grp

    def run_round(self, groups: list[GroupSpec]) -> RoundResult:
        started = time.perf_counter()
        out = RoundResult()
        if self.fabric.nic_errors and not self._errors_counted:
            # The traffic since the last read is what raises the modeled error counters.
            self._errors_counted = True
            for node, faults in self.fabric.nic_errors.items():
                for counter, per_cycle, device in faults:
                    key = (node, device, counter)
                    self._nic_counts[key] = self._nic_counts.get(key, 0) + per_cycle
        kept: set[CommKey] = set()
        for spec in groups:
            comm = spec.comm_key
            # Kept formed from the round before, as the Ray backend's ranks keep it: no
            # setup, and a short warm-up.
            formed = comm not in self._kept
            found = len(out.findings)
            seconds = self._run_group(spec, out, formed=formed)
            out.fabric_time_s = max(out.fabric_time_s, seconds)
            if not any(f.kind in ("hang", "probe_error") for f in out.findings[found:]):
                kept.add(comm)
        self._kept = kept
        out.wall_time_s = time.perf_counter() - started
        return out

    def release(self) -> float:
        """The groups kept formed between rounds end (nothing else is held)."""
        self._kept = set()
        return 0.0

    def counters(self) -> dict[str, dict[str, Any]]:
        """The modeled NIC ports of nodes whose error counters a scenario makes rise (under
        each node's first rank: a node's NICs are read once), as agents.nic_counters
        snapshots COUNTER_INTERVAL_S of modeled time after the last read; elsewhere the
        counters stand still, which says nothing either way. Between two reads, the first
        round raises each faulted counter by its ``per_cycle``: any check, a monitoring
        cycle's or a preflight's (served between cycles or run alone), reads its rise at
        the rate a cycle does."""
        f = self.fabric
        if not f.nic_errors:
            return {}
        self._counter_reads += 1
        self._errors_counted = False  # a read opens the next interval
        at = COUNTER_INTERVAL_S * self._counter_reads
        out: dict[str, dict[str, Any]] = {}
        for node, faults in sorted(f.nic_errors.items()):
            ports = []
            for device in sorted({d for _, _, d in faults}):
                counts = {c: self._nic_counts.get((node, device, c), 0) for c, _, d in faults
                          if d == device}
                ports.append({"device": f"mlx5_{device}", "port": 1, "kind": "ib",
                              "link_layer": "InfiniBand", "state": "ACTIVE",
                              "phys_state": "LinkUp", "rate_gbps": f.net_gbs * 8,
                              "counters": counts, "hw_counters": {}, "unreadable": [],
                              "read_at": at})
            out[member(node_name(node), 0)] = {"nic": ports}
        return out

    def _run_group(self, spec: GroupSpec, out: RoundResult, *, formed: bool = True) -> float:
        grp = self._group(spec.members)
        f = self.fabric
        corrupt: list[tuple[int, int]] = []
        if f.hung or f.errored or f.corrupt:
            ranks = grp.ranks
            hung = [r for r in ranks if r in f.hung]
            if hung:
                # The others wait at the collective until the group's deadline.
                out.findings += [Finding(kind="hang", node=node_name(n), gpu=g,
                                         detail={"scope": spec.scope, "world_size": grp.n})
                                 for n, g in hung]
                return spec.deadline_s
            errored = [r for r in ranks if r in f.errored]
            if errored:
                # The failing rank aborts the group; its peers see the collective break at once.
                out.findings += [Finding(kind="probe_error", node=node_name(n), gpu=g, detail={
                    "scope": spec.scope, "world_size": grp.n, "origin": "local",
                    "stage": f"{spec.ops[0]}/{spec.sizes[0]}", "error": f.errored[(n, g)]})
                    for n, g in errored]
                return SETUP_S
            corrupt = [r for r in ranks if r in f.corrupt]
            out.findings += [Finding(kind="data_corruption", node=node_name(n), gpu=g,
                                     detail={"scope": spec.scope}) for n, g in corrupt]
        if f.net_transport or f.pair_transport:
            out.findings += [x for x in self._transports(spec, grp) if x not in out.findings]
        seconds = SETUP_S + SETUP_PER_DOUBLING_S * math.log2(max(grp.n, 2)) if formed else 0.0
        warmup = spec.warmup if formed else spec.kept_warmup
        repeats = warmup + spec.iters
        contended = self._contended(grp)
        for op in spec.ops:
            lat, per_byte = self.model.op_time(op, grp, spec.algo)
            for size in spec.sizes:
                t = (lat + per_byte * size) * self._noise()
                seconds += repeats * t
                m = self._measurement(spec, op, size, t, grp, bool(corrupt), warmup)
                m.contended = contended
                out.measurements.append(m)
        return seconds

    def _transports(self, spec: GroupSpec, grp: _Group) -> list[Finding]:
        """What NCCL's log would show this group took instead of the fabric: a node's
        inter-node connections over sockets while its IB ports are up, a GPU pair over SHM or
        PCIe while NVLink joins them (agents.transport judges the real log alike)."""
        f = self.fabric
        nodes = set(grp.nodes)
        found = []
        if len(nodes) > 1:
            found += [transport_finding(node_name(n), seen, "net_ib", spec.scope,
                                        devices=[f"mlx5_{g}" for g in range(f.g)])
                      for n, seen in sorted(f.net_transport.items()) if n in nodes]
        ranks = set(grp.ranks)
        found += [transport_finding(node_name(n), seen, "p2p_nvlink", spec.scope, gpus=[a, b])
                  for (n, a, b), seen in sorted(f.pair_transport.items())
                  if (n, a) in ranks and (n, b) in ranks]
        return found

    def _noise(self) -> float:
        sigma = self.scenario.noise
        if sigma == 0:
            return 1.0
        z = min(max(self._noise_rng.standard_normal(), -NOISE_CLIP), NOISE_CLIP)
        return math.exp(sigma * z)

    def _measurement(self, spec: GroupSpec, op: str, size: int, t: float, grp: _Group,
                     corrupt: bool, warmup: int) -> Measurement:
        algbw = size / t / 1e9
        m = Measurement(op=op, scope=spec.scope, members=list(spec.members), size_bytes=size,
                        dtype=spec.dtype, warmup=warmup, iters=spec.iters,
                        time_us=t * 1e6, algbw_gbs=algbw,
                        busbw_gbs=algbw * busbw_factor(op, grp.n),
                        wrong=max(1, size // 4096) if corrupt else 0,
                        redop=redop_for(op, spec.redop), timing=TIMING_MODEL,
                        algo=spec.algo if op == "allreduce" else None)
        m.preset_gbs = self._expected(m.op, m.size_bytes, grp, m.algo)
        m.transport = self._transport(grp)
        return m

    def _transport(self, grp: _Group) -> str:
        """The transports NCCL would log for this group, as a real probe records them: NVLink
        P2P between GPUs of a node (PCIe for a pcie_only pair, SHM or PCIe for a pair's
        transport fault), IB between nodes (sockets out of a node whose transport fault says
        so)."""
        f = self.fabric
        taken = f.transports.get(grp.key)
        if taken is None:
            seen: set[str] = set()
            by_node: dict[int, list[int]] = {}
            for n, g in grp.ranks:
                by_node.setdefault(n, []).append(g)
            for n, gpus in by_node.items():
                if len(gpus) < 2:
                    continue
                seen.add("p2p_nvlink")
                if n not in f.odd_pair_nodes:
                    continue
                pairs = [(a, b) for a in gpus for b in gpus if a < b]
                seen |= {"p2p_pcie" for a, b in pairs if f.pcie[n, a, b]}
                seen |= {t for (m, a, b), t in f.pair_transport.items()
                         if m == n and a in gpus and b in gpus}
            if len(by_node) > 1:
                seen.add("net_ib")
                seen |= {t for n, t in f.net_transport.items() if n in by_node}
            taken = ",".join(sorted(seen))
            if len(f.transports) >= CACHE_LIMIT:
                f.transports.clear()
            f.transports[grp.key] = taken
        return taken

    def expected_busbw(self, m: Measurement) -> float | None:
        """The hardware preset for this measurement: fault-free, variation-free links."""
        members = tuple(m.members)
        found = self._expected_cache.get((m.op, m.size_bytes, members, m.algo))
        if found is not None:
            return found
        return self._expected(m.op, m.size_bytes, self._group(members), m.algo)

    def _expected(self, op: str, size: int, grp: _Group, algo: str | None) -> float:
        key = (op, size, grp.key, algo)
        if key not in self._expected_cache:
            lat, per_byte = self._nominal.op_time(op, grp, algo)
            t = lat + per_byte * size
            self._expected_cache[key] = size / t / 1e9 * busbw_factor(op, grp.n)
        return self._expected_cache[key]


def _nominal_fabric(s: Scenario) -> Fabric:
    """The named hardware profile with every link at its rated rate: no variation, no
    faults (so no drift at any cycle), and none of the scenario's own link rates (a fleet
    built slower than its hardware is rated, `nvlink_gbs` or `net_gbs` below the
    profile's, must look slow)."""
    return Fabric(Scenario(nodes=s.nodes, gpus_per_node=s.gpus_per_node, gpu=s.gpu,
                           noise=0.0, variation=0.0, seed=s.seed, faults=[]))
