"""NIC port counters read from a fake sysfs tree (the one seam: the root directory), holding an
mlx5 InfiniBand port, an mlx5 RoCE port and an EFA device; their rates, resets, and the
nic_errors judged from them."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import pytest

from ringwatch.agents.nic_counters import (
    PMA_WIDTHS,
    THRESHOLDS,
    PortSnapshot,
    counter_rates,
    nic_errors,
    read_ports,
)

IB_COUNTERS = {
    "symbol_error": 0, "link_error_recovery": 0, "link_downed": 1, "port_rcv_errors": 0,
    "port_rcv_remote_physical_errors": 0, "port_xmit_discards": 3,
    "local_link_integrity_errors": 0, "excessive_buffer_overrun_errors": 0,
    "port_xmit_data": 123456789, "port_rcv_data": 98765432,
}
# drivers/infiniband/hw/efa/efa_verbs.c, EFA_DEFINE_PORT_STATS.
EFA_COUNTERS = {
    "tx_bytes": 10_000_000, "tx_pkts": 1_000_000, "rx_bytes": 9_000_000, "rx_pkts": 900_000,
    "rx_drops": 0, "send_bytes": 0, "send_wrs": 0, "recv_bytes": 0, "recv_wrs": 0,
    "rdma_read_wrs": 0, "rdma_read_bytes": 0, "rdma_read_wr_err": 0, "rdma_read_resp_bytes": 0,
    "rdma_write_wrs": 0, "rdma_write_bytes": 0, "rdma_write_wr_err": 0,
    "rdma_write_recv_bytes": 0, "retrans_bytes": 0, "retrans_pkts": 0,
    "retrans_timeout_events": 0, "unresponsive_remote_events": 0,
    "impaired_remote_conn_events": 0,
}


def write_port(root: Path, device: str, port: int, *, link_layer: str, rate: str,
               counters: dict[str, int | str] | None = None,
               hw_counters: dict[str, int | str] | None = None,
               state: str = "4: ACTIVE", phys_state: str = "5: LinkUp") -> Path:
    base = root / "sys/class/infiniband" / device / "ports" / str(port)
    for name, value in (("link_layer", link_layer), ("rate", rate), ("state", state),
                        ("phys_state", phys_state)):
        base.mkdir(parents=True, exist_ok=True)
        (base / name).write_text(f"{value}\n")
    for sub, values in (("counters", counters), ("hw_counters", hw_counters)):
        if values is not None:
            (base / sub).mkdir(exist_ok=True)
            for name, value in values.items():
                (base / sub / name).write_text(f"{value}\n")
    return base


@pytest.fixture
def sysfs(tmp_path: Path) -> Path:
    """A node with mlx5_0 (InfiniBand NDR), mlx5_1 (RoCE, one counter without a PMA) and two
    EFA devices: efa_0, and one that rdma-core's udev rules renamed, known by its driver."""
    write_port(tmp_path, "mlx5_0", 1, link_layer="InfiniBand", rate="400 Gb/sec (4X NDR)",
               counters=dict(IB_COUNTERS), hw_counters={"out_of_buffer": 0, "out_of_sequence": 2})
    write_port(tmp_path, "mlx5_1", 1, link_layer="Ethernet", rate="200 Gb/sec (4X HDR)",
               counters={**IB_COUNTERS, "symbol_error": "N/A (no PMA)"})
    for name in ("efa_0", "rdmap16s27"):
        write_port(tmp_path, name, 1, link_layer="Unknown", rate="100 Gb/sec (4X EDR)",
                   hw_counters=dict(EFA_COUNTERS))
    driver = tmp_path / "sys/bus/pci/drivers/efa"
    driver.mkdir(parents=True)
    pci = tmp_path / "sys/class/infiniband/rdmap16s27/device"
    pci.mkdir()
    os.symlink(driver, pci / "driver")
    return tmp_path


def at(snaps: list[PortSnapshot], t: float) -> list[PortSnapshot]:
    return [replace(s, read_at=t) for s in snaps]


def bump(root: Path, device: str, sub: str, **values: int) -> None:
    for name, value in values.items():
        (root / "sys/class/infiniband" / device / "ports/1" / sub / name).write_text(f"{value}\n")


def test_read_every_port(sysfs: Path) -> None:
    ports = {p.device: p for p in read_ports(sysfs)}
    assert sorted(ports) == ["efa_0", "mlx5_0", "mlx5_1", "rdmap16s27"]
    ib, roce, efa, renamed = ports["mlx5_0"], ports["mlx5_1"], ports["efa_0"], ports["rdmap16s27"]
    assert (ib.kind, ib.link_layer, ib.state, ib.phys_state, ib.rate_gbps, ib.port) == \
        ("ib", "InfiniBand", "ACTIVE", "LinkUp", 400.0, 1)
    assert ib.counters["link_downed"] == 1 and ib.counters["port_xmit_data"] == 123456789
    assert ib.hw_counters == {"out_of_buffer": 0, "out_of_sequence": 2}
    assert (roce.kind, roce.rate_gbps) == ("roce", 200.0)
    assert "symbol_error" not in roce.counters and roce.unreadable == ("counters/symbol_error",)
    assert (efa.kind, efa.link_layer, efa.counters) == ("efa", "Unknown", {})
    assert efa.hw_counters["retrans_pkts"] == 0 and len(efa.hw_counters) == len(EFA_COUNTERS)
    assert renamed.kind == "efa"
    assert all(p.read_at > 0 for p in ports.values())
    assert [p.device for p in read_ports(sysfs, devices=["mlx5_1"])] == ["mlx5_1"]
    assert read_ports(sysfs / "nowhere") == []


def test_rates_per_second_and_per_interval(sysfs: Path) -> None:
    before = at(read_ports(sysfs, devices=["mlx5_0"]), 1000.0)
    bump(sysfs, "mlx5_0", "counters", port_xmit_data=123456789 + 6000, port_xmit_discards=9)
    after = at(read_ports(sysfs, devices=["mlx5_0"]), 1060.0)
    rates = {r.counter: r for r in counter_rates(before, after)}
    data = rates["port_xmit_data"]
    assert (data.delta, data.interval_s, data.rate_per_s, data.reset) == (6000, 60.0, 100.0, False)
    assert (rates["port_xmit_discards"].delta, rates["port_xmit_discards"].rate_per_s) == (6, 0.1)
    assert rates["out_of_sequence"].source == "hw_counters" and rates["out_of_sequence"].delta == 0


def test_a_counter_that_went_backwards_is_a_reset(sysfs: Path) -> None:
    before = at(read_ports(sysfs, devices=["mlx5_0"]), 0.0)
    bump(sysfs, "mlx5_0", "counters", link_downed=0, port_xmit_data=10)
    after = at(read_ports(sysfs, devices=["mlx5_0"]), 30.0)
    rates = {r.counter: r for r in counter_rates(before, after)}
    for name in ("link_downed", "port_xmit_data"):
        assert rates[name].reset and rates[name].delta is None and rates[name].rate_per_s is None
    # A reset is judged next interval, not as a rise (nor a fall) now.
    assert nic_errors(before, after, "node-1") == []


def test_a_saturated_counter_is_marked(sysfs: Path) -> None:
    before = at(read_ports(sysfs, devices=["mlx5_0"]), 0.0)
    bump(sysfs, "mlx5_0", "counters", local_link_integrity_errors=15)  # 4 bits: 15 is its maximum
    after = at(read_ports(sysfs, devices=["mlx5_0"]), 10.0)
    rates = {r.counter: r for r in counter_rates(before, after)}
    assert rates["local_link_integrity_errors"].saturated
    assert not rates["symbol_error"].saturated and PMA_WIDTHS["local_link_integrity_errors"] == 4


def test_link_downed_rising_is_a_flap(sysfs: Path) -> None:
    before = at(read_ports(sysfs), 0.0)
    bump(sysfs, "mlx5_0", "counters", link_downed=2)
    bump(sysfs, "mlx5_1", "counters", link_downed=3)
    after = at(read_ports(sysfs), 60.0)
    errors = nic_errors(before, after, "node-1")
    assert [(e.device, e.counter, e.delta, e.flap, e.severity) for e in errors] == [
        ("mlx5_0", "link_downed", 1, True, "critical"),
        ("mlx5_1", "link_downed", 2, True, "critical")]
    record = errors[0].to_dict()
    assert record["node"] == "node-1" and record["port"] == 1 and record["threshold"] == 1.0
    assert record["threshold_per"] == "interval" and "azurehpc-health-checks" in record["why"]
    assert record["rate_per_s"] == pytest.approx(1 / 60)


def test_symbol_errors_are_judged_against_the_port_rate(sysfs: Path) -> None:
    before = at(read_ports(sysfs, devices=["mlx5_0"]), 0.0)
    bump(sysfs, "mlx5_0", "counters", symbol_error=20)  # 0.33/s on 400 Gb/s: BER 8e-13
    quiet = at(read_ports(sysfs, devices=["mlx5_0"]), 60.0)
    assert nic_errors(before, quiet, "n") == []
    bump(sysfs, "mlx5_0", "counters", symbol_error=120)  # 2/s: BER 5e-12
    noisy = at(read_ports(sysfs, devices=["mlx5_0"]), 60.0)
    (error,) = nic_errors(before, noisy, "n")
    assert (error.counter, error.delta, error.threshold_per) == ("symbol_error", 120, "second")
    assert error.threshold == pytest.approx(0.4) and error.rate_per_s == pytest.approx(2.0)
    assert not error.flap and "ibdiagnet" in error.why
    # Without a rate from sysfs the fallback is a count per interval.
    no_rate = [replace(s, rate_gbps=None) for s in quiet]
    (fallback,) = nic_errors(before, no_rate, "n")
    assert (fallback.threshold, fallback.threshold_per) == (10.0, "interval")


def test_discards_need_more_than_corruption_counters(sysfs: Path) -> None:
    before = at(read_ports(sysfs, devices=["mlx5_0"]), 0.0)
    bump(sysfs, "mlx5_0", "counters", port_xmit_discards=3 + 50, port_rcv_errors=12,
         link_error_recovery=1)
    after = at(read_ports(sysfs, devices=["mlx5_0"]), 60.0)
    assert {e.counter for e in nic_errors(before, after, "n")} == {"port_rcv_errors", "link_error_recovery"}
    bump(sysfs, "mlx5_0", "counters", port_xmit_discards=3 + 150)
    later = at(read_ports(sysfs, devices=["mlx5_0"]), 60.0)
    assert "port_xmit_discards" in {e.counter for e in nic_errors(before, later, "n")}


def test_efa_counters(sysfs: Path) -> None:
    before = at(read_ports(sysfs, devices=["efa_0"]), 0.0)
    # 0.5% of the interval's packets sent again: SRD's routine retransmission.
    bump(sysfs, "efa_0", "hw_counters", tx_pkts=1_100_000, retrans_pkts=500)
    routine = at(read_ports(sysfs, devices=["efa_0"]), 60.0)
    assert nic_errors(before, routine, "n") == []
    bump(sysfs, "efa_0", "hw_counters", retrans_pkts=5000, unresponsive_remote_events=1,
         retrans_timeout_events=2, rx_drops=40)
    bad = at(read_ports(sysfs, devices=["efa_0"]), 60.0)
    errors = {e.counter: e for e in nic_errors(before, bad, "n")}
    assert sorted(errors) == ["retrans_pkts", "retrans_timeout_events", "unresponsive_remote_events"]
    assert errors["retrans_pkts"].threshold_per == "ratio" and errors["retrans_pkts"].threshold == 0.01
    assert errors["unresponsive_remote_events"].severity == "critical"
    # The IB rules do not read EFA ports, nor the EFA rules IB ports.
    assert all(e.device == "efa_0" for e in errors.values())


def test_a_port_that_left_active(sysfs: Path) -> None:
    before = at(read_ports(sysfs, devices=["mlx5_0"]), 0.0)
    base = sysfs / "sys/class/infiniband/mlx5_0/ports/1"
    (base / "state").write_text("1: DOWN\n")
    (base / "phys_state").write_text("3: Disabled\n")
    after = at(read_ports(sysfs, devices=["mlx5_0"]), 5.0)
    (error,) = nic_errors(before, after, "node-2")
    assert (error.counter, error.severity, error.interval_s) == ("state", "critical", 5.0)
    assert "DOWN" in error.why and "Disabled" in error.why


def test_every_threshold_says_where_it_comes_from() -> None:
    named = {t.counter for t in THRESHOLDS}
    assert {"symbol_error", "link_error_recovery", "link_downed", "port_rcv_errors",
            "port_xmit_discards", "local_link_integrity_errors", "excessive_buffer_overrun_errors",
            "port_rcv_remote_physical_errors", "rx_drops", "retrans_pkts", "retrans_timeout_events",
            "impaired_remote_conn_events", "unresponsive_remote_events"} <= named
    assert all(t.cited and t.meaning and t.min_delta >= 1 for t in THRESHOLDS)
    assert [t.counter for t in THRESHOLDS if t.flap] == ["link_downed"]
    assert len({(t.source, t.counter) for t in THRESHOLDS}) == len(THRESHOLDS)
