"""What the CLI prints: JSON for machines, a verdict for people.

Text that an agent or an admin supplied (a headline, a cause, a node's or a token's name, an
API's error message) can hold terminal control sequences: clear the screen, set the window
title, an OSC 8 link. Every CLI surface prints such text through ``visible``; JSON output is
safe as it is (``json.dumps`` escapes control characters)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from ringwatch.agents.places import finding_place, node_list


def visible(text: str) -> str:
    """Free text fit for one terminal line: control and invisible characters (ESC, BEL, C1
    controls, a newline, bidirectional overrides) shown as escapes, never acted on."""
    return "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text)


def say(line: str = "") -> None:
    """Print one line of output whose parts may hold free text."""
    print(visible(line))


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
    # The sim's probing time is its model's, not this machine's (docs/formats.md).
    modeled = " (modeled)" if verdict["backend"] == "sim" else ""
    in_all = f", {verdict['command_s']:.1f} s in all" if "command_s" in verdict else ""
    say(f"{state}: {verdict['nodes_checked']} node(s) checked on {verdict['backend']}, "
        f"{verdict.get('rounds', 0)} round(s), {verdict.get('duration_s', 0)} s of probing"
        f"{modeled}{in_all}")
    if verdict.get("exclude"):
        say(f"exclude: {node_list(verdict['exclude'])}")
    for f in verdict.get("findings", []):
        if f["kind"] == "fabric_below_rated":  # the fleet's, not a node's: say how far
            say(f"  {f['kind']:<18} {f.get('scope')}: {f.get('reason', '')} [{f.get('severity', '')}]")
            continue
        bw = headline(f)
        say(f"  {f['kind']:<18} {finding_place(f)}{f' {bw}' if bw else ''} [{f.get('severity', '')}]")
    if verdict.get("suspects"):
        say(f"suspects (slow in an earlier cycle, not in the latest; --confirm re-probes them): "
            f"{node_list(verdict['suspects'])}")
    if verdict.get("complete") is False:
        why = (f"the check's budget of {verdict['stopped_by']} ran out"
               if verdict.get("stopped_by") else "repeats ran out")
        say(f"incomplete: {why} with {verdict.get('undecided', 0)} group(s) undecided "
            "(never exclusions); the verdict rests on what was decided")
    if verdict.get("unprobed"):
        say(f"no fresh results for: {node_list(verdict['unprobed'])}")
    if verdict.get("contended"):
        say(f"not judged, their links carried other traffic (a job's): "
            f"{node_list(verdict['contended'])}")


def print_tokens(rows: list[dict[str, Any]], as_json: bool) -> None:
    if as_json:
        print_json(rows)
        return

    def when(value: Any) -> str:
        return value.isoformat(timespec="minutes") if value is not None else "-"

    say(f"{'id':>5}  {'role':<6}  {'name':<20}  {'last used':<22}  {'expires':<22}  state")
    for r in rows:
        state = "revoked" if r["revoked_at"] else "active"
        if r["nodes"] is not None:
            state += f", {len(r['nodes'])} node(s)"
        name = visible(r["name"])[:20]
        say(f"{r['id']:>5}  {r['role']:<6}  {name:<20}  {when(r['last_used_at']):<22}  "
            f"{when(r['expires_at']):<22}  {state}")
