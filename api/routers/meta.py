"""Liveness and Prometheus metrics."""

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse
from sqlalchemy import text

from api.deps import SessionDep
from services.monitor import fleet

router = APIRouter(tags=["meta"])


@router.get("/healthz")
def healthz(session: SessionDep) -> dict:
    """Liveness: the API answers and its database does."""
    session.execute(text("SELECT 1"))
    return {"ok": True}


@router.get("/metrics", response_class=PlainTextResponse)
def metrics(session: SessionDep) -> str:
    """Prometheus text exposition of link health."""
    s = fleet.summary(session)
    lines = [
        "# HELP ringwatch_links Probed links and groups by health status.",
        "# TYPE ringwatch_links gauge",
        *[f'ringwatch_links{{status="{k}"}} {v}' for k, v in sorted(s["links"].items())],
        "# HELP ringwatch_open_findings Open findings.",
        "# TYPE ringwatch_open_findings gauge",
        f"ringwatch_open_findings {s['open_findings']}",
        "# HELP ringwatch_nodes Nodes seen.",
        "# TYPE ringwatch_nodes gauge",
        f"ringwatch_nodes {s['nodes']}",
        "# HELP ringwatch_link_busbw_gbs Last busbw of each link or group (GB/s, nccl-tests).",
        "# TYPE ringwatch_link_busbw_gbs gauge",
        "# HELP ringwatch_link_degraded 1 while the link or group is degraded.",
        "# TYPE ringwatch_link_degraded gauge",
        "# HELP ringwatch_node_duty_cycle Fraction of the node's GPU time spent probing.",
        "# TYPE ringwatch_node_duty_cycle gauge",
    ]
    for link in fleet.links(session, status=None, scope=None, node=None):
        labels = (f'scope="{link["scope"]}",op="{link["op"]}",'
                  f'members="{",".join(link["members"])}"')
        lines.append(f"ringwatch_link_busbw_gbs{{{labels}}} {link['busbw_gbs']:.6g}")
        lines.append(f"ringwatch_link_degraded{{{labels}}} {int(link['status'] == 'degraded')}")
    for node in fleet.nodes(session):
        if node["duty_cycle"] is not None:
            lines.append(f'ringwatch_node_duty_cycle{{node="{node["name"]}"}} {node["duty_cycle"]:.6g}')
    lines += ["# HELP ringwatch_shipper_batches Batches in each scheduler's spool as its last "
              "batch reported: pending, failed (moved aside after repeated 5xx), rejected (4xx).",
              "# TYPE ringwatch_shipper_batches gauge"]
    for host, state in fleet.shipper_states(session).items():
        for key in ("pending", "failed", "rejected"):
            lines.append(f'ringwatch_shipper_batches{{host="{_label(host)}",state="{key}"}} '
                         f'{int(state.get(key, 0))}')
    return "\n".join(lines) + "\n"


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
