"""The NCCL debug-log parser against a real NCCL 2.28.9 capture and against fixtures written from
NCCL 2.22.3's and 2.28.3's format strings (tests/data/nccl/README.md), plus the probe's side:
the environment it sets and the reader that returns one window at a time."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ringwatch.agents.nccl_log import (
    DEBUG_FILE_NAME,
    NcclLogReader,
    expand_debug_file,
    find_debug_files,
    nccl_debug_setup,
    nccl_hostname,
    net_transport,
    parse_nccl_log,
    summarize,
)

DATA = Path(__file__).parent / "data" / "nccl"


def fixture(name: str) -> str:
    return (DATA / name).read_text()


def line(msg: str, host: str = "h1", pid: int = 100, dev: int = 0) -> str:
    """One INFO line in debug.cc's prefix format."""
    return f"{host}:{pid}:{pid} [{dev}] NCCL INFO {msg}\n"


def test_real_2_28_9_capture_reads_version_network_and_the_communicator() -> None:
    log = parse_nccl_log(fixture("nccl-2.28.9-h200-world1.log"))
    (proc,) = log.processes
    assert (proc.host, proc.pid, proc.nccl_version) == ("vm", 610, "2.28.9+cuda13.0")
    assert proc.network == "Socket"
    assert proc.plugins == {"IB": "failed", "Socket": "assigned"}
    assert proc.ib_no_device and proc.net_devices["IB"] == []
    assert [(d.index, d.name, d.address) for d in proc.net_devices["Socket"]] == \
        [(0, "eth0", "192.0.2.2<0>")]
    (comm,) = log.comms
    assert (comm.comm, comm.rank, comm.nranks, comm.nnodes, comm.bus_id) == \
        ("0x2dcc6e80", 0, 1, 1, "60")
    assert comm.comm_id == "0x72d7cbfc14723d62" and comm.complete and comm.topology
    assert comm.gpus == {0: "60"} and comm.nvls_channels == 0 and not comm.nvls
    # World size 1: the ring listings ("Channel 00/64 : 0") are not connections.
    assert log.connections == []
    assert log.lines == 307 and log.foreign == 0 and log.partial == 0
    assert log.recognized + log.unrecognized == log.lines


def test_eight_ranks_interleaved_in_one_file_over_nvlink() -> None:
    log = parse_nccl_log(fixture("built-2.22.3-a100-nvlink-8gpu.log"))
    assert len(log.processes) == 8
    # NCCL prints its version on rank 0 only.
    assert {p.pid: p.nccl_version for p in log.processes if p.nccl_version} == {21400: "2.22.3+cuda12.4"}
    assert {c.rank for c in log.comms} == set(range(8))
    assert {c.comm_id for c in log.comms} == {"0x5b1e4c3d2a1f0e9d"}
    assert all(len(c.gpus) == 8 and c.gpus[3] == "4e000" for c in log.comms)
    ring = [c for c in log.connections if c.src_rank == (c.dst_rank - 1) % 8]
    assert {(c.src_rank, c.dst_rank) for c in ring} == {(r, (r + 1) % 8) for r in range(8)}
    assert {c.transport for c in log.connections} == {"p2p_nvlink"}
    first = next(c for c in ring if c.src_rank == 5 and c.channel == 1)
    assert (first.pid, first.cuda_dev, first.src_dev, first.dst_dev) == (21405, 5, 5, 6)
    assert (first.raw, first.path, first.conn_index, first.direction) == ("P2P/CUMEM/read", "NVL", 0, None)
    assert first.inter_node is False and first.comm == "0x55d1e4a0c9a5"
    summary = summarize(log)
    assert summary.intra_node == ("p2p_nvlink",) and summary.inter_node == ()
    assert summary.counts == {"p2p_nvlink": 23} and summary.p2p_path_unknown == 0
    ring_pairs = {tuple(sorted((r, (r + 1) % 8))) for r in range(8)}
    tree_pairs = {((r - 1) // 2, r) for r in range(1, 8)}
    assert {p.ranks for p in summary.pairs} == ring_pairs | tree_pairs
    assert all(p.transports == ("p2p_nvlink",) and p.inter_node is False for p in summary.pairs)


def test_p2p_path_comes_from_the_graph_dump() -> None:
    text = fixture("built-2.22.3-a100-nvlink-8gpu.log")
    over_pcie = parse_nccl_log(text.replace("/NVL)", "/PXB)"))
    assert {c.transport for c in over_pcie.connections} == {"p2p_pcie"}
    assert {c.path for c in over_pcie.connections} == {"PXB"}
    # Without NCCL_GRAPH the log has no path: the connection is P2P, over something unknown.
    no_graph = parse_nccl_log("".join(
        ln + "\n" for ln in text.splitlines() if " GPU/" not in ln and "System :" not in ln))
    assert {c.transport for c in no_graph.connections} == {"p2p"}
    assert summarize(no_graph).p2p_path_unknown == 23


def test_a_pair_over_shared_memory() -> None:
    log = parse_nccl_log(fixture("built-2.22.3-shm-pair.log"))
    assert len(log.connections) == 4
    assert all(c.transport == "shm" and c.raw == "SHM/direct/direct" for c in log.connections)
    # shm.cc prints no connIndex.
    assert {c.conn_index for c in log.connections} == {None}
    summary = summarize(log)
    assert summary.pairs[0].ranks == (0, 1) and summary.pairs[0].transports == ("shm",)
    assert summary.intra_node == ("shm",) and not summary.inter_node_socket


def test_two_nodes_over_infiniband_with_gpudirect() -> None:
    log = parse_nccl_log(fixture("built-2.22.3-ib-gdr-2node.log"))
    assert len(log.connections) == 8
    assert {(c.transport, c.net, c.gdr, c.inter_node) for c in log.connections} == \
        {("net_ib", "IB", True, True)}
    assert {(c.nic_index, c.nic) for c in log.connections} == {(0, "mlx5_0"), (1, "mlx5_1")}
    # A receive is printed peer -> me: on gpu-b01 (rank 0) it comes from rank 1.
    recv = next(c for c in log.connections if c.host == "gpu-b01" and c.direction == "receive")
    assert (recv.src_rank, recv.dst_rank) == (1, 0)
    ib = log.processes[0].net_devices["IB"]
    assert [(d.name, d.port, d.link_layer) for d in ib] == [("mlx5_0", 1, "IB"), ("mlx5_1", 1, "IB")]
    summary = summarize(log)
    assert summary.inter_node == ("net_ib",) and summary.net_without_gdr == 0
    assert not summary.inter_node_socket and not summary.socket_fallback
    assert summary.pairs[0].inter_node is True


def test_sockets_between_nodes_are_a_fallback_where_rdma_nics_exist() -> None:
    log = parse_nccl_log(fixture("built-2.28.3-socket-fallback-2node.log"))
    assert {c.transport for c in log.connections} == {"net_socket"}
    assert {c.nic for c in log.connections} == {"eth0"}
    assert all(c.inter_node and c.gdr is False for c in log.connections)
    assert {p.plugins["IB"] for p in log.processes} == {"failed"}
    # The last line was still being written: not read, and counted.
    assert log.partial == 1 and all(c.channel < 2 for c in log.connections)
    assert all(c.complete and c.nnodes == 2 for c in log.comms)
    assert "all rings" in log.comms[0].connected
    alone = summarize(log)
    assert alone.inter_node_socket and not alone.socket_fallback
    with_ib = summarize(log, rdma_devices=["mlx5_0", "mlx5_1"])
    assert with_ib.socket_fallback and with_ib.rdma_devices == ("mlx5_0", "mlx5_1")


def test_efa_through_the_ofi_plugin() -> None:
    log = parse_nccl_log(fixture("built-2.28.3-efa-ofi-2node.log"))
    assert {(c.transport, c.net, c.gdr) for c in log.connections} == {("net_ofi", "AWS Libfabric", True)}
    proc = next(p for p in log.processes if p.host == "ip-10-0-1-17")
    assert proc.ofi == {"version": "1.16.2", "provider": "efa", "fabric": "efa-direct", "nics": 32}
    assert proc.network == "AWS Libfabric" and proc.plugins["AWS Libfabric"] == "assigned"
    summary = summarize(log)
    assert summary.networks == ("AWS Libfabric",) and summary.inter_node == ("net_ofi",)


def test_nvlink_sharp() -> None:
    log = parse_nccl_log(fixture("built-2.28.3-h100-nvls-8gpu.log"))
    (comm,) = log.comms
    assert comm.nvls_available and comm.nvls and comm.nvls_channels == 16
    assert comm.nnodes == 1 and comm.local_ranks == 8 and len(comm.gpus) == 8
    assert comm.path(0, 5) == "NVL"
    assert {(c.transport, c.inter_node) for c in log.connections} == {("p2p_nvlink", False)}
    assert len(log.processes[0].net_devices["IB"]) == 8
    summary = summarize(log)
    assert summary.nvls and not summary.nvls_failed
    assert summary.rdma_devices[0] == "mlx5_0" and not summary.socket_fallback


def test_formats_of_other_versions_and_transports() -> None:
    text = "".join([
        # net.cc of 2.17.1 prints bus ids in the brackets.
        line("NCCL version 2.17.1+cuda12.0", pid=1),
        line("Channel 00/0 : 0[7000] -> 1[b000] [send] via NET/IB/0/GDRDMA", pid=1),
        # p2p.cc of 2.18.3 (the same in 2.28.3); one log is one job, one NCCL version.
        line("NCCL version 2.28.3+cuda12.9", pid=2),
        line("Channel 01/0 : 0[0] -> 1[1] via P2P/IPC/read", pid=2),
        line("Channel 02/0 : 0[0] -> 1[1] via P2P/direct pointer", pid=2),
        line("Channel 03/0 : 0[0] -> 3[3] via P2P/indirect/2[2]/read", pid=2),
        # net.cc of 2.28.3: PXN proxy rank, GDR over PCI, shared buffers.
        line("Channel 04/1 : 0[0] -> 9[1] [send] via NET/IB/3(1)/GDRDMA(PCI)/Shared", pid=2),
        line("Channel 05/0 : 0[0] -> 4[0] via P2P/MNNVL/read", pid=2),
        # coll_net.cc of 2.28.3.
        line("CollNet 00/1 : 0 [send] via COLLNET/SHARP/0/GDRDMA", pid=2),
        line("Failed to bind NVLink SHARP (NVLS) Multicast memory of size 2097152 : CUDA error "
             "801 'operation not supported'. Proceeding without NVLS support.", pid=2),
    ])
    log = parse_nccl_log(text)
    old, ipc, direct, indirect, pxn, mnnvl, collnet = log.connections
    assert (old.src_bus, old.dst_bus, old.src_dev) == ("7000", "b000", None)
    # Rank 1's own file has no version line (rank 0 prints it): a value no NVML index
    # reaches still marks a bus id.
    (peer,) = parse_nccl_log(line(
        "Channel 00/0 : 0[7000] -> 1[1000] [receive] via NET/IB/0/GDRDMA", pid=3)).connections
    assert (peer.src_bus, peer.dst_bus, peer.dst_dev) == ("7000", "1000", None)
    assert (ipc.src_dev, ipc.dst_dev, ipc.src_bus) == (0, 1, None)
    assert [c.transport for c in (ipc, direct, indirect)] == ["p2p"] * 3
    assert [c.raw for c in (ipc, direct, indirect)] == \
        ["P2P/IPC/read", "P2P/direct pointer", "P2P/indirect/2[2]/read"]
    assert (pxn.proxy_rank, pxn.nic_index, pxn.gdr, pxn.conn_index) == (1, 3, True, 1)
    assert mnnvl.transport == "p2p_nvlink"
    assert (collnet.transport, collnet.src_rank, collnet.dst_rank) == ("collnet", 0, None)
    summary = summarize(log)
    assert summary.collnet and summary.nvls_failed
    assert all(None not in p.ranks for p in summary.pairs)


def test_merged_ib_devices_and_plugin_names() -> None:
    log = parse_nccl_log(line(
        "NET/IB : Using [0]={[0] mlx5_0:1/RoCE, [1] mlx5_1:1/RoCE} [1]mlx5_2:1/RoCE ; OOB eth0:10.0.0.1<0>"))
    devices = log.processes[0].net_devices["IB"]
    assert [(d.index, d.name, d.link_layer) for d in devices] == \
        [(0, "mlx5_0+mlx5_1", "RoCE"), (1, "mlx5_2", "RoCE")]
    assert [net_transport(n) for n in ("IB", "IBext_v8", "Socket", "AWS Libfabric", "Libfabric",
                                       "GPUDirectTCPX")] == \
        ["net_ib", "net_ib", "net_socket", "net_ofi", "net_ofi", "net_other"]


def test_prefixes_warnings_and_foreign_lines() -> None:
    text = (
        "[2026-01-15 02:30:45] h1:7:7 [0] NCCL INFO Using network IB\n"
        "[default0]:h2:8:8 [1] NCCL INFO Channel 00/0 : 1[1] -> 0[0] via SHM/direct/direct\n"
        "\n"
        "h1:7:9 [0] transport/p2p.cc:280 NCCL WARN failed to peer with device 1(=1b000): 217 "
        "peer access is not supported between these two devices\n"
        "Traceback (most recent call last):\n"
        "\x00\xff garbage \u2603\n")
    log = parse_nccl_log(text)
    assert log.processes[0].network == "IB"
    assert log.connections[0].host == "h2" and log.connections[0].transport == "shm"
    assert log.warnings == ["failed to peer with device 1(=1b000): 217 peer access is not "
                            "supported between these two devices"]
    assert (log.lines, log.foreign) == (6, 2)


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_never_raises_on_any_text(text: str) -> None:
    log = parse_nccl_log(text)
    assert log.recognized + log.unrecognized + log.foreign <= log.lines
    assert log.partial in (0, 1)


@settings(max_examples=100, deadline=None)
@given(st.integers(min_value=0, max_value=len(fixture("built-2.22.3-ib-gdr-2node.log"))))
def test_a_log_cut_anywhere_reads_what_is_whole(cut: int) -> None:
    text = fixture("built-2.22.3-ib-gdr-2node.log")
    log = parse_nccl_log(text[:cut])
    whole = text[:cut].count("\n")
    assert log.lines == whole
    assert log.partial == (0 if cut == 0 or text[cut - 1] == "\n" else 1)
    assert all(c.transport == "net_ib" for c in log.connections)


def test_setup_on_a_clean_environment(tmp_path: Path) -> None:
    setup = nccl_debug_setup(tmp_path, environ={})
    assert setup.env == {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,NET,GRAPH",
                         "NCCL_DEBUG_FILE": str(tmp_path / DEBUG_FILE_NAME)}
    assert setup.debug_file == str(tmp_path / "nccl.%h.%p.log")
    assert setup.transports_visible and setup.paths_visible and setup.notes == ()


@pytest.mark.parametrize(("environ", "env", "transports", "paths", "note"), [
    ({"NCCL_DEBUG": "WARN"}, {}, False, False, "NCCL_DEBUG=WARN"),
    ({"NCCL_DEBUG": "INFO"}, {}, False, False, "stdout"),
    ({"NCCL_DEBUG": "info", "NCCL_DEBUG_FILE": "/logs/%h.log"}, {}, True, False, "GRAPH"),
    ({"NCCL_DEBUG_SUBSYS": "^GRAPH"}, {"NCCL_DEBUG": "INFO"}, True, False, "GRAPH"),
    ({"NCCL_DEBUG_SUBSYS": "COLL"}, {"NCCL_DEBUG": "INFO"}, False, False, "INIT"),
    ({"NCCL_DEBUG": "TRACE", "NCCL_DEBUG_SUBSYS": "ALL", "NCCL_DEBUG_FILE": "/l/%p"}, {}, True, True, None),
])
def test_setup_never_overrides_the_user(tmp_path: Path, environ: dict[str, str],
                                        env: dict[str, str], transports: bool, paths: bool,
                                        note: str | None) -> None:
    setup = nccl_debug_setup(tmp_path, environ=environ)
    assert {k: v for k, v in setup.env.items() if k != "NCCL_DEBUG_FILE"} == env
    assert not (setup.env.keys() & environ.keys())
    assert setup.debug_file == environ.get("NCCL_DEBUG_FILE", setup.env.get("NCCL_DEBUG_FILE"))
    assert (setup.transports_visible, setup.paths_visible) == (transports, paths)
    if note is None:
        assert setup.notes == ()
    else:
        assert any(note in n for n in setup.notes)


def test_debug_file_substitutions() -> None:
    assert expand_debug_file("/l/nccl.%h.%p.log", "node7", 42) == "/l/nccl.node7.42.log"
    assert expand_debug_file("100%%-%q-%", "h", 1) == "100%-%q-%"
    assert "." not in nccl_hostname()


def test_find_every_process_file(tmp_path: Path) -> None:
    for name in ("nccl.h.1.log", "nccl.h.22.log", "nccl.other.3.log", "x.log"):
        (tmp_path / name).write_text("")
    found = find_debug_files(str(tmp_path / DEBUG_FILE_NAME), host="h")
    assert [p.name for p in found] == ["nccl.h.1.log", "nccl.h.22.log"]


def test_reader_returns_each_window_once_with_earlier_context(tmp_path: Path) -> None:
    text = fixture("built-2.28.3-h100-nvls-8gpu.log")
    head, tail = text.split("Channel 00/0", 1)
    reader = NcclLogReader(str(tmp_path / "nccl.%h.%p.log"), host="h100-n07", pid=7311)
    assert reader.path == tmp_path / "nccl.h100-n07.7311.log"
    assert reader.read().lines == 0  # NCCL has written nothing yet
    reader.path.write_text(head + "Channel 00/0")
    first = reader.read()
    assert first.connections == [] and first.partial == 1 and first.comms[0].nvls_channels == 16
    with reader.path.open("a") as f:
        f.write(tail)
    second = reader.read()
    # The topology came in the first window; the second's P2P is still classed by it.
    assert [(c.channel, c.transport) for c in second.connections] == \
        [(0, "p2p_nvlink"), (1, "p2p_nvlink")]
    assert second.processes[0].nccl_version == "2.28.3+cuda12.9"
    # Each window's records are its own: the later window did not change the earlier one's.
    assert "all rings" in second.comms[0].connected and first.comms[0].connected == []
    assert reader.read().lines == 0
    # A new process reused the name: the shorter file is read from its start.
    reader.path.write_text(line("Using network Socket", host="h100-n07", pid=7311))
    assert reader.read().processes[0].network == "Socket"
    with reader.path.open("a") as f:
        f.write(line("Channel 00/0 : 0[0] -> 1[0] [send] via NET/Socket/0", host="h100-n07", pid=7311))
    reader.skip()
    assert reader.read().connections == []


def test_reader_for_this_process(tmp_path: Path) -> None:
    assert NcclLogReader.for_this_process({}) is None
    reader = NcclLogReader.for_this_process({"NCCL_DEBUG_FILE": str(tmp_path / "n.%p")})
    assert reader is not None and reader.path.name.startswith("n.") and reader.path.name[2:].isdigit()


def test_a_long_lived_agents_file_is_trimmed_and_read_on_after(tmp_path) -> None:
    """NCCL writes with its own file position (fopen "w"): after ``trim`` empties the file,
    its next lines land past a hole of no disk, and the reader goes on from there."""
    path = tmp_path / "nccl.log"
    first = "h:1:1 [0] NCCL INFO NCCL version 2.28.9+cuda13.0\n"
    nccl = path.open("w")  # as NCCL holds it
    nccl.write(first * 4000)
    nccl.flush()
    reader = NcclLogReader(str(path))
    assert reader.read().nccl_versions == ["2.28.9+cuda13.0"]
    assert not reader.trim(max_bytes=1 << 20)  # small: kept
    assert reader.trim(max_bytes=100) and path.stat().st_size == 0
    assert reader.read().lines == 0  # nothing new yet, no restart from the top
    nccl.write("h:1:1 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via P2P/CUMEM/read\n")
    nccl.flush()
    again = reader.read()
    assert again.lines == 1 and len(again.connections) == 1 and again.foreign == 0
    assert path.stat().st_blocks * 512 < len(first) * 4000 // 10  # the emptied part takes no disk
    nccl.close()
