"""Workload profiles: probe what a kind of training job will do, on the communicators it
will form, at the message sizes it will send (docs/workloads.md).

A profile names the collectives a job's parallelism runs and the sizes it runs them at:

- ``ddp``: AllReduce of gradient buckets across the data-parallel set (torch DDP's 25 MiB
  default bucket, its 1 MiB first bucket, and a large one), ring and tree apart;
- ``fsdp``: AllGather of parameter shards before each unit's forward and backward,
  ReduceScatter of its gradients after, and AllReduce at the same sizes (the identity
  ReduceScatter + AllGather = AllReduce is checked on them);
- ``moe``: AllToAll of token dispatch and combine (latency-bound, KiB to a few MiB)
  inside nodes and across them, plus the dense layers' AllReduce;
- ``pipeline``: send/recv of activations between neighbouring stages.

Given the job's parallel layout (``JobLayout``: tensor, pipeline and data parallel
degrees) over its ranks, ``communicators`` names the job's own groups: tensor-parallel
groups of consecutive ranks (inside a node when ``tp`` divides the GPUs of one), data-
parallel groups across them, pipeline neighbours as pairs. Ranks are ordered tensor
fastest, then data, then pipeline: Megatron-LM's default order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from ringwatch.agents.spec import ALGOS

MIB = 1 << 20
KIB = 1 << 10
# torch DDP's default bucket_cap_mb (and its first bucket, kept small so the first
# AllReduce starts early in the backward pass).
DDP_BUCKET = 25 * MIB
DDP_FIRST_BUCKET = 1 * MIB
# Communicator kinds of a job (``JobLayout.communicators``).
COMM_KINDS: tuple[str, ...] = ("tp", "dp", "pp")


@dataclass(frozen=True)
class CommProbe:
    """What one kind of the job's communicators runs: ops at sizes."""

    ops: tuple[str, ...]
    sizes: tuple[int, ...]


@dataclass(frozen=True)
class Workload:
    """A profile: what its fabric check runs (``ops`` at ``sizes`` on the adaptive plan),
    what each kind of the job's communicators runs when a layout is given, the AllReduce
    algorithms probed apart, and why (the docs print ``why``)."""

    name: str
    ops: tuple[str, ...]
    sizes: tuple[int, ...]
    comms: dict[str, CommProbe] = field(default_factory=dict)
    algos: tuple[str, ...] = ()
    # Sizes at which ReduceScatter + AllGather is checked against AllReduce.
    identity_sizes: tuple[int, ...] = ()
    why: str = ""


# The profiles by name, as the API and the CLI take them (the keys of WORKLOADS).
ProfileName = Literal["ddp", "fsdp", "moe", "pipeline"]

WORKLOADS: dict[str, Workload] = {
    w.name: w for w in (
        Workload(
            "ddp", ops=("allreduce",), sizes=(DDP_FIRST_BUCKET, DDP_BUCKET, 4 * DDP_BUCKET),
            comms={"dp": CommProbe(("allreduce",), (DDP_FIRST_BUCKET, DDP_BUCKET, 4 * DDP_BUCKET)),
                   "tp": CommProbe(("allreduce",), (16 * MIB,))},
            algos=ALGOS,
            why="a plain model (GPT, BERT, ResNet) reduces its gradients in buckets: DDP's "
                "first bucket of 1 MiB, its default of 25 MiB, and 100 MiB for a larger "
                "bucket_cap_mb; across nodes that is bandwidth-bound, and NCCL picks a ring "
                "or a tree by size, so both are probed"),
        Workload(
            "fsdp", ops=("allgather", "reducescatter", "allreduce"), sizes=(16 * MIB, 128 * MIB),
            comms={"dp": CommProbe(("allgather", "reducescatter", "allreduce"),
                                   (16 * MIB, 128 * MIB)),
                   "tp": CommProbe(("allreduce",), (16 * MIB,))},
            algos=ALGOS, identity_sizes=(16 * MIB, 128 * MIB),
            why="ZeRO-3/FSDP gathers each unit's parameter shards before its forward and "
                "backward (AllGather) and scatters its gradients after (ReduceScatter): one "
                "transformer layer of a 7-70B model is tens to hundreds of MiB in bf16; "
                "AllReduce at the same sizes checks the identity RS + AG = AR"),
        Workload(
            "moe", ops=("alltoall", "allreduce"), sizes=(64 * KIB, 1 * MIB, 4 * MIB),
            comms={"tp": CommProbe(("alltoall",), (64 * KIB, 1 * MIB, 4 * MIB)),
                   "dp": CommProbe(("alltoall", "allreduce"), (64 * KIB, 1 * MIB, 4 * MIB))},
            algos=ALGOS,
            why="a Mixture-of-Experts layer dispatches tokens to experts and combines them "
                "back (AllToAll), twice per layer in each pass: a micro-batch's tokens per "
                "peer are KiB to a few MiB, so latency decides, inside a node (expert "
                "parallel over NVLink) and across nodes; the dense layers still AllReduce"),
        Workload(
            "pipeline", ops=("sendrecv",), sizes=(4 * MIB, 32 * MIB),
            comms={"pp": CommProbe(("sendrecv",), (4 * MIB, 32 * MIB)),
                   "tp": CommProbe(("allreduce",), (16 * MIB,))},
            why="pipeline stages pass each micro-batch's activations to the next stage "
                "(send/recv between neighbours): a micro-batch of 1-8 sequences of 4096 "
                "tokens at hidden size 4096-8192 in bf16 is a few to tens of MiB"),
    )
}


def fabric_ops(work: Workload, ops: Sequence[str]) -> tuple[str, ...]:
    """The ops of the fabric check under a profile: the check monitoring runs (``ops``, at
    its own sizes) with the profile's added, so a profiled check judges every link as an
    unprofiled one does; the profile's sizes are its job groups'."""
    return tuple(dict.fromkeys((*ops, *work.ops)))


def workload(name: str) -> Workload:
    try:
        return WORKLOADS[name]
    except KeyError:
        raise ValueError(f"profile must be one of {', '.join(WORKLOADS)}, got {name!r}") from None


class LayoutError(ValueError):
    """A parallel layout that does not fit the job's ranks."""


@dataclass(frozen=True)
class JobLayout:
    """A job's parallel degrees: tensor (``tp``), pipeline (``pp``) and data (``dp``);
    ``dp`` None takes what the ranks leave (world size / (tp * pp)); ``tp`` None takes the
    GPUs of one node (``resolve``'s ``per_node``)."""

    tp: int | None = None
    pp: int = 1
    dp: int | None = None

    def resolve(self, world_size: int, per_node: int | None = None) -> JobLayout:
        """This layout with ``tp`` and ``dp`` filled in; LayoutError when it does not fit
        the ranks."""
        tp = self.tp if self.tp is not None else per_node
        if tp is None:
            raise LayoutError("the job's tensor-parallel degree (tp) is not set")
        for name, value in (("tp", tp), ("pp", self.pp), ("dp", self.dp)):
            if value is not None and value < 1:
                raise LayoutError(f"{name} must be >= 1, got {value}")
        per = tp * self.pp
        if world_size % per:
            raise LayoutError(f"tp {tp} x pp {self.pp} = {per} does not divide the job's "
                              f"{world_size} ranks")
        dp = world_size // per
        if self.dp is not None and self.dp != dp:
            raise LayoutError(f"tp {tp} x pp {self.pp} x dp {self.dp} = "
                              f"{per * self.dp} ranks, but the job has {world_size}")
        return JobLayout(tp, self.pp, dp)

    def communicators(self, ranks: Sequence[str]) -> dict[str, list[tuple[str, ...]]]:
        """The job's groups by kind, each a tuple of members in rank order: ``tp`` and
        ``dp`` groups (only those of two or more ranks), and ``pp`` neighbour pairs (stage
        s with stage s + 1 at the same tensor and data position)."""
        lay = self.resolve(len(ranks))
        tp, dp, pp = lay.tp or 1, lay.dp or 1, lay.pp

        def rank(t: int, d: int, p: int) -> str:
            return ranks[t + tp * (d + dp * p)]

        out: dict[str, list[tuple[str, ...]]] = {}
        if tp > 1:
            out["tp"] = [tuple(rank(t, d, p) for t in range(tp))
                         for p in range(pp) for d in range(dp)]
        if dp > 1:
            out["dp"] = [tuple(rank(t, d, p) for d in range(dp))
                         for p in range(pp) for t in range(tp)]
        if pp > 1:
            out["pp"] = [(rank(t, d, p), rank(t, d, p + 1))
                         for p in range(pp - 1) for d in range(dp) for t in range(tp)]
        return out

    def to_dict(self) -> dict[str, int | None]:
        return {"tp": self.tp, "pp": self.pp, "dp": self.dp}

    @classmethod
    def from_dict(cls, d: dict[str, int | None]) -> JobLayout:
        """``to_dict`` undone; an unset degree takes its default (pp 1)."""
        return cls(tp=d.get("tp"), pp=d.get("pp") or 1, dp=d.get("dp"))


def disjoint_rounds(groups: Sequence[tuple[str, ...]]) -> list[list[tuple[str, ...]]]:
    """Groups packed greedily into rounds whose groups share no rank (pipeline pairs
    overlap at every inner stage: stage s pairs with s - 1 and with s + 1)."""
    rounds: list[tuple[set[str], list[tuple[str, ...]]]] = []
    for g in groups:
        for used, members in rounds:
            if used.isdisjoint(g):
                used.update(g)
                members.append(g)
                break
        else:
            rounds.append((set(g), [g]))
    return [members for _, members in rounds]
