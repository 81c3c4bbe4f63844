"""Child processes of a local stack: started with their logs in files, waited for, stopped."""

from __future__ import annotations

import contextlib
import os
import pathlib
import socket
import subprocess
import time
import urllib.request
from collections.abc import Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

STARTUP_SECONDS = 60.0
_STOP_SECONDS = 15.0
_POLL_SECONDS = 0.2


class StartupFailed(Exception):
    """A service exited or did not answer in time; the message names its log."""


def port_taken(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return True
        return False


def launch(name: str, argv: list[str], env: dict[str, str], logs: pathlib.Path) -> subprocess.Popen[bytes]:
    """Run `argv` with its output in `logs/NAME.log`.

    The child stays in our process group, so a Ctrl-C in the terminal reaches it as well."""
    with (logs / f"{name}.log").open("ab") as log:
        return subprocess.Popen(argv, env={**os.environ, **env}, stdout=log, stderr=log, cwd=logs)


def stop_all(processes: list[subprocess.Popen[bytes]]) -> None:
    """SIGTERM to every one at once (each drains in parallel), then SIGKILL to any still there after 15 s."""
    for process in processes:
        if process.poll() is None:
            process.terminate()
    deadline = time.monotonic() + _STOP_SECONDS
    for process in processes:
        try:
            process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _failed(name: str, process: subprocess.Popen[bytes], logs: pathlib.Path, what: str) -> StartupFailed:
    log = logs / f"{name}.log"
    tail = log.read_text(errors="replace").strip().splitlines()[-1:] if log.exists() else []
    last = f": {tail[0][:300]}" if tail else ""
    return StartupFailed(f"{name} {what}; see {log}{last}")


def _wait_until_ready(
    ready: Callable[[], bool], process: subprocess.Popen[bytes], name: str, logs: pathlib.Path
) -> None:
    """Asks `ready` again and again until it says yes; fails when the process exits first or
    STARTUP_SECONDS pass."""
    deadline = time.monotonic() + STARTUP_SECONDS
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise _failed(name, process, logs, f"exited during start-up (status {process.returncode})")
        if ready():
            return
        time.sleep(_POLL_SECONDS)
    raise _failed(name, process, logs, "did not become ready")


def wait_for_grpc(address: str, process: subprocess.Popen[bytes], name: str, logs: pathlib.Path) -> None:
    def serving() -> bool:
        with contextlib.suppress(grpc.RpcError), grpc.insecure_channel(address) as channel:
            check = health_pb2_grpc.HealthStub(channel).Check  # type: ignore[attr-defined]  # untyped stub
            answer = check(health_pb2.HealthCheckRequest(), timeout=1)
            return bool(answer.status == health_pb2.HealthCheckResponse.SERVING)
        return False

    _wait_until_ready(serving, process, name, logs)


def wait_for_http(url: str, process: subprocess.Popen[bytes], name: str, logs: pathlib.Path) -> None:
    def answering() -> bool:
        with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=1) as response:
            return response.status == 200
        return False

    _wait_until_ready(answering, process, name, logs)
