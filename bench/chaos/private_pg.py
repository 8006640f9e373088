"""A Postgres cluster of the suite's own, to stop and start under load: the shared server
other work uses is never touched. Made by pgserver (its binaries, and its way of running the
server as an unprivileged user when we are root), then driven with pg_ctl."""

from __future__ import annotations

import contextlib
import shutil
import time
import uuid
import warnings
from pathlib import Path

from ringwatch.services.config import STATE_DIR


class PrivatePostgres:
    """initdb into a fresh folder under the state folder, start, ``restart``, and on exit
    stop and delete it. It listens on a Unix socket in its own folder only."""

    def __init__(self) -> None:
        with warnings.catch_warnings():  # it warns that XDG_RUNTIME_DIR is unset, and copes
            warnings.simplefilter("ignore")
            import pgserver

        self.folder = STATE_DIR / "chaos" / f"pg-{uuid.uuid4().hex[:6]}"
        self.folder.mkdir(parents=True)
        self.pgdata = self.folder / "data"
        # cleanup_mode None: this class stops and deletes it (pgserver's own clean-up would
        # lose track of a server that pg_ctl restarted).
        self.server = pgserver.get_server(self.pgdata, cleanup_mode=None)
        info = self.server.get_postmaster_info()
        self.socket_dir: Path = info.socket_dir
        self.url = f"postgresql+psycopg://postgres@/postgres?host={self.socket_dir}"

    def _pg_ctl(self, *args: str) -> None:
        from pgserver._commands import pg_ctl  # type: ignore[attr-defined]  # made at import

        pg_ctl(list(args), pgdata=self.server.pgdata, user=self.server.system_user, timeout=60)

    def stop(self) -> None:
        # Fast shutdown: open transactions are rolled back and clients cut off, as when an
        # operator restarts the server or it fails over.
        self._pg_ctl("-w", "-m", "fast", "stop")

    def start(self) -> None:
        self._pg_ctl("-w", "-o", '-h ""', "-o", f"-k {self.socket_dir}", "-l", str(self.server.log),
                     "start")

    def restart(self, down_s: float) -> None:
        self.stop()
        time.sleep(down_s)
        self.start()

    def close(self) -> None:
        with contextlib.suppress(Exception):  # already stopped
            self.stop()
        shutil.rmtree(self.folder, ignore_errors=True)

    def __enter__(self) -> PrivatePostgres:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
