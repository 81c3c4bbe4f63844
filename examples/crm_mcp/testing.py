"""Run the demo CRM as a real subprocess on a free loopback port, for tests and the offline demo."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from crm_mcp.auth import parse_token_list
from crm_mcp.tools import Variant

LOOPBACK = "127.0.0.1"
_STOP_TIMEOUT_SECONDS = 5.0
_POLL_SECONDS = 0.05


@dataclass(frozen=True)
class RunningCrmServer:
    url: str  # the MCP endpoint, http://127.0.0.1:PORT/mcp
    base_url: str  # http://127.0.0.1:PORT
    port: int
    db_path: Path
    token: str  # a token the server accepts, for the helper's own calls and for clients
    log_path: Path
    pid: int

    def _request(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        request = urllib.request.Request(
            self.base_url + path,
            method=method,
            data=None if body is None else json.dumps(body).encode(),
            headers={"Authorization": f"Bearer {self.token}", "Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=10) as response:
            return json.loads(response.read())

    def tickets(self) -> list[dict[str, Any]]:
        """GET /tickets: every stored ticket with the idempotency key it was created under."""
        result: list[dict[str, Any]] = self._request("GET", "/tickets")
        return result

    def calls(self) -> list[dict[str, Any]]:
        """Every tool call the server ran, with the wall-clock `started` and `finished` times; needs
        the server started with enable_control=True."""
        result: list[dict[str, Any]] = self._request("GET", "/_control/calls")
        return result

    def reset(self, read_latency_ms: int = 0) -> None:
        """Empty the CRM as if just started (no ticket, key or recorded call; the standard contract),
        its lookups then taking `read_latency_ms`; needs enable_control=True."""
        self._request("POST", "/_control/reset", {"read_latency_ms": read_latency_ms})

    def set_variant(self, variant: Variant | str) -> None:
        """Switch the contract live; needs the server started with enable_control=True."""
        self._request("POST", "/_control/variant", {"variant": str(Variant(variant))})


def _log_tail(log_path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(log_path.read_text(encoding="utf-8", errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _answers_health(base_url: str) -> bool:
    try:
        with urllib.request.urlopen(base_url + "/healthz", timeout=2) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError):
        return False


@contextmanager
def running_crm_server(
    *,
    db_path: Path | None = None,
    token: str | None = None,
    token_file: Path | None = None,
    variant: Variant | str = Variant.STANDARD,
    enable_control: bool = False,
    read_latency_ms: int = 0,
    port: int = 0,
    startup_timeout: float = 60.0,
) -> Iterator[RunningCrmServer]:
    """Start `python -m crm_mcp.server` on 127.0.0.1, wait until it answers, stop it on exit.

    Without `db_path` the tickets live in a temporary file removed afterwards; pass the same `db_path`
    to two consecutive servers to show that tickets survive a restart. Without `token_file` the server
    accepts `token` (generated when omitted); with it, the server reads its credentials from the file
    and `token` (default: the file's first token) is what the helper itself sends.
    """
    with tempfile.TemporaryDirectory(prefix="crm-mcp-") as scratch:
        scratch_dir = Path(scratch)
        database = db_path if db_path is not None else scratch_dir / "crm.sqlite3"
        ready_file = scratch_dir / "ready.json"
        log_path = scratch_dir / "server.log"
        environment = {name: value for name, value in os.environ.items() if not name.startswith("CRM_MCP_")}
        command = [
            sys.executable,
            "-m",
            "crm_mcp.server",
            "--host",
            LOOPBACK,
            "--port",
            str(port),
            "--db",
            str(database),
            "--variant",
            str(Variant(variant)),
            "--ready-file",
            str(ready_file),
        ]
        if token_file is not None:
            command += ["--token-file", str(token_file)]
            client_token = token if token is not None else sorted(parse_token_list(token_file.read_text()))[0]
        else:
            client_token = token if token is not None else secrets.token_urlsafe(24)
            # The environment rather than argv, so the secret does not show up in process listings.
            environment["CRM_MCP_TOKEN"] = client_token
        if enable_control:
            command.append("--enable-control")
        if read_latency_ms:
            command += ["--read-latency-ms", str(read_latency_ms)]
        with open(log_path, "wb") as log:
            process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=environment)
        try:
            server = _wait_until_ready(process, ready_file, log_path, startup_timeout, database, client_token)
            yield server
        finally:
            _stop(process)


def _wait_until_ready(
    process: subprocess.Popen[bytes],
    ready_file: Path,
    log_path: Path,
    startup_timeout: float,
    database: Path,
    token: str,
) -> RunningCrmServer:
    deadline = time.monotonic() + startup_timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(
                f"the CRM server exited with status {process.returncode} before it was ready:\n"
                + _log_tail(log_path)
            )
        if ready_file.exists():
            announced = json.loads(ready_file.read_text())
            base_url = f"http://{LOOPBACK}:{announced['port']}"
            if _answers_health(base_url):
                return RunningCrmServer(
                    url=announced["url"],
                    base_url=base_url,
                    port=announced["port"],
                    db_path=database,
                    token=token,
                    log_path=log_path,
                    pid=process.pid,
                )
        time.sleep(_POLL_SECONDS)
    raise RuntimeError(f"the CRM server was not ready within {startup_timeout}s:\n{_log_tail(log_path)}")


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(timeout=_STOP_TIMEOUT_SECONDS)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
