"""A PostgreSQL server the test owns (pgserver in a temp dir), which it may stop and start at will.

Never the machine's shared server: restarting that one would pull the floor from under everything
else running on the machine.
"""

from __future__ import annotations

import contextlib
import pathlib
import tempfile
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass

import pgserver
from pgserver._commands import pg_ctl


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
            with contextlib.suppress(Exception):
                owned.start()  # pgserver stops only a running server
            server.cleanup()
