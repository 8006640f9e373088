"""Counter readers and big requests under attack (issue 50, items 11, 13f and 13g): a counter
reading that cannot be true never becomes a figure, one finding's bad number never costs the
batch it came in, a request naming the documented maximum of nodes or hosts is answered, and
a sysfs tree holding a FIFO, a huge file or non-ASCII digits neither blocks nor breaks the
reader."""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text

from ringwatch.agents.contention import TrafficMeter, TrafficSample
from ringwatch.agents.nic_counters import (
    PortSnapshot,
    counter_rates,
    nic_errors,
    read_data_bytes,
    read_ports,
)
from ringwatch.agents.telemetry import telemetry_findings
from ringwatch.api.schemas import MeasurementBatch
from ringwatch.services.store import db
from tests.api_fixtures import fleet_batch
from tests.test_nic_counters import EFA_COUNTERS, IB_COUNTERS, write_port

ALL_ONES = (1 << 64) - 1
PORTS = "sys/class/infiniband"


def at(snaps: list[PortSnapshot], t: float) -> list[PortSnapshot]:
    return [replace(s, read_at=t) for s in snaps]


def set_counter(root: Path, device: str, sub: str, name: str, value: int | str) -> None:
    (root / PORTS / device / "ports/1" / sub / name).write_text(f"{value}\n")


@pytest.fixture
def efa(tmp_path: Path) -> Path:
    """One EFA port at 100 Gb/s and one mlx5 InfiniBand port at 400 Gb/s, as
    tests/test_nic_counters.py lays them out (the kernel's own counter names)."""
    write_port(tmp_path, "efa_0", 1, link_layer="Unknown", rate="100 Gb/sec (4X EDR)",
               hw_counters=dict(EFA_COUNTERS))
    write_port(tmp_path, "mlx5_0", 1, link_layer="InfiniBand", rate="400 Gb/sec (4X NDR)",
               counters=dict(IB_COUNTERS))
    return tmp_path


# ---- 11a: an impossible reading is dropped at the reader, with a note ---------------------


def test_an_efa_counter_jumping_to_all_ones_makes_no_figure_and_a_note(
        efa: Path, caplog: pytest.LogCaptureFixture) -> None:
    before = at(read_ports(efa), 1000.0)
    # rx_drops and a critical counter from 0 to 2^64-1 in a minute: more than any port carries.
    set_counter(efa, "efa_0", "hw_counters", "rx_drops", ALL_ONES)
    set_counter(efa, "efa_0", "hw_counters", "unresponsive_remote_events", ALL_ONES)
    # A real rise beside them is still judged.
    set_counter(efa, "efa_0", "hw_counters", "retrans_timeout_events", 3)
    after = at(read_ports(efa), 1060.0)
    with caplog.at_level(logging.WARNING, logger="ringwatch.agents.nic_counters"):
        rates = {(r.device, r.counter): r for r in counter_rates(before, after)}
        errors = nic_errors(before, after, "node-1")
    drops = rates[("efa_0", "rx_drops")]
    assert drops.delta is None and drops.rate_per_s is None and drops.impossible
    assert all(r.delta is None or r.delta < 1 << 63 for r in rates.values())
    assert [(e.counter, e.delta) for e in errors] == [("retrans_timeout_events", 3)]
    notes = [r.getMessage() for r in caplog.records]
    assert any("efa_0 port 1 hw_counters/rx_drops" in n and str(ALL_ONES) in n for n in notes)
    assert any("unresponsive_remote_events" in n for n in notes)


def test_a_counter_going_backwards_is_dropped_with_a_note(
        efa: Path, caplog: pytest.LogCaptureFixture) -> None:
    before = at(read_ports(efa, devices=["mlx5_0"]), 0.0)
    set_counter(efa, "mlx5_0", "counters", "link_downed", 0)
    after = at(read_ports(efa, devices=["mlx5_0"]), 30.0)
    with caplog.at_level(logging.WARNING, logger="ringwatch.agents.nic_counters"):
        (rate,) = [r for r in counter_rates(before, after) if r.counter == "link_downed"]
    assert rate.reset and rate.delta is None
    assert any("mlx5_0 port 1 counters/link_downed" in r.getMessage() and "went back" in
               r.getMessage() for r in caplog.records)


def test_a_data_counter_rising_faster_than_the_port_is_dropped(efa: Path) -> None:
    """The bound is the port's own rate: 400 Gb/s for a minute is 3e12 bytes, 7.5e11 words."""
    before = at(read_ports(efa, devices=["mlx5_0"]), 0.0)
    start = IB_COUNTERS["port_xmit_data"]
    set_counter(efa, "mlx5_0", "counters", "port_xmit_data", start + 700_000_000_000)
    set_counter(efa, "mlx5_0", "counters", "port_rcv_data", 98765432 + 10 ** 14)
    after = at(read_ports(efa, devices=["mlx5_0"]), 60.0)
    rates = {r.counter: r for r in counter_rates(before, after)}
    assert rates["port_xmit_data"].delta == 700_000_000_000  # 373 Gb/s: a busy port, not a lie
    assert rates["port_rcv_data"].impossible and rates["port_rcv_data"].delta is None


def _nvlink(errors: dict[str, int], read_at: float | None) -> dict[str, Any]:
    reading: dict[str, Any] = {"available": True, "local_index": 0, "nvlinks": [
        {"link": 3, "active": True, "errors": errors}]}
    if read_at is not None:
        reading["read_at"] = read_at
    return reading


@pytest.mark.parametrize("times", [(100.0, 160.0), (None, None)], ids=["timed", "untimed"])
def test_an_nvml_counter_jumping_to_all_ones_makes_no_figure_and_a_note(
        times: tuple[float | None, float | None], caplog: pytest.LogCaptureFixture) -> None:
    before = _nvlink({"crc_flit": 0, "replay": 0}, times[0])
    after = _nvlink({"crc_flit": ALL_ONES, "replay": 7}, times[1])
    with caplog.at_level(logging.WARNING, logger="ringwatch.agents.telemetry"):
        (found,) = telemetry_findings(before, after, "node-1", 0)
    # The real rise stays a finding; the impossible one is neither a figure nor a rise.
    assert found.detail["rising_errors"] == {"3": {"replay": 7}}
    assert any("link 3 crc_flit" in r.getMessage() and str(ALL_ONES) in r.getMessage()
               for r in caplog.records)
    with caplog.at_level(logging.WARNING, logger="ringwatch.agents.telemetry"):
        only_bad = telemetry_findings(before, _nvlink({"crc_flit": ALL_ONES, "replay": 0},
                                                      times[1]), "node-1", 0)
    assert only_bad == []


def test_a_traffic_counter_jumping_to_all_ones_is_no_traffic(
        caplog: pytest.LogCaptureFixture) -> None:
    meter = TrafficMeter()
    before = TrafficSample(at=0.0, nvlink_kib={(1, 0): 0, (2, 0): 0},
                           net_bytes={("efa_0", 1): 0, ("efa_0", 2): 1_000})
    after = TrafficSample(at=0.2, nvlink_kib={(1, 0): ALL_ONES, (2, 0): 100},
                          net_bytes={("efa_0", 1): ALL_ONES, ("efa_0", 2): 1_000 + 200_000_000})
    with caplog.at_level(logging.WARNING, logger="ringwatch.agents.contention"):
        traffic = meter.traffic(before, after, 0.2, "n/0")
    # Only the counters that could be true count: 100 KiB and 200 MB in 0.2 s.
    assert traffic.nvlink_gbs == pytest.approx(100 * 1024 / 0.2 / 1e9)
    assert traffic.net_gbs == pytest.approx(1.0)
    assert sum("cannot be true" in r.getMessage() for r in caplog.records) == 2


# ---- 11b: one finding's out-of-range number never costs the batch -------------------------


def _bad_nic_finding(node: str) -> dict[str, Any]:
    """A nic_errors finding as agents.transport.nic_finding writes it, from an older agent
    that judged a 0 -> 2^64-1 jump."""
    return {"kind": "nic_errors", "node": node, "severity": "warning", "source": "sysfs",
            "device": "efa_0", "port": 1, "counter": "rx_drops", "cause": "efa_0 rx_drops",
            "counters": [{"node": node, "device": "efa_0", "port": 1, "counter": "rx_drops",
                          "delta": ALL_ONES, "rate_per_s": 3.07e17, "threshold": 100.0,
                          "threshold_per": "interval", "interval_s": 60.0,
                          "severity": "warning", "flap": False, "why": "EFA rx_drops"}]}


def _batch_with_one_bad_finding() -> dict[str, Any]:
    batch = fleet_batch(nodes=3)
    batch["findings"] = [
        {"kind": "gpu_xid", "node": "node-000", "gpu": 0, "severity": "critical", "xids": [79],
         "source": "nvml"},
        _bad_nic_finding("node-001"),
    ]
    batch["counters"] = [
        {"node": "node-002", "local_index": 0, "before": [{"link": 0, "errors": {"crc_flit": 0}}],
         "after": [{"link": 0, "errors": {"crc_flit": ALL_ONES}}], "xid": [],
         "findings": ["nvlink_degraded"]},
        {"node": "node-000", "local_index": 0, "before": [], "after": [],
         "xid": [{"xid": 79, "type": 8}], "findings": ["gpu_xid"]},
    ]
    return batch


def test_the_schema_drops_a_finding_whose_number_is_out_of_range_and_says_so() -> None:
    batch = MeasurementBatch.model_validate_json(json.dumps(_batch_with_one_bad_finding()))
    assert [f.kind for f in batch.findings] == ["gpu_xid"]
    assert [(c.node, c.findings) for c in batch.counters] == [("node-000", ["gpu_xid"])]
    assert len(batch.dropped) == 2
    assert "findings[1]" in batch.dropped[0] and "nic_errors" in batch.dropped[0]
    assert "counters.0.delta" in batch.dropped[0] and "int64" in batch.dropped[0]
    assert "counters[0]" in batch.dropped[1] and "node-002" in batch.dropped[1]
    # Anything else wrong with a finding is still the sender's error.
    wrong = _batch_with_one_bad_finding()
    wrong["findings"][0]["kind"] = "gremlins"
    with pytest.raises(ValueError, match="kind"):
        MeasurementBatch.model_validate_json(json.dumps(wrong))


def test_a_batch_with_one_impossible_counter_is_accepted_and_the_rest_stored(
        api, caplog: pytest.LogCaptureFixture) -> None:
    batch = _batch_with_one_bad_finding()
    with caplog.at_level(logging.WARNING, logger="ringwatch.api.schemas"):
        r = api.post("/v1/measurements", json=batch, headers=api.h["agent"])
    assert r.status_code == 200, r.text
    assert r.json()["stored"] == len(batch["measurements"])
    assert len(r.json()["dropped"]) == 2 and "nic_errors" in r.json()["dropped"][0]
    opened = api.get("/v1/findings", params={"status": "open"}, headers=api.h["reader"]).json()
    assert {(f["kind"], f["nodes"][0]) for f in opened} == {("gpu_xid", "node-000")}
    nodes = {n["name"] for n in api.get("/v1/nodes", headers=api.h["reader"]).json()}
    assert nodes == {"node-000", "node-001", "node-002"}
    assert any("nic_errors" in r.getMessage() and "dropped" in r.getMessage()
               for r in caplog.records)


# ---- 13f: the documented maxima of a preflight and a rank map are answered ----------------


def test_a_preflight_naming_100000_mostly_unknown_nodes_is_a_404_naming_them(api) -> None:
    api.post("/v1/measurements", json=fleet_batch(), headers=api.h["agent"]).raise_for_status()
    names = [f"node-{i:03d}" for i in range(4)] + [f"ghost-{i:06d}" for i in range(99_996)]
    r = api.post("/v1/preflight", json={"nodes": names}, headers=api.h["reader"])
    assert r.status_code == 404, r.text[:300]
    assert "node(s): ghost-000000" in r.json()["message"]


def test_a_preflight_naming_100000_known_nodes_is_answered(api, clean_db) -> None:
    api.post("/v1/measurements", json=fleet_batch(), headers=api.h["agent"]).raise_for_status()
    with db.transaction(clean_db) as s:
        s.execute(text("INSERT INTO nodes (name) SELECT 'big-' || lpad(g::text, 6, '0') "
                       "FROM generate_series(0, 99995) AS g"))
    names = [f"node-{i:03d}" for i in range(4)] + [f"big-{i:06d}" for i in range(99_996)]
    r = api.post("/v1/preflight", json={"nodes": names, "max_age_s": 600},
                 headers=api.h["reader"])
    # Never probed: the request waits for a scheduler.
    assert r.status_code == 202, r.text[:300]
    assert r.json()["status"] == "pending" and len(r.json()["nodes"]) == 100_000


def test_a_rank_map_of_60000_hosts_is_checked(api) -> None:
    api.post("/v1/measurements", json=fleet_batch(), headers=api.h["agent"]).raise_for_status()
    hosts = [f"node-{i:03d}" for i in range(4)] + [f"host-{i:05d}" for i in range(59_996)]
    ranks = [{"rank": i, "host": h, "local_rank": 0, "gpu_uuid": f"GPU-{i:08d}"}
             for i, h in enumerate(hosts)]
    r = api.post("/v1/rank-maps/check", json={"ranks": ranks}, headers=api.h["reader"])
    assert r.status_code == 200, r.text[:300]
    body = r.json()
    assert body["hosts"] == 60_000
    problems = [f["problem"] for f in body["findings"]]
    assert problems.count("unknown_host") == 59_996 and not body["ok"]


# ---- 13g: FIFOs, huge files and non-ASCII digits under the sysfs root ---------------------


def _promptly(call: Callable[[], Any], unblock: Callable[[], None], seconds: float = 10.0) -> Any:
    """``call``'s answer, asserting it came within a generous bound (``unblock`` frees a call
    that hung, so a failing test does not hang the run)."""
    out: list[Any] = []
    worker = threading.Thread(target=lambda: out.append(call()), daemon=True)
    worker.start()
    worker.join(seconds)
    if worker.is_alive():
        unblock()
        worker.join(5)
        pytest.fail(f"the reader was still blocked after {seconds:.0f} s")
    return out[0]


def _writer_for(fifo: Path) -> Callable[[], None]:
    def unblock() -> None:
        fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        os.close(fd)
    return unblock


@pytest.fixture
def planted(efa: Path) -> Iterator[Path]:
    """The EFA port's ``state`` a FIFO, its tx_bytes a FIFO too, and one counter each
    holding a superscript two and an Arabic-Indic three."""
    port = efa / PORTS / "efa_0/ports/1"
    (port / "state").unlink()
    os.mkfifo(port / "state")
    set_counter(efa, "efa_0", "hw_counters", "rx_drops", "²")
    set_counter(efa, "efa_0", "hw_counters", "retrans_pkts", "٣")
    yield efa


def test_a_fifo_state_file_and_unicode_digits_are_skipped_with_a_note(planted: Path) -> None:
    fifo = planted / PORTS / "efa_0/ports/1/state"
    ports = {p.device: p for p in _promptly(lambda: read_ports(planted), _writer_for(fifo))}
    efa = ports["efa_0"]
    assert efa.state is None and "state" in efa.unreadable
    assert "rx_drops" not in efa.hw_counters and "hw_counters/rx_drops" in efa.unreadable
    assert "retrans_pkts" not in efa.hw_counters and "hw_counters/retrans_pkts" in efa.unreadable
    assert efa.hw_counters["tx_bytes"] == EFA_COUNTERS["tx_bytes"]
    assert ports["mlx5_0"].state == "ACTIVE" and ports["mlx5_0"].unreadable == ()


def test_a_fifo_data_counter_does_not_block_the_traffic_reader(efa: Path) -> None:
    fifo = efa / PORTS / "efa_0/ports/1/hw_counters/tx_bytes"
    fifo.unlink()
    os.mkfifo(fifo)
    data = _promptly(lambda: read_data_bytes(efa), _writer_for(fifo))
    assert ("efa_0", 1) not in data and ("mlx5_0", 1) in data


def test_a_fifo_among_counters_is_skipped_with_a_note(efa: Path) -> None:
    fifo = efa / PORTS / "mlx5_0/ports/1/counters/symbol_error"
    fifo.unlink()
    os.mkfifo(fifo)
    (ib,) = _promptly(lambda: read_ports(efa, devices=["mlx5_0"]), _writer_for(fifo))
    assert "symbol_error" not in ib.counters and ib.unreadable == ("counters/symbol_error",)


def test_a_huge_or_overlong_counter_file_is_not_a_reading(efa: Path) -> None:
    # Longer than any sysfs attribute (a page), and a number past 64 bits: neither is true.
    set_counter(efa, "mlx5_0", "counters", "port_rcv_errors", "0" * 65536)
    set_counter(efa, "mlx5_0", "counters", "port_xmit_discards", "9" * 25)
    (ib,) = read_ports(efa, devices=["mlx5_0"])
    assert "port_rcv_errors" not in ib.counters and "port_xmit_discards" not in ib.counters
    assert set(ib.unreadable) == {"counters/port_rcv_errors", "counters/port_xmit_discards"}
    assert ib.counters["port_xmit_data"] == IB_COUNTERS["port_xmit_data"]


@pytest.mark.parametrize("rate", ["4..0 Gb/sec (4X NDR)", "٤٠٠ Gb/sec (4X NDR)", "..Gb/sec"])
def test_a_rate_that_is_no_number_is_no_rate(efa: Path, rate: str) -> None:
    (efa / PORTS / "mlx5_0/ports/1/rate").write_text(rate + "\n")
    (ib,) = read_ports(efa, devices=["mlx5_0"])
    assert ib.rate_gbps is None and "rate" in ib.unreadable


def test_real_layouts_still_read_the_same(efa: Path) -> None:
    """The kernel's layouts (tests/test_nic_counters.py: mlx5 IB and EFA) read as before:
    every counter, the states and rates, nothing unreadable."""
    ports = {p.device: p for p in read_ports(efa)}
    assert ports["efa_0"].hw_counters == EFA_COUNTERS
    assert ports["mlx5_0"].counters == IB_COUNTERS
    assert [(p.state, p.phys_state, p.rate_gbps, p.unreadable) for p in ports.values()] == [
        ("ACTIVE", "LinkUp", 100.0, ()), ("ACTIVE", "LinkUp", 400.0, ())]
    assert read_data_bytes(efa) == {
        ("efa_0", 1): EFA_COUNTERS["tx_bytes"] + EFA_COUNTERS["rx_bytes"],
        ("mlx5_0", 1): 4 * (IB_COUNTERS["port_xmit_data"] + IB_COUNTERS["port_rcv_data"])}
