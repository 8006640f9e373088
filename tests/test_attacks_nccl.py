"""What a user or task sharing a GPU node's temp folder can plant for the agent's NCCL debug
files, and what the parser reads from them: nothing outside ringwatch's own private folder
changes, no crafted name stops the agent, and parsing stays linear in the line's length."""

from __future__ import annotations

import os
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from ringwatch.agents import nccl_log, probe
from ringwatch.agents.nccl_log import NcclLogReader, nccl_hostname, parse_nccl_log


@pytest.fixture
def node_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """The node's shared temp folder, with no NCCL_DEBUG* of the user's set."""
    shared = tmp_path / "tmp"
    shared.mkdir()
    shared.chmod(0o1777)
    for key in ("NCCL_DEBUG", "NCCL_DEBUG_SUBSYS", "NCCL_DEBUG_FILE"):
        monkeypatch.setenv(key, "")  # so that the undo puts back what was (or was not) set
        monkeypatch.delenv(key)
    monkeypatch.setattr(tempfile, "tempdir", str(shared))
    yield shared


def _user_folder(tmp_path: Path) -> tuple[Path, dict[Path, bytes]]:
    """A user's own log folder, holding files named as ringwatch names its own, of a pid no
    process has."""
    folder = tmp_path / "user-logs"
    folder.mkdir()
    host = nccl_hostname()
    files = {folder / f"nccl.{host}.{pid}.log": f"user's log {pid}\n".encode()
             for pid in (2_000_001, 2_000_002)}
    for path, data in files.items():
        path.write_bytes(data)
    return folder, files


def _unchanged(files: dict[Path, bytes]) -> bool:
    return all(p.exists() and not p.is_symlink() and p.read_bytes() == d for p, d in files.items())


def test_a_folder_planted_as_a_link_to_a_users_logs_is_never_used(node_tmp: Path,
                                                                   tmp_path: Path) -> None:
    """Planted under the names the agent's folder has had: the agent does not delete the
    user's files there, and does not point NCCL at that folder."""
    folder, files = _user_folder(tmp_path)
    for name in ("ringwatch-nccl", f"ringwatch-nccl-{os.getuid()}"):
        (node_tmp / name).symlink_to(folder, target_is_directory=True)
    reader = probe._nccl_log_reader()
    assert _unchanged(files)
    pattern = os.environ.get("NCCL_DEBUG_FILE")
    assert pattern is None or Path(pattern).parent.resolve() != folder.resolve()
    assert reader is None or folder.resolve() not in reader.path.resolve().parents


def test_a_folder_someone_else_made_is_refused(node_tmp: Path) -> None:
    planted = node_tmp / f"ringwatch-nccl-{os.getuid()}"
    planted.mkdir(mode=0o777)
    planted.chmod(0o777)  # anyone may add or swap files in it
    folder, problem = nccl_log.private_dir(planted)
    assert folder is None and problem is not None and "0777" in problem
    if os.getuid() == 0:
        planted.chmod(0o700)
        os.chown(planted, 65534, 65534)
        folder, problem = nccl_log.private_dir(planted)
        assert folder is None and problem is not None and "owned by uid 65534" in problem


def test_the_agents_own_folder_is_private_and_its_file_goes_there(node_tmp: Path) -> None:
    reader = probe._nccl_log_reader()
    expected = node_tmp / f"ringwatch-nccl-{os.getuid()}"
    st = expected.lstat()
    assert expected.is_dir() and not expected.is_symlink() and st.st_mode & 0o777 == 0o700
    assert st.st_uid == os.getuid()
    assert reader is not None and reader.path.parent == expected
    assert os.environ["NCCL_DEBUG_FILE"] == str(expected / nccl_log.DEBUG_FILE_NAME)


def test_a_file_planted_as_a_link_is_neither_read_nor_trimmed(tmp_path: Path) -> None:
    """The agent's file a link to someone's large file: the trim that empties a read file
    leaves the link's target as it was."""
    target = tmp_path / "precious.log"
    data = b"h:1:1 [0] NCCL INFO NCCL version 2.28.9+cuda13.0\n" * 4000
    target.write_bytes(data)
    reader = NcclLogReader(str(tmp_path / "nccl.%h.%p.log"), host="h", pid=7)
    reader.path.symlink_to(target)
    log = reader.read()
    assert log.lines == 0
    assert not reader.trim(max_bytes=100)
    assert target.read_bytes() == data


def test_a_fifo_planted_as_the_file_does_not_block_the_reader(tmp_path: Path) -> None:
    reader = NcclLogReader(str(tmp_path / "nccl.%h.%p.log"), host="h", pid=7)
    os.mkfifo(reader.path)
    done = _within(30, reader.read)
    assert done is not None and done.lines == 0


@pytest.mark.parametrize("pid", ["\u00b2", "\u0663", "99999999999999999999", "00012", "-1"])
def test_a_crafted_name_in_the_folder_does_not_stop_the_agent(node_tmp: Path, pid: str) -> None:
    folder = node_tmp / f"ringwatch-nccl-{os.getuid()}"
    folder.mkdir(mode=0o700)
    crafted = folder / f"nccl.{nccl_hostname()}.{pid}.log"
    crafted.write_text("x\n")
    reader = probe._nccl_log_reader()
    assert reader is not None and reader.path.parent == folder
    assert crafted.exists()  # not a pid of any agent: not ours to remove


def test_a_dead_agents_file_in_the_private_folder_is_still_removed(node_tmp: Path) -> None:
    folder = node_tmp / f"ringwatch-nccl-{os.getuid()}"
    folder.mkdir(mode=0o700)
    dead = folder / f"nccl.{nccl_hostname()}.4194303.log"  # above any pid in use here
    dead.write_text("x\n")
    if _alive(4194303):
        pytest.skip("pid 4194303 is in use on this machine")
    probe._nccl_log_reader()
    assert not dead.exists()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _within(seconds: float, fn: Callable[[], Any]) -> Any:
    """``fn()``'s result, or None if it had not returned after ``seconds`` (a guard against
    a hang or a quadratic parse, never a measure of speed)."""
    out: list[Any] = []
    worker = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    worker.start()
    worker.join(seconds)
    return out[0] if out else None


@pytest.mark.parametrize("line", [
    "a" * 1_000_000,                                   # no prefix at all
    "h:1:2 [0] " + "x" * 1_000_000,                    # a prefix, and no level after it
    "a:1" * 333_333,                                   # near-prefixes all along
    "h:1:2 [0] " + "y" * 1_000_000 + " NCCL INFO NCCL version 2.28.9",
])
def test_a_one_megabyte_line_is_read_in_linear_time(line: str) -> None:
    """Before, one 40 kB line without NCCL's prefix took 39 s: at 1 MB that is hours."""
    text = line + "\nh:1:2 [0] NCCL INFO NCCL version 2.28.9+cuda13.0\n"
    log = _within(60, lambda: parse_nccl_log(text))
    assert log is not None, "parsing a 1 MB line did not finish"
    assert log.lines == 2 and log.foreign == 1 and log.nccl_versions == ["2.28.9+cuda13.0"]


def test_the_longest_real_line_still_parses() -> None:
    """NCCL formats a line into 1024 bytes (debug.cc): the H200 capture's longest line is
    1023 characters and is read as before."""
    text = (Path(__file__).parent / "data" / "nccl" / "nccl-2.28.9-h200-world1.log").read_text()
    longest = max(text.splitlines(), key=len)
    assert len(longest) == 1023
    log = parse_nccl_log(longest + "\n")
    assert log.foreign == 0 and log.recognized + log.unrecognized == 1
