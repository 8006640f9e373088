"""Property tests run under the "ci" Hypothesis profile (tests/conftest.py): no deadline per
example and no health check that times data generation, so a loaded machine slows them and
never fails them. No test sets a deadline of its own."""

from __future__ import annotations

import ast
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

TESTS = Path(__file__).resolve().parent


def test_the_loaded_profile_has_no_deadline_and_no_timing_health_check() -> None:
    loaded = settings.default
    assert loaded is not None
    assert loaded.deadline is None
    assert HealthCheck.too_slow in loaded.suppress_health_check
    assert settings.get_profile("ci").deadline is None


def test_a_test_with_settings_of_its_own_inherits_no_deadline() -> None:
    @settings(max_examples=3)
    @given(st.integers())
    def property_test(x: int) -> None:
        assert isinstance(x, int)

    property_test()
    assert property_test._hypothesis_internal_use_settings.deadline is None  # type: ignore[attr-defined]


def test_no_property_test_sets_a_deadline() -> None:
    timed = []
    for path in sorted(TESTS.glob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name | ast.Attribute)):
                continue
            name = node.func.id if isinstance(node.func, ast.Name) else node.func.attr
            if name not in ("settings", "register_profile"):
                continue
            for kw in node.keywords:
                if kw.arg == "deadline" and not (isinstance(kw.value, ast.Constant)
                                                 and kw.value.value is None):
                    timed.append(f"{path.name}:{node.lineno}")
    assert timed == []
