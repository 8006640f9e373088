"""What a node has: its NICs from the InfiniBand/EFA sysfs tree, and the driver, CUDA and
NCCL versions its GPU ranks run with. Read at agent start and each cycle; judged against
the node's hardware profile and the fleet's majority (services.analyzer.inventory).

The sysfs root is a parameter (``RINGWATCH_SYSFS_IB``): the one seam a test replaces with
a tree of its own. EFA devices appear there as ``efa_N`` like InfiniBand HCAs do.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

SYSFS_IB = "/sys/class/infiniband"
_RATE = re.compile(r"([\d.]+)\s*Gb/sec")


def read_nics(root: str | os.PathLike[str] | None = None) -> list[dict[str, Any]]:
    """Every port of every RDMA device: its rate (Gb/s) and state ("ACTIVE", "DOWN", ...).
    Empty where the tree does not exist (no RDMA NICs, or not Linux)."""
    base = Path(root or os.environ.get("RINGWATCH_SYSFS_IB", SYSFS_IB))
    nics: list[dict[str, Any]] = []
    if not base.is_dir():
        return nics
    for dev in sorted(base.iterdir()):
        ports = dev / "ports"
        if not ports.is_dir():
            continue
        for port in sorted(ports.iterdir(), key=lambda p: p.name):
            rate = _read(port / "rate")
            state = _read(port / "state")
            m = _RATE.search(rate or "")
            nics.append({
                "device": dev.name, "port": port.name,
                "rate_gbps": float(m.group(1)) if m else None,
                # "4: ACTIVE" -> "ACTIVE"
                "state": (state or "").split(":")[-1].strip() or None,
                "link_layer": _read(port / "link_layer"),
            })
    return nics


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def versions(nvml_driver: str | None) -> dict[str, str | None]:
    """Driver (from NVML), CUDA and NCCL (from this process's torch)."""
    import torch

    nccl: str | None = None
    try:
        v = torch.cuda.nccl.version()
        nccl = ".".join(str(x) for x in v) if isinstance(v, tuple) else str(v)
    except Exception:  # a CPU build of torch has no NCCL
        nccl = None
    return {"driver": nvml_driver, "cuda": torch.version.cuda, "nccl": nccl}


def product_name(root: str | os.PathLike[str] | None = None) -> str | None:
    """The machine's DMI product name (an instance type such as "p5.48xlarge" on AWS)."""
    base = Path(root or os.environ.get("RINGWATCH_SYSFS_DMI", "/sys/devices/virtual/dmi/id"))
    return _read(base / "product_name")
