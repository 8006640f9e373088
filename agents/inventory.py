"""What a node has: its NICs from the InfiniBand/EFA sysfs tree, and the driver, CUDA and
NCCL versions its GPU ranks run with. Read at agent start and each cycle; judged against
the node's hardware profile and the fleet's majority (services.analyzer.inventory).

The sysfs root is a parameter (``RINGWATCH_SYSFS_IB``): the one seam a test replaces with
a tree of its own. EFA devices appear there as ``efa_N`` like InfiniBand HCAs do.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ringwatch.agents.nic_counters import rate_gbps, read_attribute

SYSFS_IB = "/sys/class/infiniband"
# More ports than any node has (a DGX has 8 to 12 HCAs of one or two ports): a tree past
# this is not the kernel's, and is read no further.
MAX_PORTS = 256


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
            if len(nics) >= MAX_PORTS:
                return nics
            state = read_attribute(port / "state")
            nics.append({
                "device": dev.name, "port": port.name,
                "rate_gbps": rate_gbps(read_attribute(port / "rate")),
                # "4: ACTIVE" -> "ACTIVE"
                "state": (state or "").split(":")[-1].strip() or None,
                "link_layer": read_attribute(port / "link_layer"),
            })
    return nics


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
    return read_attribute(base / "product_name")
