"""``ringwatch kubernetes sync`` (the Slurm drain's equivalent) and ``kubernetes check`` (the
init container's gate), against recorded Kubernetes API answers.

A local HTTP server answers as the API server does (tests/data/kubernetes: a NodeList of full
Node objects, a 422 Status for a JSON patch whose test failed, all built in the documented
shapes, not captured from a cluster) and as ringwatch's API does (GET /v1/fleet/nodes, held
to its schema). It applies each JSON patch the sync sends to the nodes it holds, with RFC
6902's ``test``, and records it: what a node ends as is what the patches made it. No
Kubernetes cluster ran any of this.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest

from ringwatch.services.cli.kubernetes import Sync
from ringwatch.services.cli.main import build_parser, main
from ringwatch.services.kubernetes.client import ServiceAccount
from ringwatch.services.kubernetes.remediation import (
    HEALTH_LABEL,
    TAINT_KEY,
    KubeNode,
    judge,
    match_nodes,
    plan,
    tainted_cap,
)

KUBE = Path(__file__).parent / "data" / "kubernetes"
TOKEN = "eyJhbGciOiJSUzI1NiIsImtpZCI6InJ3In0.cmVtZWRpYXRpb24.c2lnbmF0dXJl"
READER = "rw_reader-token-for-the-sync"
NOW = datetime.now(UTC)
GPU_TAINT = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}
MAINTENANCE = {"key": "example.com/maintenance", "value": "window-2", "effect": "NoSchedule"}


def _state(name: str, state: str = "ok", *, age_s: float | None = 600.0,
           excluded_by: tuple[str, ...] = ()) -> dict[str, Any]:
    """One node of GET /v1/fleet/nodes."""
    return {"name": name, "backend": "nccl", "profile": "h100-sxm-8",
            "last_probed_at": (NOW - timedelta(seconds=age_s)).isoformat()
            if age_s is not None else None,
            "skipped_reason": None, "occupied": None, "links": 12,
            "degraded_links": 3 if excluded_by else 0, "open_findings": 1 if excluded_by else 0,
            "nvlink_ratio": 0.4 if excluded_by else 0.98, "net_ratio": 0.97,
            "ratio": 0.4 if excluded_by else 0.97, "state": state,
            "excluded_by": list(excluded_by)}


def fleet(**changed: dict[str, Any]) -> dict[str, Any]:
    """ringwatch's word: gpu-001 healthy, gpu-002 excluded (NVLink), gpu-003 recovered,
    gpu-004 not probed for three days, gpu-006 excluded (corruption), gpu-007 a node
    Kubernetes does not list. gpu-005 and cpu-001 are not ringwatch's."""
    nodes = {"gpu-001": _state("gpu-001"),
             "gpu-002": _state("gpu-002", "degraded", excluded_by=("nvlink_degraded",)),
             "gpu-003": _state("gpu-003"),
             "gpu-004": _state("gpu-004", age_s=3 * 86400),
             "gpu-006": _state("gpu-006", "degraded", excluded_by=("data_corruption", "hang")),
             "gpu-007": _state("gpu-007")}
    nodes.update(changed)
    return {"nodes": list(nodes.values()), "degraded_ratio": {"nccl": 0.7}}


# ---- the fake API server -------------------------------------------------------------------


class PatchRefused(Exception):
    pass


def _pointer(path: str) -> list[str]:
    return [p.replace("~1", "/").replace("~0", "~") for p in path.lstrip("/").split("/")]


def apply_json_patch(doc: dict, ops: list[dict]) -> dict:
    """RFC 6902 on a copy of ``doc``: add, remove, replace, test; all or nothing."""
    doc = copy.deepcopy(doc)
    for op in ops:
        *parents, last = _pointer(op["path"])
        node: Any = doc
        try:
            for key in parents:
                node = node[int(key)] if isinstance(node, list) else node[key]
            if op["op"] == "test":
                got = node[int(last)] if isinstance(node, list) else node[last]
                if got != op["value"]:
                    raise PatchRefused(f"testing value {op['path']} failed: test failed")
            elif op["op"] == "remove":
                del node[int(last) if isinstance(node, list) else last]
            elif op["op"] == "add" and isinstance(node, list):
                node.insert(len(node) if last == "-" else int(last), op["value"])
            elif op["op"] == "add" or (op["op"] == "replace"
                                       and (last in node if isinstance(node, dict)
                                            else int(last) < len(node))):
                node[int(last) if isinstance(node, list) else last] = op["value"]
            else:
                raise PatchRefused(f"{op['op']} {op['path']}: no such member")
        except (KeyError, IndexError, ValueError, TypeError) as exc:
            raise PatchRefused(f"{op['op']} {op['path']}: {exc!r}") from None
    return doc


@dataclass
class Cluster:
    """What the server holds and what it was asked."""

    url: str = ""
    nodes: dict[str, dict] = field(default_factory=dict)
    fleet: dict[str, Any] = field(default_factory=fleet)
    requests: list[tuple[str, str, dict[str, list[str]], dict[str, str]]] = field(
        default_factory=list)
    patches: list[tuple[str, list[dict]]] = field(default_factory=list)
    # Runs before a PATCH is applied: another controller changing the node meanwhile.
    before_patch: Callable[[str, dict], None] | None = None
    mode: str = "ok"  # ok, ringwatch-401, kube-403, hang

    def patched(self) -> set[str]:
        return {name for name, _ in self.patches}


def _selected(node: dict, selector: str) -> bool:
    labels = node["metadata"].get("labels") or {}
    for term in filter(None, selector.split(",")):
        key, _, value = term.partition("=")
        if labels.get(key) != value:
            return False
    return True


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    state = Cluster()
    for item in json.loads((KUBE / "built-nodes-full.json").read_text())["items"]:
        state.nodes[item["metadata"]["name"]] = item
    release = threading.Event()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

        def _seen(self) -> tuple[str, dict[str, list[str]]]:
            parts = urlsplit(self.path)
            query = parse_qs(parts.query, keep_blank_values=True)
            state.requests.append((self.command, parts.path, query,
                                   {k.lower(): v for k, v in self.headers.items()}))
            if state.mode == "hang":
                release.wait(30)
            return parts.path, query

        def do_GET(self) -> None:
            path, query = self._seen()
            if path == "/v1/fleet/nodes":
                if state.mode == "ringwatch-401":
                    return self.answer(401, {"error": "unauthorized",
                                             "message": "invalid or revoked token"})
                return self.answer(200, state.fleet)
            if path == "/api/v1/nodes":
                if state.mode == "kube-403":
                    return self.answer(403, json.loads(
                        (KUBE / "built-status-403.json").read_text()))
                items = [n for n in state.nodes.values()
                         if _selected(n, query.get("labelSelector", [""])[0])]
                start = int(query.get("continue", ["0"])[0] or 0)
                limit = int(query["limit"][0])
                more = start + limit < len(items)
                return self.answer(200, {
                    "kind": "NodeList", "apiVersion": "v1",
                    "metadata": {"resourceVersion": "48213371",
                                 **({"continue": str(start + limit)} if more else {})},
                    "items": items[start:start + limit]})
            self.answer(404, {"kind": "Status", "code": 404, "message": "not found"})

        def do_PATCH(self) -> None:
            path, _ = self._seen()
            ops = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            name = path.removeprefix("/api/v1/nodes/")
            assert self.headers["Content-Type"] == "application/json-patch+json"
            state.patches.append((name, ops))
            if state.before_patch is not None:
                state.before_patch(name, state.nodes[name])
            try:
                node = apply_json_patch(state.nodes[name], ops)
            except PatchRefused:
                return self.answer(422, json.loads(
                    (KUBE / "built-status-422-test-failed.json").read_text()))
            node["metadata"]["resourceVersion"] = str(
                int(node["metadata"]["resourceVersion"]) + 1000)
            state.nodes[name] = node
            self.answer(200, node)

        def answer(self, code: int, body: Any) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    state.url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        yield state
    finally:
        release.set()
        server.shutdown()
        server.server_close()


def sync(cluster: Cluster, tmp_path: Path, *argv: str) -> Sync:
    """The command as ``ringwatch kubernetes sync --once ARGV`` runs it, its service account
    token in ``tmp_path`` and both APIs on the fake server."""
    args = build_parser().parse_args(["kubernetes", "sync", "--once", *argv])
    token = tmp_path / "token"
    token.write_text(TOKEN + "\n")
    account = ServiceAccount(cluster.url, token_path=token, ca_path=tmp_path / "no-ca.crt")
    return Sync(args, cluster.url, READER, account)


def ours_removed(node: dict) -> dict:
    """A node with ringwatch's label and taints taken out, and its resourceVersion: what
    nothing ringwatch does may change."""
    node = copy.deepcopy(node)
    node["metadata"].pop("resourceVersion")
    (node["metadata"].get("labels") or {}).pop(HEALTH_LABEL, None)
    kept = [t for t in node["spec"].pop("taints", []) if t["key"] != TAINT_KEY]
    if kept:  # a list ringwatch made holds only its own taint
        node["spec"]["taints"] = kept
    return node


def taints(cluster: Cluster, name: str) -> list[dict] | None:
    return cluster.nodes[name]["spec"].get("taints")


def health(cluster: Cluster, name: str) -> str | None:
    return cluster.nodes[name]["metadata"]["labels"].get(HEALTH_LABEL)


# ---- sync ------------------------------------------------------------------------------------


def test_the_fake_ringwatch_answer_is_what_the_api_schema_gives() -> None:
    from ringwatch.api.schemas import NodeStatesOut

    assert NodeStatesOut.model_validate(fleet()).model_dump(mode="json")["nodes"][1][
        "excluded_by"] == ["nvlink_degraded"]


def test_a_dry_run_says_what_it_would_do_and_patches_nothing(cluster, tmp_path, capsys) -> None:
    before = copy.deepcopy(cluster.nodes)
    code = sync(cluster, tmp_path).cycle()
    out = capsys.readouterr().out
    assert [m for m, *_ in cluster.requests] == ["GET", "GET"] and not cluster.patches
    assert cluster.nodes == before
    (_, ringwatch, _, rh), (_, kube, query, kh) = cluster.requests
    assert (ringwatch, rh["authorization"]) == ("/v1/fleet/nodes", f"Bearer {READER}")
    assert (kube, kh["authorization"]) == ("/api/v1/nodes", f"Bearer {TOKEN}")
    assert query == {"labelSelector": ["nvidia.com/gpu.present=true"], "limit": ["500"]}
    lines = out.splitlines()
    assert ("dry run: gpu-002: would label ringwatch.io/health=degraded: excluded by "
            "nvlink_degraded") in lines
    assert "dry run: gpu-002: would taint ringwatch.io/unhealthy=nvlink_degraded:NoSchedule" in lines
    assert "dry run: gpu-003: would untaint ringwatch.io/unhealthy=hang:NoSchedule: healthy again" \
        in lines
    assert "dry run: gpu-005: would label ringwatch.io/health=unknown: not a node of ringwatch's " \
        "fleet" in lines
    assert not [line for line in lines if line.startswith("dry run: gpu-001")]  # as it should be
    assert lines[-1] == ("6 node(s) (nvidia.com/gpu.present=true): 2 healthy, 2 degraded, "
                         "2 unknown; 1 tainted (cap 1); dry run: nothing changed (--apply acts)")
    assert code == 1  # the cap left gpu-006 untainted
    # docs/kubernetes.md shows this run's output, line for line.
    docs = (Path(__file__).parents[1] / "docs" / "kubernetes.md").read_text()
    shown = docs.split("**A dry run by default.**", 1)[1].split("```\n", 2)[1].splitlines()
    assert shown and set(shown) <= set(lines), set(shown) - set(lines)


def test_apply_labels_every_node_taints_the_excluded_and_untaints_the_recovered(
        cluster, tmp_path, capsys) -> None:
    before = copy.deepcopy(cluster.nodes)
    code = sync(cluster, tmp_path, "--apply", "--max-tainted-share", "0.5").cycle()
    assert code == 0
    # Every GPU node carries its health; gpu-001 had it already, so it was not patched.
    assert {n: health(cluster, n) for n in cluster.nodes if n != "cpu-001"} == {
        "gpu-001": "healthy", "gpu-002": "degraded", "gpu-003": "healthy",
        "gpu-004": "unknown", "gpu-005": "unknown", "gpu-006.ec2.internal": "degraded"}
    assert cluster.patched() == {"gpu-002", "gpu-003", "gpu-004", "gpu-005",
                                 "gpu-006.ec2.internal"}
    # The excluded nodes carry the taint with the finding's kind (the first, critical first);
    # the recovered one lost it; every other taint is where it was.
    assert taints(cluster, "gpu-002") == [
        GPU_TAINT, {"key": TAINT_KEY, "value": "nvlink_degraded", "effect": "NoSchedule"}]
    assert taints(cluster, "gpu-006.ec2.internal") == [
        {"key": TAINT_KEY, "value": "data_corruption", "effect": "NoSchedule"}]
    assert taints(cluster, "gpu-003") == [MAINTENANCE]
    assert taints(cluster, "gpu-004") is None
    # Nothing but ringwatch's own label and taint changed on any node: not gpu-005's
    # ringwatch.io/set-aside label and taint, not a Node the selector left out.
    assert {n: ours_removed(v) for n, v in cluster.nodes.items()} == {
        n: ours_removed(v) for n, v in before.items()}
    assert cluster.nodes["cpu-001"] == before["cpu-001"]
    # A node without a taint list gets one only as it was read (its resourceVersion).
    (ops,) = [ops for name, ops in cluster.patches if name == "gpu-006.ec2.internal"]
    assert {"op": "test", "path": "/metadata/resourceVersion", "value": "48000006"} in ops
    out = capsys.readouterr().out
    assert "gpu-006.ec2.internal (ringwatch gpu-006): taint " \
        "ringwatch.io/unhealthy=data_corruption:NoSchedule" in out
    # The next cycle finds every node as it should be and patches nothing.
    cluster.patches.clear()
    assert sync(cluster, tmp_path, "--apply", "--max-tainted-share", "0.5").cycle() == 0
    assert cluster.patches == []


def test_the_cap_stops_tainting_and_says_so(cluster, tmp_path, capsys) -> None:
    code = sync(cluster, tmp_path, "--apply").cycle()
    err = capsys.readouterr().err
    assert code == 1
    # 5 % of 6 nodes, at least one: gpu-002 (first by name) is tainted, gpu-006 labelled only.
    assert [t["key"] for t in taints(cluster, "gpu-002")] == ["nvidia.com/gpu", TAINT_KEY]
    assert health(cluster, "gpu-006.ec2.internal") == "degraded"
    assert taints(cluster, "gpu-006.ec2.internal") is None
    assert ("the cap holds: 1 of 6 node(s) may carry the taint (--max-tainted-share 0.05, at "
            "least 1), so 1 excluded node(s) stay untainted: gpu-006.ec2.internal") in err
    # gpu-002 recovers: its taint goes, which leaves room for gpu-006's in the same cycle.
    cluster.fleet = fleet(**{"gpu-002": _state("gpu-002")})
    assert sync(cluster, tmp_path, "--apply").cycle() == 0
    assert taints(cluster, "gpu-002") == [GPU_TAINT]
    assert taints(cluster, "gpu-006.ec2.internal") == [
        {"key": TAINT_KEY, "value": "data_corruption", "effect": "NoSchedule"}]


def test_a_taint_another_controller_adds_meanwhile_is_never_overwritten(
        cluster, tmp_path, capsys) -> None:
    foreign = {"key": "nvsentinel.dgxc.nvidia.com/gpu-error", "value": "true",
               "effect": "NoSchedule"}

    def other_controller(name: str, node: dict) -> None:
        if name == "gpu-003" and foreign not in node["spec"]["taints"]:
            node["spec"]["taints"].insert(0, foreign)

    cluster.before_patch = other_controller
    code = sync(cluster, tmp_path, "--apply", "--max-tainted-share", "0.5").cycle()
    assert code == 1
    # The patch tested the entry it meant to remove, found another there and was refused
    # whole: the foreign taint and ringwatch's both stand, the label unchanged.
    assert taints(cluster, "gpu-003") == [
        foreign, {"key": TAINT_KEY, "value": "hang", "effect": "NoSchedule"}, MAINTENANCE]
    assert health(cluster, "gpu-003") == "degraded"
    err = capsys.readouterr().err
    assert ("gpu-003: not changed, read again next cycle: PATCH /api/v1/nodes/gpu-003 answered "
            "422: the server rejected our request due to an error in our request; testing "
            "value /spec/taints/0 failed: test failed") in err
    # Read again, ringwatch's own taint goes and the other two stay.
    cluster.before_patch = None
    assert sync(cluster, tmp_path, "--apply", "--max-tainted-share", "0.5").cycle() == 0
    assert taints(cluster, "gpu-003") == [foreign, MAINTENANCE]


def test_a_changed_effect_or_kind_replaces_ringwatchs_taint_in_place(cluster, tmp_path) -> None:
    sync(cluster, tmp_path, "--apply").cycle()
    assert sync(cluster, tmp_path, "--apply", "--taint-effect", "NoExecute").cycle() == 1
    assert taints(cluster, "gpu-002") == [
        GPU_TAINT, {"key": TAINT_KEY, "value": "nvlink_degraded", "effect": "NoExecute"}]
    cluster.fleet = fleet(**{"gpu-002": _state("gpu-002", "degraded", excluded_by=("hang",))})
    cluster.patches.clear()
    sync(cluster, tmp_path, "--apply", "--taint-effect", "NoExecute").cycle()
    ((name, ops),) = [(n, o) for n, o in cluster.patches if n == "gpu-002"]
    assert [o["op"] for o in ops] == ["test", "replace"]
    assert taints(cluster, "gpu-002")[1] == {"key": TAINT_KEY, "value": "hang",
                                             "effect": "NoExecute"}


def test_a_node_ringwatch_cannot_vouch_for_keeps_its_taint(cluster, tmp_path, capsys) -> None:
    sync(cluster, tmp_path, "--apply").cycle()
    # gpu-002 leaves ringwatch's fleet (retired): it is unknown now, and keeps the taint
    # until ringwatch finds it healthy or a person removes it.
    cluster.fleet = fleet()
    cluster.fleet["nodes"] = [n for n in cluster.fleet["nodes"] if n["name"] != "gpu-002"]
    sync(cluster, tmp_path, "--apply").cycle()
    assert health(cluster, "gpu-002") == "unknown"
    assert [t["key"] for t in taints(cluster, "gpu-002")] == ["nvidia.com/gpu", TAINT_KEY]
    assert ("gpu-002: keep taint ringwatch.io/unhealthy=nvlink_degraded:NoSchedule: ringwatch "
            "cannot vouch for it (not a node of ringwatch's fleet)") in capsys.readouterr().out


def test_an_api_that_cannot_be_read_changes_nothing(cluster, tmp_path, capsys) -> None:
    cluster.mode = "ringwatch-401"
    assert sync(cluster, tmp_path, "--apply").cycle() == 2
    assert [p for _, p, *_ in cluster.requests] == ["/v1/fleet/nodes"]
    assert ("ringwatch not read (GET /v1/fleet/nodes answered 401: invalid or revoked token); "
            "no node changed") in capsys.readouterr().err
    cluster.mode = "kube-403"
    assert sync(cluster, tmp_path, "--apply").cycle() == 2
    assert not cluster.patches
    assert "the Kubernetes API not read (GET /api/v1/nodes answered 403: pods is forbidden" \
        in capsys.readouterr().err


def test_every_node_and_another_name_label(cluster, tmp_path, capsys) -> None:
    # Matched by kubernetes.io/hostname, gpu-006.ec2.internal is gpu-006 by its label; the
    # empty selector lists cpu-001 too (unknown), and pages are followed.
    s = sync(cluster, tmp_path, "--node-selector", "", "--node-name-label",
             "kubernetes.io/hostname", "--max-tainted-share", "1")
    assert s.cycle() == 0
    out = capsys.readouterr().out
    assert "dry run: cpu-001: would label ringwatch.io/health=unknown" in out
    assert out.splitlines()[-1].startswith("7 node(s): 2 healthy, 2 degraded, 3 unknown; "
                                           "2 tainted (cap 7)")
    assert "gpu-006.ec2.internal (ringwatch gpu-006): would taint" in out


def test_the_command_line_without_a_service_account_says_why(cluster, tmp_path, monkeypatch,
                                                             capsys) -> None:
    """The real entry point, as a pod would run it, outside a pod."""
    from ringwatch.services.settings import get_settings

    monkeypatch.setenv("RINGWATCH_TOKEN", READER)
    monkeypatch.setenv("RINGWATCH_API_URL", cluster.url)
    monkeypatch.delenv("RINGWATCH_KUBERNETES_API_URL", raising=False)
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    get_settings.cache_clear()
    try:
        assert main(["kubernetes", "sync", "--once", "--apply"]) == 2
    finally:
        get_settings.cache_clear()
    assert "KUBERNETES_SERVICE_HOST is not set" in capsys.readouterr().err
    assert not cluster.patches


def test_the_real_command_through_kubectl_proxy(cluster) -> None:
    """``ringwatch kubernetes sync`` as a process, as a person runs it from outside the
    cluster: the Kubernetes API through ``kubectl proxy`` (no token file: the proxy adds
    its user's credentials), a dry run, then --apply."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RINGWATCH_", "KUBERNETES_"))}
    env.update(RINGWATCH_API_URL=cluster.url, RINGWATCH_TOKEN=READER,
               RINGWATCH_KUBERNETES_API_URL=cluster.url)
    command = [sys.executable, "-m", "ringwatch.services.cli.main", "kubernetes", "sync", "--once",
               "--max-tainted-share", "0.5"]
    r = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "dry run: nothing changed (--apply acts)" in r.stdout and not cluster.patches
    kube = [h for _, path, _, h in cluster.requests if path.startswith("/api/")]
    assert kube and not any("authorization" in h for h in kube)
    r = subprocess.run([*command, "--apply"], env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert health(cluster, "gpu-002") == "degraded" and taints(cluster, "gpu-003") == [MAINTENANCE]


# ---- the plan's rules on their own ------------------------------------------------------------


def test_judge_takes_the_prologs_exclusion_and_the_age_of_the_newest_result() -> None:
    assert judge(None, NOW, 3600).health == "unknown"
    j = judge(_state("n", excluded_by=("nvlink_degraded", "hang")), NOW, 3600)
    assert (j.health, j.kind) == ("degraded", "nvlink_degraded")
    # An excluded node is degraded however old its results: the finding stays open.
    assert judge(_state("n", age_s=9e6, excluded_by=("hang",)), NOW, 3600).health == "degraded"
    # A kind a taint value cannot hold is named generically.
    assert judge(_state("n", excluded_by=("bad kind;rm",)), NOW, 3600).kind == "finding"
    assert judge(_state("n", age_s=7200), NOW, 3600).health == "unknown"
    assert judge(_state("n", age_s=None), NOW, 3600).why == "never probed"
    assert judge(_state("n", age_s=60), NOW, 3600).health == "healthy"
    # Suspect (a shared link slow, nobody blamed) and busy are not exclusions.
    assert judge(_state("n", "suspect"), NOW, 3600).health == "healthy"


def test_names_match_exactly_then_by_short_name_and_never_ambiguously() -> None:
    def node(name: str, **labels: str) -> KubeNode:
        return KubeNode(name, labels, None, "1")

    kube = [node("gpu-001"), node("gpu-002.example"), node("gpu-003.a"), node("gpu-003.b"),
            node("ip-10-0-1-4", **{"kubernetes.io/hostname": "gpu-004"})]
    got = match_nodes(kube, ["gpu-001", "gpu-001.example", "gpu-002", "gpu-003", "gpu-004"])
    # gpu-001: the exact name wins over the FQDN; gpu-003: two nodes share the short name.
    assert got == {"gpu-001": "gpu-001", "gpu-002.example": "gpu-002"}
    got = match_nodes(kube, ["gpu-004"], "kubernetes.io/hostname")
    assert got == {"ip-10-0-1-4": "gpu-004"}


def test_the_cap_is_a_share_of_the_nodes_and_at_least_one() -> None:
    assert [tainted_cap(n, 0.05) for n in (1, 19, 20, 39, 40, 1000)] == [1, 1, 1, 1, 2, 50]
    assert tainted_cap(10, 1.0) == 10 and tainted_cap(3, 0.1) == 1
    # Taints already there count: with the cap full, no new node is tainted.
    nodes = [KubeNode(f"n{i}", {}, [{"key": TAINT_KEY, "value": "hang", "effect": "NoSchedule"}]
                      if i == 0 else None, "1") for i in range(3)]
    states = {f"n{i}": _state(f"n{i}", excluded_by=("hang",)) for i in range(3)}
    p = plan(nodes, {n.name: n.name for n in nodes}, states, now=NOW, max_tainted_share=0.1)
    assert (p.cap, p.tainted, p.held_back) == (1, 1, ["n1", "n2"])
    with pytest.raises(ValueError, match="PreferNoSchedule"):
        plan(nodes, {}, {}, now=NOW, effect="PreferNoSchedule")


def test_duplicate_taints_of_ringwatchs_are_folded_into_one() -> None:
    node = KubeNode("n", {HEALTH_LABEL: "degraded"},
                    [{"key": TAINT_KEY, "value": "hang", "effect": "NoExecute"}, GPU_TAINT,
                     {"key": TAINT_KEY, "value": "hang", "effect": "NoSchedule"}], "7")
    p = plan([node], {"n": "n"}, {"n": _state("n", excluded_by=("hang",))}, now=NOW)
    (change,) = p.changes
    result = apply_json_patch({"metadata": {"labels": dict(node.labels or {})},
                               "spec": {"taints": list(node.taints or [])}}, change.ops)
    assert result["spec"]["taints"] == [GPU_TAINT, {"key": TAINT_KEY, "value": "hang",
                                                    "effect": "NoSchedule"}]


# ---- the real API's answer -------------------------------------------------------------------


def test_the_apis_fleet_nodes_carry_the_preflights_exclusion(api) -> None:
    """GET /v1/fleet/nodes says what a preflight excludes, and the plan taints by it."""
    from tests.api_fixtures import fleet_batch

    api.post("/v1/measurements", json=fleet_batch(slow_node="node-003"),
             headers=api.h["agent"]).raise_for_status()
    states = api.get("/v1/fleet/nodes", headers=api.h["reader"]).json()
    by_name = {n["name"]: n for n in states["nodes"]}
    verdict = api.post("/v1/preflight", json={"nodes": sorted(by_name)},
                       headers=api.h["reader"]).json()
    assert verdict["exclude"] == ["node-003"]
    assert [n for n, s in by_name.items() if s["excluded_by"]] == ["node-003"]
    assert by_name["node-003"]["excluded_by"][0] in {f["kind"] for f in verdict["findings"]
                                                      if f.get("node") == "node-003"}
    nodes = [KubeNode(n, {}, None, "1") for n in by_name]
    p = plan(nodes, {n: n for n in by_name}, by_name, now=datetime.now(UTC),
             max_tainted_share=1.0)
    assert {c.node for c in p.changes if any(o["path"] == "/spec/taints" for o in c.ops)} \
        == {"node-003"}
    assert {n: j.health for n, j in p.judged.items()} == {
        "node-000": "healthy", "node-001": "healthy", "node-002": "healthy",
        "node-003": "degraded"}


# ---- check: the init container's gate ----------------------------------------------------------


@dataclass
class Gate:
    url: str
    verdict: dict[str, Any] | None = None  # None: never answers
    asked: list[dict] = field(default_factory=list)


@pytest.fixture
def gate() -> Iterator[Gate]:
    state = Gate(url="")
    release = threading.Event()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

        def do_POST(self) -> None:
            state.asked.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            if state.verdict is None:
                release.wait(30)
                return
            data = json.dumps({"id": "r1", "status": "done", **state.verdict}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    state.url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        yield state
    finally:
        release.set()
        server.shutdown()
        server.server_close()


def _check(monkeypatch, url: str, *argv: str) -> int:
    monkeypatch.setenv("RINGWATCH_TOKEN", READER)
    monkeypatch.setenv("RINGWATCH_API_URL", url)
    monkeypatch.setenv("NODE_NAME", "gpu-002")
    return main(["kubernetes", "check", *argv])


def test_the_gate_lets_a_pod_start_when_ringwatch_cannot_answer(gate, monkeypatch, capsys) -> None:
    # An API that takes the request and never answers: cut off at the bound, fail-open.
    assert _check(monkeypatch, gate.url, "--bound", "2") == 0
    assert "gpu-002: no answer" in capsys.readouterr().err
    assert gate.asked[0]["nodes"] == ["gpu-002"] and gate.asked[0]["max_age_s"] == 900.0
    # Nothing listens: fail-open too, unless told to fail closed.
    assert _check(monkeypatch, "http://127.0.0.1:9", "--bound", "2") == 0
    assert "the pod may start (fail-open)" in capsys.readouterr().err
    assert _check(monkeypatch, "http://127.0.0.1:9", "--bound", "2", "--on-error", "closed") == 1
    assert capsys.readouterr().out.startswith("ringwatch: no answer: API at http://127.0.0.1:9")


def test_the_gate_refuses_a_node_ringwatch_excludes(gate, monkeypatch, capsys) -> None:
    from ringwatch.services.cli.slurm import reason_for

    gate.verdict = {"healthy": False, "exclude": ["gpu-002"], "findings": [
        {"kind": "nvlink_degraded", "node": "gpu-002", "gpus": [0, 1], "severity": "critical",
         "measured_gbs": 40.0, "expected_gbs": 360.0}]}
    assert _check(monkeypatch, gate.url) == 1
    # The prolog's drain reason, word for word.
    out = capsys.readouterr().out.strip()
    assert out == reason_for(gate.verdict, "gpu-002")
    assert out.startswith("ringwatch: nvlink_degraded gpu-002") and "40 of 360 GB/s" in out
    gate.verdict = {"healthy": True, "exclude": [], "findings": []}
    assert _check(monkeypatch, gate.url) == 0
    monkeypatch.delenv("NODE_NAME")
    assert main(["kubernetes", "check"]) == 2
    assert "NODE_NAME is not set" in capsys.readouterr().err
