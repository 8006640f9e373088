"""``ringwatch status``: the fleet at a glance from the API, for a person at a terminal.

Tables with colour where standard output is a terminal (rich), the same figures as plain
aligned text where it is not (a pipe, a log, a cron mail), and JSON with ``--json``.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import httpx

from ringwatch.agents.places import finding_place
from ringwatch.services.cli.errors import CliError
from ringwatch.services.cli.output import headline, visible
from ringwatch.services.config import TOKEN_EXPIRY_WARN_S

# Incidents listed at most; the count says how many more are open.
MAX_LISTED = 20
# The incidents table's "where" column: a longer node list is cut with a count of the rest.
WHERE_WIDTH = 40
# Expiring tokens named on the tokens line at most; the count says how many expire.
MAX_TOKENS_LISTED = 5
STATUS_STYLE = {"healthy": "bold green", "degraded": "bold red", "unknown": "bold yellow"}


@dataclass
class FleetStatus:
    api_url: str
    health: dict[str, Any]
    incidents: list[dict[str, Any]]
    # Per node: when it was last seen and its probing duty cycle (a fraction).
    last_seen: dict[str, datetime]
    duty: dict[str, float]
    now: datetime
    # Per busy node: what holds it (the API's ``occupied``), so it reads as busy, not stale.
    busy: dict[str, dict[str, Any]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        newest = max(self.last_seen.values(), default=None)
        duty = sorted(self.duty.values())
        return {
            "api_url": self.api_url, "status": self.health["status"],
            "nodes": self.health["nodes"], "links": self.health["links"],
            "open_incidents": len(self.incidents), "incidents": self.incidents,
            "last_cycle_at": newest.isoformat() if newest else None,
            "last_cycle_age_s": round((self.now - newest).total_seconds(), 1) if newest else None,
            "duty_cycle": {"max": duty[-1], "median": statistics.median(duty),
                           "busiest_node": max(self.duty, key=lambda n: self.duty[n])}
            if duty else None,
            # Active tokens expiring within TOKEN_EXPIRY_WARN_S (an API from before says none).
            "tokens_expiring": self.health.get("tokens_expiring") or [],
            "busy": {"nodes": len(self.busy),
                     "jobs": len({o.get("job") for o in self.busy.values() if o.get("job")}),
                     "unknown": sorted(n for n, o in self.busy.items() if o.get("unknown")),
                     "sources": sorted({str(o.get("source")) for o in self.busy.values()}),
                     "by_node": self.busy},
        }


def fetch(client: httpx.Client) -> FleetStatus:
    """Everything ``status`` shows, from the reader routes of the API."""
    health = _get(client, "/v1/health")
    incidents = _get(client, "/v1/findings", params={"status": "open", "limit": 500})
    last_seen: dict[str, datetime] = {}
    duty: dict[str, float] = {}
    busy: dict[str, dict[str, Any]] = {}
    after = None
    while True:
        resp = _response(client, "/v1/nodes", params={"limit": 5000,
                                                      **({"after": after} if after else {})})
        for node in resp.json():
            last_seen[node["name"]] = datetime.fromisoformat(node["last_seen_at"])
            if node.get("duty_cycle") is not None:
                duty[node["name"]] = float(node["duty_cycle"])
            if node.get("occupied"):
                busy[node["name"]] = node["occupied"]
        after = resp.headers.get("X-Next-Cursor")
        if not after:
            break
    return FleetStatus(str(client.base_url), health, incidents, last_seen, duty,
                       datetime.now(UTC), busy)


def _response(client: httpx.Client, path: str, **kw: Any) -> httpx.Response:
    try:
        resp = client.get(path, **kw)
    except httpx.HTTPError as exc:
        raise CliError(f"API at {client.base_url} unreachable: {exc}") from None
    if resp.status_code == 401:
        raise CliError(f"API at {client.base_url} refused the token (401): set RINGWATCH_TOKEN "
                       "to a reader token")
    if resp.status_code != 200:
        raise CliError(f"API answered {resp.status_code} for {path}: {resp.text[:200]}")
    return resp


def _get(client: httpx.Client, path: str, **kw: Any) -> Any:
    return _response(client, path, **kw).json()


def ago(seconds: float | None) -> str:
    """A span as a person says it: 12 s, 5 min, 3 h, 2 d ago."""
    if seconds is None:
        return "never"
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f} {unit} ago"
    return f"{max(seconds, 0):.0f} s ago"


def where(incident: dict[str, Any]) -> str:
    """An incident's place as every surface prints it (agents.places): ``node-003 GPUs 2,5``,
    ``node-004 GPU 1``, a path's ends ``node-[001,007]``; a long node list cut to its column."""
    detail = incident.get("detail") or {}
    return finding_place({"nodes": incident.get("nodes") or [], "gpus": detail.get("gpus"),
                          "gpu": detail.get("gpu")}, width=WHERE_WIDTH)


def rows(status: FleetStatus) -> tuple[list[tuple[str, str]], list[list[str]]]:
    """The summary (label, value) and the incidents table, as text: what both renderings
    print."""
    d = status.to_dict()
    links = d["links"]
    link_text = ", ".join(f"{n} {s}" for s, n in sorted(links.items())) or "none probed yet"
    duty = d["duty_cycle"]
    summary = [
        ("status", d["status"].upper()),
        ("API", d["api_url"]),
        ("nodes", str(d["nodes"])),
        ("links", link_text),
        ("incidents", f"{d['open_incidents']} open"),
        ("last cycle", ago(d["last_cycle_age_s"])),
        ("duty cycle", f"max {duty['max']:.3%} ({duty['busiest_node']}), median "
                       f"{duty['median']:.3%}" if duty else "not reported yet"),
        ("busy", busy_text(d["busy"])),
    ]
    if d["tokens_expiring"]:
        summary.append(("tokens", tokens_text(d["tokens_expiring"], status.now)))
    table = []
    for inc in status.incidents[:MAX_LISTED]:
        opened = datetime.fromisoformat(inc["opened_at"]) if inc.get("opened_at") else None
        table.append([str(inc["id"]), inc["kind"], inc.get("severity") or "", where(inc),
                      ago((status.now - opened).total_seconds() if opened else None),
                      headline(inc.get("detail") or {})])
    # Names, headlines and causes are an agent's text: shown, never acted on by a terminal.
    return ([(label, visible(value)) for label, value in summary],
            [[visible(cell) for cell in row] for row in table])


def busy_text(busy: dict[str, Any]) -> str:
    """The nodes jobs hold, in one line: scheduled probes leave them alone and their health
    is their last results'."""
    if not busy["nodes"]:
        return "none (every node idle to the prober)"
    text = (f"{busy['nodes']} node(s) in {busy['jobs']} job(s) per {', '.join(busy['sources'])};"
            " not probed while busy, last results kept")
    if busy["unknown"]:
        text += f"; {len(busy['unknown'])} counted busy because occupancy could not be read"
    return text


def until(seconds: float) -> str:
    """A span ahead as a person says it: in 3 d, in 5 h, in 12 min, in 40 s."""
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"in {seconds / size:.0f} {unit}"
    return f"in {max(seconds, 0):.0f} s"


def tokens_text(expiring: list[dict[str, Any]], now: datetime) -> str:
    """The tokens line: how many active tokens expire soon, the soonest named with their
    role and how long they have."""
    named = []
    for t in expiring[:MAX_TOKENS_LISTED]:
        name = visible(str(t.get("name") or "")) or f"token {t.get('id')}"
        at = datetime.fromisoformat(str(t["expires_at"]))
        named.append(f"{name} ({t.get('role')}) {until((at - now).total_seconds())}")
    more = len(expiring) - len(named)
    return (f"{len(expiring)} expire within {TOKEN_EXPIRY_WARN_S / 86400:g} days: "
            f"{', '.join(named)}{f' and {more} more' if more > 0 else ''}")


HEADERS = ["id", "kind", "severity", "where", "opened", "busbw"]


def plain(status: FleetStatus) -> str:
    summary, table = rows(status)
    width = max(len(label) for label, _ in summary)
    lines = [f"{label:<{width}}  {value}" for label, value in summary]
    if table:
        cols = [max(len(h), *(len(r[i]) for r in table)) for i, h in enumerate(HEADERS)]
        lines += ["", "  ".join(h.upper().ljust(c) for h, c in zip(HEADERS, cols, strict=True))
                  .rstrip()]
        lines += ["  ".join(v.ljust(c) for v, c in zip(r, cols, strict=True)).rstrip()
                  for r in table]
        more = len(status.incidents) - len(table)
        if more > 0:
            lines.append(f"... and {more} more (GET /v1/findings?status=open)")
    return "\n".join(lines)


def render_rich(status: FleetStatus) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    summary, table = rows(status)
    console = Console()
    head = Table.grid(padding=(0, 2))
    head.add_column(style="bold")
    head.add_column()
    for label, value in summary:
        style = STATUS_STYLE.get(value.lower(), "") if label == "status" else ""
        if label == "tokens":
            style = "bold yellow"
        # A value may hold free text (a token's name): shown as written, never as markup.
        head.add_row(label, f"[{style}]{escape(value)}[/]" if style else escape(value))
    console.print(head)
    if table:
        t = Table(title=f"open incidents ({len(status.incidents)})", title_justify="left")
        for h in HEADERS:
            t.add_column(h)
        for r in table:  # as written, never as markup
            t.add_row(*(escape(c) for c in r), style="red" if r[2] == "critical" else "yellow")
        console.print(t)
