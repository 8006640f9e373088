"""From the ranks' own reports of one group (``ProbeAgent.run_group`` replies) to what the
group measured and what went wrong: the same reduction for the Ray driver and for
``ringwatch selftest``, which runs agents without Ray.

- A measurement per op and size that every rank finished: the group's time is its slowest
  rank's (nccl-tests' ``-a`` max over ranks), the median over repeats; wrong counts summed.
  Where a rank's links carried other traffic before the group formed (agents.contention),
  every one of them is ``contended``.
- ``data_corruption`` for each rank whose output held a wrong element.
- ``probe_error`` for each rank whose own code failed (an exception in the rank, an agent
  process that died, a machine that cannot probe). Peers whose collective broke because of
  it are listed in the finding, not blamed. When every failure was a broken collective, no
  rank can be singled out, and each rank that saw one is named.
"""

from __future__ import annotations

import statistics
from collections.abc import Collection
from typing import Any

from ringwatch.agents.collectives import algbw_gbs, busbw_gbs
from ringwatch.agents.contention import Traffic, contention
from ringwatch.agents.groups import split_member
from ringwatch.agents.probe import arrived_key, done_key, entered_key
from ringwatch.agents.spec import Finding, GroupSpec, Measurement, redop_for, weakest_timing

Reply = dict[str, Any]
# (kind, member) of the faults injected into a backend: findings they cause say so.
Injected = Collection[tuple[str, str]]


def measurements(spec: GroupSpec, replies: dict[int, Reply]) -> list[Measurement]:
    """One Measurement per op/size that every rank finished."""
    if len(replies) != spec.world_size:
        return []
    per_rank = [replies[r]["probes"] for r in range(spec.world_size)]
    finished = min(len(p) for p in per_rank)
    found = [measurement(spec, [p[i] for p in per_rank]) for i in range(finished)]
    taken, contended = transport_of(replies), contended_of(replies)
    for m in found:
        m.transport = taken
        m.contended = contended
    return found


def transport_of(replies: dict[int, Reply]) -> str | None:
    """The transports NCCL's log showed any rank of the group take, comma-joined in name
    order; None where no rank's log said (gloo, NCCL_DEBUG set elsewhere)."""
    seen = {t for reply in replies.values()
            for t in ((reply.get("transports") or {}).get("counts") or {})}
    return ",".join(sorted(seen)) if seen else None


def contended_of(replies: dict[int, Reply]) -> str | None:
    """agents.contention's verdict on the traffic the group's ranks read on their links
    before it formed: why every measurement of the group is contended, or None (the links
    were quiet, or no rank could read them)."""
    return contention(Traffic.from_dict(t) for t in (r.get("traffic") for r in replies.values())
                      if isinstance(t, dict) and "member" in t)


def measurement(spec: GroupSpec, probes: list[dict[str, Any]]) -> Measurement:
    """The group's figure for one op and size from each rank's probe record."""
    first = probes[0]
    # Per repeat, the group's time is its slowest rank's (nccl-tests' -a reduction).
    group_times = [max(p["times_s"][i] for p in probes) for i in range(len(first["times_s"]))]
    time_s = statistics.median(group_times)
    stats = None
    if len(group_times) > 1:
        stats = {"min": min(group_times) * 1e6, "median": time_s * 1e6,
                 "max": max(group_times) * 1e6}
    timings = [p["timing"] for p in probes if p.get("timing")]
    return Measurement(
        op=first["op"], scope=spec.scope, members=list(spec.members),
        size_bytes=first["size_bytes"], dtype=spec.dtype, warmup=spec.warmup,
        iters=spec.iters, time_us=time_s * 1e6,
        algbw_gbs=algbw_gbs(first["size_bytes"], time_s),
        busbw_gbs=busbw_gbs(first["op"], first["size_bytes"], time_s, spec.world_size),
        wrong=sum(p["wrong"] for p in probes), stats=stats,
        redop=first.get("redop", redop_for(first["op"], spec.redop)),
        timing=weakest_timing(timings) if timings else None,
        algo=spec.algo if first["op"] == "allreduce" else None,
    )


def _rank_finding(kind: str, spec: GroupSpec, rank: int, detail: dict[str, Any],
                  injected: Injected, injected_kind: str) -> Finding:
    m = spec.members[rank]
    node, local = split_member(m)
    info = {"members": list(spec.members), "scope": spec.scope, "rank": rank, **detail}
    if (injected_kind, m) in injected:
        info["injected"] = True
    return Finding(kind=kind, node=node, gpu=local, detail=info)


def transport_findings(replies: dict[int, Reply]) -> list[Finding]:
    """The ``transport_fallback`` findings the ranks read in NCCL's log (agents.transport),
    each once however many ranks of its node saw it."""
    found: list[Finding] = []
    for _, reply in sorted(replies.items()):
        for d in reply.get("transport_findings") or []:
            f = Finding.from_dict(d)
            if f not in found:
                found.append(f)
    return found


def corruption_findings(spec: GroupSpec, replies: dict[int, Reply],
                        injected: Injected = ()) -> list[Finding]:
    findings = []
    for rank, reply in sorted(replies.items()):
        bad = [p for p in reply.get("probes", []) if p["wrong"] > 0]
        if bad:
            findings.append(_rank_finding("data_corruption", spec, rank, {
                "wrong": sum(p["wrong"] for p in bad),
                "ops": sorted({f"{p['op']}/{p['size_bytes']}" for p in bad}),
            }, injected, "corrupt"))
    return findings


def failed_ranks(replies: dict[int, Reply], died: dict[int, str]) -> dict[int, dict[str, Any]]:
    """The ranks to blame for a group's errors, each with its stage and message.

    Ranks whose own code failed (origin ``local`` or ``setup``) and agents that died are to
    blame; a rank that only saw the collective break is a victim, unless nobody else
    failed, in which case the broken collective is all there is to report.
    """
    errors = {r: reply for r, reply in replies.items() if reply.get("status") == "error"}
    own = {r: {"stage": reply.get("stage"), "error": reply.get("error"),
               "origin": reply.get("origin", "local")}
           for r, reply in errors.items() if reply.get("origin", "local") != "collective"}
    own.update({r: {"stage": "agent_died", "error": why, "origin": "agent_died"}
                for r, why in died.items()})
    if own:
        return own
    return {r: {"stage": reply.get("stage"), "error": reply.get("error"), "origin": "collective"}
            for r, reply in errors.items()}


def error_findings(spec: GroupSpec, replies: dict[int, Reply], died: dict[int, str],
                   injected: Injected = ()) -> list[Finding]:
    """``probe_error`` findings for the ranks ``failed_ranks`` blames."""
    blamed = failed_ranks(replies, died)
    victims = sorted(r for r, reply in replies.items()
                     if reply.get("status") == "error" and r not in blamed)
    return [_rank_finding("probe_error", spec, rank, {
        **detail, "error": (detail.get("error") or "")[:500],
        **({"peers_failed": [spec.members[v] for v in victims]} if victims else {}),
    }, injected, "error") for rank, detail in sorted(blamed.items())]


# ---- hangs: who got least far, from the group's store -------------------------------


def rank_progress(store: Any, spec: GroupSpec, rank: int) -> int:
    """How far a rank got, from its keys in the group's store: 0 never arrived, 1 arrived,
    then one more for each op/size it entered and each it finished."""
    if not store.check([arrived_key(rank)]):
        return 0
    keys = [key(rank, op, size) for op in spec.ops for size in spec.sizes
            for key in (entered_key, done_key)]
    return 1 + sum(1 for k in keys if store.check([k]))


def _stage(spec: GroupSpec, progress: int) -> str:
    """Where a rank with this progress is stuck: join, form, OP/SIZE or leave."""
    if progress <= 1:
        return ("join", "form")[progress]
    steps = [f"{op}/{size}" for op in spec.ops for size in spec.sizes]
    index = (progress - 1) // 2  # entered step k: 2k+2; finished step k: 2k+3 (next step)
    return steps[index] if index < len(steps) else "leave"


def hang_suspects(store: Any, spec: GroupSpec, unfinished: list[int],
                  below: int | None = None) -> tuple[list[int], str]:
    """The ranks that held a group up, and where: those that got least far. Peers blocked
    in a collective wait at the same step as the rank that stalled inside it, so then all
    of them are named; a rank that never arrived, or stalled between steps, stands alone.

    ``below``: where a rank of the group failed with an error at that progress, ranks still
    waiting at or past it are that error's victims; only those that got less far hung."""
    progress = {r: rank_progress(store, spec, r) for r in unfinished}
    if below is not None:
        progress = {r: p for r, p in progress.items() if p < below}
    if not progress:
        return [], ""
    lowest = min(progress.values())
    return [r for r, p in progress.items() if p == lowest], _stage(spec, lowest)
