"""``ringwatch node``: the fleet's nodes through the API, with an admin RINGWATCH_TOKEN.

``retire`` takes nodes out of the fleet (POST /v1/nodes/retire): made-up nodes one agent
flooded in, or machines gone for good. Their history stays readable, and a node that
reports again comes back (docs/security.md, "The node table").
"""

from __future__ import annotations

import argparse
from typing import Any

from ringwatch.agents.places import node_list
from ringwatch.services.cli.errors import CliError
from ringwatch.services.cli.output import print_json, visible


def add_parser(sub: argparse._SubParsersAction) -> None:
    from ringwatch.services.cli.main import add_api_option

    p = sub.add_parser("node", help="the fleet's nodes through the API, as an admin: retire "
                                    "nodes from the fleet")
    nsub = p.add_subparsers(dest="node_command", required=True, parser_class=type(p))
    r = nsub.add_parser("retire", help="take nodes out of the fleet (lists, counts, map, "
                                       "/metrics, preflight), their history kept; one that "
                                       "reports again comes back")
    r.add_argument("nodes", nargs="+", metavar="NODE",
                   help="node names, or Slurm host lists (fake-[0000-8191])")
    r.add_argument("--dry-run", action="store_true",
                   help="say which nodes would be retired, change nothing")
    r.add_argument("--json", action="store_true")
    add_api_option(r, "the API whose fleet the nodes leave, with an admin RINGWATCH_TOKEN")


def cmd_node(args: argparse.Namespace) -> int:
    import httpx

    from ringwatch.services.settings import get_settings

    settings = get_settings()
    if not settings.token:
        raise CliError(f"RINGWATCH_TOKEN is not set: set it to an admin token for the API at "
                       f"{settings.api_url} (ringwatch token create --role admin)")
    names = _expand(args.nodes)
    with httpx.Client(base_url=settings.api_url, timeout=120,
                      headers={"Authorization": f"Bearer {settings.token}"}) as client:
        answer = _post(client, "/v1/nodes/retire", {"nodes": names}, {"dry_run": args.dry_run})
    if args.json:
        print_json(answer)
    else:
        print(_said(answer))
    return 0


def _expand(texts: list[str]) -> list[str]:
    from ringwatch.services.cli.hostlist import expand_hostlists

    try:
        names = expand_hostlists(texts)
    except ValueError as exc:
        raise CliError(str(exc)) from None
    if not names:
        raise CliError("no node named")
    return list(names)


def _post(client: Any, path: str, body: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    import httpx

    try:
        resp = client.post(path, json=body, params=params)
    except httpx.HTTPError as exc:
        raise CliError(f"API at {client.base_url} unreachable: {exc}") from None
    if resp.status_code != 200:
        try:
            reason = str(resp.json().get("message", resp.text))
        except ValueError:
            reason = resp.text
        raise CliError(f"API answered {resp.status_code}: {reason[:500]}")
    return resp.json()


def _said(answer: dict[str, Any]) -> str:
    """The answer for a person: what left the fleet (or would), and what had already; a
    name stored before today's name rule shown with its control characters escaped."""
    retired = [visible(n) for n in answer["retired"]]
    before = [visible(n) for n in answer["already_retired"]]
    verb = "would retire" if answer["dry_run"] else "retired"
    lines = [f"{verb} {len(retired)} node(s)" + (f": {node_list(retired)}" if retired else "")]
    if before:
        lines.append(f"already retired: {node_list(before)}")
    if answer["dry_run"]:
        lines.append("dry run: nothing changed")
    return "\n".join(lines)
