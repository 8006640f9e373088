"""Published link figures of common GPU nodes, the sim's hardware presets (sources: docs/analysis.md).

Every rate is GB/s (1e9 bytes/s) in one direction, the unit nccl-tests' busbw is in.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GpuPreset:
    name: str
    # NVLink per GPU, one direction: NVLink 4 is 900 GB/s bidirectional on H100/H200.
    nvlink_gbs: float
    # One NIC per GPU (rail-optimized DGX/HGX and p5 layouts): 400 Gb/s = 50 GB/s.
    net_gbs: float
    # GPU-to-GPU copies over PCIe when a pair has no NVLink (x16, achievable, not line rate).
    pcie_gbs: float
    # nvidia-smi topo's word for an NVLink pair of this generation.
    nvlink_word: str
    # Per-step latencies of a ring/tree step on each link class, seconds.
    alpha_nvlink_s: float = 2e-6
    alpha_net_s: float = 5e-6


PRESETS: dict[str, GpuPreset] = {
    "H100-SXM": GpuPreset("H100-SXM", nvlink_gbs=450.0, net_gbs=50.0, pcie_gbs=50.0,
                          nvlink_word="NV18"),
    "H200": GpuPreset("H200", nvlink_gbs=450.0, net_gbs=50.0, pcie_gbs=50.0, nvlink_word="NV18"),
    "A100": GpuPreset("A100", nvlink_gbs=300.0, net_gbs=25.0, pcie_gbs=25.0, nvlink_word="NV12",
                      alpha_nvlink_s=3e-6, alpha_net_s=6e-6),
}
ALIASES = {"H100": "H100-SXM", "H200-SXM": "H200", "A100-SXM": "A100", "A100-SXM4-80GB": "A100"}


def preset(name: str) -> GpuPreset:
    key = ALIASES.get(name, name)
    if key not in PRESETS:
        known = ", ".join(sorted(PRESETS))
        raise ValueError(f"gpu must be one of {known}, got {name!r}")
    return PRESETS[key]
