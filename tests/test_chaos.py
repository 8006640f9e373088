"""The CI-sized part of the reliability suite (``make chaos`` runs all of it; what each fault
does is in docs/reliability.md): real ringwatch processes, a real Postgres, real HTTP.
Each fault must be survived with nothing lost and nothing doubled."""

from __future__ import annotations

from bench.chaos.suite import format_table, run_fault


def test_every_route_refuses_callers_without_the_role(admin_url: str) -> None:
    row = run_fault("roles", admin_url)
    assert row.survived is True, row.note


def test_hostile_inputs_get_a_4xx_never_a_5xx(admin_url: str) -> None:
    row = run_fault("hostile", admin_url)
    assert row.survived is True, row.note


def test_one_agents_attacks_leave_the_monitor_answering(admin_url: str) -> None:
    row = run_fault("attacks", admin_url)
    assert row.survived is True, row.note


def test_the_api_killed_mid_ingest_loses_no_results(admin_url: str) -> None:
    row = run_fault("kill-api", admin_url)
    assert row.survived is True, row.note
    assert row.results_lost == 0, row.note


def test_a_notifier_killed_mid_delivery_loses_and_doubles_no_event(admin_url: str) -> None:
    row = run_fault("kill-notifier", admin_url)
    assert row.survived is True, row.note
    assert (row.events_lost, row.events_doubled) == (0, 0), row.note


def test_the_table_says_which_fault_missed() -> None:
    from bench.chaos.harness import Row

    rows = [Row("a", True, 0, None, None, "fine"), Row("b", True, 2, 0, 0, "lost two"),
            Row("c", None, note="not run: x")]
    table = format_table(rows)
    assert [r.met for r in rows] == [True, False, False]
    assert table.splitlines()[-1] == ("1 of 3 met the target (survived, 0 lost, 0 doubled); "
                                      "missed: b; not run: c")
