"""A PostgreSQL server the test owns (pgserver in a temp dir), which it may stop and start at will.

Never the machine's shared server: restarting that one would pull the floor from under everything
else running on the machine.
"""

from __future__ import annotations

import contextlib
import pathlib
import subprocess
import tempfile
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass

import pgserver
from pgserver._commands import POSTGRES_BIN_PATH, pg_ctl


@dataclass
class OwnedPostgres:
    server: pgserver.PostgresServer
    url: str

    @property
    def _socket_dir(self) -> str:
        return urllib.parse.parse_qs(urllib.parse.urlparse(self.url).query)["host"][0]

    def stop_immediately(self) -> None:
        """`pg_ctl stop -m immediate`: every connection cut, no shutdown checkpoint (a crash, to clients)."""
        pg_ctl(["-w", "-m", "immediate", "stop"], pgdata=self.server.pgdata, user=self.server.system_user)

    def running(self) -> bool:
        """`pg_ctl status` (0: running, 3: not), run directly: pgserver's wrapper would log the
        expected "not running" answer as a failed command."""
        done = subprocess.run(
            [str(POSTGRES_BIN_PATH / "pg_ctl"), "-D", str(self.server.pgdata), "status"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            user=self.server.system_user,
            timeout=30,
            check=False,
        )
        return done.returncode == 0

    def start(self) -> None:
        pg_ctl(
            ["-w", "-o", '-h ""', "-o", f"-k {self._socket_dir}", "-l", str(self.server.log), "start"],
            pgdata=self.server.pgdata,
            user=self.server.system_user,
            timeout=30,
        )


@contextlib.contextmanager
def owned_postgres() -> Iterator[OwnedPostgres]:
    with tempfile.TemporaryDirectory(prefix="abada-owned-pg-") as data_dir:
        server = pgserver.get_server(pathlib.Path(data_dir), cleanup_mode="stop")
        owned = OwnedPostgres(server, server.get_uri())
        try:
            yield owned
        finally:
            # pgserver stops only a running server, and `pg_ctl start` on a running one fails (and is
            # logged as an error): start it only if the test left it stopped.
            if not owned.running():
                owned.start()
            server.cleanup()
