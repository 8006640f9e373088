"""Build the probe backend a command asked for: --address, --local or --fabric.

torch and Ray are imported only where a gloo or nccl backend is built: they take seconds
and hundreds of MB to load, and the sim and the API client need neither."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

from ringwatch.agents.groups import node_order
from ringwatch.agents.places import node_list
from ringwatch.agents.spec import InjectedFault, ProbeBackend
from ringwatch.services.cli.errors import CliError


def add_backend_args(p: argparse.ArgumentParser) -> None:
    where = p.add_mutually_exclusive_group()
    where.add_argument("--address", help="join this Ray cluster (nodes named by hostname)")
    where.add_argument("--local", type=int, metavar="N",
                       help="start a local Ray cluster of N logical nodes node-000...")
    where.add_argument("--fabric", type=Path, metavar="FILE", help="the sim backend on this scenario")
    p.add_argument("--gpus-per-node", type=int, default=2, metavar="G", help="ranks per node (default 2)")
    p.add_argument("--backend", choices=("nccl", "gloo", "sim"),
                   help="collective backend: nccl where GPUs are, gloo otherwise, sim with --fabric")
    p.add_argument("--inject", action="append", default=[], metavar="JSON",
                   help='inject a fault, e.g. \'{"kind": "slow", "node": "node-001", "gpu": 0, "factor": 0.5}\'')


def parse_injected(raw: list[str]) -> list[InjectedFault]:
    faults = []
    for text in raw:
        try:
            faults.append(InjectedFault.from_dict(json.loads(text)))
        except (json.JSONDecodeError, TypeError, ValueError) as exc:
            raise CliError(f"--inject {text!r}: {exc}") from exc
    return faults


def has_backend(args: argparse.Namespace) -> bool:
    return bool(args.address or args.local or args.fabric)


def default_backend(args: argparse.Namespace) -> str:
    if args.backend:
        return args.backend
    if args.fabric:
        return "sim"
    import torch

    return "nccl" if torch.cuda.is_available() else "gloo"


def make_backend(args: argparse.Namespace, progress: Callable[[str], None] | None = None) -> ProbeBackend:
    name = default_backend(args)
    injected = parse_injected(args.inject)
    if args.fabric or name == "sim":
        if not args.fabric:
            raise CliError("--backend sim needs --fabric FILE")
        if name != "sim":
            raise CliError(f"--fabric runs the sim backend, not {name}")
        from ringwatch.agents.sim import SimBackend

        try:
            return SimBackend.from_file(args.fabric)
        except (OSError, ValueError) as exc:
            raise CliError(f"--fabric {args.fabric}: {exc}") from exc
    if args.local is not None and args.local < 1:
        raise CliError("--local needs at least 1 node")
    if args.gpus_per_node < 1:
        raise CliError("--gpus-per-node needs at least 1")
    if not (args.local or args.address):
        raise CliError("say where to probe: --address ADDR, --local N or --fabric FILE")
    if args.local:
        # The local cluster's ranks are known before it starts: a fault aimed elsewhere is
        # refused now rather than silently never happening.
        from ringwatch.agents.sim import node_name

        _check_injected(injected, {(node_name(i), g) for i in range(args.local)
                                   for g in range(args.gpus_per_node)})
    if name == "nccl" and args.local:
        # The local ranks are this machine's GPUs: refuse before any cluster starts. On a
        # cluster (--address) every agent checks its own node as it starts.
        from ringwatch.agents.device import check_cuda

        check_cuda(args.local * args.gpus_per_node - 1)
    from ringwatch.services.scheduler.ray_backend import RayBackend

    backend = RayBackend(backend=name, local_nodes=args.local, ranks_per_node=args.gpus_per_node,
                         address=args.address, injected=injected,
                         temp_dir=_state_dir() / "ray", progress=progress,
                         repeats=_repeats(args, name), cuda_graph=getattr(args, "cuda_graph", True))
    if args.address:  # a joined cluster's ranks are known once it is joined
        try:
            _check_injected(injected, {(r.node, r.local_index) for r in backend.ranks()})
        except CliError:
            backend.close()
            raise
    return backend


def _check_injected(injected: list, ranks: set[tuple[str, int]]) -> None:
    """Every --inject names a rank of the cluster probed."""
    for f in injected:
        if (f.node, f.gpu) not in ranks:
            nodes = sorted({n for n, _ in ranks}, key=node_order)
            raise CliError(f"--inject names {f.node}/{f.gpu}, not a rank of this cluster "
                           f"({len(nodes)} node(s): {node_list(nodes, width=40)})")


def _repeats(args: argparse.Namespace, backend: str) -> int:
    """CPU timings on a shared host jitter far more than NCCL's: gloo takes the median of 3."""
    repeats = getattr(args, "repeats", None) or (3 if backend == "gloo" else 1)
    if repeats < 1:
        raise CliError("--repeats must be >= 1")
    return repeats


def _state_dir() -> Path:
    from ringwatch.services.settings import get_settings

    return get_settings().state_dir
