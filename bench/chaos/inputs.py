"""Faults of what clients send: schemathesis over the live OpenAPI, every route under every
role, and oversized or hostile requests. The API must answer each with a 4xx in its JSON
error shape, or a success, and never a 5xx."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx

from bench.chaos.harness import ROLES, Row, Stage
from tests.api_fixtures import fleet_batch, measurement, pair

# Who may call what; admin may do everything. A route the live OpenAPI lists that this table
# does not place is itself a failure: the matrix must be told about every new route.
PUBLIC = frozenset({"/healthz", "/readyz", "/metrics"})
ADMIN_PREFIXES = ("/v1/tokens", "/v1/webhooks")
ADMIN_ROUTES = frozenset({("POST", "/v1/nodes/retire")})
AGENT_ROUTES = frozenset({("POST", "/v1/measurements"), ("POST", "/v1/preflight/claim"),
                          ("POST", "/v1/preflight/{request_id}/renew"),
                          ("POST", "/v1/preflight/{request_id}/complete"),
                          ("POST", "/v1/scheduler/lease"), ("DELETE", "/v1/scheduler/lease"),
                          ("POST", "/v1/scheduler/cycle")})
# Any valid token may ask about itself.
ANY_TOKEN_ROUTES = frozenset({("GET", "/v1/tokens/self")})
MAY = {"reader": {"reader", "agent", "admin"}, "agent": {"agent", "admin"}, "admin": {"admin"}}
BAD_TOKEN = "rw_" + "0" * 43


def needs(method: str, path: str) -> str | None:
    """The least role a route needs: "none", "reader", "agent", "admin"; None if unknown."""
    if path in PUBLIC:
        return "none"
    if (method, path) in ANY_TOKEN_ROUTES:
        return "reader"
    if path.startswith(ADMIN_PREFIXES) or (method, path) in ADMIN_ROUTES:
        return "admin"
    if (method, path) in AGENT_ROUTES:
        return "agent"
    if path.startswith("/v1/"):
        return "reader"
    return None


def error_shaped(resp: httpx.Response) -> bool:
    try:
        body = resp.json()
    except ValueError:
        return False
    return isinstance(body, dict) and isinstance(body.get("error"), str) and isinstance(body.get("message"), str)


def _reason(resp: httpx.Response) -> str:
    """A 5xx's error code and the log reference in its message, or the start of its text."""
    if not error_shaped(resp):
        return resp.text[:120]
    body = resp.json()
    ref = re.search(r"reference (\w+)", body["message"])
    return body["error"] + (f" (reference {ref.group(1)})" if ref else f": {body['message'][:100]}")


def _operations(spec: dict[str, Any]) -> Iterator[tuple[str, str, dict[str, Any]]]:
    for path, ops in spec["paths"].items():
        for method, op in ops.items():
            if method in ("get", "post", "put", "patch", "delete"):
                yield method.upper(), path, op


def _concrete(path: str, op: dict[str, Any]) -> str:
    """The path with each parameter filled: integers with a number no row has, others with a uuid."""
    for p in op.get("parameters", []):
        if p.get("in") == "path":
            kind = p.get("schema", {}).get("type")
            path = path.replace("{" + p["name"] + "}", "987654" if kind == "integer" else str(uuid.uuid4()))
    return path


def role_matrix(admin_url: str | None = None) -> Row:
    """Every route of the live /openapi.json with no token, a token that does not exist, and a
    reader, agent and admin token: 401 without a valid token (public routes aside), 403 where
    the role is not enough, something else where it is, never a 5xx; every 4xx in the error
    shape."""
    row = Row("role matrix over every route", False)
    stage = Stage("roles", admin_url)
    try:
        stage.start_api()
        tokens = {"none": None, "bad": BAD_TOKEN, **{r: stage.token(r) for r in ROLES}}
        spec = httpx.get(f"{stage.api_url}/openapi.json", timeout=30).json()
        problems: list[str] = []
        codes: Counter[int] = Counter()
        routes = list(_operations(spec))
        for method, path, op in routes:
            role = needs(method, path)
            if role is None:
                problems.append(f"{method} {path}: not in the matrix")
                continue
            url = _concrete(path, op)
            body: dict[str, Any] | None = {} if "requestBody" in op else None
            for who, token in tokens.items():
                with stage.client(token) as c:
                    resp = c.request(method, url, json=body)
                codes[resp.status_code] += 1
                problem = _judge_role(role, who, resp)
                if problem:
                    problems.append(f"{method} {path} as {who}: {problem}")
        row.survived = not problems
        row.note = (f"{len(routes)} routes x {len(tokens)} callers: "
                    + ", ".join(f"{n}x{code}" for code, n in sorted(codes.items()))
                    + (f"; {len(problems)} wrong: " + "; ".join(problems[:8]) if problems else ""))
        return row
    finally:
        stage.close(keep_logs=not row.met)


def _judge_role(role: str, who: str, resp: httpx.Response) -> str | None:
    code = resp.status_code
    if code >= 500:
        return f"{code} {_reason(resp)}"
    if code >= 400 and not error_shaped(resp):
        return f"{code} without the error shape: {resp.text[:120]}"
    if role == "none":
        if who == "none" and code != 200:
            return f"{code}, expected 200 (public)"
        return "403 on a public route" if code == 403 else None
    if who in ("none", "bad"):
        return None if code == 401 else f"{code}, expected 401"
    if who in MAY[role]:
        return f"{code}, expected the role to be enough" if code in (401, 403) else None
    return None if code == 403 else f"{code}, expected 403"


# -- hostile inputs -------------------------------------------------------------------------

MAX_BODY = 65536
# Arrays nested this deep: 40 KB of JSON, under the body limit, far past any parser's stack.
NESTING = 20_000


@dataclass
class Case:
    name: str
    method: str
    path: str
    as_role: str | None
    expect: frozenset[int] | None = None  # None: any 4xx, or a success
    json: Any = None
    content: Any = None
    headers: dict[str, str] | None = None
    params: dict[str, str] | None = None


def _batch(**fields: Any) -> dict[str, Any]:
    m = measurement(pair("h-000", "h-001"), 10.0)
    m.update(fields)
    return {"batch_id": str(uuid.uuid4()), "backend": "sim", "measurements": [m]}


def _raw_batch(value: str, field: str = "busbw_gbs") -> bytes:
    """A batch whose ``field`` is the JSON token ``value`` (NaN, Infinity, 1e999, ...)."""
    text = json.dumps(_batch(**{field: 123456789.0}))
    return text.replace("123456789.0", value).encode()


def _chunks(total: int) -> Iterator[bytes]:
    sent = 0
    while sent < total:
        yield b"x" * 8192
        sent += 8192


def hostile_cases() -> list[Case]:
    J = {"Content-Type": "application/json"}
    over = MAX_BODY * 4
    nested = "[" * NESTING + "]" * NESTING
    s413, s401 = frozenset({413}), frozenset({401})
    return [
        Case("declared body over the limit, no token", "POST", "/v1/measurements", None, s413,
             content=b"x" * over, headers=J),
        Case("declared body over the limit, bad token", "POST", "/v1/measurements", "bad", s413,
             content=b"x" * over, headers=J),
        # Chunked: the size is known only by reading, so 401 (nothing read) is as good as 413.
        Case("chunked body over the limit, no token", "POST", "/v1/measurements", None,
             frozenset({401, 413}), content=_chunks(over), headers=J),
        Case("chunked body over the limit, agent", "POST", "/v1/measurements", "agent", s413,
             content=_chunks(over), headers=J),
        Case("bad JSON, no token", "POST", "/v1/measurements", None, s401, content=b'{"batch_id": ', headers=J),
        Case("bad JSON, agent", "POST", "/v1/measurements", "agent", content=b'{"batch_id": ', headers=J),
        Case("deeply nested JSON", "POST", "/v1/measurements", "agent",
             content=('{"batch_id": "n", "backend": "sim", "measurements": [], "injected": ['
                      + nested + "]}").encode(), headers=J),
        Case("nested JSON in a rank map", "POST", "/v1/rank-maps/check", "reader",
             content=('{"ranks": ' + nested + "}").encode(), headers=J),
        Case("integer of 5000 digits", "POST", "/v1/measurements", "agent",
             content=_raw_batch("9" * 5000, "size_bytes"), headers=J),
        Case("1e999 (inf) size", "POST", "/v1/measurements", "agent",
             content=_raw_batch("1e999", "size_bytes"), headers=J),
        Case("2^63 size", "POST", "/v1/measurements", "agent", json=_batch(size_bytes=2**63)),
        Case("NaN busbw", "POST", "/v1/measurements", "agent", content=_raw_batch("NaN"), headers=J),
        Case("Infinity busbw", "POST", "/v1/measurements", "agent", content=_raw_batch("Infinity"), headers=J),
        Case("-Infinity time_us", "POST", "/v1/measurements", "agent",
             content=_raw_batch("-Infinity", "time_us"), headers=J),
        Case("1e308 algbw", "POST", "/v1/measurements", "agent", content=_raw_batch("1e308", "algbw_gbs"),
             headers=J),
        Case("negative busbw", "POST", "/v1/measurements", "agent", json=_batch(busbw_gbs=-1.0)),
        Case("negative size", "POST", "/v1/measurements", "agent", json=_batch(size_bytes=-4096)),
        Case("zero iterations", "POST", "/v1/measurements", "agent", json=_batch(iters=0)),
        Case("far-future time", "POST", "/v1/measurements", "agent", json=_batch(time="9999-12-31T23:59:59Z")),
        Case("year 10000", "POST", "/v1/measurements", "agent", json=_batch(time="10000-01-01T00:00:00Z")),
        Case("time without zone", "POST", "/v1/measurements", "agent", json=_batch(time="2026-01-01T00:00:00")),
        Case("year 1 time", "POST", "/v1/measurements", "agent", json=_batch(time="0001-01-01T00:00:00Z")),
        Case("NUL in batch id", "POST", "/v1/measurements", "agent",
             json={**_batch(), "batch_id": "nul\u0000id"}),
        Case("NUL in a node name", "POST", "/v1/measurements", "agent",
             json=_batch(members=["no\u0000de/0", "no\u0000de/1"])),
        Case("NUL in a rank's hostname", "POST", "/v1/measurements", "agent",
             json={**_batch(), "ranks": [{"node": "h-000", "local_index": 0, "hostname": "a\u0000b"}]}),
        Case("NUL in a dtype", "POST", "/v1/measurements", "agent", json=_batch(dtype="fl\u0000at32")),
        Case("lone surrogate in a batch id", "POST", "/v1/measurements", "agent",
             content=json.dumps({**_batch(), "batch_id": "b\ud800"}).encode(), headers=J),
        Case("lone surrogate in a preflight node", "POST", "/v1/preflight", "reader",
             content=json.dumps({"nodes": ["h\udfff"]}).encode(), headers=J),
        Case("lone surrogate in a rank map host", "POST", "/v1/rank-maps/check", "reader",
             content=json.dumps({"ranks": [{"rank": 0, "host": "h\ud800", "local_rank": 0}]}).encode(),
             headers=J),
        Case("lone surrogate in a webhook secret", "POST", "/v1/webhooks", "admin",
             content=json.dumps({"url": "https://example.com/hook", "secret": "s" * 16 + "\ud800",
                                 "events": ["health.degraded"]}).encode(), headers=J),
        Case("unicode node names", "POST", "/v1/measurements", "agent",
             json=_batch(members=["ノード-1/0", "ノード-1/1", "узел-2/0", "узел-2/1"])),
        Case("emoji and right-to-left node names", "POST", "/v1/measurements", "agent",
             json=_batch(members=["🔥-a/0", "\u202enode/0"])),
        Case("lone surrogate in a node name", "POST", "/v1/measurements", "agent",
             content=json.dumps(_batch(members=["\ud800x/0", "\ud800x/1"])).encode(), headers=J),
        Case("member index 2^40", "POST", "/v1/measurements", "agent",
             json=_batch(members=[f"h-000/{2**40}", "h-000/1"])),
        Case("nodes read back after hostile names", "GET", "/v1/nodes", "reader"),
        Case("metrics after hostile names", "GET", "/metrics", None),
        Case("links filtered by a unicode node", "GET", "/v1/links", "reader", params={"node": "ノード-1"}),
        Case("links filtered by a NUL node", "GET", "/v1/links", "reader", params={"node": "a\u0000b"}),
        Case("series of a NUL member", "GET", "/v1/series", "reader", params={"members": "a\u0000/0"}),
        Case("series since the far future", "GET", "/v1/series", "reader",
             params={"members": "h-000/0,h-000/1,h-001/0,h-001/1", "since": "9999-12-31T00:00:00Z"}),
        Case("series until before since", "GET", "/v1/series", "reader",
             params={"members": "h-000/0,h-000/1,h-001/0,h-001/1", "since": "2026-01-02T00:00:00Z",
                     "until": "2025-01-01T00:00:00Z", "resolution": "1d"}),
        Case("series size 2^70", "GET", "/v1/series", "reader",
             params={"members": "h-000/0,h-000/1", "size_bytes": str(2**70)}),
        Case("webhook id 2^80", "GET", f"/v1/webhooks/{2**80}/deliveries", "admin"),
        Case("finding id -1", "GET", "/v1/findings/-1", "reader"),
        Case("preflight id of 4000 characters", "GET", "/v1/preflight/" + "a" * 4000, "reader"),
        Case("preflight of NaN max age", "POST", "/v1/preflight", "reader",
             content=b'{"nodes": ["h-000"], "max_age_s": NaN}', headers=J),
        Case("preflight of a NUL node", "POST", "/v1/preflight", "reader", json={"nodes": ["h\u0000"]}),
        Case("preflight wait of 1e9 s", "POST", "/v1/preflight", "reader", json={"nodes": ["h-000"]},
             params={"wait": "1e9"}),
        Case("claim with lease NaN", "POST", "/v1/preflight/claim", "agent",
             content=b'{"worker": "w", "lease_s": NaN}', headers=J),
        Case("rank 2^31-1 alone", "POST", "/v1/rank-maps/check", "reader",
             json={"ranks": [{"rank": 2**31 - 1, "host": "h-000", "local_rank": 0}]}),
        Case("hostfile slots of 30 digits", "POST", "/v1/rank-maps/check", "reader",
             json={"hostfile": "h-000 slots=" + "9" * 30}),
        Case("hostfile of NUL and control bytes", "POST", "/v1/rank-maps/check", "reader",
             json={"hostfile": "h\u0000 slots=2\n\u0007\u001b[31m:4\n"}),
        Case("token request for a role that does not exist", "POST", "/v1/tokens", "admin",
             json={"role": "root"}),
        Case("token with NaN days", "POST", "/v1/tokens", "admin",
             content=b'{"role": "reader", "expires_in_days": NaN}', headers=J),
        Case("webhook URL of 10000 characters", "POST", "/v1/webhooks", "admin",
             json={"url": "http://example.com/" + "a" * 10000, "secret": "s" * 16,
                   "events": ["health.degraded"]}),
        Case("webhook URL with a NUL", "POST", "/v1/webhooks", "admin",
             json={"url": "http://exa\u0000mple.com/", "secret": "s" * 16, "events": ["health.degraded"]}),
        Case("webhook to a file: URL", "POST", "/v1/webhooks", "admin",
             json={"url": "file:///etc/passwd", "secret": "s" * 16, "events": ["health.degraded"]}),
        Case("text/plain body", "POST", "/v1/measurements", "agent", content=json.dumps(_batch()).encode(),
             headers={"Content-Type": "text/plain"}),
        Case("unknown method", "PUT", "/v1/measurements", "agent", json={}),
        Case("bearer token of 6000 characters", "GET", "/v1/nodes", None,
             headers={"Authorization": "Bearer " + "t" * 6000}),
        Case("bearer token with control bytes", "GET", "/v1/nodes", None,
             headers={"Authorization": "Bearer a\tb\x7fc"}),
        Case("basic auth instead of bearer", "GET", "/v1/nodes", None, s401,
             headers={"Authorization": "Basic YWRtaW46YWRtaW4="}),
    ]


def hostile_inputs(admin_url: str | None = None) -> Row:
    """Each request of ``hostile_cases`` against a live API whose body limit is 64 KiB: the
    expected status where one is named, else any 4xx in the error shape or a success; never
    a 5xx, never a request left unanswered."""
    row = Row("oversized and hostile inputs", False)
    stage = Stage("hostile", admin_url, env={"RINGWATCH_MAX_BODY_BYTES": str(MAX_BODY)})
    try:
        api = stage.start_api()
        tokens = {"bad": "rw_" + "1" * 43, **{r: stage.token(r) for r in ROLES}}
        with stage.client(tokens["agent"]) as agent:
            agent.post("/v1/measurements", json=fleet_batch(prefix="h")).raise_for_status()
        problems: list[str] = []
        cases = hostile_cases()
        for case in cases:
            headers = dict(case.headers or {})
            if case.as_role:
                headers.setdefault("Authorization", f"Bearer {tokens[case.as_role]}")
            problem = _send(stage, case, headers)
            if problem:
                problems.append(f"{case.name} ({case.method} {case.path[:40]}): {problem}")
        alive = api.poll() is None and httpx.get(f"{stage.api_url}/healthz", timeout=10).status_code == 200
        row.survived = alive and not problems
        row.note = (f"{len(cases)} requests" + ("" if alive else "; the API died")
                    + (f"; {len(problems)} wrong: " + "; ".join(problems[:8]) if problems else ""))
        return row
    finally:
        stage.close(keep_logs=not row.met)


def _send(stage: Stage, case: Case, headers: dict[str, str]) -> str | None:
    try:
        with httpx.Client(base_url=stage.api_url, timeout=60) as c:
            resp = c.request(case.method, case.path, json=case.json, content=case.content,
                             headers=headers, params=case.params)
    except httpx.HTTPError as exc:
        return f"no answer ({type(exc).__name__}: {exc})"
    code = resp.status_code
    if code >= 500:
        return f"{code} {_reason(resp)}"
    if case.expect is not None and code not in case.expect:
        return f"{code}, expected {'/'.join(map(str, sorted(case.expect)))}: {resp.text[:100]}"
    if code >= 400 and not error_shaped(resp):
        return f"{code} without the error shape: {resp.text[:100]}"
    return None


# -- schemathesis ----------------------------------------------------------------------------

def schemathesis(admin_url: str | None = None, examples: int = 25, seed: int = 1) -> Row:
    """schemathesis over the live /openapi.json with an admin token (every route reachable),
    positive and negative examples, ``examples`` per operation, checking only that no
    response is a server error."""
    row = Row("schemathesis (live OpenAPI)", False)
    stage = Stage("schemathesis", admin_url)
    try:
        api = stage.start_api()
        with stage.client(stage.token("agent")) as agent:
            agent.post("/v1/measurements", json=fleet_batch(prefix="node")).raise_for_status()
        started = time.monotonic()
        # Revoking a token can revoke the run's own admin token, after which every request is
        # a 401: that route is fuzzed on its own, last.
        runs = [_schemathesis(stage, examples, seed, "--exclude-name", REVOKE),
                _schemathesis(stage, examples, seed, "--include-name", REVOKE)]
        out = "\n".join(r.stdout + r.stderr for r in runs)
        failures = _server_errors(out)
        alive = api.poll() is None
        row.survived = all(r.returncode == 0 for r in runs) and not failures and alive
        summary = ", ".join(_summary_line(r.stdout + r.stderr) for r in runs)
        row.note = (f"{summary} in {time.monotonic() - started:.0f} s"
                    + (f"; {len(failures)} server error(s): " + " | ".join(failures[:6]) if failures else "")
                    + ("" if alive else "; the API died")
                    + ("" if row.survived or failures else f"; exits {[r.returncode for r in runs]}: {out[-300:]}"))
        if failures:
            print(_reproductions(out), file=sys.stderr)
        return row
    finally:
        stage.close(keep_logs=not row.met)


REVOKE = "DELETE /v1/tokens/{token_id}"


def _schemathesis(stage: Stage, examples: int, seed: int, *select: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "schemathesis.cli", "run", f"{stage.api_url}/openapi.json",
         "--header", f"Authorization: Bearer {stage.admin}", "--checks", "not_a_server_error",
         "--max-examples", str(examples), "--seed", str(seed), "--workers", "2",
         "--phases", "examples,coverage,fuzzing", "--request-timeout", "60",
         "--suppress-health-check", "all", "--output-truncate", "true", "--no-color", *select],
        capture_output=True, text=True, timeout=1200, env={**stage.env, "NO_COLOR": "1"})


def _server_errors(out: str) -> list[str]:
    """Each failing operation schemathesis names, with its first response line."""
    found = []
    for block in re.split(r"\n_{5,} ", out)[1:]:
        name = block.splitlines()[0].strip(" _")
        status = re.search(r"\[(5\d\d)\]", block)
        found.append(f"{name} [{status.group(1) if status else '?'}]")
    return found


def _reproductions(out: str) -> str:
    """schemathesis' own reproduction lines (curl commands) with the failures they belong to."""
    keep = [line for line in out.splitlines()
            if line.strip().startswith(("curl ", "_____", "- Server error", "[5")) or "Reproduce" in line]
    return "\n".join(keep)


def _summary_line(out: str) -> str:
    """schemathesis' count of test cases: "2084 generated, 2084 passed"."""
    for line in reversed(out.splitlines()):
        if re.search(r"\d+ generated", line):
            return line.strip()
    return "no summary"
