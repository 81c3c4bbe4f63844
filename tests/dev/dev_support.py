"""Running `abada dev` from a test as a user runs it: a real process, its env file sourced in a shell."""

from __future__ import annotations

import os
import pathlib
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
ABADA = pathlib.Path(sys.executable).with_name("abada")
STARTUP_SECONDS = 120


def clean_environment() -> dict[str, str]:
    """The user's shell: no ABADA_* left over (so PostgreSQL is the embedded one) and no provider keys."""
    keys = ("GEMINI_API_KEY", "OPENAI_API_KEY", "ANTHROPIC_API_KEY")
    return {k: v for k, v in os.environ.items() if not k.startswith("ABADA_") and k not in keys}


@contextmanager
def abada_dev(workdir: pathlib.Path, *flags: str) -> Iterator[subprocess.Popen[str]]:
    """`abada dev --any-ports FLAGS` in `workdir`, yielded once it says it is running; Ctrl-C after."""
    process = subprocess.Popen(
        [str(ABADA), "dev", "--any-ports", *flags],
        cwd=workdir,
        env=clean_environment(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert process.stdout is not None
        seen = []
        deadline = time.monotonic() + STARTUP_SECONDS
        for line in process.stdout:
            seen.append(line)
            if line.startswith("Abada is running"):
                break
            assert time.monotonic() < deadline, "".join(seen)
        else:
            pytest.fail("abada dev ended before it was running:\n" + "".join(seen))
        yield process
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGINT)
            process.wait(60)


def sourced(
    workdir: pathlib.Path, command: str, cwd: pathlib.Path | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """`source .abada/dev/env` (of `workdir`) then `command`, in a shell as a user types it."""
    env_file = workdir / ".abada" / "dev" / "env"
    script = (
        f"source {shlex.quote(str(env_file))} && PATH={shlex.quote(str(ABADA.parent))}:$PATH && {command}"
    )
    return subprocess.run(
        ["bash", "-c", script],
        cwd=cwd or workdir,
        env=clean_environment(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def started_in_shell(
    workdir: pathlib.Path, command: str, cwd: pathlib.Path, log: pathlib.Path
) -> subprocess.Popen[bytes]:
    """Like `sourced`, left running (its output in `log`)."""
    env_file = workdir / ".abada" / "dev" / "env"
    with log.open("wb") as out:
        return subprocess.Popen(
            ["bash", "-c", f"source {shlex.quote(str(env_file))} && exec {command}"],
            cwd=cwd,
            env=clean_environment(),
            stdout=out,
            stderr=subprocess.STDOUT,
        )
