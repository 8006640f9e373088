"""What reading occupancy costs a cycle at 1024 nodes (services/scheduler/occupancy.py):
parsing Slurm's answer, and the Kubernetes API's pod list at several pods per node, then the
whole read through the sources' real code paths (scripts standing in for scontrol and squeue;
a local HTTP server answering as the API server, page by page).

    python -m bench.run occupancy
    python -m bench.run occupancy --quick     # 256 nodes

The answers are generated here from the recorded ones of tests/data (their line and pod
shapes, many times over): a third of the nodes allocated to 16-node jobs, a sixth mixed, the
rest idle, drained or down; on Kubernetes one 8-GPU training pod per busy node beside the
DaemonSets' CPU pods every node runs.
"""

from __future__ import annotations

import copy
import json
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

from ringwatch.services.scheduler import occupancy

DATA = Path(__file__).resolve().parent.parent / "tests" / "data"
REPEATS = 7
# Pods every GPU node runs besides a job's: node-exporter, the GPU Operator's DaemonSets
# (device plugin, DCGM exporter, feature discovery, toolkit, validator), a CNI, kube-proxy,
# the RDMA device plugin.
DAEMON_PODS = 9


def _median_s(work: Callable[[], object]) -> float:
    times = []
    for _ in range(REPEATS):
        started = time.perf_counter()
        work()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


# ---- Slurm ----------------------------------------------------------------------------------


def slurm_answer(nodes: int) -> tuple[str, str]:
    """``scontrol --details --oneliner show node`` and ``squeue`` for ``nodes`` nodes."""
    recorded = (DATA / "slurm" / "built-22.05.8-scontrol-details-oneliner-show-node.txt")
    template = recorded.read_text().splitlines()[0]  # gpu-001, ALLOCATED, all 8 GPUs
    lines, jobs = [], []
    for i in range(nodes):
        name = f"gpu-{i:04d}"
        kind = i % 6
        state, used = (("ALLOCATED", "gpu:h100:8(IDX:0-7)") if kind < 2 else
                       ("MIXED", "gpu:h100:4(IDX:0-3)") if kind == 2 else
                       ("IDLE+DRAIN", "gpu:h100:0(IDX:N/A)") if kind == 3 else
                       ("DOWN+NOT_RESPONDING", "gpu:h100:0(IDX:N/A)") if i % 50 == 4 else
                       ("IDLE", "gpu:h100:0(IDX:N/A)"))
        lines.append(template.replace("gpu-001", name).replace("State=ALLOCATED", f"State={state}")
                     .replace("GresUsed=gpu:h100:8(IDX:0-7)", f"GresUsed={used}"))
        if kind == 2:
            jobs.append(f"{700000 + i} {name}")
    for j, start in enumerate(range(0, nodes, 16)):  # 16-node jobs over the allocated ones
        held = [i for i in range(start, min(start + 16, nodes)) if i % 6 < 2]
        if held:
            jobs.append(f"{600000 + j} gpu-[{','.join(f'{i:04d}' for i in held)}]")
    return "\n".join(lines) + "\n", "\n".join(jobs) + "\n"


def bench_slurm(nodes: int, tmp: Path) -> None:
    shown, queued = slurm_answer(nodes)
    ours = [f"gpu-{i:04d}.cluster.example" for i in range(nodes)]

    def parse() -> dict:
        known, busy = occupancy.slurm_busy(shown, queued)
        return occupancy.vouch(ours, known, busy, "slurm", "not a Slurm node")

    busy = parse()
    parse_s = _median_s(parse)
    (tmp / "show.txt").write_text(shown)
    (tmp / "queue.txt").write_text(queued)
    bin_dir = tmp / "slurm-bin"
    bin_dir.mkdir()
    for name, answer in (("scontrol", "show.txt"), ("squeue", "queue.txt")):
        (bin_dir / name).write_text(f"#!/bin/sh\nexec cat {tmp / answer}\n")
        (bin_dir / name).chmod(0o755)
    source = occupancy.SlurmOccupancy(slurm_bin=str(bin_dir))
    read = occupancy.read_occupancy(source, ours)
    assert read.error is None and read.busy.keys() == busy.keys(), read.error
    read_s = _median_s(lambda: occupancy.read_occupancy(source, ours))
    print(f"slurm       {nodes:5d} nodes  {len(shown) / 1e6:5.2f} MB scontrol + "
          f"{len(queued) / 1e3:5.1f} kB squeue  {len(busy):4d} busy  "
          f"parse {parse_s * 1e3:7.1f} ms  read (two commands) {read_s * 1e3:7.1f} ms")


# ---- Kubernetes -----------------------------------------------------------------------------


def kubernetes_answer(nodes: int, page: int) -> tuple[list[bytes], bytes, int]:
    """The pod list's pages (JSON, as the API sends them) and the node list, and the pods."""
    recorded = [json.loads((DATA / "kubernetes" / f"built-pods-page-{n}.json").read_text())
                for n in (1, 2)]
    trainer = recorded[0]["items"][2]  # a PyTorchJob's 8-GPU pod
    daemon = recorded[0]["items"][1]  # node-exporter, CPU only
    pods = []
    for i in range(nodes):
        name = f"gpu-{i:04d}"
        for d in range(DAEMON_PODS):
            pod = copy.deepcopy(daemon)
            pod["metadata"]["name"] = f"daemon-{d}-{i:04d}"
            pod["spec"]["nodeName"] = name
            pods.append(pod)
        if i % 3 != 2:
            pod = copy.deepcopy(trainer)
            pod["metadata"]["name"] = f"train-{i // 16}-worker-{i % 16}"
            pod["metadata"]["ownerReferences"][0]["name"] = f"train-{i // 16}"
            pod["spec"]["nodeName"] = name
            pods.append(pod)
    pages = []
    for n, start in enumerate(range(0, len(pods), page)):
        more = start + page < len(pods)
        meta = {"resourceVersion": "1", **({"continue": f"page-{n + 1}"} if more else {})}
        pages.append(json.dumps({"kind": "PodList", "apiVersion": "v1", "metadata": meta,
                                 "items": pods[start:start + page]}).encode())
    node_list = json.dumps({"kind": "PartialObjectMetadataList", "metadata": {},
                            "items": [{"metadata": {"name": f"gpu-{i:04d}"}}
                                      for i in range(nodes)]}).encode()
    return pages, node_list, len(pods)


def _serve(pages: list[bytes], node_list: bytes) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def do_GET(self) -> None:
            parts = urlsplit(self.path)
            token = parse_qs(parts.query).get("continue", ["page-0"])[0]
            body = node_list if parts.path == "/api/v1/nodes" else pages[int(token[5:])]
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def bench_kubernetes(nodes: int, tmp: Path) -> None:
    pages, node_list, count = kubernetes_answer(nodes, occupancy.PAGE)
    ours = [f"gpu-{i:04d}" for i in range(nodes)]

    def parse() -> dict:
        known = {item["metadata"]["name"] for item in json.loads(node_list)["items"]}
        pods = (pod for body in pages for pod in json.loads(body)["items"])
        return occupancy.vouch(ours, known, occupancy.pod_busy(pods), "kubernetes", "absent")

    busy = parse()
    parse_s = _median_s(parse)
    server = _serve(pages, node_list)
    try:
        token = tmp / "token"
        token.write_text("bench-token")
        source = occupancy.KubernetesOccupancy(f"http://127.0.0.1:{server.server_address[1]}",
                                               token_path=token)
        read = occupancy.read_occupancy(source, ours)
        assert read.error is None and read.busy.keys() == busy.keys(), read.error
        read_s = _median_s(lambda: occupancy.read_occupancy(source, ours))
    finally:
        server.shutdown()
        server.server_close()
    size = sum(len(p) for p in pages)
    print(f"kubernetes  {nodes:5d} nodes  {count:6d} pods in {len(pages):3d} pages, "
          f"{size / 1e6:5.1f} MB  {len(busy):4d} busy  parse {parse_s * 1e3:7.1f} ms  "
          f"read (local HTTP) {read_s * 1e3:7.1f} ms")


def main(flags: list[str]) -> None:
    nodes = 256 if "--quick" in flags else 1024
    print(f"median of {REPEATS}; parse: the source's own parsing of the answer (JSON decoding "
          "included); read: read_occupancy end to end, without a real controller's or API "
          "server's own time")
    with tempfile.TemporaryDirectory(prefix="rw-occupancy-") as tmp:
        bench_slurm(nodes, Path(tmp))
        bench_kubernetes(nodes, Path(tmp))
