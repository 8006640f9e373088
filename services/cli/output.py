"""What the CLI prints: JSON for machines, a verdict for people."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any


def headline(finding: dict[str, Any]) -> str:
    """A finding's headline as every surface prints it (its ``headline.text``: op, size,
    measured of expected busbw, ratio; for a record stored before findings had one, its
    measured and expected busbw), and its ``cause`` beside it where one is known."""
    h = finding.get("headline")
    measured, expected = finding.get("measured_gbs"), finding.get("expected_gbs")
    if isinstance(h, dict) and isinstance(h.get("text"), str):
        figure = h["text"]
    elif isinstance(measured, int | float) and isinstance(expected, int | float) and expected:
        figure = f"{measured:g} of {expected:g} GB/s ({measured / expected:.2f})"
    else:
        figure = ""
    return with_cause(figure, finding)


def with_cause(figure: str, finding: Mapping[str, Any]) -> str:
    """``figure`` and, where the finding knows why (the transport NCCL took, a NIC counter,
    the fabric state: docs/transport.md), its ``cause`` beside it; the cause alone where
    there is no figure."""
    cause = finding.get("cause")
    if isinstance(cause, str) and cause:
        return f"{figure}; {cause}" if figure else cause
    return figure


def print_json(obj: Any) -> None:
    print(json.dumps(obj, indent=2, default=str))


def print_verdict(verdict: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print_json(verdict)
        return
    state = "HEALTHY" if verdict["healthy"] else "UNHEALTHY"
    print(f"{state}: {verdict['nodes_checked']} node(s) checked on {verdict['backend']}, "
          f"{verdict.get('rounds', 0)} round(s), {verdict.get('duration_s', 0)} s of probing")
    if verdict.get("exclude"):
        print(f"exclude: {', '.join(verdict['exclude'])}")
    for f in verdict.get("findings", []):
        if f["kind"] == "fabric_below_rated":  # the fleet's, not a node's: say how far
            print(f"  {f['kind']:<18} {f.get('scope')}: {f.get('reason', '')} [{f.get('severity', '')}]")
            continue
        where = f.get("node") or ",".join(f.get("nodes") or [])
        gpus = f" gpus {f['gpus']}" if f.get("gpus") else (f" gpu {f['gpu']}" if "gpu" in f else "")
        bw = headline(f)
        print(f"  {f['kind']:<18} {where}{gpus}{f' {bw}' if bw else ''} [{f.get('severity', '')}]")
    if verdict.get("suspects"):
        print(f"suspects (slow in an earlier cycle, not in the latest; --confirm re-probes them): "
              f"{', '.join(verdict['suspects'])}")
    if verdict.get("complete") is False:
        why = (f"the check's budget of {verdict['stopped_by']} ran out"
               if verdict.get("stopped_by") else "repeats ran out")
        print(f"incomplete: {why} with {verdict.get('undecided', 0)} group(s) undecided "
              "(never exclusions); the verdict rests on what was decided")
    if verdict.get("unprobed"):
        print(f"no fresh results for: {', '.join(verdict['unprobed'])}")
    if verdict.get("contended"):
        print(f"not judged, their links carried other traffic (a job's): "
              f"{', '.join(verdict['contended'])}")


def print_tokens(rows: list[dict[str, Any]], as_json: bool) -> None:
    if as_json:
        print_json(rows)
        return

    def when(value: Any) -> str:
        return value.isoformat(timespec="minutes") if value is not None else "-"

    print(f"{'id':>5}  {'role':<6}  {'name':<20}  {'last used':<22}  {'expires':<22}  state")
    for r in rows:
        state = "revoked" if r["revoked_at"] else "active"
        if r["nodes"] is not None:
            state += f", {len(r['nodes'])} node(s)"
        print(f"{r['id']:>5}  {r['role']:<6}  {r['name'][:20]:<20}  {when(r['last_used_at']):<22}  "
              f"{when(r['expires_at']):<22}  {state}")
