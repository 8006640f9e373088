"""The wire's vocabulary is spelled once (agents/spec.py) and the API's schemas speak it."""

from __future__ import annotations

from typing import get_args

from ringwatch.agents.spec import (
    ALGOS,
    BACKENDS,
    FINDING_KINDS,
    OPS,
    REDOPS,
    SCOPES,
    TIMINGS,
    WireRedOp,
)
from ringwatch.agents.workloads import WORKLOADS, ProfileName
from ringwatch.api.schemas import FindingIn, MeasurementBatch, MeasurementIn, PreflightIn


def _enum(model, field: str) -> list[str]:
    prop = model.model_json_schema()["properties"][field]
    options = prop.get("anyOf", [prop])
    return next(o["enum"] for o in options if "enum" in o)


def test_the_api_accepts_exactly_the_spec_words() -> None:
    assert _enum(MeasurementIn, "op") == list(OPS)
    assert _enum(MeasurementIn, "scope") == list(SCOPES)
    assert _enum(MeasurementIn, "algo") == list(ALGOS)
    assert _enum(MeasurementIn, "timing") == list(TIMINGS)
    assert _enum(MeasurementIn, "redop") == list(get_args(WireRedOp))
    assert _enum(MeasurementBatch, "backend") == list(BACKENDS)
    assert _enum(FindingIn, "kind") == list(FINDING_KINDS)
    assert _enum(PreflightIn, "profile") == list(get_args(ProfileName))


def test_a_probe_runs_every_wire_reduction_but_prod() -> None:
    assert set(get_args(WireRedOp)) - set(REDOPS) == {"prod"}


def test_the_profile_names_are_the_workloads() -> None:
    assert list(get_args(ProfileName)) == list(WORKLOADS)
