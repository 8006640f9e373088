"""Which nodes a workload manager's jobs hold, read once per scheduler cycle, so that scheduled
probes touch idle nodes only (docs/slurm.md and docs/kubernetes.md, "Occupancy").

A source answers for the nodes it knows: busy ones with what holds them (``Occupant``), idle
ones by leaving them out. A node it cannot vouch for, because it failed, timed out or does
not know the node, counts as busy with ``unknown`` set: never guessed idle.
"""

from __future__ import annotations

import contextvars
import os
import re
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol, get_args

from ringwatch.agents.hostlist import expand_hostlist
from ringwatch.agents.spec import Occupant, ProbeBackend
from ringwatch.services.kubernetes.client import (
    NODES_PATH,
    PAGE,
    SERVICE_ACCOUNT_CA,
    SERVICE_ACCOUNT_TOKEN,
    KubernetesError,
    ServiceAccount,
)

# RINGWATCH_OCCUPANCY: where occupancy comes from (``source_for``).
OccupancySetting = Literal["auto", "slurm", "kubernetes", "ray", "sim", "none"]
OCCUPANCY_SETTINGS: tuple[str, ...] = get_args(OccupancySetting)
# RINGWATCH_OCCUPANCY_TIMEOUT_S's default: the longest one cycle's read may take.
DEFAULT_TIMEOUT_S = 10.0
# The longest error text an unknown node carries (Occupant.state).
MAX_ERROR = 160



class OccupancySource(Protocol):
    """What one workload manager says holds which nodes."""

    name: str

    def read(self, nodes: Sequence[str]) -> dict[str, Occupant]:
        """The busy nodes among ``nodes``, each with what holds it; a node left out is idle.
        May raise: ``read_occupancy`` turns a failure into every node unknown."""
        ...


class OccupancyError(Exception):
    """A source could not read occupancy; the message is one line for a person."""


@dataclass
class Occupancy:
    """One cycle's occupancy: the busy nodes, and the error that made some unknown."""

    source: str
    busy: dict[str, Occupant]
    error: str | None = None
    read_s: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"source": self.source, "error": self.error, "read_s": round(self.read_s, 4),
                "busy": {node: o.to_dict() for node, o in self.busy.items()}}


# The time by which the read in progress must be done, where ``read_occupancy`` bounds it:
# a source's own subprocess and HTTP timeouts come from it.
_DEADLINE: contextvars.ContextVar[float | None] = contextvars.ContextVar(
    "ringwatch_occupancy_deadline", default=None)


def time_left(default_s: float) -> float:
    """Seconds left for the read in progress; ``default_s`` outside ``read_occupancy``."""
    deadline = _DEADLINE.get()
    return default_s if deadline is None else max(0.01, deadline - time.monotonic())


def one_line(text: str) -> str:
    text = " ".join("".join(c if c.isprintable() else " " for c in text).split())
    return text if len(text) <= MAX_ERROR else text[: MAX_ERROR - 3] + "..."


def read_occupancy(source: OccupancySource, nodes: Sequence[str],
                   timeout_s: float = DEFAULT_TIMEOUT_S) -> Occupancy:
    """``source.read(nodes)`` within ``timeout_s``; never raises. On a failure or past the
    bound every node counts as busy, ``unknown``, with why."""
    nodes = list(nodes)
    started = time.monotonic()
    box: list[dict[str, Occupant] | BaseException] = []

    def run() -> None:
        _DEADLINE.set(started + timeout_s)
        try:
            box.append(source.read(nodes))
        except Exception as exc:  # any failure is an answer: every node unknown
            box.append(exc)

    worker = threading.Thread(target=run, name=f"ringwatch-occupancy-{source.name}",
                              daemon=True)
    worker.start()
    worker.join(timeout_s)
    read_s = time.monotonic() - started
    got = box[0] if box else None
    if isinstance(got, dict):
        wanted = set(nodes)
        return Occupancy(source.name, {n: o for n, o in got.items() if n in wanted},
                         read_s=read_s)
    if got is None:
        error = f"no answer in {timeout_s:g} s"
    elif isinstance(got, OccupancyError):
        error = one_line(str(got))
    else:
        error = one_line(f"{type(got).__name__}: {got}")
    unknown = Occupant(source=source.name, state=error, unknown=True)
    return Occupancy(source.name, dict.fromkeys(nodes, unknown), error=error, read_s=read_s)


# ---- names ----------------------------------------------------------------------------------


def _short(name: str) -> str:
    return name.split(".", 1)[0].lower()


def match_names(ours: Iterable[str], theirs: Iterable[str]) -> dict[str, str]:
    """Each of ringwatch's node names to the workload manager's name for it: the same name,
    else the same short name (before the first dot, any case), where only one of theirs has
    it. A name without a match is left out."""
    exact = set(theirs)
    by_short: dict[str, str | None] = {}
    for name in exact:
        key = _short(name)
        by_short[key] = None if key in by_short else name  # two of theirs: neither
    out: dict[str, str] = {}
    for name in ours:
        found = name if name in exact else by_short.get(_short(name))
        if found is not None:
            out[name] = found
    return out


def vouch(nodes: Sequence[str], known: Iterable[str], busy: Mapping[str, Occupant],
          source: str, unknown_why: str) -> dict[str, Occupant]:
    """The busy nodes among ``nodes`` given the manager's own names: ``known`` (every node it
    lists) and ``busy``. A node it does not list is unknown, so busy."""
    found = match_names(nodes, known)
    out: dict[str, Occupant] = {}
    for node in nodes:
        theirs = found.get(node)
        if theirs is None:
            out[node] = Occupant(source=source, state=unknown_why, unknown=True)
        elif theirs in busy:
            out[node] = busy[theirs]
    return out


# ---- none, and the backend's own view --------------------------------------------------------


class NoOccupancy:
    """Nothing else runs on the fleet, or the operator says to probe regardless."""

    name = "none"

    def read(self, nodes: Sequence[str]) -> dict[str, Occupant]:
        return {}


class BackendOccupancy:
    """The probe backend's own view (``ProbeBackend.busy_nodes``): Ray's other work, or the
    sim's scenario jobs."""

    def __init__(self, backend: ProbeBackend, name: str) -> None:
        self.backend = backend
        self.name = name

    def read(self, nodes: Sequence[str]) -> dict[str, Occupant]:
        wanted = set(nodes)
        return {n: o for n, o in self.backend.busy_nodes().items() if n in wanted}


# ---- Slurm ----------------------------------------------------------------------------------

# Node states (``State=``, base and flags joined by "+") in which a job holds the node. A
# drained, down or not-responding node without a job is not busy: nothing runs there to
# contend with, whoever drained it (ringwatch's own drains included, so it can probe them
# again), and a probe of a node that is down finds it unreachable.
SLURM_BUSY_STATES = frozenset({"ALLOCATED", "ALLOC", "MIXED", "COMPLETING"})
# The job states whose nodes squeue names: running, completing, configuring (nodes booting
# for it) and suspended (its allocation kept).
SLURM_JOB_STATES = "R,CG,CF,S"
_FIELD = re.compile(r"(?:^|\s)([A-Za-z][A-Za-z0-9_]*)=")
# One GPU entry of GresUsed: gpu:h100:8(IDX:0-7), gpu:2(IDX:0,3); not gpumem or shard.
_GPU_USED = re.compile(r"(?:^|,)gpu(?::[^,(]*)?\(IDX:([^)]*)\)")
MAX_GPU_INDEX = 1024


@dataclass(frozen=True)
class SlurmNode:
    name: str
    state: str
    # GresUsed's GPU indices; None where the line has no GresUsed with a GPU entry.
    gpus: tuple[int, ...] | None

    @property
    def busy(self) -> bool:
        return (not SLURM_BUSY_STATES.isdisjoint(self.state.upper().split("+"))
                or bool(self.gpus))


def _fields(line: str) -> dict[str, str]:
    """``Key=value`` pairs of one ``scontrol --oneliner`` line; a value runs to the next
    `` Key=``. The first of a key counts: a reason's text cannot pass for the node's state."""
    out: dict[str, str] = {}
    marks = list(_FIELD.finditer(line))
    for mark, after in zip(marks, [*marks[1:], None], strict=True):
        out.setdefault(mark.group(1), line[mark.end(): after.start() if after else len(line)]
                       .strip())
    return out


def _indices(text: str) -> list[int]:
    """``0-3,6`` as [0, 1, 2, 3, 6]; ``N/A`` as []."""
    out: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.strip().partition("-")
        if not (lo.isascii() and lo.isdigit()) or (hi and not (hi.isascii() and hi.isdigit())):
            continue
        if int(hi or lo) - int(lo) <= MAX_GPU_INDEX:  # no node has more GPUs than that
            out += range(int(lo), int(hi or lo) + 1)
    return out


def gpus_used(gres_used: str) -> tuple[int, ...] | None:
    """The GPU indices a ``GresUsed=`` value names: ``gpu:h100:8(IDX:0-7)`` is 0..7; None
    where it has no GPU entry with indices."""
    found = _GPU_USED.findall(gres_used)
    if not found:
        return None
    return tuple(sorted({i for idx in found for i in _indices(idx)}))


def parse_scontrol_nodes(text: str) -> dict[str, SlurmNode]:
    """``scontrol --details --oneliner show node``: each node's state and the GPUs its jobs
    hold."""
    nodes: dict[str, SlurmNode] = {}
    for line in text.splitlines():
        fields = _fields(line)
        name = fields.get("NodeName")
        if name:
            used = fields.get("GresUsed")
            nodes[name] = SlurmNode(name, fields.get("State", ""),
                                    gpus_used(used) if used else None)
    return nodes


def parse_squeue_jobs(text: str) -> dict[str, list[str]]:
    """``squeue --noheader --format='%i %N'``: each node's jobs (a host list per job)."""
    jobs: dict[str, list[str]] = {}
    for line in text.splitlines():
        job, _, hosts = line.strip().partition(" ")
        hosts = hosts.strip()
        if not job or not hosts or hosts in ("(null)", "n/a"):
            continue
        for node in expand_hostlist(hosts):
            jobs.setdefault(node, []).append(job)
    return jobs


def slurm_busy(shown: str, queued: str) -> tuple[set[str], dict[str, Occupant]]:
    """Every node Slurm lists, and the busy ones with their jobs, from ``scontrol`` and
    ``squeue``'s output. A node squeue names a job on is busy whatever its state says (the
    two are read a moment apart)."""
    nodes = parse_scontrol_nodes(shown)
    jobs = parse_squeue_jobs(queued)
    busy: dict[str, Occupant] = {}
    for name in set(nodes) | set(jobs):
        node = nodes.get(name)
        held = jobs.get(name)
        if (node is not None and node.busy) or held:
            busy[name] = Occupant(source="slurm", job=",".join(held) if held else None,
                                  gpus=node.gpus if node is not None else None,
                                  state=node.state if node is not None else None)
    return set(nodes), busy


class SlurmOccupancy:
    """Slurm's view: one ``scontrol show node`` and one ``squeue`` per cycle, whatever the
    number of nodes (docs/slurm.md, "Occupancy")."""

    name = "slurm"

    def __init__(self, *, slurm_bin: str | None = None, env: Mapping[str, str] | None = None,
                 timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.slurm_bin = slurm_bin
        self.env = env
        self.timeout_s = timeout_s

    def _call(self, name: str, *args: str) -> str:
        # The prolog's helpers, where Slurm's commands are looked for and run: imported here,
        # so that reading the settings (which name this module's choices) loads no more.
        from ringwatch.services.cli.errors import CliError
        from ringwatch.services.cli.slurm import find_slurm_command, run_bounded

        try:
            command = find_slurm_command(name, self.slurm_bin)
        except CliError as exc:
            raise OccupancyError(str(exc)) from None
        r = run_bounded([command, *args], time_left(self.timeout_s), env=self.env)
        if r.returncode != 0:
            why = (r.stderr or r.stdout).strip() or "no output"
            raise OccupancyError(f"{name} exited {r.returncode}: {why}")
        return r.stdout

    def read(self, nodes: Sequence[str]) -> dict[str, Occupant]:
        shown = self._call("scontrol", "--details", "--oneliner", "show", "node")
        queued = self._call("squeue", "--noheader", f"--states={SLURM_JOB_STATES}",
                            "--format=%i %N")
        known, busy = slurm_busy(shown, queued)
        return vouch(nodes, known, busy, self.name, "not a node of scontrol show node")


# ---- Kubernetes -----------------------------------------------------------------------------

# Labels of ringwatch's own pods (deploy/kubernetes/base): its GPU workers request GPUs in
# overlays/exclusive-gpus, and are not a job.
OWN_LABELS = (("app.kubernetes.io/name", "ringwatch"), ("app.kubernetes.io/part-of", "ringwatch"))
PODS_PATH = "/api/v1/pods"
# Pods that still hold what they were given.
POD_SELECTOR = "status.phase!=Succeeded,status.phase!=Failed"
# Node names only: the API server's metadata-only form of a list, not whole Node objects.
METADATA_ONLY = "application/json;as=PartialObjectMetadataList;g=meta.k8s.io;v=v1,application/json"


def is_gpu_resource(name: str) -> bool:
    """NVIDIA's device plugin's resources: whole GPUs, shared (time-sliced, renamed) ones and
    MIG slices of them."""
    return (name == "nvidia.com/gpu" or name.startswith("nvidia.com/gpu.")
            or name.startswith("nvidia.com/mig-"))


def _count(value: Any) -> float:
    """A resource quantity as a number; one that does not read as a number counts as some
    (never guessed zero)."""
    try:
        return float(value)
    except (TypeError, ValueError):
        return 1.0


def wants_gpus(pod_spec: Mapping[str, Any]) -> bool:
    for container in pod_spec.get("containers") or ():
        resources = container.get("resources") or {}
        for kind in ("requests", "limits"):
            for name, value in (resources.get(kind) or {}).items():
                if is_gpu_resource(name) and _count(value) > 0:
                    return True
    return False


def _is_ours(metadata: Mapping[str, Any]) -> bool:
    labels = metadata.get("labels") or {}
    return any(labels.get(key) == value for key, value in OWN_LABELS)


def job_of(metadata: Mapping[str, Any]) -> str:
    """``namespace/owner`` (the controller owner: a Job, a PyTorchJob, a RayCluster), else
    ``namespace/pod``."""
    owners = metadata.get("ownerReferences") or []
    owner = next((o for o in owners if o.get("controller")), owners[0] if owners else None)
    name = owner.get("name") if owner else metadata.get("name")
    return f"{metadata.get('namespace', '')}/{name}"


def pod_busy(pods: Iterable[Mapping[str, Any]]) -> dict[str, Occupant]:
    """Nodes (Kubernetes' names) where a pod that is not ringwatch's, not finished, holds
    GPUs: its job, and the pods' phases."""
    held: dict[str, tuple[set[str], set[str]]] = {}
    for pod in pods:
        spec, metadata = pod.get("spec") or {}, pod.get("metadata") or {}
        node = spec.get("nodeName")
        phase = (pod.get("status") or {}).get("phase") or "Unknown"
        if not node or phase in ("Succeeded", "Failed") or _is_ours(metadata):
            continue
        if wants_gpus(spec):
            jobs, phases = held.setdefault(node, (set(), set()))
            jobs.add(job_of(metadata))
            phases.add(phase)
    return {node: Occupant(source="kubernetes", job=",".join(sorted(jobs)),
                           state=",".join(sorted(phases)))
            for node, (jobs, phases) in held.items()}


class KubernetesOccupancy:
    """Kubernetes' view, through its API from inside the cluster: one paginated list of the
    cluster's pods that have not finished, and one of its node names, per cycle
    (docs/kubernetes.md, "Occupancy"). ``api_url``, ``token_path`` and ``ca_path`` default to
    what a pod is given."""

    name = "kubernetes"

    def __init__(self, api_url: str = "", *, token_path: str | Path = SERVICE_ACCOUNT_TOKEN,
                 ca_path: str | Path = SERVICE_ACCOUNT_CA,
                 environ: Mapping[str, str] = os.environ,
                 timeout_s: float = DEFAULT_TIMEOUT_S, page: int = PAGE) -> None:
        self.account = ServiceAccount(api_url, token_path=token_path, ca_path=ca_path,
                                      environ=environ)
        self.timeout_s = timeout_s
        self.page = page

    def base_url(self) -> str:
        try:
            return self.account.base_url()
        except KubernetesError as exc:
            raise OccupancyError(str(exc)) from None

    def read(self, nodes: Sequence[str]) -> dict[str, Occupant]:
        try:
            with self.account.open(lambda: time_left(self.timeout_s)) as api:
                known = {item["metadata"]["name"] for item in api.list_items(
                    NODES_PATH, accept=METADATA_ONLY, page=self.page)}
                busy = pod_busy(api.list_items(PODS_PATH, {"fieldSelector": POD_SELECTOR},
                                         page=self.page))
        except KubernetesError as exc:
            raise OccupancyError(str(exc)) from None
        return vouch(nodes, known, busy, self.name, "not a node of the Kubernetes API")


# ---- choosing one ---------------------------------------------------------------------------


def in_pod(environ: Mapping[str, str], token_path: str | Path = SERVICE_ACCOUNT_TOKEN) -> bool:
    """Running in a Kubernetes pod that was given a service account token."""
    return bool(environ.get("KUBERNETES_SERVICE_HOST")) and Path(token_path).is_file()


def backend_view(backend: ProbeBackend) -> BackendOccupancy:
    """The backend's own view of what else runs: the sim's scenario jobs, else Ray's other
    work (what a cycle asks where no source was chosen)."""
    return BackendOccupancy(backend, "sim" if backend.name == "sim" else "ray")


def source_for(setting: str, backend: ProbeBackend, *, environ: Mapping[str, str] = os.environ,
               token_path: str | Path = SERVICE_ACCOUNT_TOKEN, kubernetes_api_url: str = "",
               timeout_s: float = DEFAULT_TIMEOUT_S) -> OccupancySource:
    """The source RINGWATCH_OCCUPANCY names. ``auto``: the sim's jobs under the sim backend;
    Kubernetes in a pod with a service account token; else Ray's own view. Slurm is never
    chosen by itself: a machine with Slurm installed may not be the fleet's workload manager."""
    if setting not in OCCUPANCY_SETTINGS:
        raise ValueError(f"occupancy source {setting!r}: one of {', '.join(OCCUPANCY_SETTINGS)}")
    if setting == "auto":
        if backend.name == "sim" or not in_pod(environ, token_path):
            return backend_view(backend)
        setting = "kubernetes"
    if setting == "none":
        return NoOccupancy()
    if setting in ("ray", "sim"):
        return BackendOccupancy(backend, setting)
    if setting == "slurm":
        return SlurmOccupancy(timeout_s=timeout_s)
    return KubernetesOccupancy(kubernetes_api_url, token_path=token_path, environ=environ,
                               timeout_s=timeout_s)
