"""What NCCL says it chose: an NCCL debug log (``NCCL_DEBUG=INFO``) read into the transport of
every channel connection, the network plugin and its NICs, and the path between local GPUs.

Pure text in, records out. A line no rule knows is counted, never raised on. Each pattern
names the NCCL format string it reads and where that string was read (tests/data/nccl/README.md
lists them). The end of the module is the probe's side: the environment that makes NCCL write
the log, and a reader that returns only what NCCL appended since its last read.
"""

from __future__ import annotations

import copy
import errno
import os
import re
import socket
import stat
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args

# The closed vocabulary of a connection's transport. P2P is classed by the path NCCL's topology
# gives between the two GPUs (NVL/NVB: NVLink; PIX/PXB/PXN/P2C/PHB/SYS: PCIe); "p2p" where the
# log holds no path (NCCL_DEBUG_SUBSYS without GRAPH). IPC, CUMEM and "direct pointer" are how
# NCCL maps the peer's memory, not which wire carries it: they stay in ``Connection.raw``.
Transport = Literal["p2p_nvlink", "p2p_pcie", "p2p", "shm", "net_ib", "net_socket", "net_ofi",
                    "net_other", "nvls", "collnet"]
TRANSPORTS: tuple[str, ...] = get_args(Transport)
NET_TRANSPORTS = frozenset({"net_ib", "net_socket", "net_ofi", "net_other"})
_NVLINK_PATHS = frozenset({"NVL", "NVB"})
_PCIE_PATHS = frozenset({"PIX", "PXB", "PXN", "P2C", "PHB", "SYS"})

# debug.cc, ncclDebugLog (2.22.3; the same in the 2.28.9 capture): INFO is
# "%s:%d:%d [%d] NCCL INFO " (host cut at its first '.', pid, tid, the thread's cudaDev);
# WARN puts "file:line" before "NCCL WARN" and a newline before the line; TRACE a time. Since
# 2.26 a strftime stamp ("[%F %T] ", NCCL_DEBUG_TIMESTAMP_FORMAT) may come first, and
# launchers add prefixes of their own: so the prefix is searched for, not anchored.
_LEVEL = re.compile(r" NCCL (?P<level>INFO|WARN|TRACE|CALL) ?")
# The "host:pid:tid [dev]" before the level, searched only where a host name starts (the
# character before is none of its own), so a long run of name characters is walked once,
# not once per position: the search stays linear in the line.
_HEAD = re.compile(r"(?<![^\s:\[\]])(?P<host>[^\s:\[\]]+):(?P<pid>[0-9]+):(?P<tid>[0-9]+)"
                   r"(?: \[(?P<dev>-?[0-9]+)\])?")
# NCCL formats each line into a 1024-byte buffer (debug.cc; the longest line of the H200
# capture is 1023 characters), so a longer line is not NCCL's: it is counted foreign unread,
# and no rule's pattern ever runs over more than this.
MAX_LINE_CHARS = 4096


def _prefix(line: str) -> tuple[re.Match[str], re.Match[str]] | None:
    """NCCL's prefix in ``line``: its head (host, pid, tid, device) and its level; the
    first level with a head before it (after the previous level), as launchers and
    NCCL_DEBUG_TIMESTAMP_FORMAT put text of their own first."""
    start = 0
    for level in _LEVEL.finditer(line):
        head = _HEAD.search(line, start, level.start())
        if head is not None:
            return head, level
        start = level.start()
    return None


# init.cc: "NCCL version %s" ("2.28.9+cuda13.0").
_VERSION = re.compile(r"^NCCL version (?P<v>\d+\.\d+\.\d+)(?P<suffix>\S*)")
# init.cc, "... comm %p rank %d nranks %d cudaDev %d nvmlDev %d busId %lx commId 0x%llx -
# Init START", after "ncclCommInitRank", "ncclCommInitRankConfig", "ncclCommSplit ... parent
# %p color %d key %d" or nothing (2.18 to 2.28 name the caller differently, the tail is one).
_INIT_START = re.compile(
    r"comm (?P<comm>0x[0-9a-fA-F]+|\(nil\)) rank (?P<rank>\d+) nranks (?P<nranks>\d+) "
    r"cudaDev (?P<cuda>\d+) nvmlDev (?P<nvml>\d+) busId (?P<bus>[0-9a-fA-F]+)"
    r"(?: parent \S+ color -?\d+ key -?\d+)? commId (?P<id>0x[0-9a-fA-F]+) - Init START")
_INIT_COMPLETE = re.compile(r"comm (?P<comm>0x[0-9a-fA-F]+) rank \d+ .*- Init COMPLETE")
# init.cc (2.28.9 capture): "comm %p rank %d nRanks %d nNodes %d localRanks %d localRank %d
# MNNVL %d".
_COMM_SHAPE = re.compile(r"^comm (?P<comm>0x[0-9a-fA-F]+) rank \d+ nRanks \d+ nNodes (?P<nodes>\d+)"
                         r" localRanks (?P<local>\d+)")
_USING_NETWORK = re.compile(r"^Using network (?P<name>.+?)\s*$")
# transport/net_ib.cc, ncclIbInit (2.22.3): "NET/IB : Using%s %s; OOB %s:%s", the
# devices as " [%d]%s:%d/%s" (index, name, port, "IB"/"RoCE"), merged NICs as
# " [%d]={[%d] %s:%d/%s, ...}", then "[RO]" where relaxed ordering is on.
_NET_IB_USING = re.compile(r"^NET/IB ?: Using(?P<devs>.*?);\s*OOB (?P<oob>.*)$")
_IB_DEV = re.compile(r"\[(?P<i>\d+)\] ?(?P<name>[\w.+-]+):(?P<port>\d+)/(?P<ll>IB|RoCE)")
_IB_MERGED = re.compile(r"\[(?P<i>\d+)\]=\{(?P<members>[^}]*)\}")
# transport/net_socket.cc: "NET/Socket : Using%s", the devices as " [%d]%s:%s" (name:address).
_NET_SOCKET_USING = re.compile(r"^NET/Socket ?: Using(?P<devs>.*)$")
_SOCKET_DEV = re.compile(r"\[(?P<i>\d+)\](?P<name>[^:\s]+):(?P<addr>\S+)")
# plugin/net.cc (2.28): "Initialized NET plugin %s", "Failed to initialize NET plugin %s",
# "Assigned NET plugin %s to comm"; "NET/Plugin: Loaded net plugin %s (v%d)".
_PLUGIN_STATE = re.compile(
    r"^(?:(?P<init>Initialized NET plugin )|(?P<fail>Failed to initialize NET plugin )"
    r"|(?P<assigned>Assigned NET plugin )|(?P<loaded>NET/Plugin: Loaded net plugin ))"
    r"(?P<name>.+?)(?: to comm| \(v\d+\))?\s*$")
# aws-ofi-nccl (NCCL_OFI_INFO prefixes "NET/OFI "): "Initializing aws-ofi-nccl %s";
# nccl_ofi_net.cpp "Selected provider is %s, fabric is %s (found %d nics)", older
# nccl_ofi_net.c "Selected Provider is %s (found %d nics)".
_OFI_VERSION = re.compile(r"^NET/OFI Initializing aws-ofi-nccl (?P<v>\S+)")
_OFI_PROVIDER = re.compile(
    r"^NET/OFI Selected [Pp]rovider is (?P<prov>[^,\s]+)(?:, fabric is (?P<fabric>[^\s(]+))?"
    r"(?: \(found (?P<nics>\d+) nics\))?")
# transport/p2p.cc (2.18.3, 2.28.3), shm.cc and net.cc (2.22.3, 2.28.3):
#   "Channel %02d/%01d : %d[%d] -> %d[%d] via P2P/CUMEM%s%s"     (and P2P/IPC, P2P/direct
#                                                                 pointer, P2P/indirect/%d[%d])
#   "Channel %02d : %d[%d] -> %d[%d] via SHM/%s/%s"              (SHM prints no connIndex)
#   "Channel %02d/%d : %d[%d] -> %d[%d] [send] via NET/%s/%d%s%s%s"     (proxy: "%d(%d)")
#   "Channel %02d/%d : %d[%d] -> %d[%d] [receive] via NET/%s/%d%s%s%s"  (peer -> me)
# The brackets hold nvmlDev from 2.18 (net.cc of 2.20.3 too); 2.17.1 prints the bus id
# ("%d[%lx]").
_CHANNEL = re.compile(
    r"^(?:Channel|Ring) (?P<ch>\d+)(?:/(?P<ci>\d+))? : (?P<src>\d+)(?:\[(?P<sdev>[0-9a-fA-F]+)\])?"
    r" -> (?P<dst>\d+)(?:\[(?P<ddev>[0-9a-fA-F]+)\])?(?: \[(?P<dir>send|receive)\])?"
    r" via (?P<via>.+?)\s*$")
# transport/coll_net.cc: "CollNet %02d/%1d : %d [send] via COLLNET/%s/%d%s%s" (recent source,
# "(PCI)" last); "CollNet %02d : %d [send] via COLLNET/%s/%d%s" and "Coll %02d : ..." before.
_COLLNET = re.compile(r"^(?:CollNet|Coll) (?P<ch>\d+)(?:/(?P<ci>\d+))? : (?P<rank>\d+)"
                      r" \[(?P<dir>send|receive)\] via (?P<via>COLLNET/.+?)\s*$")
_NET_VIA = re.compile(r"^NET/(?P<name>[^/]+)/(?P<dev>\d+)(?:\((?P<proxy>\d+)\))?(?P<flags>.*)$")
# transport/nvls.cc (2.28.3): "NVLS multicast support is %savailable on dev %d (NVLS_NCHANNELS
# %d)"; "NVLS comm %p headRank %d nHeads %d nvlsRanks %d buffSize ..." once its buffers exist;
# "Failed to bind NVLink SHARP (NVLS) Multicast memory ... Proceeding without NVLS support.".
_NVLS_SUPPORT = re.compile(r"^NVLS multicast support is (?P<not>not )?available on dev \d+"
                           r"(?: \(NVLS_NCHANNELS (?P<n>\d+)\))?")
_NVLS_COMM = re.compile(r"^NVLS comm (?P<comm>0x[0-9a-fA-F]+) headRank -?\d+ nHeads \d+")
_NVLS_FAILED = "Failed to bind NVLink SHARP (NVLS) Multicast memory"
# init.cc: "%d coll channels, %d collnet channels, %d nvls channels, %d p2p channels, %d p2p
# channels per peer" (2.28.9 capture; 2.18 has no collnet count).
_CHANNEL_COUNTS = re.compile(r"^(?P<coll>\d+) coll channels, "
                             r"(?:(?P<collnet>\d+) collnet channels, )?"
                             r"(?P<nvls>\d+) nvls channels, \d+ p2p channels")
# init.cc / transport/generic.cc: "Connected all rings" (2.28.3: ", use ring PXN %d GDR %d"),
# "Connected all trees", "Connected NVLS tree", "Connected binomial trees", ...
_CONNECTED = re.compile(r"^Connected (?P<what>[^,]+?)\s*(?:,.*)?$")
# graph/topo.cc, ncclTopoPrintRec (2.22.3; the 2.28.9 capture): a GPU is "GPU/%lx-%lx (%d)":
# its id (host index, bus id) and its rank. Links print the far GPU without a rank.
_TOPO_GPU = re.compile(r"GPU/(?P<id>[0-9a-fA-F]+(?:-[0-9a-fA-F]+)?) \((?P<rank>\d+)\)\s*$")
# graph/paths.cc, printNodePaths: "%s/%lX :" (2.22.3; "%s/%lx-%lx :" in 2.28), then per node
# "%s/%lx-%lx (%d/%.1f/%s) ": hops, bandwidth and the path type. NCCL cuts a line at 1024
# characters, so a long one is read as far as it goes.
_PATHS_HEAD = re.compile(r"^GPU/(?P<id>[0-9a-fA-F]+(?:-[0-9a-fA-F]+)?) :(?P<rest>.*)$")
_PATH_ENTRY = re.compile(
    r"GPU/(?P<id>[0-9a-fA-F]+(?:-[0-9a-fA-F]+)?) \(\d+/[\d.]+/(?P<path>[A-Z0-9]+)\)")


@dataclass(frozen=True)
class NetDevice:
    """One device a network plugin said it uses ("[0]mlx5_0:1/IB", "[0]eth0:10.0.0.1<0>")."""

    index: int
    name: str
    port: int | None = None
    link_layer: str | None = None    # "IB" or "RoCE" (NET/IB); None for sockets
    address: str | None = None       # NET/Socket's interface address


@dataclass
class ProcessInfo:
    """What one process's NCCL said once for all its communicators: version and network."""

    host: str
    pid: int
    nccl_version: str | None = None
    network: str | None = None                       # "Using network %s": the plugin in use
    # plugin name -> "initialized", "failed", "assigned" (to a communicator) or "loaded"
    plugins: dict[str, str] = field(default_factory=dict)
    net_devices: dict[str, list[NetDevice]] = field(default_factory=dict)  # "IB", "Socket"
    ib_no_device: bool = False                       # "NET/IB : No device found."
    ofi: dict[str, Any] = field(default_factory=dict)  # version, provider, fabric, nics


@dataclass
class CommInfo:
    """One communicator as one rank's process logged it."""

    host: str
    pid: int
    cuda_dev: int | None
    comm: str | None                                 # the communicator's address in that process
    comm_id: str | None = None                       # commId: the same on every rank
    rank: int | None = None
    nranks: int | None = None
    nnodes: int | None = None
    local_ranks: int | None = None
    nvml_dev: int | None = None
    bus_id: str | None = None
    gpus: dict[int, str] = field(default_factory=dict)        # rank -> bus id, this node's GPUs
    topology: bool = False                           # the GRAPH system dump was seen
    gpu_paths: dict[str, str] = field(default_factory=dict)   # "busA>busB" -> NVL, PIX, ...
    nvls_available: bool | None = None
    nvls_channels: int | None = None
    nvls: bool = False                               # NVLS buffers set up or channels counted
    nvls_failed: bool = False                        # multicast bind failed: NCCL went on without
    connected: list[str] = field(default_factory=list)        # "all rings", "NVLS tree", ...
    complete: bool = False                           # Init COMPLETE seen

    def path(self, src_rank: int, dst_rank: int) -> str | None:
        """The topology path type NCCL computed between two ranks' GPUs on this node."""
        a, b = self.gpus.get(src_rank), self.gpus.get(dst_rank)
        if a is None or b is None:
            return None
        return self.gpu_paths.get(f"{a}>{b}") or self.gpu_paths.get(f"{b}>{a}")


@dataclass(frozen=True)
class Connection:
    """One channel connection NCCL set up, as one rank's log line printed it.

    ``src_rank`` -> ``dst_rank`` is the direction data flows: NCCL prints a receive as
    "peer -> me". ``src_dev``/``dst_dev`` are the NVML device indices NCCL prints in brackets
    (2.18 and later); a 2.17-or-older log prints bus ids there, kept in ``src_bus``/``dst_bus``.
    ``cuda_dev`` is the logging thread's CUDA device, from the line prefix. A CollNet line names
    one rank: ``dst_rank`` is None (the peer is the network's reduction tree)."""

    host: str
    pid: int
    cuda_dev: int | None
    comm: str | None
    comm_id: str | None
    channel: int
    conn_index: int | None
    src_rank: int
    dst_rank: int | None
    direction: Literal["send", "receive"] | None
    transport: Transport
    raw: str                          # the text after "via "
    src_dev: int | None = None
    dst_dev: int | None = None
    src_bus: str | None = None
    dst_bus: str | None = None
    path: str | None = None           # P2P: the topology path type that classed it
    net: str | None = None            # NET: the plugin's name as printed ("IB", "Socket", ...)
    nic_index: int | None = None      # NET/<plugin>/<index>
    nic: str | None = None            # that index's device, from the plugin's device line
    gdr: bool | None = None           # NET: GPUDirect RDMA ("/GDRDMA")
    proxy_rank: int | None = None     # NET via another local GPU's NIC (PXN): that rank
    inter_node: bool | None = None    # None where the log cannot tell


@dataclass
class NcclLog:
    """One read of a log: what it added, plus what its processes had said before."""

    processes: list[ProcessInfo] = field(default_factory=list)
    comms: list[CommInfo] = field(default_factory=list)
    connections: list[Connection] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    lines: int = 0
    recognized: int = 0
    unrecognized: int = 0   # NCCL lines no rule here reads (most INFO lines: expected)
    foreign: int = 0        # lines that are not NCCL log lines at all
    partial: int = 0        # a last line without its newline (still being written)

    @property
    def nccl_versions(self) -> list[str]:
        return sorted({p.nccl_version for p in self.processes if p.nccl_version})


def _bus(value: str) -> str:
    """A GPU's bus id as NCCL's topology ids and Init lines print it, normalised:
    "0-1b000", "1B000" and "1b000" are one GPU."""
    local = value.rsplit("-", 1)[-1].lower().lstrip("0")
    return local or "0"


def _version_tuple(version: str | None) -> tuple[int, ...] | None:
    if not version:
        return None
    m = re.match(r"(\d+)\.(\d+)\.(\d+)", version)
    return tuple(int(x) for x in m.groups()) if m else None


def net_transport(name: str) -> Transport:
    """A NET plugin's name to the vocabulary: the built-in "IB" (and HPC-X's "IBext_v*"),
    "Socket", the AWS OFI plugin ("AWS Libfabric", later "Libfabric"); others net_other."""
    low = name.lower()
    if low == "ib" or low.startswith("ibext"):
        return "net_ib"
    if low == "socket":
        return "net_socket"
    if "libfabric" in low or "ofi" in low:
        return "net_ofi"
    return "net_other"


class NcclLogParser:
    """Parses a log a piece at a time, keeping what earlier pieces said (versions, devices,
    each communicator's topology), so a later piece's connections are classed with it."""

    def __init__(self) -> None:
        self._procs: dict[tuple[str, int], ProcessInfo] = {}
        self._current: dict[tuple[str, int, int | None], CommInfo] = {}
        self._by_addr: dict[tuple[str, int, str], CommInfo] = {}
        self._version: str | None = None   # the last version any process printed

    def feed(self, text: str) -> NcclLog:
        """Records from ``text``; a last line without its newline is counted as partial and
        left unread (the reader reads it again once it is whole). The processes and
        communicators returned are copies: a later piece does not change them."""
        out = NcclLog()
        touched_procs: dict[tuple[str, int], None] = {}
        touched_comms: dict[int, CommInfo] = {}
        lines = text.split("\n")
        if lines and lines[-1] == "":
            lines.pop()
        elif lines:
            lines.pop()
            out.partial = 1
        for line in lines:
            out.lines += 1
            if not line.strip():
                continue
            found = _prefix(line) if len(line) <= MAX_LINE_CHARS else None
            if found is None:
                out.foreign += 1
                continue
            head, level = found
            host, pid = head["host"], int(head["pid"])
            dev = int(head["dev"]) if head["dev"] is not None else None
            msg = line[level.end():].rstrip()
            self._proc(host, pid)
            touched_procs[(host, pid)] = None
            if level["level"] == "WARN":
                out.warnings.append(msg)
                out.recognized += 1
                continue
            comm = self._line(host, pid, dev, msg, out)
            if comm is None:
                out.unrecognized += 1
            else:
                out.recognized += 1
                if isinstance(comm, CommInfo):
                    touched_comms[id(comm)] = comm
        out.processes = copy.deepcopy([self._procs[k] for k in touched_procs])
        out.comms = copy.deepcopy(list(touched_comms.values()))
        return out

    def _proc(self, host: str, pid: int) -> ProcessInfo:
        return self._procs.setdefault((host, pid), ProcessInfo(host=host, pid=pid))

    def _comm(self, host: str, pid: int, dev: int | None) -> CommInfo:
        """The communicator this thread is setting up: the last one started on its device."""
        key = (host, pid, dev)
        if key not in self._current:
            self._current[key] = CommInfo(host=host, pid=pid, cuda_dev=dev, comm=None)
        return self._current[key]

    def _line(self, host: str, pid: int, dev: int | None, msg: str,
              out: NcclLog) -> CommInfo | bool | None:
        """One message: the communicator it added to, True for a process-wide fact, None when
        no rule reads it."""
        if " via " in msg:
            return self._connection(host, pid, dev, msg, out)
        if msg.startswith("NCCL version "):
            m = _VERSION.match(msg)
            if m:
                self._proc(host, pid).nccl_version = self._version = m["v"] + m["suffix"]
                return True
        if msg.startswith("NET/") or "NET plugin" in msg:
            return self._net_line(host, pid, msg)
        if msg.startswith("Using network "):
            m = _USING_NETWORK.match(msg)
            if m:
                self._proc(host, pid).network = m["name"]
                return True
        if "Init START" in msg:
            return self._init_start(host, pid, dev, msg)
        if "Init COMPLETE" in msg:
            m = _INIT_COMPLETE.search(msg)
            if m:
                comm = self._by_addr.get((host, pid, m["comm"])) or self._comm(host, pid, dev)
                comm.complete = True
                return comm
        return self._comm_line(host, pid, dev, msg)

    def _init_start(self, host: str, pid: int, dev: int | None, msg: str) -> CommInfo | None:
        m = _INIT_START.search(msg)
        if m is None:
            return None
        rank, bus = int(m["rank"]), _bus(m["bus"])
        comm = CommInfo(host=host, pid=pid, cuda_dev=dev, comm=m["comm"], comm_id=m["id"],
                        rank=rank, nranks=int(m["nranks"]), nvml_dev=int(m["nvml"]), bus_id=bus,
                        gpus={rank: bus})
        self._current[(host, pid, dev)] = comm
        self._by_addr[(host, pid, m["comm"])] = comm
        return comm

    def _comm_line(self, host: str, pid: int, dev: int | None, msg: str) -> CommInfo | None:
        """Topology, paths, NVLS and connection progress: facts of the current communicator."""
        text = msg.strip()
        m = _TOPO_GPU.search(text)
        if m and text.startswith(("+", "GPU/")) and ":" not in text:
            comm = self._comm(host, pid, dev)
            comm.gpus[int(m["rank"])] = _bus(m["id"])
            comm.topology = True
            return comm
        m = _PATHS_HEAD.match(text)
        if m:
            comm = self._comm(host, pid, dev)
            src = _bus(m["id"])
            for entry in _PATH_ENTRY.finditer(m["rest"]):
                dst = _bus(entry["id"])
                if dst != src:
                    comm.gpu_paths[f"{src}>{dst}"] = entry["path"]
            return comm
        m = _COMM_SHAPE.match(text)
        if m:
            comm = self._by_addr.get((host, pid, m["comm"])) or self._comm(host, pid, dev)
            comm.nnodes, comm.local_ranks = int(m["nodes"]), int(m["local"])
            return comm
        m = _NVLS_SUPPORT.match(text)
        if m:
            comm = self._comm(host, pid, dev)
            comm.nvls_available = not m["not"]
            return comm
        m = _NVLS_COMM.match(text)
        if m:
            comm = self._by_addr.get((host, pid, m["comm"])) or self._comm(host, pid, dev)
            comm.nvls = True
            return comm
        if text.startswith(_NVLS_FAILED):
            comm = self._comm(host, pid, dev)
            comm.nvls_failed = True
            return comm
        m = _CHANNEL_COUNTS.match(text)
        if m:
            comm = self._comm(host, pid, dev)
            comm.nvls_channels = int(m["nvls"])
            comm.nvls = comm.nvls or comm.nvls_channels > 0
            return comm
        m = _CONNECTED.match(text)
        if m:
            comm = self._comm(host, pid, dev)
            comm.connected.append(m["what"])
            if m["what"].startswith("NVLS"):
                comm.nvls = True
            return comm
        return None

    def _net_line(self, host: str, pid: int, msg: str) -> bool | None:
        proc = self._proc(host, pid)
        m = _NET_IB_USING.match(msg)
        if m:
            proc.net_devices["IB"] = _ib_devices(m["devs"])
            return True
        if msg.startswith("NET/IB : No device found"):
            proc.ib_no_device = True
            return True
        m = _NET_SOCKET_USING.match(msg)
        if m:
            proc.net_devices["Socket"] = [
                NetDevice(index=int(d["i"]), name=d["name"], address=d["addr"])
                for d in _SOCKET_DEV.finditer(m["devs"])]
            return True
        m = _PLUGIN_STATE.match(msg)
        if m:
            state = ("initialized" if m["init"] else "failed" if m["fail"]
                     else "assigned" if m["assigned"] else "loaded")
            proc.plugins[m["name"]] = state
            return True
        m = _OFI_VERSION.match(msg)
        if m:
            proc.ofi["version"] = m["v"]
            return True
        m = _OFI_PROVIDER.match(msg)
        if m:
            proc.ofi.update(provider=m["prov"], fabric=m["fabric"],
                            nics=int(m["nics"]) if m["nics"] else None)
            return True
        return None

    def _connection(self, host: str, pid: int, dev: int | None, msg: str,
                    out: NcclLog) -> CommInfo | None:
        text = msg.strip()
        if (m := _CHANNEL.match(text)) is not None:
            comm = self._comm(host, pid, dev)
            conn = self._channel(host, pid, dev, m, comm, self._proc(host, pid))
        elif (m := _COLLNET.match(text)) is not None:
            comm = self._comm(host, pid, dev)
            conn = Connection(
                host=host, pid=pid, cuda_dev=dev, comm=comm.comm, comm_id=comm.comm_id,
                channel=int(m["ch"]), conn_index=int(m["ci"]) if m["ci"] else None,
                src_rank=int(m["rank"]), dst_rank=None, direction=_direction(m["dir"]),
                transport="collnet", raw=m["via"], gdr="/GDRDMA" in m["via"], inter_node=True)
        else:
            return None
        if conn is None:
            return None
        out.connections.append(conn)
        return comm

    def _channel(self, host: str, pid: int, dev: int | None, m: re.Match[str],
                 comm: CommInfo, proc: ProcessInfo) -> Connection | None:
        via = m["via"]
        src, dst = int(m["src"]), int(m["dst"])
        version = _version_tuple(proc.nccl_version or self._version)
        devs: dict[str, Any] = {}
        for side, text in (("src", m["sdev"]), ("dst", m["ddev"])):
            if text is None:
                continue
            # 2.17 and older print the bus id in hex; 2.18 and later the NVML index. Only rank
            # 0 prints the version: without it, hex digits or a value no NVML index reaches
            # (a GPU on PCI bus 1 or above prints 1000 or more) mark a bus id.
            if ((version is not None and version < (2, 18)) or re.search("[a-fA-F]", text)
                    or int(text) >= 256):
                devs[f"{side}_bus"] = _bus(text)
            else:
                devs[f"{side}_dev"] = int(text)
        common: dict[str, Any] = dict(
            host=host, pid=pid, cuda_dev=dev, comm=comm.comm, comm_id=comm.comm_id,
            channel=int(m["ch"]), conn_index=int(m["ci"]) if m["ci"] else None,
            src_rank=src, dst_rank=dst, direction=_direction(m["dir"]), raw=via, **devs)
        inter = _between_nodes(comm, src, dst)
        if via.startswith("P2P/"):
            path = comm.path(src, dst)
            if path is None and "src_bus" in devs and "dst_bus" in devs:
                path = comm.gpu_paths.get(f"{devs['src_bus']}>{devs['dst_bus']}")
            mode = via.split("/")[1]
            transport: Transport = (
                "p2p_nvlink" if mode == "MNNVL" or path in _NVLINK_PATHS
                else "p2p_pcie" if path in _PCIE_PATHS else "p2p")
            # P2P stays inside a node, except over multi-node NVLink (MNNVL).
            return Connection(**common, transport=transport, path=path,
                              inter_node=inter if mode == "MNNVL" else False)
        if via.startswith("SHM/") or via == "direct shared memory":
            return Connection(**common, transport="shm", inter_node=False)
        net = _NET_VIA.match(via)
        if net:
            transport = net_transport(net["name"])
            index = int(net["dev"])
            key = {"net_ib": "IB", "net_socket": "Socket"}.get(transport)
            names = {d.index: d.name for d in proc.net_devices.get(key or "", [])}
            return Connection(**common, transport=transport, net=net["name"], nic_index=index,
                              nic=names.get(index), gdr="/GDRDMA" in net["flags"],
                              proxy_rank=int(net["proxy"]) if net["proxy"] else None,
                              inter_node=inter)
        return None


def _direction(text: str | None) -> Literal["send", "receive"] | None:
    return "send" if text == "send" else "receive" if text == "receive" else None


def _between_nodes(comm: CommInfo, src: int, dst: int) -> bool | None:
    """Whether two ranks sit on different nodes, as far as the communicator's log tells: its
    topology lists this node's ranks; without it, one node or one local rank decide."""
    if comm.nnodes == 1:
        return False
    if comm.topology or comm.local_ranks == 1:
        return not (src in comm.gpus and dst in comm.gpus)
    return None


def _ib_devices(text: str) -> list[NetDevice]:
    devices = []
    for merged in _IB_MERGED.finditer(text):
        parts = list(_IB_DEV.finditer(merged["members"]))
        if parts:
            devices.append(NetDevice(index=int(merged["i"]),
                                     name="+".join(p["name"] for p in parts),
                                     port=int(parts[0]["port"]), link_layer=parts[0]["ll"]))
    rest = _IB_MERGED.sub("", text)
    devices += [NetDevice(index=int(d["i"]), name=d["name"], port=int(d["port"]),
                          link_layer=d["ll"]) for d in _IB_DEV.finditer(rest)]
    return sorted(devices, key=lambda d: d.index)


def parse_nccl_log(text: str) -> NcclLog:
    """The whole of one log's text (a file, or several ranks' lines interleaved)."""
    return NcclLogParser().feed(text)


@dataclass(frozen=True)
class PairTransports:
    """The transports between two ranks of one communicator, both directions together."""

    comm_id: str | None
    ranks: tuple[int, int]
    transports: tuple[str, ...]
    inter_node: bool | None


@dataclass(frozen=True)
class TransportSummary:
    """What a probe's communicators ran over, in the few facts a judgement needs."""

    nccl_versions: tuple[str, ...]
    networks: tuple[str, ...]                 # "Using network %s" of each process
    counts: dict[str, int]                    # connections per transport
    pairs: tuple[PairTransports, ...]
    intra_node: tuple[str, ...]               # transports between ranks of one node
    inter_node: tuple[str, ...]               # ... and between nodes
    inter_node_socket: bool                   # some traffic between nodes went over TCP sockets
    socket_fallback: bool                     # ... although the node has RDMA NICs
    rdma_devices: tuple[str, ...]             # the RDMA NICs that make it a fallback
    net_without_gdr: int                      # IB/OFI connections without GPUDirect RDMA
    p2p_path_unknown: int                     # P2P connections the log gave no path for
    nvls: bool
    nvls_failed: bool
    collnet: bool
    warnings: int
    unrecognized_lines: int
    foreign_lines: int
    partial_lines: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def summarize(logs: NcclLog | Iterable[NcclLog], *,
              rdma_devices: Iterable[str] = ()) -> TransportSummary:
    """Several ranks' logs (or one) in one summary. ``rdma_devices`` are RDMA NICs the node is
    known to have (from sysfs, agents.nic_counters): with them, or with NET/IB devices in the
    log, inter-node traffic over sockets is a fallback. A NET connection whose locality the
    log cannot tell counts as inter-node: NCCL uses NET inside a node only when P2P and SHM
    both cannot serve (disabled, or slower than the NIC)."""
    items = [logs] if isinstance(logs, NcclLog) else list(logs)
    conns = [c for log in items for c in log.connections]
    procs = [p for log in items for p in log.processes]
    comms = [c for log in items for c in log.comms]
    counts: dict[str, int] = {}
    pairs: dict[tuple[str | None, int, int], tuple[set[str], bool | None]] = {}
    intra: set[str] = set()
    inter: set[str] = set()
    for c in conns:
        counts[c.transport] = counts.get(c.transport, 0) + 1
        between_nodes = c.inter_node if c.inter_node is not None else c.transport in NET_TRANSPORTS
        (inter if between_nodes else intra).add(c.transport)
        if c.dst_rank is None:
            continue
        key = (c.comm_id, min(c.src_rank, c.dst_rank), max(c.src_rank, c.dst_rank))
        kinds, locality = pairs.get(key, (set(), c.inter_node))
        kinds.add(c.transport)
        pairs[key] = (kinds, locality if locality is not None else c.inter_node)
    rdma = set(rdma_devices) | {d.name for p in procs for d in p.net_devices.get("IB", [])}
    socket_between = "net_socket" in inter
    return TransportSummary(
        nccl_versions=tuple(sorted({p.nccl_version for p in procs if p.nccl_version})),
        networks=tuple(sorted({p.network for p in procs if p.network})),
        counts=dict(sorted(counts.items())),
        pairs=tuple(PairTransports(comm_id=k[0], ranks=(k[1], k[2]),
                                   transports=tuple(sorted(v[0])), inter_node=v[1])
                    for k, v in sorted(pairs.items(), key=_pair_key)),
        intra_node=tuple(sorted(intra)),
        inter_node=tuple(sorted(inter)),
        inter_node_socket=socket_between,
        socket_fallback=socket_between and bool(rdma),
        rdma_devices=tuple(sorted(rdma)),
        net_without_gdr=sum(1 for c in conns if c.transport in ("net_ib", "net_ofi") and not c.gdr),
        p2p_path_unknown=counts.get("p2p", 0),
        nvls=any(c.nvls for c in comms),
        nvls_failed=any(c.nvls_failed for c in comms),
        collnet="collnet" in counts,
        warnings=sum(len(log.warnings) for log in items),
        unrecognized_lines=sum(log.unrecognized for log in items),
        foreign_lines=sum(log.foreign for log in items),
        partial_lines=sum(log.partial for log in items),
    )


def _pair_key(item: tuple[tuple[str | None, int, int], Any]) -> tuple[str, int, int]:
    (comm_id, a, b), _ = item
    return (comm_id or "", a, b)


# --- The probe's side: making NCCL write the log, and reading it a probe at a time. ---

DEBUG_SUBSYS = "INIT,NET,GRAPH"
DEBUG_FILE_NAME = "nccl.%h.%p.log"
# debug.cc (2.22.3): the subsystems NCCL_DEBUG_SUBSYS names; unset, the mask is INIT and ENV.
_SUBSYSTEMS = frozenset({"INIT", "COLL", "P2P", "SHM", "NET", "GRAPH", "TUNING", "ENV", "ALLOC",
                         "CALL", "PROXY", "NVLS", "BOOTSTRAP", "REG", "PROFILE", "RAS"})
_NEEDED = {"INIT": "channel connections and NET devices (NCCL_INIT)",
           "GRAPH": "the GPU-to-GPU path that tells NVLink from PCIe (NCCL_GRAPH)"}


@dataclass(frozen=True)
class DebugSetup:
    """What to add to a probe process's environment so NCCL writes what this module reads.

    NCCL reads NCCL_DEBUG, NCCL_DEBUG_SUBSYS and NCCL_DEBUG_FILE once per process, at its first
    log call (debug.cc, ncclDebugInit), and opens the file then with fopen(.., "w"): so ``env``
    must be in the environment before the first communicator of the process is created (for a
    Ray actor: its runtime_env, or os.environ in its constructor before torch.distributed
    builds a NCCL communicator). The file then grows for the process's life, one communicator
    after another: NcclLogReader reads it a window at a time."""

    env: dict[str, str]            # set these; never one the user already set
    debug_file: str | None         # the NCCL_DEBUG_FILE pattern in effect (ours or the user's)
    transports_visible: bool       # NCCL, so configured, writes the connection lines to a file
    paths_visible: bool            # ... and the GRAPH path dump (NVLink vs PCIe)
    notes: tuple[str, ...] = ()    # why not, where not


def _subsys_mask(value: str | None) -> frozenset[str]:
    """The subsystems a NCCL_DEBUG_SUBSYS value enables (debug.cc: a comma list, "^" inverts
    it, ALL is every one); unset, NCCL's default mask."""
    if value is None:
        return frozenset({"INIT", "ENV"})
    invert = value.startswith("^")
    names = {s.strip().upper() for s in value.lstrip("^").split(",") if s.strip()}
    named = _SUBSYSTEMS if "ALL" in names else frozenset(names) & _SUBSYSTEMS
    return _SUBSYSTEMS - named if invert else named


def nccl_debug_setup(base_dir: str | os.PathLike[str],
                     environ: Mapping[str, str] | None = None) -> DebugSetup:
    """The NCCL debug settings for a probe process whose log goes under ``base_dir``.

    ringwatch sets each variable only where the user has not. A user's NCCL_DEBUG is theirs:
    ringwatch then sets none of the three (their choice of level, subsystems and destination
    stands), and reads their NCCL_DEBUG_FILE if they named one. So NCCL_DEBUG=WARN (or VERSION)
    leaves the transports unrecorded, as does NCCL_DEBUG=INFO without a file (the lines go to
    stdout, which ringwatch does not read); ``notes`` says which."""
    env = dict(os.environ if environ is None else environ)
    setup: dict[str, str] = {}
    notes: list[str] = []
    user_level = env.get("NCCL_DEBUG")
    if user_level is None:
        setup["NCCL_DEBUG"] = "INFO"
        if "NCCL_DEBUG_SUBSYS" not in env:
            setup["NCCL_DEBUG_SUBSYS"] = DEBUG_SUBSYS
        if "NCCL_DEBUG_FILE" not in env:
            setup["NCCL_DEBUG_FILE"] = str(Path(base_dir) / DEBUG_FILE_NAME)
    level = (user_level or "INFO").upper()
    debug_file = env.get("NCCL_DEBUG_FILE", setup.get("NCCL_DEBUG_FILE"))
    visible = level in ("INFO", "TRACE")
    if not visible:
        notes.append(f"NCCL_DEBUG={user_level} (set by the user) writes no INFO lines")
    if debug_file is None:
        visible = False
        notes.append("NCCL_DEBUG is the user's and NCCL_DEBUG_FILE is unset: NCCL logs to "
                     "stdout, which ringwatch does not read")
    mask = _subsys_mask(env.get("NCCL_DEBUG_SUBSYS", setup.get("NCCL_DEBUG_SUBSYS")))
    missing = [name for name in _NEEDED if name not in mask]
    notes += [f"NCCL_DEBUG_SUBSYS leaves out {name}: no {_NEEDED[name]}" for name in missing]
    return DebugSetup(env=setup, debug_file=debug_file,
                      transports_visible=visible and "INIT" not in missing,
                      paths_visible=visible and not missing, notes=tuple(notes))


def nccl_hostname() -> str:
    """The host name as NCCL writes it (%h, and each line's prefix): cut at its first '.'."""
    return socket.gethostname().split(".", 1)[0]


def expand_debug_file(pattern: str, host: str, pid: int) -> str:
    """NCCL_DEBUG_FILE's substitutions as debug.cc makes them: %h the host, %p the pid, %%
    a '%'; any other %x is kept as written."""
    out: list[str] = []
    i = 0
    while i < len(pattern):
        ch = pattern[i]
        if ch != "%" or i + 1 == len(pattern):
            out.append(ch)
            i += 1
            continue
        nxt = pattern[i + 1]
        out.append({"%": "%", "h": host, "p": str(pid)}.get(nxt, "%" + nxt))
        i += 2
    return "".join(out)


def find_debug_files(pattern: str, host: str | None = None) -> list[Path]:
    """Every process's file on this host that ``pattern`` names (%p as any pid)."""
    glob = expand_debug_file(pattern.replace("%p", "\0"), host or nccl_hostname(), 0)
    path = Path(glob.replace("\0", "*"))
    return sorted(path.parent.glob(path.name))


def debug_file_pid(pattern: str, name: str, host: str | None = None) -> int | None:
    """The pid in ``name`` where ``pattern`` names this host's file of that process: ASCII
    digits, no leading zero, at most Linux's largest pid (2**22); None for any other name."""
    named = Path(expand_debug_file(pattern.replace("%p", "\0"), host or nccl_hostname(), 0)).name
    prefix, _, suffix = named.partition("\0")
    if not (name.startswith(prefix) and name.endswith(suffix)):
        return None
    pid = name[len(prefix):len(name) - len(suffix)]
    if not re.fullmatch(r"[1-9][0-9]{0,6}", pid) or int(pid) > PID_MAX:
        return None
    return int(pid)


PID_MAX = 1 << 22  # kernel/pid.c, PID_MAX_LIMIT on 64-bit


def private_dir(path: str | os.PathLike[str]) -> tuple[Path | None, str | None]:
    """``path`` as a folder only this user can write in: made 0700 where it is missing, and
    where it is there, taken only as a real folder (no link) owned by this user that no one
    else may write to. Anyone sharing a node's temp folder could have made it first, as a
    link to their own files or as an open folder, and NCCL (which opens its file through
    links) and the agent's trim and clean-up would then act on what they chose. The folder,
    or None and why not."""
    folder = Path(path)
    try:
        os.mkdir(folder, 0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        return None, f"cannot make {folder}: {exc.strerror}"
    try:
        st = os.lstat(folder)
    except OSError as exc:
        return None, f"cannot read {folder}: {exc.strerror}"
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        return None, f"{folder} is not a folder but a {'link' if stat.S_ISLNK(st.st_mode) else 'file'}"
    if st.st_uid != os.getuid():
        return None, f"{folder} is owned by uid {st.st_uid}, not this agent's {os.getuid()}"
    if st.st_mode & 0o077:
        return None, f"{folder} is mode {stat.S_IMODE(st.st_mode):04o}: others may write in it"
    return folder, None


def _open_regular(path: Path, flags: int) -> int:
    """A descriptor on ``path`` that is a regular file reached without following a link as
    its last part: a link, a FIFO or a device planted there raises OSError (and a FIFO never
    blocks the open)."""
    fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", str(path))
    except BaseException:
        os.close(fd)
        raise
    return fd


# The most of NCCL's debug file an agent keeps once read (NcclLogReader.trim): every
# communicator's init writes its topology and channels, tens of kilobytes a group.
TRIM_BYTES = 16 << 20
# The most one ``read`` takes in (a user's own file may be far larger); the rest waits for
# the next read.
READ_BYTES = 64 << 20


class NcclLogReader:
    """One process's NCCL debug file, read a window at a time: each ``read`` parses only what
    NCCL appended since the last one, so the probe that reads after each group gets that
    group's communicators and connections. The parser keeps earlier windows' context (version,
    devices, topology). A line still being written is left for the next read; a file that
    shrank (a new process reusing the name) is read again from its start.

    The file is opened only as a regular file reached without a link, and trimmed only where
    it is ``own`` (ringwatch named it, in its private folder) and this user's: a user's own
    NCCL_DEBUG_FILE is read, never emptied."""

    def __init__(self, debug_file: str, *, host: str | None = None, pid: int | None = None,
                 own: bool = True) -> None:
        self.path = Path(expand_debug_file(debug_file, host or nccl_hostname(),
                                           os.getpid() if pid is None else pid))
        self.own = own
        self._offset = 0
        self._parser = NcclLogParser()
        # Set by ``trim``: the file was emptied under NCCL, which goes on writing at its own
        # position (it opened the file "w"), so a size below the offset is no new process.
        self._trimmed = False

    @classmethod
    def for_this_process(cls, environ: Mapping[str, str] | None = None, *,
                         own: bool = False) -> NcclLogReader | None:
        """A reader of the file NCCL_DEBUG_FILE names for this process; None when NCCL writes
        to stdout."""
        env = os.environ if environ is None else environ
        pattern = env.get("NCCL_DEBUG_FILE")
        return cls(pattern, own=own) if pattern else None

    def _size(self) -> int | None:
        try:
            fd = _open_regular(self.path, os.O_RDONLY)
        except OSError:
            return None
        try:
            return os.fstat(fd).st_size
        finally:
            os.close(fd)

    def skip(self) -> None:
        """Start from the end: what NCCL wrote before now is not the next probe's."""
        self._offset = self._size() or 0

    def read(self) -> NcclLog:
        try:
            fd = _open_regular(self.path, os.O_RDONLY)
        except OSError:
            return NcclLog()  # NCCL has not logged yet in this process (or it is no file)
        try:
            size = os.fstat(fd).st_size
            if size < self._offset:
                if self._trimmed:
                    return NcclLog()  # trimmed, and NCCL has written nothing since
                self._offset, self._parser = 0, NcclLogParser()
            data = os.pread(fd, min(size - self._offset, READ_BYTES), self._offset)
        finally:
            os.close(fd)
        end = data.rfind(b"\n") + 1
        self._offset += end
        log = self._parser.feed(data[:end].decode("utf-8", errors="replace"))
        log.partial = 1 if end < len(data) else 0
        return log

    def trim(self, max_bytes: int = TRIM_BYTES) -> bool:
        """Keep a long-lived agent's file from growing without end: once everything in it
        was read and it holds more than ``max_bytes``, empty it. NCCL opened it with
        fopen(..., "w") (debug.cc) and goes on writing at its own position, so the file
        becomes sparse (the emptied part takes no disk) and reading goes on at the same
        offset. Whether it was emptied."""
        if not self.own:
            return False
        try:
            fd = _open_regular(self.path, os.O_WRONLY)
        except OSError:
            return False
        try:
            st = os.fstat(fd)
            if st.st_uid != os.getuid() or st.st_size <= max_bytes or st.st_size != self._offset:
                return False
            os.ftruncate(fd, 0)
        finally:
            os.close(fd)
        self._trimmed = True
        return True
