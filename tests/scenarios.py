"""Fabric scenarios shared by the sim tests."""

# The scenario file of the design's first version: six faults of six kinds.
DESIGN_SCENARIO = {
    "nodes": 16, "gpus_per_node": 8, "gpu": "H100-SXM", "nvlink_gbs": 450, "net_gbs": 50,
    "noise": 0.03, "seed": 7,
    "faults": [
        {"kind": "nvlink", "node": "node-003", "gpus": [2, 5], "factor": 0.5},
        {"kind": "nic", "node": "node-011", "factor": 0.4},
        {"kind": "net_path", "nodes": ["node-001", "node-007"], "factor": 0.3},
        {"kind": "hang", "node": "node-004", "gpu": 1},
        {"kind": "corrupt", "node": "node-009", "gpu": 6},
        {"kind": "pcie_only", "node": "node-002", "gpus": [0, 1]},
    ],
}
