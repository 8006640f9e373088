"""Request and response bodies: validation lives here, so bad input is a 422 with a reason."""

from __future__ import annotations

import hashlib
import logging
import math
import re
from collections.abc import Callable
from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    AnyHttpUrl,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    ValidationInfo,
    ValidatorFunctionWrapHandler,
    field_validator,
    model_validator,
)
from pydantic_core import ErrorDetails, to_json

from ringwatch.agents.groups import NODE_NAME, check_node_name, split_member
from ringwatch.agents.hostlist import TooManyHosts, expand_hostlist
from ringwatch.agents.spec import Algo, Backend, FindingKind, Op, Scope, Timing, WireRedOp
from ringwatch.agents.workloads import ProfileName
from ringwatch.services.config import PLACEHOLDER_SECRET
from ringwatch.services.store.events import Subscribable as Event

log = logging.getLogger(__name__)

# Hostname-like ASCII (agents.groups.NODE_NAME): no separators, whitespace, control,
# invisible, bidirectional or look-alike characters.
NodeName = Annotated[str, Field(min_length=1, max_length=253,
                                json_schema_extra={"pattern": f"^{NODE_NAME}$"}),
                     AfterValidator(check_node_name)]
# The most nodes a person's list names (a preflight, a token's scope, a retirement), counted
# after its host lists are expanded.
MAX_NODES_NAMED = 100_000


def host_lists(limit: int) -> Callable[[Any], Any]:
    """A list's items that are Slurm host lists (``node-[000-004]``, ``a[1-2],b``) replaced by
    the names they hold, by the command line's rules (agents.hostlist), the rest kept as they
    are for the item type to judge; more than ``limit`` names in all is refused before they
    are built."""
    def expand(value: Any) -> Any:
        if not isinstance(value, list):
            return value
        out: list[Any] = []
        for item in value:
            if not (isinstance(item, str) and ("[" in item or "," in item)):
                out.append(item)
                continue
            try:
                names = expand_hostlist(item, limit=limit - len(out))
            except TooManyHosts:
                raise ValueError(f"more than {limit} nodes named (past it at host list "
                                 f"{item[:80]!r})") from None
            if not names:
                raise ValueError(f"host list {item[:80]!r} names no node")
            out += names
        return out
    return expand


def _items_may_be_host_lists(schema: dict[str, Any]) -> None:
    schema["items"] = {"type": "string", "minLength": 1, "description":
                       "a node name, or a Slurm host list (node-[000-004],gpu-a[1-2]b)"}


# Node names as a person gives them: names or host lists, expanded before the names are judged.
NodeNames = Annotated[list[NodeName], BeforeValidator(host_lists(MAX_NODES_NAMED)),
                      Field(max_length=MAX_NODES_NAMED, json_schema_extra=_items_may_be_host_lists)]
# What Postgres' bigint holds; a larger integer is the sender's error, not a server fault.
Int64 = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]
Count = Annotated[int, Field(ge=0, le=2**63 - 1)]
# A GPU's index on its node (NVML enumerates at most a few dozen).
GpuIndex = Annotated[int, Field(ge=0, le=4095)]
Gbs = Annotated[float, Field(ge=0, le=1e6)]
# Bounds on free-form JSON an agent sends (finding details, NVML readings, telemetry).
JSON_MAX_DEPTH = 8
JSON_MAX_ITEMS = 16384
JSON_MAX_STRING = 4096
DETAIL_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_.:-]{0,63}$")


class OutOfRange(ValueError):
    """A number no column holds (an integer past int64, a float that is not finite): in a
    batch's finding or counter reading, that one item is dropped, not the batch."""


def bounded_json(value: Any, where: str = "", depth: int = 0) -> int:
    """Check a free-form JSON value: nesting at most JSON_MAX_DEPTH, at most JSON_MAX_ITEMS
    values in all, strings of at most JSON_MAX_STRING characters, integers within int64 and
    floats finite. Returns the number of values; ValueError naming the place otherwise."""
    if depth > JSON_MAX_DEPTH:
        raise ValueError(f"{where or 'value'}: nested deeper than {JSON_MAX_DEPTH} levels")
    if value is None or isinstance(value, bool):
        return 1
    if isinstance(value, int):
        if not -(2**63) <= value < 2**63:
            raise OutOfRange(f"{where or 'value'}: integer outside int64")
        return 1
    if isinstance(value, float):
        if not math.isfinite(value):
            raise OutOfRange(f"{where or 'value'}: number is not finite")
        return 1
    if isinstance(value, str):
        if len(value) > JSON_MAX_STRING:
            raise ValueError(f"{where or 'value'}: string longer than {JSON_MAX_STRING}")
        return 1
    if isinstance(value, list):
        items = enumerate(value)
    elif isinstance(value, dict):
        items = value.items()  # type: ignore[assignment]
    else:
        raise ValueError(f"{where or 'value'}: not a JSON value")
    total = 1
    for k, v in items:
        if isinstance(k, str) and len(k) > 128:
            raise ValueError(f"{where or 'value'}: key longer than 128 characters")
        total += bounded_json(v, f"{where}.{k}" if where else str(k), depth + 1)
        if total > JSON_MAX_ITEMS:
            raise ValueError(f"{where or 'value'}: more than {JSON_MAX_ITEMS} values")
    return total


def _bounded(value: Any) -> Any:
    bounded_json(value)
    return value


# A free-form JSON object within the bounds above.
BoundedObject = Annotated[dict[str, Any], AfterValidator(_bounded)]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


# Free text shown to a person, on one line: no control characters.
ONE_LINE = r"^[^\x00-\x1f\x7f]*$"


class MeasurementIn(Strict):
    op: Op
    scope: Scope
    members: list[str] = Field(min_length=1, max_length=65536)
    size_bytes: int = Field(gt=0, le=1 << 40)
    dtype: str = Field(default="float32", max_length=16, pattern=r"^[a-z0-9_]+$")
    warmup: int = Field(default=0, ge=0, le=1 << 31)
    iters: int = Field(ge=1, le=1 << 31)
    time_us: float = Field(gt=0, le=1e15)
    algbw_gbs: Gbs
    busbw_gbs: Gbs
    wrong: Count = 0
    time: datetime
    stats: dict[Annotated[str, Field(max_length=64)], float] | None = Field(default=None,
                                                                             max_length=64)
    redop: WireRedOp = "sum"
    # How it was timed: CUDA graph replay, CUDA events, host wall clock, or the sim's model.
    timing: Timing | None = None
    # The sender's hardware-model figure (busbw GB/s): a floor under the expectation.
    preset_gbs: float | None = Field(default=None, ge=0, le=1e6)
    # The hardware profile's rated busbw for it (GB/s), at bandwidth-bound sizes.
    rated_gbs: float | None = Field(default=None, gt=0, le=1e6)
    # The algorithm its communicator was pinned to (NCCL_ALGO); stored as a series of its
    # own, named by op and algorithm (allreduce:ring).
    algo: Algo | None = None
    # The transports NCCL took for the group, comma-joined (docs/transport.md).
    transport: str | None = Field(default=None, max_length=64, pattern=r"^[a-z0-9_]+(,[a-z0-9_]+)*$")
    # The other traffic its links carried while it ran (agents.contention): stored and
    # shown, never judged (docs/operations.md, "Occupancy and contention").
    contended: str | None = Field(default=None, min_length=1, max_length=512,
                                  pattern=ONE_LINE)

    @field_validator("members")
    @classmethod
    def members_are_ranks(cls, v: list[str]) -> list[str]:
        for m in v:
            split_member(m)  # ValueError -> 422 naming the bad member
        if len(set(v)) != len(v):
            raise ValueError("members repeat a rank")
        return v

    @field_validator("time")
    @classmethod
    def time_has_zone(cls, v: datetime) -> datetime:
        if v.tzinfo is None:
            raise ValueError("time needs a UTC offset (ISO 8601, e.g. 2026-01-01T00:00:00Z)")
        return v


class RankIn(Strict):
    node: NodeName
    local_index: GpuIndex
    hostname: str = Field(default="", max_length=255)
    gpu_uuid: str | None = Field(default=None, max_length=128)
    pci_bus_id: str | None = Field(default=None, max_length=64)
    numa_node: int | None = Field(default=None, ge=-1, le=4096)
    gpu_name: str | None = Field(default=None, max_length=128)
    telemetry: BoundedObject = Field(default_factory=dict)
    profile: str | None = Field(default=None, max_length=64)


class HeadlineIn(Strict):
    """A finding's headline as the analyzer makes it (docs/analysis.md, "The headline")."""

    op: str = Field(min_length=1, max_length=64)
    size_bytes: Int64 = Field(ge=0)
    busbw_gbs: Gbs
    expected_gbs: Gbs
    ratio: float = Field(ge=0, le=1e6, allow_inf_nan=False)
    text: str = Field(min_length=1, max_length=256)


class FindingIn(BaseModel):
    """A finding an agent or scheduler saw (docs/formats.md, "Verdict"): the fields that
    place it are typed; more fields by kind (evidence, message, rank, ...) are free-form JSON
    within bounds, under identifier-like names."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)
    kind: FindingKind
    node: NodeName | None = None
    gpu: GpuIndex | None = None
    gpus: list[GpuIndex] | None = Field(default=None, max_length=4096)
    nodes: list[NodeName] | None = Field(default=None, max_length=65536)
    severity: Literal["critical", "warning", "info"] | None = None
    measured_gbs: Gbs | None = None
    expected_gbs: Gbs | None = None
    headline: HeadlineIn | None = None
    detail: BoundedObject | None = None

    @model_validator(mode="after")
    def _extras_bounded(self) -> FindingIn:
        extra = self.model_extra or {}
        if len(extra) > 64:
            raise ValueError(f"{len(extra)} extra fields; at most 64")
        for key, value in extra.items():
            if not DETAIL_KEY.match(key):
                raise ValueError(f"field name {key[:70]!r} is not an identifier")
            bounded_json(value, key)
        return self


class ShipperState(Strict):
    """What the sender's spool held when it wrote this batch. It is kept as the spool of
    the token that sent the batch: ``host`` says where that spool is (a label on /metrics,
    at most a few per token), never whose it is (docs/security.md, "The shipper's
    identity")."""

    host: str = Field(default="", max_length=255)
    pending: Count = 0
    failed: Count = 0
    rejected: Count = 0
    # Seconds the sender plans between its batches now: its cycle and the wait after it
    # (the probe interval, or longer where the duty cycle stretches it). A scheduled cycle's
    # batch says it; RingwatchIngestStalled waits three of them (docs/operations.md).
    interval_s: float | None = Field(default=None, gt=0, le=30 * 86400)


class CounterSnapshotIn(Strict):
    """One GPU's NVML readings before and after a cycle (stored where something rose)."""

    node: NodeName
    local_index: GpuIndex
    before: list[BoundedObject] = Field(default_factory=list, max_length=64)
    after: list[BoundedObject] = Field(default_factory=list, max_length=64)
    xid: list[BoundedObject] = Field(default_factory=list, max_length=100)
    # An nvlink_fabric finding's GPU: its fabric reading after the check (a state, not a count).
    fabric: BoundedObject | None = None
    findings: list[Annotated[str, Field(max_length=64)]] = Field(default_factory=list,
                                                                  max_length=10)


# A job's id as a workload manager writes it (Slurm's 1234 or 1234_7, a Kubernetes
# namespace/owner): printable, no spaces, bounded; it may become a /metrics label.
JobId = Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.:/+-]*$")]
OccupancySourceName = Literal["slurm", "kubernetes", "ray", "sim", "none"]


class OccupantIn(Strict):
    """What held a node (agents.spec.Occupant)."""

    source: OccupancySourceName
    job: JobId | None = None
    gpus: list[GpuIndex] | None = Field(default=None, max_length=4096)
    state: str | None = Field(default=None, max_length=256, pattern=ONE_LINE)
    unknown: bool = False
    # Derived again from the fields above when stored; accepted for symmetry.
    reason: str | None = Field(default=None, max_length=1024)


class OccupancyIn(Strict):
    """How the scheduler's occupancy source answered for this batch's cycle
    (docs/operations.md, "Occupancy and contention"): the busy nodes with what holds them;
    ``error`` where the source failed, its nodes then counted busy (``unknown``)."""

    source: OccupancySourceName
    error: str | None = Field(default=None, max_length=1024)
    read_s: float = Field(default=0.0, ge=0, le=1e6)
    busy: dict[NodeName, OccupantIn] = Field(default_factory=dict, max_length=262_144)


# Fields of a batch (""), its measurements and its counters added after batches were
# first digested: left out of the content digest while None, so the digest of a batch that
# does not use them is what it was (a batch spooled before an upgrade is its own retry).
LATER_BATCH_FIELDS: dict[str, tuple[str, ...]] = {
    "": ("occupancy", "facts"), "measurements": ("contended",), "counters": ("fabric",)}


def _drop_unset(d: dict[str, Any], names: tuple[str, ...]) -> None:
    for name in names:
        if name in d and d[name] is None:
            del d[name]


# What pydantic calls a number outside a field's bounds.
_RANGE_ERRORS = frozenset({"greater_than", "greater_than_equal", "less_than", "less_than_equal",
                           "finite_number"})


def _out_of_range(error: ErrorDetails) -> bool:
    return (error["type"] in _RANGE_ERRORS
            or isinstance((error.get("ctx") or {}).get("error"), OutOfRange))


class _Kept(list):  # type: ignore[type-arg]
    """A batch's findings (or counters) less the ones dropped for a number out of range,
    with a line on each: carried to MeasurementBatch, which keeps the lines."""

    def __init__(self, items: list[Any], dropped: list[str]) -> None:
        super().__init__(items)
        self.dropped = dropped


def _dropped_note(field: str, index: int, item: Any, error: ErrorDetails) -> str:
    named = [str(item[k])[:64] for k in ("kind", "node")
             if isinstance(item, dict) and isinstance(item.get(k), str)]
    where = ".".join(str(p) for p in error["loc"][1:])
    note = (f"{field}[{index}]{' (' + ' on '.join(named) + ')' if named else ''} dropped: "
            f"{where + ': ' if where else ''}{error['msg']}")
    return re.sub(r"[^\x20-\x7e]", "?", note)[:300]  # one printable line, whatever was sent


def _drop_out_of_range(value: Any, handler: ValidatorFunctionWrapHandler, field: str) -> Any:
    """A batch's list validated; where its only errors are numbers out of range (one
    reading misread as 2^64-1 by an older agent), each item holding one is dropped and
    named, and the rest stored: one bad counter never costs a fleet's cycle. Any other
    error is still the sender's, a 422."""
    try:
        return handler(value)
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        if not isinstance(value, list) or not all(
                _out_of_range(e) and e["loc"] and isinstance(e["loc"][0], int) for e in errors):
            raise
        bad: dict[int, ErrorDetails] = {}
        for e in errors:
            bad.setdefault(int(e["loc"][0]), e)
        notes = [_dropped_note(field, i, value[i], bad[i]) for i in sorted(bad)]
        return _Kept(handler([item for i, item in enumerate(value) if i not in bad]), notes)


class MeasurementBatch(Strict):
    batch_id: str = Field(min_length=1, max_length=128)
    backend: Backend
    measurements: list[MeasurementIn] = Field(max_length=1_000_000)
    ranks: list[RankIn] = Field(default_factory=list, max_length=262_144)
    findings: list[FindingIn] = Field(default_factory=list, max_length=100_000)
    # Accepted for symmetry with `ringwatch probe --json`; not stored.
    injected: list[BoundedObject] = Field(default_factory=list, max_length=1024)
    # Nodes the scheduler left out (other work held them), with the reason.
    skipped: dict[NodeName, Annotated[str, Field(max_length=1024)]] = Field(default_factory=dict)
    # Fraction of each node's GPU time spent probing.
    duty_cycle: dict[NodeName, Annotated[float, Field(ge=0, le=1)]] = Field(default_factory=dict)
    shipper: ShipperState | None = None
    counters: list[CounterSnapshotIn] = Field(default_factory=list, max_length=100_000)
    # Nodes whose facts (NVML and NIC counters, NVLink fabric state) the check read before
    # and after its probes: only these may clear a counter incident (docs/formats.md).
    facts: list[NodeName] | None = Field(default=None, max_length=262_144)
    # What held the fleet's nodes this cycle: scheduled batches carry it.
    occupancy: OccupancyIn | None = None
    _dropped: list[str] = PrivateAttr(default_factory=list)

    @field_validator("findings", "counters", mode="wrap")
    @classmethod
    def _numbers_in_range(cls, value: Any, handler: ValidatorFunctionWrapHandler,
                          info: ValidationInfo) -> Any:
        return _drop_out_of_range(value, handler, str(info.field_name))

    @model_validator(mode="after")
    def _keep_dropped(self) -> MeasurementBatch:
        for field in ("findings", "counters"):
            items = getattr(self, field)
            if isinstance(items, _Kept):
                self._dropped += items.dropped
                setattr(self, field, list(items))
        for note in self._dropped:
            log.warning("batch %r: %s; the rest of the batch is stored", self.batch_id, note)
        return self

    @property
    def dropped(self) -> list[str]:
        """The findings and counter readings left out of this batch for a number out of
        range, a line each (docs/security.md, "Names, counters and batch sizes")."""
        return list(self._dropped)

    def content_digest(self) -> str:
        """SHA-256 of what the batch says (its id and the sender's spool state aside): a
        retry of the same batch has the same digest, other content under the same id not.
        Fields added since batches were first digested count only where a batch sets them,
        so a batch spooled before an upgrade and sent after it is still its own retry."""
        body = self.model_dump(mode="json", exclude={"batch_id", "shipper"})
        _drop_unset(body, LATER_BATCH_FIELDS[""])
        for part, names in LATER_BATCH_FIELDS.items():
            for item in body.get(part) or () if part else ():
                _drop_unset(item, names)
        return hashlib.sha256(to_json(body)).hexdigest()


class IngestOut(BaseModel):
    batch_id: str
    created: bool
    run_id: int
    stored: int
    # Incidents this batch opened (degradations; probe_findings: hangs, errors, wrong
    # data) and closed, each a localized fault; findings: everything the batch's judgement
    # localized, open incident or not yet.
    degraded: list[dict[str, Any]]
    recovered: list[dict[str, Any]]
    probe_findings: list[dict[str, Any]]
    findings: list[dict[str, Any]] = []
    # Findings and counter readings left out for a number out of range (an integer past
    # int64), a line each: the rest of the batch is stored (MeasurementBatch.dropped).
    dropped: list[str] = []


class GpuOut(BaseModel):
    local_index: int
    uuid: str | None
    pci_bus_id: str | None
    numa_node: int | None
    name: str | None


class OccupiedOut(BaseModel):
    """What holds a busy node, as the scheduler's occupancy source last said: the job where
    the source names it, its GPUs where known, since when (docs/operations.md)."""

    source: str
    job: str | None = None
    gpus: list[int] | None = None
    state: str | None = None
    # The source could not vouch for the node (it failed or timed out): counted busy.
    unknown: bool = False
    reason: str
    since: datetime | None = None


class NodeOut(BaseModel):
    name: str
    hostname: str | None
    backend: str | None
    # Hardware profile (agents.profiles): what its links are rated for.
    profile: str | None = None
    duty_cycle: float | None
    skipped_reason: str | None
    # Busy: a job holds it (scheduled probes leave it alone); None while idle.
    occupied: OccupiedOut | None = None
    last_seen_at: datetime
    gpus: list[GpuOut]


class NodeDetailGpuOut(GpuOut):
    # Free-form NVML facts as the rank reported them (NVLink state, P2P row, versions).
    telemetry: dict[str, Any]


class NodeDetailOut(BaseModel):
    """One node's inventory, NICs and newest NVML counter readings (newest first)."""

    name: str
    hostname: str | None
    backend: str | None
    profile: str | None
    duty_cycle: float | None
    skipped_reason: str | None
    # Busy: a job holds it (scheduled probes leave it alone); None while idle.
    occupied: OccupiedOut | None = None
    last_seen_at: datetime
    last_probed_at: datetime | None
    # When it left the fleet (POST /v1/nodes/retire, or retention); None while in it.
    retired_at: datetime | None = None
    gpus: list[NodeDetailGpuOut]
    nics: list[dict[str, Any]]
    counters: list[dict[str, Any]]


class NodesRetireIn(Strict):
    # Names as stored, any the table holds (one stored before today's name rule too), or
    # host lists of them.
    nodes: Annotated[list[Annotated[str, Field(min_length=1, max_length=255)]],
                     BeforeValidator(host_lists(MAX_NODES_NAMED)),
                     Field(min_length=1, max_length=MAX_NODES_NAMED,
                           json_schema_extra=_items_may_be_host_lists)]


class NodesRetireOut(BaseModel):
    dry_run: bool
    # Taken out of the fleet by this request (with dry_run: would be).
    retired: list[str]
    already_retired: list[str]


class NodeStateOut(BaseModel):
    name: str
    backend: str | None
    profile: str | None
    last_probed_at: datetime | None
    skipped_reason: str | None
    occupied: OccupiedOut | None = None
    links: int
    degraded_links: int
    open_findings: int
    # Worst ratio (measured over expected) of its own NVLink groups; median of its node pairs.
    nvlink_ratio: float | None
    net_ratio: float | None
    ratio: float | None
    # busy: a job holds it and no open finding names it (its last results kept, with
    # their age in last_probed_at).
    state: Literal["degraded", "suspect", "ok", "unknown", "busy"]
    # The kinds of the findings for which a preflight naming this node excludes it, critical
    # first (the Slurm prolog's judgement; `ringwatch kubernetes sync` taints by it); empty:
    # a preflight would not exclude it.
    excluded_by: list[str] = []


class NodeStatesOut(BaseModel):
    nodes: list[NodeStateOut]
    # Per backend seen: the ratio below which a measurement counts as degraded.
    degraded_ratio: dict[str, float]


class NodePairsOut(BaseModel):
    nodes: list[str]
    # Base64, one byte per pair (a, b), a < b, by index into ``nodes``, row by row through
    # the upper triangle: 0 not probed as a pair; else 0x80 set when degraded, and the low
    # seven bits 1 + the worst ratio in hundredths (capped at 1.25), or 127 for no ratio.
    cells: str


class NodePairTileOut(BaseModel):
    """One tile of the node x node map (GET /v1/fleet/pairs?row_from=...)."""

    # The fleet's nodes now; rows and columns are indices into them in name order, so a
    # tile whose names differ from an earlier tile's was read after the fleet changed.
    node_count: int
    row_from: int
    col_from: int
    rows: list[str]
    cols: list[str]
    # Base64, one byte per (row, column), row by row, len(rows) x len(cols); each byte as
    # in NodePairsOut, and 0 where row and column are the same node.
    cells: str


class StandingOut(BaseModel):
    """Where a link stands in the hysteresis window (services.analyzer.hysteresis.standing):
    why one slow cycle leaves it ok, or one good cycle leaves it degraded."""

    bad: int = Field(description="cycles of the window in which it was slow")
    window: int = Field(description="the window: the last n cycles")
    opens_at: int = Field(description="slow cycles of the window at which it turns degraded")
    good_streak: int = Field(description="good cycles in a row")
    closes_at: int = Field(description="good cycles in a row at which it turns ok again")
    text: str | None = Field(description="the reason in words, e.g. 'slow, 1 of 3 \u2014 opens "
                                         "at 2 of 3'; null when there is none to give")


class LinkOut(BaseModel):
    # The series key: members comma-joined, or "sha256:..." for a group too large for that
    # (GET /v1/series?group=KEY reads it).
    group_key: str
    scope: str
    op: str
    members: list[str]
    nodes: list[str]
    status: str
    size_bytes: int
    busbw_gbs: float
    expected_gbs: float | None
    ratio: float | None
    updated_at: datetime
    changed_at: datetime
    standing: StandingOut | None = None


class BaselineOut(BaseModel):
    """A link's running baseline: its last busbw values (GB/s, oldest first) at its judged
    size, from which an adaptive check learns the link's own normal."""

    group_key: str
    scope: str
    op: str
    members: list[str]
    size_bytes: int
    values: list[float]


class SeriesPoint(BaseModel):
    """A raw probe, or (resolution 1h/1d) a bucket: ``time`` its start, busbw/algbw/time
    its medians, ``count`` probes, busbw min/max/mean, ``wrong`` summed."""

    time: datetime
    op: str
    size_bytes: int
    dtype: str | None = None
    redop: str | None = None
    timing: str | None = None
    # The transports NCCL took for the group (raw probes; docs/transport.md).
    transport: str | None = None
    # The other traffic its links carried (raw probes; docs/operations.md): shown, never
    # judged, and left out of the 1h/1d buckets.
    contended: str | None = None
    time_us: float
    algbw_gbs: float
    busbw_gbs: float
    wrong: int
    count: int | None = None
    busbw_min: float | None = None
    busbw_max: float | None = None
    busbw_mean: float | None = None


class SeriesOut(BaseModel):
    members: list[str]
    group_key: str
    resolution: Literal["raw", "1h", "1d"]
    points: list[SeriesPoint]
    # NVML readings of the members' GPUs around cycles in which an error counter rose.
    counters: list[dict[str, Any]] = []


class TokenExpiringOut(BaseModel):
    """An active token that expires within TOKEN_EXPIRY_WARN_S (rotate it before then)."""

    id: int
    role: str
    name: str
    expires_at: datetime


class HealthOut(BaseModel):
    status: Literal["healthy", "degraded", "unknown"]
    nodes: int
    links: dict[str, int]
    open_findings: int
    tokens_expiring: list[TokenExpiringOut] = []


class PreflightIn(Strict):
    nodes: NodeNames = Field(min_length=1)
    # Up to 30 days: older results are not held raw anyway (RINGWATCH_RETENTION_RAW_DAYS).
    max_age_s: float = Field(default=900.0, gt=0, le=30 * 86400)
    # When fresh results look unhealthy, have a scheduler re-probe before answering.
    confirm: bool = False
    # What the job will run (docs/workloads.md): a scheduler probes the nodes with the
    # profile's ops and the job's own communicators, however fresh the stored results are.
    profile: ProfileName | None = Field(
        default=None, description="workload profile: ddp, fsdp, moe or pipeline; the "
                                  "request is then always probed by a scheduler")
    # The job's parallel degrees; unset: tensor parallel over one node's GPUs, pipeline 1,
    # data parallel over what is left.
    tp: int | None = Field(default=None, ge=1, le=65536, description="tensor-parallel degree")
    pp: int | None = Field(default=None, ge=1, le=65536, description="pipeline stages")
    dp: int | None = Field(default=None, ge=1, le=1 << 20, description="data-parallel degree")

    @model_validator(mode="after")
    def layout_needs_profile(self) -> PreflightIn:
        if self.profile is None and any(v is not None for v in (self.tp, self.pp, self.dp)):
            raise ValueError("tp, pp and dp describe the job a profile probes; give a profile")
        return self


class HeadlineOut(BaseModel):
    """A finding's headline (docs/analysis.md, "The headline"): the one measurement every
    surface shows for it, and the text they all print."""

    model_config = ConfigDict(extra="allow")
    op: str
    size_bytes: int
    busbw_gbs: float
    expected_gbs: float
    ratio: float
    text: str = Field(description="e.g. 'allreduce 256 MiB: 122 of 238 GB/s (0.51)'")


class FindingOut(BaseModel):
    """A finding (docs/formats.md, "Verdict"): its kind, place and figures (its headline's,
    where it has one); more fields by kind (confidence, evidence, problem, ...)."""

    model_config = ConfigDict(extra="allow")
    kind: str
    severity: str | None = None
    node: str | None = None
    gpu: int | None = None
    gpus: list[int] | None = None
    nodes: list[str] | None = None
    measured_gbs: float | None = None
    expected_gbs: float | None = None
    headline: HeadlineOut | None = None


class PreflightOut(BaseModel):
    """A preflight request: while ``pending`` or ``running`` its state; once ``done``, the
    verdict (docs/formats.md, "Verdict") beside it; ``failed`` with an ``error``."""

    model_config = ConfigDict(extra="allow")
    id: str
    status: Literal["pending", "running", "done", "failed"]
    nodes: list[str]
    max_age_s: float
    created_at: datetime | None = None
    completed_at: datetime | None = None
    attempts: int = 0
    error: str | None = None
    profile: ProfileName | None = Field(default=None, description="the workload profile asked about")
    job: dict[str, int | None] | None = Field(default=None, description="the job's tp, pp, dp")
    # The verdict, once done.
    healthy: bool | None = None
    backend: str | None = None
    nodes_checked: int | None = None
    exclude: list[str] | None = Field(default=None, description="nodes a job should not use")
    findings: list[FindingOut] | None = None
    rounds: int | None = None
    duration_s: float | None = Field(default=None, description="fabric time of the check (s)")
    source: Literal["stored", "probed"] | None = Field(
        default=None, description="stored: from monitoring's fresh results; probed: a "
                                  "scheduler probed for this request")
    unprobed: list[str] | None = None
    suspects: list[str] | None = None
    contended: list[str] | None = Field(
        default=None, description="nodes whose probes met other traffic (a job's): not "
                                  "judged, so not vouched for, never excluded")
    workload: dict[str, Any] | None = Field(
        default=None, description="with a profile: how the job's communicators ran "
                                  "(docs/workloads.md)")


class ClaimIn(Strict):
    worker: str = Field(min_length=1, max_length=255)
    lease_s: float = Field(default=300.0, gt=0, le=3600)


class VerdictIn(BaseModel):
    """A verdict a scheduler's own preflight reached (docs/formats.md, "Verdict")."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)
    healthy: bool
    backend: Backend
    nodes_checked: int = Field(ge=0, le=1 << 31)
    exclude: list[NodeName] = Field(max_length=100_000)
    findings: list[FindingIn] = Field(max_length=100_000)
    rounds: int = Field(ge=0, le=1 << 31)
    duration_s: float = Field(ge=0, le=1e9)

    @model_validator(mode="after")
    def _extras_bounded(self) -> VerdictIn:
        for key, value in (self.model_extra or {}).items():
            if not DETAIL_KEY.match(key):
                raise ValueError(f"field name {key[:70]!r} is not an identifier")
            bounded_json(value, key)
        return self


class CompleteIn(Strict):
    worker: str = Field(min_length=1, max_length=255)
    error: str | None = Field(default=None, max_length=4000)
    # The verdict of the scheduler's own preflight; without one, it is computed from the
    # results the scheduler shipped.
    verdict: VerdictIn | None = None


# A webhook secret signs deliveries: long enough not to be guessed, never a placeholder.
WebhookSecret = Annotated[str, Field(min_length=16, max_length=512)]
PLACEHOLDER_SECRETS = (PLACEHOLDER_SECRET, PLACEHOLDER_SECRET.replace("-", ""))


def _real_secret(secret: object) -> object:
    """Checked before the length, so ``change-me`` is named a placeholder, not short."""
    if not isinstance(secret, str):
        return secret
    if any(p in secret.lower() for p in PLACEHOLDER_SECRETS):
        raise ValueError("is a placeholder; use a random secret, e.g. "
                         "python -c 'import secrets; print(secrets.token_urlsafe(32))'")
    if any(ord(c) < 32 or ord(c) == 127 for c in secret):
        raise ValueError("must not contain control characters (NUL, newlines, tabs)")
    return secret


class WebhookIn(Strict):
    url: AnyHttpUrl
    secret: WebhookSecret
    events: list[Event] = Field(min_length=1)
    format: Literal["json", "slack"] = "json"

    _secret = field_validator("secret", mode="before")(_real_secret)


class WebhookPatch(Strict):
    """Any of these; ``active: false`` disables the webhook (queued deliveries wait)."""

    url: AnyHttpUrl | None = None
    events: list[Event] | None = Field(default=None, min_length=1)
    format: Literal["json", "slack"] | None = None
    active: bool | None = None


class WebhookRotateIn(Strict):
    # None: a random secret is made (and returned once).
    secret: WebhookSecret | None = None
    # Seconds the old secret keeps signing too (a second ``v1=``); at most a week.
    grace_s: float = Field(default=0.0, ge=0, le=7 * 24 * 3600)

    _secret = field_validator("secret", mode="before")(_real_secret)


class WebhookOut(BaseModel):
    id: int
    url: str
    events: list[str]
    format: str
    active: bool
    created_at: datetime
    # Until when a rotated-out secret still signs (None: no grace period running or set).
    previous_secret_expires_at: datetime | None = None


class WebhookSecretOut(BaseModel):
    """The new secret of a rotation: shown once, never again."""

    id: int
    secret: str
    previous_secret_expires_at: datetime | None


class DeliveryOut(BaseModel):
    # The cursor for ``before``: the next page of the log starts below it.
    id: int
    delivery_id: str
    event: str
    # Also the delivery's X-Ringwatch-Sequence.
    event_id: int
    status: str
    attempts: int
    last_status_code: int | None
    last_error: str | None
    created_at: datetime
    delivered_at: datetime | None


class TokenIn(Strict):
    role: Literal["agent", "reader", "admin"]
    name: str = Field(default="", max_length=128)
    # Days until it expires; None: RINGWATCH_TOKEN_TTL_DAYS; 0: never.
    expires_in_days: float | None = Field(default=None, ge=0, le=3650)
    # Agent tokens only: the nodes it may report on (None: all).
    nodes: NodeNames | None = Field(default=None, min_length=1)

    @model_validator(mode="after")
    def _scope_is_for_agents(self) -> TokenIn:
        if self.nodes is not None and self.role != "agent":
            raise ValueError("only agent tokens are scoped to nodes")
        return self


class TokenInfoOut(BaseModel):
    id: int
    role: str
    name: str
    created_at: datetime
    expires_at: datetime | None
    last_used_at: datetime | None
    revoked_at: datetime | None
    nodes: list[str] | None


class TokenOut(TokenInfoOut):
    token: str


class ErrorOut(BaseModel):
    error: str
    message: str
    detail: list[dict[str, Any]] | None = None


class RankEntryIn(Strict):
    rank: int = Field(ge=0, le=2**31 - 1, strict=True)
    host: NodeName
    local_rank: int = Field(ge=0, le=2**31 - 1, strict=True)
    gpu_uuid: str | None = Field(default=None, min_length=1, max_length=64)


class RankMapIn(Strict):
    """A job's rank table: its entries, or the text of its hostfile (one of the two)."""

    # 262144: services.rankmap.checks.MAX_RANKS, the most ranks one check takes.
    ranks: list[RankEntryIn] | None = Field(default=None, min_length=1, max_length=262_144)
    hostfile: str | None = Field(default=None, min_length=1, max_length=16 << 20)


class RankMapCheckOut(BaseModel):
    ok: bool
    ranks: int
    hosts: int
    findings: list[dict[str, Any]]
    skipped: list[str]


# -- one scheduler per fleet ------------------------------------------------------------

# A fleet's name ("default"; one per fleet where one API serves several).
FLEET_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.:-]*$"
FleetName = Annotated[str, Field(min_length=1, max_length=128, pattern=FLEET_NAME_PATTERN)]


def printable(value: str) -> str:
    if not value.isprintable():
        raise ValueError("must be printable (no control, separator or invisible characters)")
    return value


# The scheduler asking: a free-form worker id such as "host:pid".
Holder = Annotated[str, Field(min_length=1, max_length=255), AfterValidator(printable)]


class LeaseIn(Strict):
    """No time from the scheduler: the lease runs on the database's clock."""

    fleet: FleetName
    holder: Holder
    lease_s: float = Field(default=60.0, ge=5, le=3600,
                           description="seconds the lease holds unless renewed")


class LeaseOut(BaseModel):
    fleet: str
    # Who holds the lease now: the asker when ``leader``, else another scheduler (None
    # where it was handed back in between).
    holder: str | None
    leader: bool
    term: int
    expires_at: datetime | None
    lease_s: float
    cycle: int


class CycleIn(Strict):
    fleet: FleetName
    holder: Holder
    # Every node in the fleet's rotation now (a name given twice counts once).
    nodes: list[NodeName] = Field(max_length=262_144)


class CycleOut(BaseModel):
    fleet: str
    cycle: int
    # The node-pair tournament's slots: a node name, or null for a vacant slot.
    slots: list[str | None]


class FleetOut(BaseModel):
    name: str
    holder: str | None
    term: int
    lease_expires_at: datetime | None
    cycle: int
    # Nodes in its rotation (filled slots).
    nodes: int


class TokenSelfOut(BaseModel):
    """The presenting token, never its secret: ``prefix`` is its first few characters,
    enough to tell which token it is."""

    id: int
    role: str
    name: str
    prefix: str
    expires_at: datetime | None
    nodes: list[str] | None
