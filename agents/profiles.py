"""Hardware profiles: what healthy hardware of a kind reaches, so a fleet that is slow
everywhere alike is still found.

A profile names a node type (GPUs, NVLinks per GPU, NICs and their rate) and its rated
busbw per op inside a node (NVLink) and across nodes (the network), in nccl-tests' busbw
(GB/s). The sources of every figure are in docs/profiles.md. A site file
(``RINGWATCH_PROFILES_FILE``, JSON: ``{"NAME": {field: value, ...}}``) adds profiles or
overrides fields of the built-in ones; ``RINGWATCH_PROFILE`` forces one for every node.

A node's profile is detected from what its agents see (the NVML GPU name, or the machine's
instance type), or configured; its NVLink count and NIC rates are then checked against it
(services.analyzer.inventory).
"""

from __future__ import annotations

import functools
import json
import os
import re
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from ringwatch.agents.groups import node_of

OPS = ("allreduce", "allgather", "reducescatter", "alltoall", "sendrecv")
# Below this size a collective is latency-bound: no rated figure applies.
MIN_RATED_BYTES = 64 << 20


@dataclass(frozen=True)
class Profile:
    name: str
    # Substrings of the NVML GPU name that identify it (case-insensitive).
    gpu_match: tuple[str, ...]
    gpus_per_node: int
    nvlinks_per_gpu: int
    nics_per_node: int
    # Line rate of one NIC, Gb/s (400 for NDR InfiniBand, 100 for an EFA v2 device).
    nic_gbps: float
    # Rated busbw inside one node over NVLink, per op (GB/s, nccl-tests, 8 GPUs).
    nvlink_busbw: dict[str, float] = field(default_factory=dict)
    # Rated busbw across nodes per NIC rail, per op (GB/s): one rank per node reaches it;
    # ``rated_busbw`` scales it to the group's shape.
    network_busbw: dict[str, float] = field(default_factory=dict)
    # Substrings of the instance type or product name (e.g. "p5.48xlarge"), if any.
    instance_match: tuple[str, ...] = ()
    # GPUs in one NVLink domain where it spans nodes: 72 on an NVL72 rack, whose nodes are
    # its 18 compute trays of 4 GPUs; 0 where NVLink ends at the node. A group on several
    # trays of one rack rides NVLink, but ``rated_busbw`` rates it by the network figure
    # still, a floor below what it reaches (docs/profiles.md, "NVL72").
    nvlink_domain_gpus: int = 0

    @property
    def network_gbs_per_gpu(self) -> float:
        return self.nics_per_node * self.nic_gbps / 8 / self.gpus_per_node

    def rated(self, scope_class: str, op: str) -> float | None:
        table = self.nvlink_busbw if scope_class == "nvlink" else self.network_busbw
        return table.get(op)

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def _ops(ring: float, alltoall: float, sendrecv: float) -> dict[str, float]:
    return {"allreduce": ring, "allgather": ring, "reducescatter": ring, "alltoall": alltoall,
            "sendrecv": sendrecv}


# Rated figures: NVLink from the per-GPU NVLink bandwidth in one direction (what a ring's
# busbw approaches) and published nccl-tests results; the network from the NIC line rate
# per GPU. docs/profiles.md gives each figure's source.
BUILTIN: dict[str, Profile] = {
    "H100-SXM": Profile(
        # NVML names the SXM part "NVIDIA H100 80GB HBM3"; "H100 PCIe" and "H100 NVL" are
        # other machines.
        "H100-SXM", ("H100 80GB HBM3", "H100 SXM"), gpus_per_node=8,
        nvlinks_per_gpu=18, nics_per_node=8, nic_gbps=400,
        nvlink_busbw=_ops(450.0, 450.0, 450.0), network_busbw=_ops(50.0, 50.0, 50.0)),
    "H200": Profile(
        "H200", ("H200",), gpus_per_node=8, nvlinks_per_gpu=18, nics_per_node=8, nic_gbps=400,
        nvlink_busbw=_ops(450.0, 450.0, 450.0), network_busbw=_ops(50.0, 50.0, 50.0)),
    "A100": Profile(
        "A100", ("A100",), gpus_per_node=8, nvlinks_per_gpu=12, nics_per_node=8, nic_gbps=200,
        nvlink_busbw=_ops(300.0, 300.0, 300.0), network_busbw=_ops(25.0, 25.0, 25.0)),
    "p5.48xlarge": Profile(
        "p5.48xlarge", ("H100",), gpus_per_node=8, nvlinks_per_gpu=18, nics_per_node=32,
        nic_gbps=100, nvlink_busbw=_ops(450.0, 450.0, 450.0),
        network_busbw=_ops(50.0, 50.0, 50.0), instance_match=("p5.48xlarge", "p5en.48xlarge")),
    # Blackwell, NVLink 5: 18 links, 1.8 TB/s per GPU both directions (900 one way).
    "B200": Profile(
        # NVML names it "NVIDIA B200"; the Grace Blackwell parts ("GB200") match longer.
        "B200", ("B200",), gpus_per_node=8, nvlinks_per_gpu=18, nics_per_node=8, nic_gbps=400,
        nvlink_busbw=_ops(900.0, 900.0, 900.0), network_busbw=_ops(50.0, 50.0, 50.0)),
    "GB200-NVL72": Profile(
        # A node is a compute tray: 2 Grace CPUs, 4 GPUs, a ConnectX-7 at 400 Gb/s per GPU.
        "GB200-NVL72", ("GB200",), gpus_per_node=4, nvlinks_per_gpu=18, nics_per_node=4,
        nic_gbps=400, nvlink_busbw=_ops(900.0, 900.0, 900.0),
        network_busbw=_ops(50.0, 50.0, 50.0), nvlink_domain_gpus=72),
    "GB300-NVL72": Profile(
        # Blackwell Ultra trays of 4 GPUs, a ConnectX-8 at 800 Gb/s per GPU.
        "GB300-NVL72", ("GB300",), gpus_per_node=4, nvlinks_per_gpu=18, nics_per_node=4,
        nic_gbps=800, nvlink_busbw=_ops(900.0, 900.0, 900.0),
        network_busbw=_ops(100.0, 100.0, 100.0), nvlink_domain_gpus=72),
}
ALIASES = {"H100": "H100-SXM", "H200-SXM": "H200", "A100-SXM": "A100", "A100-SXM4-80GB": "A100",
           "B200-SXM": "B200", "GB200": "GB200-NVL72", "GB300": "GB300-NVL72"}


def load(site_file: str | os.PathLike[str] | None = None) -> dict[str, Profile]:
    """The built-in profiles, with a site file's additions and overrides. The file is read
    once per change (judging calls this every round)."""
    path = site_file if site_file is not None else os.environ.get("RINGWATCH_PROFILES_FILE")
    if not path:
        return dict(BUILTIN)
    try:
        st = Path(path).stat()
    except OSError as exc:
        raise ValueError(f"profiles file {path}: {exc}") from exc
    return dict(_load_file(str(path), st.st_mtime_ns, st.st_size))


@functools.lru_cache(maxsize=8)
def _load_file(path: str, _mtime_ns: int, _size: int) -> dict[str, Profile]:
    profiles = dict(BUILTIN)
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"profiles file {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"profiles file {path}: expected an object of profiles by name")
    names = {f.name for f in fields(Profile)}
    for name, spec in data.items():
        if not isinstance(spec, dict) or set(spec) - names:
            raise ValueError(f"profiles file {path}: {name!r} has unknown fields "
                             f"{sorted(set(spec) - names) if isinstance(spec, dict) else spec}")
        spec = {k: tuple(v) if k in ("gpu_match", "instance_match") else v
                for k, v in spec.items() if k != "name"}
        base = profiles.get(name)
        try:
            profiles[name] = replace(base, **spec) if base else Profile(name=name, **spec)
        except TypeError as exc:
            raise ValueError(f"profiles file {path}: {name!r}: {exc}") from exc
    return profiles


def get(name: str, profiles: dict[str, Profile] | None = None) -> Profile:
    profiles = profiles or load()
    key = ALIASES.get(name, name)
    if key not in profiles:
        raise ValueError(f"unknown hardware profile {name!r}; known: {', '.join(sorted(profiles))}")
    return profiles[key]


def detect(gpu_name: str | None, instance: str | None = None,
           profiles: dict[str, Profile] | None = None) -> str | None:
    """The profile of a node from what its agents see; None when nothing matches.

    ``RINGWATCH_PROFILE`` wins; then an instance type match; then the GPU name (the longest
    matching pattern, so "H100 80GB HBM3" beats "H100")."""
    forced = os.environ.get("RINGWATCH_PROFILE")
    profiles = profiles or load()
    if forced:
        return get(forced, profiles).name
    if instance:
        for p in profiles.values():
            if any(s.lower() in instance.lower() for s in p.instance_match):
                return p.name
    if not gpu_name:
        return None
    best: tuple[int, str] | None = None
    for p in profiles.values():
        if p.instance_match:
            continue  # an instance profile is chosen by its instance type only
        for s in p.gpu_match:
            if _names(gpu_name, s) and (best is None or len(s) > best[0]):
                best = (len(s), p.name)
    return best[1] if best else None


def _names(gpu_name: str, pattern: str) -> bool:
    """Whether ``pattern`` is in ``gpu_name`` as a word of its own at its start: "H200" is in
    "NVIDIA H200" but not in "NVIDIA GH200 480GB" (a Grace Hopper, not an H200 board)."""
    return re.search(r"(?<![a-z0-9])" + re.escape(pattern.lower()), gpu_name.lower()) is not None


def scope_class(nodes: list[str] | tuple[str, ...]) -> str:
    """``nvlink`` for a group on one node (its distinct ``nodes``, as
    ``Measurement.nodes`` gives them), else ``network``."""
    return "nvlink" if len(set(nodes)) == 1 else "network"


def rated_busbw(profile: Profile, op: str, members: list[str] | tuple[str, ...],
                size_bytes: int) -> float | None:
    """The rated busbw of one measurement (None below the bandwidth-bound sizes, or where
    the profile has no figure for the op).

    Inside a node: the profile's NVLink figure. Across nodes each rank has its own NIC
    rail, so a ring's busbw grows with the ranks per node (k rails in parallel) up to the
    NVLink figure; an all-to-all sends (n - k) / n of its data over the network and
    counts (n - 1) / n of it, so its busbw is the rail rate times (n - 1) / (n - k)."""
    if size_bytes < MIN_RATED_BYTES or len(members) < 2:
        return None
    per_node: dict[str, int] = {}
    for m in members:
        node = node_of(m)
        per_node[node] = per_node.get(node, 0) + 1
    nvlink = profile.nvlink_busbw.get(op)
    if len(per_node) == 1:
        return nvlink
    rail = profile.network_busbw.get(op)
    if rail is None:
        return None
    n, k = len(members), min(per_node.values())
    if op == "alltoall":
        rated = rail * (n - 1) / max(n - k, 1)
    elif op == "sendrecv":
        rated = rail
    else:
        rated = rail * k
    return min(rated, nvlink) if nvlink else rated


def annotate(measurements: Any, node_profiles: dict[str, str | None],
             profiles: dict[str, Profile] | None = None) -> None:
    """Set each measurement's ``rated_gbs`` from its nodes' profiles (the lowest where they
    differ); left unset where a node has no profile or the size is latency-bound."""
    if not any(node_profiles.values()):
        return
    table = profiles or load()
    for m in measurements:
        if m.rated_gbs is not None:
            continue
        names = {node_profiles.get(n) for n in m.nodes}
        if not names or None in names:
            continue
        rated = [rated_busbw(get(str(n), table), m.op, m.members, m.size_bytes) for n in names]
        if rated and all(r is not None for r in rated):
            m.rated_gbs = min(r for r in rated if r is not None)
