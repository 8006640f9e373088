"""The scheduler keeps monitoring through errors, and its spool survives a crash."""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path

import pytest

from ringwatch.agents.sim import SimBackend
from ringwatch.services.scheduler import cycle as cycle_module
from ringwatch.services.scheduler.cycle import ProbeOptions, run_scheduler
from ringwatch.services.scheduler.shipper import Shipper
from tests.procs import free_port

SMALL = {"nodes": 4, "gpus_per_node": 2, "gpu": "H100-SXM", "noise": 0.0, "seed": 1, "faults": []}


def test_a_disk_error_costs_one_cycle_not_the_monitoring(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cycle_module, "ERROR_BACKOFF_S", 0.05)
    spool = tmp_path / "spool"
    # The API is down (nothing listens), and the spool's disk fails for the first cycle.
    shipper = Shipper(f"http://127.0.0.1:{free_port()}", "t", spool, timeout_s=1)
    shutil.rmtree(spool)
    spool.write_text("not a directory")
    said: list[str] = []
    stop = threading.Event()

    def progress(msg: str) -> None:
        said.append(msg)
        if msg.startswith("error:"):  # the operator frees the disk
            spool.unlink()
            spool.mkdir()
        if msg.startswith("cycle "):
            stop.set()

    cycles = run_scheduler(SimBackend(SMALL), shipper, ProbeOptions(), interval_s=0.0, once=False,
                           stop=stop, progress=progress, jitter=0.0, max_duty=1.0)
    shipper.close()
    errors = [m for m in said if m.startswith("error:")]
    assert cycles == 1 and len(errors) == 1 and "retrying in" in errors[0]
    # The cycle after the error was kept: spooled for the API that is still down.
    assert len(shipper.pending()) == 1


def test_the_spool_recovers_what_a_crash_left_half_written(tmp_path: Path) -> None:
    spool = tmp_path / "spool"
    spool.mkdir()
    whole = {"batch_id": "whole", "measurements": []}
    (spool / "00000000000000000001-whole.tmp").write_text(json.dumps(whole))
    (spool / "00000000000000000002-torn.tmp").write_text('{"batch_id": "torn", "measu')
    shipper = Shipper("http://127.0.0.1:9", "t", spool)
    shipper.close()
    assert shipper.recovered == 1
    assert [p.name for p in shipper.pending()] == ["00000000000000000001-whole.json"]
    assert json.loads(shipper.pending()[0].read_text()) == whole
    assert [p.name for p in (spool / "rejected").iterdir()] == ["00000000000000000002-torn.tmp"]


def test_a_served_preflight_counts_in_the_duty_cycle() -> None:
    duty = cycle_module.DutyCycle(max_duty=0.01)
    duty.charge_preflight({"n0/0": 2.0, "n0/1": 1.5, "n1/0": 0.5})
    # The busiest rank held 2 s: at 1 % the next cycle owes 198 s of rest, once.
    assert duty.take_owed() == pytest.approx(198.0)
    assert duty.take_owed() == 0.0
    assert set(duty.fractions()) == {"n0", "n1"}
    assert duty.fractions()["n0"] > duty.fractions()["n1"] > 0
