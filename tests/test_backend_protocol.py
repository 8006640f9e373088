"""Every backend has the whole ProbeBackend surface: callers use plain attribute access, so a
member one backend lacks would fail only when a cycle first reaches it."""

from __future__ import annotations

import inspect

import pytest

from ringwatch.agents.sim import SimBackend
from ringwatch.agents.spec import BackendDefaults, ProbeBackend
from ringwatch.services.scheduler.cycle import ProbeOptions, run_cycle
from ringwatch.services.scheduler.ray_backend import RayBackend
from tests.test_preflight_sim import SlowRankBackend

# Every concrete backend and every double used as one: a new member must reach them all.
BACKENDS = [SimBackend, RayBackend, SlowRankBackend]


def declared(proto: type) -> set[str]:
    """The members a protocol declares: its annotated attributes, properties and methods."""
    return {n for n in (*vars(proto), *proto.__annotations__) if not n.startswith("_")}


def has(cls: type) -> set[str]:
    """What a class offers: its attributes, and the attributes its instances set
    (annotated on the class, as RayBackend's ``name``)."""
    annotated = {n for k in cls.__mro__ for n in vars(k).get("__annotations__", {})}
    return set(dir(cls)) | annotated


def test_the_protocol_declares_what_the_check_and_scheduler_use() -> None:
    assert declared(ProbeBackend) == {
        "name", "injected", "repeats", "preflight_sizes", "preflight_deadline_s",
        "expected_busbw", "ranks", "refresh_ranks", "begin_cycle", "counters",
        "busy_nodes", "acquire", "release", "not_acquired", "run_round", "close"}


@pytest.mark.parametrize("cls", BACKENDS, ids=lambda c: c.__name__)
def test_every_backend_has_every_member_of_the_protocol(cls: type) -> None:
    assert declared(ProbeBackend) - has(cls) == set()


@pytest.mark.parametrize("cls", BACKENDS, ids=lambda c: c.__name__)
def test_the_protocols_methods_are_methods(cls: type) -> None:
    methods = {n for n, v in vars(ProbeBackend).items()
               if inspect.isfunction(v) and not n.startswith("_")}
    assert methods and all(callable(getattr(cls, n)) for n in methods)


def test_the_defaults_are_neutral() -> None:
    b = BackendDefaults()
    assert list(b.injected) == [] and b.repeats == 1 and b.expected_busbw is None
    assert b.preflight_sizes is None and b.preflight_deadline_s is None
    assert b.counters() == {} and b.busy_nodes() == {}
    assert b.refresh_ranks() is None and b.begin_cycle(3) is None and b.close() is None
    # Nothing held on a GPU, so nothing to set up or tear down: no seconds for the duty cycle.
    assert b.acquire(["node-000", "node-001"]) == 0.0 and b.acquire([]) == 0.0
    assert b.release() == 0.0 and b.release() == 0.0


def test_a_backend_with_only_the_defaults_runs_a_scheduled_cycle() -> None:
    """No injected faults, no counters, no busy nodes: a cycle reads the defaults as
    "nothing to say", and probes at the defaults' sizes."""
    b = SlowRankBackend(3, 2)
    cycle = run_cycle(b, ProbeOptions(), skip_busy=True)
    assert cycle.injected == [] and cycle.skipped == {} and cycle.counters == []
    assert cycle.measurements and cycle.findings == []
    assert {m.size_bytes for m in cycle.measurements} == {1 << 16, 1 << 22}


def test_the_sim_states_only_what_differs() -> None:
    """The sim's own deadline and hardware model; its sizes are the sizes table's (one
    home for every backend's); the rest is the defaults'."""
    from ringwatch.agents.collectives import default_sizes
    from ringwatch.services.check.shape import probe_sizes

    b = SimBackend({"nodes": 2, "gpus_per_node": 2})
    assert b.preflight_sizes is None and probe_sizes(b) == default_sizes("sim")
    assert b.preflight_deadline_s and b.expected_busbw is not None
    assert list(b.injected) == [] and b.repeats == 1 and b.counters() == {}
