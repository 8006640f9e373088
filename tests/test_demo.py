"""`ringwatch demo` as `make demo` runs it, whole: the embedded-style database, the API and
notifier as a server process, a local Ray cluster probing with gloo. Every run shows the
link table after the clean cycle, the slow rank's link DEGRADED, the one finding kind the
demo promises, and its signed webhook; it exits 0 only when all of that came out."""

from __future__ import annotations

import os
import re

import pytest

from ringwatch.services.cli.demo import EXPECTED_KIND, SLOW
from tests.procs import cli

pytestmark = pytest.mark.ray


def _section(out: str, title: str) -> str:
    """The lines of ``out`` from the step line starting ``== title`` to the next step."""
    start = out.index(f"== {title}")
    end = out.find("\n== ", start + 3)
    return out[start:end if end >= 0 else None]


def test_the_demo_shows_what_it_promises(admin_url, tmp_path_factory) -> None:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RINGWATCH_API_URL", "RINGWATCH_SECRET_KEY",
                        "RINGWATCH_WEBHOOK_ALLOWED_NETWORKS", "RINGWATCH_TOKEN")}
    env |= {"RINGWATCH_DATABASE_URL": admin_url,
            "RINGWATCH_STATE_DIR": str(tmp_path_factory.mktemp("demo"))}
    r = cli("demo", env=env, timeout=900)
    out = r.stdout
    assert r.returncode == 0, out[-4000:] + r.stderr[-4000:]

    # After the clean cycle: a table with every link, none degraded.
    clean = _section(out, "cycle 1: clean")
    rows = [line for line in clean.splitlines() if re.match(r"\s+(intra_node|inter_node|world)\s", line)]
    assert rows, clean
    assert "DEGRADED" not in clean

    # After the second slow cycle, the slow node's link is DEGRADED.
    last = _section(out, "cycle 3:")
    degraded = [line for line in last.splitlines() if line.rstrip().endswith("DEGRADED")]
    assert degraded and all(SLOW["node"] in line for line in degraded), last

    verdict = _section(out, "preflight")
    assert EXPECTED_KIND in verdict and SLOW["node"] in verdict, verdict

    hooks = _section(out, "webhooks received")
    assert re.search(rf"health\.degraded\s+delivery \w+\s+signature ok\s+{EXPECTED_KIND} "
                     rf"{SLOW['node']}", hooks), hooks
    assert f"as {EXPECTED_KIND}, and its webhook arrived" in out
