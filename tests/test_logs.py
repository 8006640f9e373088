"""Logs (docs/operations.md, "Logs"): RINGWATCH_LOG_FORMAT=json makes every line of a
process one JSON object; every API request has an id (the caller's X-Request-ID where it
is a plain token, else a fresh one, never echoed raw) on its lines, its answer and its one
access line; and a database outage is a line when it starts, one a minute and one when it
ends, never a traceback a second. The rules in-process; the whole of it on a real
``ringwatch serve`` whose own Postgres is stopped for 70 s."""

from __future__ import annotations

import io
import json
import logging
import os
import re
import socket
import subprocess
import sys
import threading
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest

from ringwatch.api.request_id import request_id_of
from ringwatch.services import logs
from ringwatch.services.cli.api_process import serve_args, wait_ready
from ringwatch.services.logs import LogSettingError, OutageLog, chosen
from tests.procs import api_env, cli, free_port

ADMIN = "rw_admin_" + uuid.uuid4().hex
FRESH = re.compile(r"[0-9a-f]{32}")


# ---- the rules ------------------------------------------------------------------------------


def test_text_is_the_default_and_json_is_asked_for_by_name() -> None:
    assert chosen({}) == ("text", logging.WARNING)
    assert chosen({}, verbose=True) == ("text", logging.INFO)
    # A collector wants the access lines (info) unless a level is named.
    assert chosen({"RINGWATCH_LOG_FORMAT": "json"}) == ("json", logging.INFO)
    assert chosen({"ringwatch_log_format": "JSON", "RINGWATCH_LOG_LEVEL": "Debug"}) == \
        ("json", logging.DEBUG)
    for bad in ({"RINGWATCH_LOG_FORMAT": "yaml"}, {"RINGWATCH_LOG_LEVEL": "loud"}):
        with pytest.raises(LogSettingError, match="RINGWATCH_LOG_"):
            chosen(bad)


def test_settings_refuse_a_log_value_outside_the_vocabulary() -> None:
    from pydantic import ValidationError

    from ringwatch.services.settings import Settings

    assert Settings(log_format="JSON", log_level="Info").log_format == "json"
    with pytest.raises(ValidationError, match="log_format"):
        Settings(log_format="yaml")


def test_a_json_line_has_time_level_logger_message_and_the_request(monkeypatch) -> None:
    root = logging.getLogger()
    # Configured as in a process of its own: pytest's capture handlers set aside meanwhile.
    monkeypatch.setattr(root, "handlers", [])
    monkeypatch.setattr(root, "level", root.level)
    stream = io.StringIO()
    try:
        assert logs.configure(environ={"RINGWATCH_LOG_FORMAT": "json"}, stream=stream) == "json"
        log = logging.getLogger("ringwatch.test")
        log.info("outside a request")
        rid, where = logs.request_id.set("abc-123"), logs.route.set("/v1/nodes/{name}")
        try:
            log.warning("inside\na request")
            try:
                raise ValueError("boom")
            except ValueError:
                log.exception("failed")
        finally:
            logs.request_id.reset(rid)
            logs.route.reset(where)
        logging.getLogger("httpx").info("HTTP Request: GET ... (kept back below warning)")
    finally:
        for handler in root.handlers:
            handler.close()
        logs._state["format"] = "text"
    lines = stream.getvalue().splitlines()
    assert len(lines) == 3, lines
    outside, inside, failed = (json.loads(x) for x in lines)
    for record in (outside, inside, failed):
        when = datetime.fromisoformat(record["time"])
        assert when.utcoffset() is not None and when.utcoffset().total_seconds() == 0
        assert abs((datetime.now(UTC) - when).total_seconds()) < 60
        assert record["logger"] == "ringwatch.test"
    assert outside["level"] == "INFO" and outside["message"] == "outside a request"
    assert "request_id" not in outside and "route" not in outside
    assert inside == {**inside, "level": "WARNING", "message": "inside\na request",
                      "request_id": "abc-123", "route": "/v1/nodes/{name}"}
    # The traceback is a field of the same one line.
    assert failed["level"] == "ERROR" and "ValueError: boom" in failed["exc_info"]


def test_a_sent_request_id_is_kept_only_when_it_is_one_plain_token() -> None:
    def sent(*values: bytes) -> str:
        return request_id_of([(b"host", b"x"), *((b"x-request-id", v) for v in values)])

    assert sent(b"job-42.prolog:node-007") == "job-42.prolog:node-007"
    assert sent(b"x" * 128) == "x" * 128
    for bad in ([b"x" * 129], [b"a\x01b"], [b"a\x1b[2Jb"], [b"a b"], [b"a\x7fb"],
                ["é".encode()], [b""], [b"one", b"two"]):
        assert FRESH.fullmatch(sent(*bad)), bad
    assert FRESH.fullmatch(sent())


def test_an_outage_is_three_lines_not_one_per_failure(caplog) -> None:
    now = [0.0]
    outage = OutageLog(logging.getLogger("ringwatch.test.outage"), "the database",
                       clock=lambda: now[0])
    caplog.set_level(logging.INFO, "ringwatch.test.outage")
    outage.ok()  # no outage: nothing said
    for _ in range(280):  # four failures a second for 70 s
        outage.failed(ConnectionRefusedError(111, "Connection refused"))
        now[0] += 0.25
    outage.ok()  # within settle_s of the last failure: still down
    assert outage.down
    now[0] += 5
    outage.ok()
    outage.ok()
    said = [r.getMessage() for r in caplog.records]
    assert said == [
        "the database unavailable: ConnectionRefusedError: [Errno 111] Connection refused",
        "the database still unavailable after 60 s (241 failures): ConnectionRefusedError: "
        "[Errno 111] Connection refused",
        "the database available again: unavailable for 70 s (280 failures)"]
    assert not any(r.exc_info for r in caplog.records)
    assert caplog.records[-1].failures == 280
    assert caplog.records[-1].outage_s == pytest.approx(69.75, abs=0.06)


def test_a_failure_of_its_own_is_said_with_its_traceback_once(caplog) -> None:
    outage = OutageLog(logging.getLogger("ringwatch.test.pass"), "notifier pass",
                       state="failing", back="works again", settle_s=0)
    caplog.set_level(logging.INFO, "ringwatch.test.pass")
    for _ in range(5):
        try:
            raise KeyError("webhook")
        except KeyError as exc:
            outage.failed(exc, traceback=True)
    outage.ok()
    assert [bool(r.exc_info) for r in caplog.records] == [True, False]
    assert caplog.records[1].getMessage() == "notifier pass works again: failing for 0 s (5 failures)"


def test_the_scheduler_says_once_that_the_api_is_away_not_at_every_try(tmp_path, caplog) -> None:
    from ringwatch.services.scheduler.shipper import Shipper

    shipper = Shipper(f"http://127.0.0.1:{free_port()}", "rw_agent_x", tmp_path / "spool",
                      timeout_s=1)
    caplog.set_level(logging.DEBUG, "ringwatch.services.scheduler.shipper")
    try:
        for i in range(5):
            assert shipper.ship({"batch_id": f"b{i}", "measurements": []}) == i + 1
    finally:
        shipper.close()
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and said[0].startswith("the API at http://127.0.0.1:"), said
    assert "unavailable: ConnectError: " in said[0] and "batches stay spooled" in said[0]


def test_an_unexpected_error_answers_500_with_the_request_id(api) -> None:
    from fastapi.testclient import TestClient

    def boom() -> None:
        raise RuntimeError("a bug")

    api.app.add_api_route("/v1/boom", boom)
    client = TestClient(api.app, raise_server_exceptions=False)
    r = client.get("/v1/boom", headers={**api.h["reader"], "X-Request-ID": "trace-500"})
    assert r.status_code == 500 and r.json()["error"] == "internal"
    assert r.headers["x-request-id"] == "trace-500"
    refused = client.get("/v1/nodes", headers={"X-Request-ID": "no-token"})
    assert refused.status_code == 401 and refused.headers["x-request-id"] == "no-token"


# ---- real processes ---------------------------------------------------------------------------


def test_a_command_in_json_says_its_progress_and_its_error_as_records(tmp_path: Path) -> None:
    scenario = tmp_path / "fabric.json"
    scenario.write_text(json.dumps({"nodes": 4, "gpus_per_node": 2, "seed": 1, "faults": []}))
    env = {**os.environ, "RINGWATCH_LOG_FORMAT": "json", "RINGWATCH_STATE_DIR": str(tmp_path)}
    checked = cli("preflight", "--fabric", str(scenario), env=env)
    assert checked.returncode == 0, checked.stderr
    assert checked.stdout.startswith("HEALTHY")  # the command's answer stays its own
    progress = [json.loads(x) for x in checked.stderr.splitlines()]
    assert progress and all(r["logger"] == "ringwatch.progress" for r in progress)
    # The one line a command exits 2 with: a record in json, a plain line in text.
    away = {**env, "RINGWATCH_API_URL": f"http://127.0.0.1:{free_port()}",
            "RINGWATCH_TOKEN": "rw_reader_x"}
    failed = cli("status", env=away)
    assert failed.returncode == 2 and len(failed.stderr.splitlines()) == 1, failed.stderr
    record = json.loads(failed.stderr)
    assert record["level"] == "ERROR" and record["logger"] == "ringwatch.cli"
    assert record["message"].startswith("ringwatch status: API at ")
    plain = cli("status", env={**away, "RINGWATCH_LOG_FORMAT": "text"})
    assert plain.returncode == 2 and plain.stderr.startswith("ringwatch status: API at ")
    wrong = cli("status", env={**away, "RINGWATCH_LOG_FORMAT": "yaml"})
    assert wrong.returncode == 2 and wrong.stderr == \
        "ringwatch status: RINGWATCH_LOG_FORMAT is 'yaml': use one of text, json\n"


# ---- a real server ----------------------------------------------------------------------------


def _raw_get(url: str, path: str, request_id: bytes) -> tuple[int, dict[str, str]]:
    """GET with an X-Request-ID no HTTP client would send (control characters)."""
    where = urlsplit(url)
    with socket.create_connection((where.hostname, where.port), timeout=10) as s:
        s.sendall(b"GET " + path.encode() + b" HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                  b"X-Request-ID: " + request_id + b"\r\n\r\n")
        raw = b""
        while chunk := s.recv(65536):
            raw += chunk
    head = raw.split(b"\r\n\r\n", 1)[0].decode("latin-1").split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (h.partition(":") for h in head[1:])}
    return int(head[0].split()[1]), headers


def _records(path: Path) -> list[dict[str, Any]]:
    out = []
    for line in path.read_text().splitlines():
        record = json.loads(line)  # every line, or the test fails here naming it
        assert isinstance(record, dict), line
        for field in ("time", "level", "logger", "message"):
            assert field in record, line
        when = datetime.fromisoformat(record["time"])
        assert when.utcoffset() is not None and when.utcoffset().total_seconds() == 0, line
        out.append(record)
    return out


def test_a_json_server_through_a_70_s_database_outage(tmp_path: Path) -> None:
    from bench.chaos.private_pg import PrivatePostgres

    with PrivatePostgres() as pg:
        env = {**api_env(pg.url, tmp_path / "state", ADMIN), "RINGWATCH_LOG_FORMAT": "json",
               "RINGWATCH_NOTIFIER_POLL_S": "0.5"}
        upgrade = cli("db", "upgrade", env=env)
        assert upgrade.returncode == 0, upgrade.stderr
        url = env["RINGWATCH_API_URL"]
        err = tmp_path / "serve.err"
        with err.open("w") as sink:  # a file: a pipe nobody reads would stop the server
            proc = subprocess.Popen([sys.executable, "-m", "ringwatch.services.cli.main",
                                     *serve_args(url)], env=env, stderr=sink)
        auth = {"Authorization": f"Bearer {ADMIN}"}
        sent: list[str] = []
        codes: dict[int, int] = {}
        try:
            wait_ready(proc, url)
            with httpx.Client(base_url=url, timeout=30) as c:
                kept = c.get("/v1/nodes", headers={**auth, "X-Request-ID": "job-42.prolog"})
                assert kept.status_code == 200 and kept.headers["x-request-id"] == "job-42.prolog"
                sent.append("job-42.prolog")
                for bad in (b"x" * 129, b"a b", "é".encode()):
                    r = c.get("/v1/nodes", headers={**auth, "X-Request-ID": bad})
                    assert r.status_code == 200 and FRESH.fullmatch(r.headers["x-request-id"])
                    sent.append(r.headers["x-request-id"])
                # Errors carry it too: a 401, a 404, a 422 naming its field.
                for path, want in (("/v1/nodes", 401), ("/v1/no-such-route", 404),
                                   ("/v1/nodes?limit=-1", 422)):
                    rid = f"err-{want}"
                    r = c.get(path, headers={**({} if want == 401 else auth), "X-Request-ID": rid})
                    assert r.status_code == want and r.headers["x-request-id"] == rid, r.text
                    sent.append(rid)
            for control in (b"a\x01b", b"a\x1b[2Jb"):
                status, headers = _raw_get(url, "/healthz", control)
                # Refused by the HTTP parser, or answered with a fresh id: never echoed.
                got = headers.get("x-request-id", "")
                assert got.encode() != control and (status == 400 or FRESH.fullmatch(got))

            # The database goes away for 70 s while a reader asks five times a second.
            stop = threading.Event()

            def read() -> None:
                with httpx.Client(base_url=url, headers=auth, timeout=30) as c:
                    i = 0
                    while not stop.is_set():
                        rid = f"poll-{i}"
                        r = c.get("/v1/nodes", headers={"X-Request-ID": rid})
                        assert r.headers["x-request-id"] == rid
                        sent.append(rid)
                        codes[r.status_code] = codes.get(r.status_code, 0) + 1
                        i += 1
                        stop.wait(0.2)

            reader = threading.Thread(target=read)
            reader.start()
            time.sleep(2)
            down_at = datetime.now(UTC)
            pg.stop()
            time.sleep(70)
            pg.start()
            time.sleep(10)  # the outage ends at the first success 5 s after the last failure
            up_at = datetime.now(UTC)
            stop.set()
            reader.join(timeout=60)
        finally:
            proc.terminate()
            proc.wait(timeout=60)
        records = _records(err)

    assert codes.get(503, 0) > 100 and codes.get(200, 0) > 10, codes
    access = [r for r in records if r["logger"] == "ringwatch.access"]
    # One access line per request, with its id, route template, status and duration.
    by_id: dict[str, list[dict[str, Any]]] = {}
    for r in access:
        by_id.setdefault(r["request_id"], []).append(r)
        assert {"method", "route", "status", "duration_ms", "client"} <= set(r), r
    assert all(len(by_id.get(rid, [])) == 1 for rid in sent), \
        [rid for rid in sent if len(by_id.get(rid, [])) != 1][:5]
    kept = by_id["job-42.prolog"][0]
    assert kept["route"] == "/v1/nodes" and kept["status"] == 200 and kept["method"] == "GET"
    assert by_id["err-404"][0]["route"] == "unmatched"
    assert by_id["err-422"][0]["status"] == 422 and by_id["err-401"][0]["status"] == 401
    assert not any("a b" in json.dumps(r) or "x" * 129 in json.dumps(r) for r in records)

    # The outage: a line when it started, one at its minute, one when it ended.
    outage = [r for r in records if r.get("dependency") == "the database"]
    messages = [r["message"] for r in outage]
    assert len(outage) == 3, messages
    assert messages[0].startswith("the database unavailable: ")
    assert messages[1].startswith("the database still unavailable after 6")
    assert messages[2].startswith("the database available again: unavailable for ")
    assert 65 <= outage[2]["outage_s"] <= 80 and outage[2]["failures"] > 300, outage[2]
    during = [r for r in records if r["logger"] != "ringwatch.access"
              and down_at <= datetime.fromisoformat(r["time"]) <= up_at]
    assert not any("exc_info" in r for r in during), [r["message"] for r in during]
    # Besides those three, only the notifier's LISTEN lost and regained: not one a second.
    assert len(during) <= 6, [r["message"] for r in during]
