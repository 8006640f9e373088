"""One scheduler per fleet: the lease through the API (one leader at a time, renewal,
takeover after expiry or at once after a clean stop, the database's clock deciding), the
roles that may hold it, and the fleet's rotation (cycle numbers, slots that keep their
places, a corrupt state rebuilt)."""

from __future__ import annotations

import logging
import sys
import threading
import time
from datetime import datetime, timedelta
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from sqlalchemy import text

from ringwatch.services.store import db, fleets, tokens
from tests.threads import on_threads

LEASE = "/v1/scheduler/lease"
CYCLE = "/v1/scheduler/cycle"


def lease(api, holder: str, fleet: str = "default", lease_s: float = 60.0,
          role: str = "agent") -> dict[str, Any]:
    r = api.post(LEASE, json={"fleet": fleet, "holder": holder, "lease_s": lease_s},
                 headers=api.h[role])
    assert r.status_code == 200, r.text
    return r.json()


def cycle(api, holder: str, nodes: list[str], fleet: str = "default"):
    return api.post(CYCLE, json={"fleet": fleet, "holder": holder, "nodes": nodes},
                    headers=api.h["agent"])


def db_now(factory) -> datetime:
    with db.transaction(factory) as s:
        return s.execute(text("SELECT clock_timestamp()")).scalar_one()


def run_out(factory, fleet: str = "default") -> None:
    """The fleet's lease ran out a second ago, by the database's clock (no sleeping)."""
    with db.transaction(factory) as s:
        s.execute(text("UPDATE fleets SET lease_expires_at = clock_timestamp() - "
                       "interval '1 second' WHERE name = :f"), {"f": fleet})


def set_slots(factory, raw_json: str, fleet: str = "default") -> None:
    with db.transaction(factory) as s:
        s.execute(text("UPDATE fleets SET slots = CAST(:s AS jsonb) WHERE name = :f"),
                  {"s": raw_json, "f": fleet})


# -- the lease -------------------------------------------------------------------------


def test_one_leader_at_a_time_and_its_holder_renews(api, clean_db) -> None:
    before = db_now(clean_db)
    a = lease(api, "host-a:101")
    assert a["leader"] is True and a["holder"] == "host-a:101" and a["term"] == 1
    assert a["fleet"] == "default" and a["lease_s"] == 60.0 and a["cycle"] == 0
    expires = datetime.fromisoformat(a["expires_at"])
    assert before + timedelta(seconds=59) < expires <= db_now(clean_db) + timedelta(seconds=60)

    b = lease(api, "host-b:202")
    assert b["leader"] is False and b["holder"] == "host-a:101" and b["term"] == 1
    assert datetime.fromisoformat(b["expires_at"]) == expires

    renewed = lease(api, "host-a:101", lease_s=120)
    assert renewed["leader"] is True and renewed["term"] == 1
    assert datetime.fromisoformat(renewed["expires_at"]) > expires + timedelta(seconds=50)
    # Another fleet is another lease.
    other = lease(api, "host-b:202", fleet="rack-2")
    assert other["leader"] is True and other["term"] == 1


def test_after_expiry_the_other_takes_over_with_the_next_term(api, clean_db) -> None:
    lease(api, "host-a:101")
    assert cycle(api, "host-a:101", ["node-000", "node-001"]).json()["cycle"] == 1
    run_out(clean_db)
    b = lease(api, "host-b:202")
    assert b["leader"] is True and b["holder"] == "host-b:202" and b["term"] == 2
    # The fleet's count goes on under its new holder; the old holder is refused.
    assert b["cycle"] == 1
    assert cycle(api, "host-b:202", ["node-000", "node-001"]).json()["cycle"] == 2
    a = lease(api, "host-a:101")
    assert a["leader"] is False and a["holder"] == "host-b:202" and a["term"] == 2
    refused = cycle(api, "host-a:101", ["node-000"])
    assert refused.status_code == 409 and refused.json()["error"] == "not_leader"
    assert "host-b:202" in refused.json()["message"]


def test_a_holder_whose_lease_ran_out_unchallenged_keeps_its_term(api, clean_db) -> None:
    lease(api, "host-a:101")
    run_out(clean_db)
    gone = cycle(api, "host-a:101", ["node-000"])
    assert gone.status_code == 409 and "ran out" in gone.json()["message"]
    again = lease(api, "host-a:101")
    assert again["leader"] is True and again["term"] == 1
    assert cycle(api, "host-a:101", ["node-000"]).status_code == 200


def test_a_clean_stop_hands_the_lease_over_at_once(api, clean_db) -> None:
    lease(api, "host-a:101")
    # Only the holder hands it back; anyone else's DELETE changes nothing.
    r = api.delete(LEASE, params={"fleet": "default", "holder": "host-b:202"},
                   headers=api.h["agent"])
    assert r.status_code == 204
    assert lease(api, "host-b:202")["leader"] is False
    r = api.delete(LEASE, params={"fleet": "default", "holder": "host-a:101"},
                   headers=api.h["agent"])
    assert r.status_code == 204 and r.content == b""
    refused = cycle(api, "host-a:101", ["node-000"])
    assert refused.status_code == 409 and "free" in refused.json()["message"]
    b = lease(api, "host-b:202")
    assert b["leader"] is True and b["term"] == 2
    # Handing back a fleet that has no lease at all is harmless too.
    assert api.delete(LEASE, params={"fleet": "nowhere", "holder": "x"},
                      headers=api.h["agent"]).status_code == 204


def test_concurrent_asks_never_make_two_leaders(clean_db) -> None:
    """Four schedulers ask at the same instant, round after round, on real Postgres: for a
    fleet with no row yet (the insert race) and for one whose lease just ran out (the
    update race). Exactly one is leader each round, and every other names it."""
    ranks, rounds = 4, 120
    gate = threading.Barrier(ranks)
    answers: list[list[fleets.LeaseState]] = [[] for _ in range(ranks)]

    def scheduler(rank: int) -> None:
        for r in range(rounds):
            fleet = f"race-{r // 2}"
            if r % 2 and rank == 0:
                run_out(clean_db, fleet)
            gate.wait(timeout=30)
            with db.transaction(clean_db) as s:
                answers[rank].append(fleets.take_lease(s, fleet, f"sched-{rank}", 60))
            gate.wait(timeout=30)

    on_threads(ranks, scheduler, timeout_s=120)
    previous = None
    for r in range(rounds):
        this = [answers[rank][r] for rank in range(ranks)]
        leaders = [a for a in this if a.leader]
        assert len(leaders) == 1, (r, this)
        winner = leaders[0].holder
        assert all(a.holder == winner for a in this), (r, this)
        # term counts holders: 1 for a new fleet; one more after expiry only if it changed.
        expected = 1 if r % 2 == 0 else 1 + (winner != previous)
        assert leaders[0].term == expected, (r, this)
        previous = winner


# -- the database's clock decides ------------------------------------------------------


def shift_python_clock(monkeypatch: pytest.MonkeyPatch, seconds: float) -> None:
    """Every clock this process's own code reads runs ``seconds`` off: ``time.time``,
    ``datetime.now`` as the API's, services' and agents' modules see it, and
    ``ringwatch.agents.spec.utcnow`` wherever it was imported: an API server whose clock is skewed."""
    import datetime as dt_module

    import ringwatch.agents.spec

    real_dt, real_time, real_utcnow = dt_module.datetime, time.time, ringwatch.agents.spec.utcnow
    delta = timedelta(seconds=seconds)

    class Skewed(real_dt):  # type: ignore[misc,valid-type]
        @classmethod
        def now(cls, tz=None):  # type: ignore[no-untyped-def,override]
            return real_dt.now(tz) + delta

    monkeypatch.setattr(time, "time", lambda: real_time() + seconds)
    for name, module in list(sys.modules.items()):
        if module is None or not name.startswith("ringwatch."):
            continue
        if getattr(module, "datetime", None) is real_dt:
            monkeypatch.setattr(module, "datetime", Skewed)
        if getattr(module, "utcnow", None) is real_utcnow:
            monkeypatch.setattr(module, "utcnow", lambda: real_utcnow() + delta)


@pytest.mark.parametrize("skew_s", [30.0, -30.0])
def test_a_skewed_api_clock_changes_nothing_the_database_clock_decides(
        api, clean_db, monkeypatch, skew_s) -> None:
    shift_python_clock(monkeypatch, skew_s)
    from ringwatch.services.store import tokens as token_store

    skewed_now = token_store.utcnow()
    # A lease shorter than the skew: were the API's clock to decide, 30 s ahead would see
    # it run out at once, and 30 s behind would see it live after the database's ran out.
    a = lease(api, "host-a:101", lease_s=20)
    assert a["leader"] is True
    expires = datetime.fromisoformat(a["expires_at"])
    assert abs((expires - db_now(clean_db)).total_seconds() - 20) < 10
    assert abs((expires - skewed_now).total_seconds() - 20) > 15

    b = lease(api, "host-b:202", lease_s=20)
    assert b["leader"] is False and b["holder"] == "host-a:101"
    run_out(clean_db)
    b = lease(api, "host-b:202", lease_s=20)
    assert b["leader"] is True and b["term"] == 2
    assert lease(api, "host-a:101", lease_s=20)["leader"] is False


def test_no_route_takes_a_time_from_its_caller(api) -> None:
    for extra in ({"now": "2030-01-01T00:00:00Z"}, {"expires_at": "2030-01-01T00:00:00Z"}):
        r = api.post(LEASE, json={"fleet": "default", "holder": "a", **extra},
                     headers=api.h["agent"])
        assert r.status_code == 422, extra
    schema = api.get("/openapi.json").json()["components"]["schemas"]
    for name in ("LeaseIn", "CycleIn"):
        assert set(schema[name]["properties"]) <= {"fleet", "holder", "lease_s", "nodes"}


# -- who may ---------------------------------------------------------------------------


def test_only_unscoped_agent_and_admin_tokens_may_schedule(api, clean_db) -> None:
    with db.transaction(clean_db) as s:
        scoped = tokens.create_token(s, "agent", nodes=["node-000", "node-001"])
    scoped_h = {"Authorization": f"Bearer {scoped}"}
    body = {"fleet": "default", "holder": "a"}
    for headers in (api.h["reader"], scoped_h):
        r = api.post(LEASE, json=body, headers=headers)
        assert r.status_code == 403 and r.json()["error"] == "forbidden"
        assert api.post(CYCLE, json={**body, "nodes": ["node-000"]},
                        headers=headers).status_code == 403
        assert api.delete(LEASE, params=body, headers=headers).status_code == 403
    assert "scoped" in api.post(LEASE, json=body, headers=scoped_h).json()["message"]
    assert api.post(LEASE, json=body).status_code == 401
    # Nothing was taken by the refused asks: the admin gets the first term.
    got = lease(api, "admin-sched", role="admin")
    assert got["leader"] is True and got["term"] == 1
    # A reader sees the fleets; a scoped agent token reads too.
    for headers in (api.h["reader"], scoped_h):
        assert api.get("/v1/scheduler/fleets", headers=headers).status_code == 200


@pytest.mark.parametrize("body", [
    {"fleet": "", "holder": "a"},
    {"fleet": "-lead", "holder": "a"},
    {"fleet": "two words", "holder": "a"},
    {"fleet": "default\n", "holder": "a"},
    {"fleet": "f" * 129, "holder": "a"},
    {"fleet": "default", "holder": ""},
    {"fleet": "default", "holder": "a\nb"},
    {"fleet": "default", "holder": "a\u202eb"},
    {"fleet": "default", "holder": "h" * 256},
    {"fleet": "default", "holder": "a", "lease_s": 1},
    {"fleet": "default", "holder": "a", "lease_s": 7200},
])
def test_a_bad_fleet_holder_or_lease_is_a_422(api, body) -> None:
    r = api.post(LEASE, json=body, headers=api.h["agent"])
    assert r.status_code == 422 and r.json()["error"] == "invalid_input", r.text
    if set(body) == {"fleet", "holder"}:
        d = api.delete(LEASE, params=body, headers=api.h["agent"])
        assert d.status_code == 422, d.text


# -- the rotation ----------------------------------------------------------------------


def test_cycles_count_up_by_one_and_slots_keep_their_places(api, clean_db) -> None:
    lease(api, "s")
    nodes = [f"node-{i:03d}" for i in range(5)]
    got = [cycle(api, "s", nodes).json() for _ in range(3)]
    assert [g["cycle"] for g in got] == [1, 2, 3]
    assert got[0]["slots"] == nodes and got[0]["fleet"] == "default"

    # node-002 leaves: its slot is vacant, the rest keep theirs.
    left = cycle(api, "s", [n for n in nodes if n != "node-002"]).json()
    assert left["cycle"] == 4
    assert left["slots"] == ["node-000", "node-001", None, "node-003", "node-004"]
    # A node joins: it takes the vacancy. Two more: they go to the end, in name order.
    joined = cycle(api, "s", ["node-009", *nodes[:2], *nodes[3:]]).json()
    assert joined["slots"] == ["node-000", "node-001", "node-009", "node-003", "node-004"]
    more = cycle(api, "s", ["node-011", "node-010", "node-009", *nodes[:2], *nodes[3:]]).json()
    assert more["slots"][5:] == ["node-010", "node-011"]
    # The last ones leave: no vacancies trail.
    trimmed = cycle(api, "s", ["node-000", "node-001", "node-009", "node-003"]).json()
    assert trimmed["slots"] == ["node-000", "node-001", "node-009", "node-003"]
    assert trimmed["cycle"] == 7

    fleets_seen = api.get("/v1/scheduler/fleets", headers=api.h["reader"]).json()
    assert fleets_seen == [{"name": "default", "holder": "s", "term": 1,
                            "lease_expires_at": fleets_seen[0]["lease_expires_at"],
                            "cycle": 7, "nodes": 4}]
    assert fleets_seen[0]["lease_expires_at"] is not None


@pytest.mark.parametrize("raw", ['"garbage"', "[1, 2]", '["node-001", "node-000", "node-001"]',
                                 '{"node-000": 0}', "null", '[null, ["node-000"]]'])
def test_corrupt_slots_are_rebuilt_in_name_order_and_said_so(api, clean_db, caplog,
                                                             raw) -> None:
    lease(api, "s")
    assert cycle(api, "s", ["node-000", "node-001"]).status_code == 200
    set_slots(clean_db, raw)
    listed = api.get("/v1/scheduler/fleets", headers=api.h["reader"])
    assert listed.status_code == 200
    with caplog.at_level(logging.WARNING, logger="ringwatch.services.store.fleets"):
        r = cycle(api, "s", ["node-002", "node-001", "node-000"])
    assert r.status_code == 200, r.text
    assert r.json() == {"fleet": "default", "cycle": 2,
                        "slots": ["node-000", "node-001", "node-002"]}
    assert any("rebuilt" in m for m in caplog.messages), caplog.messages
    # Rebuilt once; the next cycle keeps the places again.
    assert cycle(api, "s", ["node-000", "node-002"]).json()["slots"] == [
        "node-000", None, "node-002"]


def test_a_cycle_for_a_fleet_nobody_holds_is_a_409(api) -> None:
    r = cycle(api, "s", ["node-000"], fleet="never-leased")
    assert r.status_code == 409 and r.json()["error"] == "not_leader"
    assert "no lease" in r.json()["message"]


# -- the reconciliation, as a rule -----------------------------------------------------

NAMES = st.sampled_from([f"n{i:02d}" for i in range(24)])


@given(before=st.lists(st.one_of(st.none(), NAMES), max_size=20),
       nodes=st.lists(NAMES, max_size=24))
def test_reconciled_slots_hold_every_node_once_and_keep_places(before, nodes) -> None:
    slots, why = fleets.reconcile_slots(before, nodes)
    corrupt = len({s for s in before if s}) != len([s for s in before if s])
    assert (why is not None) == corrupt
    filled = [s for s in slots if s is not None]
    assert sorted(filled) == sorted(set(nodes))
    assert not slots or slots[-1] is not None
    if corrupt:
        assert slots == sorted(set(nodes))
        return
    for i, s in enumerate(before):
        if s is not None and s in nodes:
            assert slots[i] == s
    # New nodes take vacancies before the end grows.
    kept = [s if s in nodes else None for s in before]
    new = set(nodes) - set(kept)
    assert len(slots) <= max(len(kept), len([s for s in kept if s]) + len(new))



def test_the_lease_is_its_holders_with_the_token_it_asked_with(api, clean_db) -> None:
    """Another token sending the same holder id neither renews, nor hands back, nor starts
    a cycle of the fleet (as a preflight claim is its worker's and token's)."""
    assert lease(api, "sched-a:1")["leader"] is True
    other = api.post(LEASE, json={"fleet": "default", "holder": "sched-a:1", "lease_s": 60},
                     headers=api.h["admin"]).json()
    assert other["leader"] is False and other["holder"] == "sched-a:1"
    refused = api.post(CYCLE, json={"fleet": "default", "holder": "sched-a:1",
                                    "nodes": ["node-000"]}, headers=api.h["admin"])
    assert refused.status_code == 409 and "another token" in refused.json()["message"]
    assert api.delete(LEASE, params={"fleet": "default", "holder": "sched-a:1"},
                      headers=api.h["admin"]).status_code == 204
    # Not handed back: its own token still leads and starts cycles.
    assert cycle(api, "sched-a:1", ["node-000"]).status_code == 200
    assert lease(api, "sched-a:1")["leader"] is True
