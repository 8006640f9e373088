"""Settings: one object from RINGWATCH_* variables; placeholder secrets refused outside the demo."""

import os

import pytest

from ringwatch.services.analyzer.evidence import CusumPolicy
from ringwatch.services.config import PLACEHOLDER_SECRET
from ringwatch.services.settings import Settings


def test_settings_read_the_environment(monkeypatch) -> None:
    monkeypatch.setenv("RINGWATCH_PROBE_INTERVAL_S", "42")
    monkeypatch.setenv("RINGWATCH_HYSTERESIS_K_BAD", "3")
    monkeypatch.setenv("RINGWATCH_HYSTERESIS_N_WINDOW", "4")
    s = Settings()
    assert s.probe_interval_s == 42.0
    assert (s.hysteresis().k_bad, s.hysteresis().n_window) == (3, 4)


def test_drift_settings_make_the_cusum_policy(monkeypatch) -> None:
    assert Settings().drift() == CusumPolicy()  # the defaults are the policy's own
    monkeypatch.setenv("RINGWATCH_DRIFT_THRESHOLD", "12")
    monkeypatch.setenv("RINGWATCH_DRIFT_SLACK", "0.75")
    assert Settings().drift() == CusumPolicy(slack=0.75, threshold=12.0)
    monkeypatch.setenv("RINGWATCH_DRIFT_SLACK", "0")
    with pytest.raises(ValueError, match="drift_slack"):
        Settings()


def test_placeholder_secrets_are_refused_outside_the_demo() -> None:
    with pytest.raises(ValueError, match="RINGWATCH_BOOTSTRAP_ADMIN_TOKEN"):
        Settings(bootstrap_admin_token=PLACEHOLDER_SECRET).check_secrets()
    Settings(bootstrap_admin_token=PLACEHOLDER_SECRET, demo=True).check_secrets()
    Settings(bootstrap_admin_token="a-real-secret").check_secrets()


def test_bad_settings_are_refused(monkeypatch) -> None:
    monkeypatch.setenv("RINGWATCH_PROBE_INTERVAL_S", "-1")
    with pytest.raises(ValueError, match="probe_interval_s"):
        Settings()
    monkeypatch.setenv("RINGWATCH_PROBE_INTERVAL_S", "60")
    monkeypatch.setenv("RINGWATCH_HYSTERESIS_K_BAD", "5")
    with pytest.raises(ValueError, match="k_bad"):
        Settings().hysteresis()


def test_default_thresholds_are_the_settings_defaults(monkeypatch) -> None:
    """What a check on defaults uses without building Settings (the analyzer's thresholds)
    is what Settings gives when no RINGWATCH_* variable is set."""
    from ringwatch.services.analyzer.assess import thresholds_for
    from ringwatch.services.check import CheckBudget
    from ringwatch.services.config import settings_in_environment

    for name in [k for k in os.environ if k.lower().startswith("ringwatch_")]:
        monkeypatch.delenv(name)
    assert not settings_in_environment()
    for backend in ("sim", "gloo", "nccl"):
        assert thresholds_for(backend) == Settings().thresholds(backend)
    assert CheckBudget() == CheckBudget.from_settings(Settings())
    # Settings matches variables in any case; so must the test for whether one is set.
    monkeypatch.setenv("ringwatch_rated_floor", "0.3")
    assert settings_in_environment() and Settings().rated_floor == 0.3
