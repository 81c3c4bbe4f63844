"""Running a scripted model endpoint (Gemini, OpenAI, Anthropic) as a subprocess, for tests and the demo.

    with running_scripted_gemini() as base_url:
        client = genai.Client(api_key="x", http_options=types.HttpOptions(base_url=base_url))
        ...
        assert not fetch_calls(base_url)["repeated"]

The helpers talk plain HTTP with the standard library so they work from sync and async code
alike (loopback calls are quick enough not to matter to an event loop).
"""

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

from scripted_gemini.endpoint import READY_MARKER
from scripted_gemini.script import SUPPORT_TRIAGE_SCRIPT

ScriptSource = str | os.PathLike[str] | Mapping[str, Any] | Sequence[Any] | None


class ScriptedGeminiStartError(RuntimeError):
    """The subprocess exited or did not become ready in time; the message holds its stderr."""


@contextlib.contextmanager
def running_scripted_gemini(
    script: ScriptSource = None, *, startup_timeout: float = 60.0, log_level: str = "warning"
) -> Iterator[str]:
    """Starts the server on a free loopback port and yields its base URL, e.g. `http://127.0.0.1:40123`.

    `script` is a path to a YAML/JSON script file, or a script document (mapping or list of
    turns) that is written to a temporary file; None plays `scripts/support_triage.yaml`.
    The process is terminated (then killed if it lingers) when the block exits.
    """
    with running_scripted_endpoint(
        "scripted_gemini.server", script, startup_timeout=startup_timeout, log_level=log_level
    ) as url:
        yield url


@contextlib.contextmanager
def running_scripted_endpoint(
    module: str, script: ScriptSource = None, *, startup_timeout: float = 60.0, log_level: str = "warning"
) -> Iterator[str]:
    """Any scripted endpoint (`scripted_gemini.server`, `scripted_openai.server`, ...) the same way.

    The `fetch_calls`, `reset_calls` and `load_script` helpers work on every one of them.
    """
    with tempfile.TemporaryDirectory(prefix="scripted-endpoint-") as workdir:
        server = _ServerProcess(
            module, _script_path(script, Path(workdir)), Path(workdir) / "stderr.log", log_level
        )
        try:
            yield server.wait_until_ready(startup_timeout)
        finally:
            server.stop()


def fetch_calls(base_url: str) -> dict[str, Any]:
    """`GET /_script/calls`: `{"total", "calls": [...], "counts": [...], "repeated": [...]}`."""
    return _request_json("GET", f"{base_url}/_script/calls")


def reset_calls(base_url: str) -> None:
    _request_json("POST", f"{base_url}/_script/reset", b"")


def set_outage(base_url: str, status: int, retry_after_seconds: float | None = None) -> None:
    """`POST /_script/outage`: answer every model request with `status` (0 ends the outage)."""
    body = {"status": status, "retry_after_seconds": retry_after_seconds}
    _request_json("POST", f"{base_url}/_script/outage", json.dumps(body).encode())


def load_script(
    base_url: str, script: str | os.PathLike[str] | Mapping[str, Any] | Sequence[Any]
) -> list[str]:
    """Replaces the server's scripts; `script` is YAML/JSON text, a file path or a script document.

    A plain `str` is taken as script text; pass a `Path` for a file. Returns the loaded names.
    """
    if isinstance(script, str):
        body = script.encode()
    elif isinstance(script, os.PathLike):
        body = Path(script).read_bytes()
    else:
        body = json.dumps(script).encode()
    return list(_request_json("POST", f"{base_url}/_script/load", body)["scripts"])


def _script_path(script: ScriptSource, workdir: Path) -> Path:
    if script is None:
        return SUPPORT_TRIAGE_SCRIPT
    if isinstance(script, str | os.PathLike):
        return Path(script)
    path = workdir / "script.json"
    path.write_text(json.dumps(script), encoding="utf-8")
    return path


class _ServerProcess:
    def __init__(self, module: str, script_path: Path, stderr_path: Path, log_level: str) -> None:
        self._module = module
        self._stderr_path = stderr_path
        with stderr_path.open("wb") as stderr_file:
            self._process = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    module,
                    "--host",
                    "127.0.0.1",
                    "--port",
                    "0",
                    "--script",
                    str(script_path),
                    "--log-level",
                    log_level,
                ],
                stdout=subprocess.PIPE,
                stderr=stderr_file,
                stdin=subprocess.DEVNULL,
            )
        self._ready_url: str | None = None
        self._ready_line_seen = threading.Event()
        # A reader thread because a pipe read cannot time out; it keeps draining stdout
        # afterwards so the child never blocks on a full pipe.
        self._reader = threading.Thread(target=self._read_stdout, daemon=True)
        self._reader.start()

    def wait_until_ready(self, timeout: float) -> str:
        if not self._ready_line_seen.wait(timeout) or self._ready_url is None:
            self.stop()
            raise ScriptedGeminiStartError(
                f"{self._module} did not start (exit code {self._process.returncode}): {self._stderr_tail()}"
            )
        deadline = time.monotonic() + timeout
        while True:
            try:
                _request_json("GET", f"{self._ready_url}/_script/health")
                return self._ready_url
            except (urllib.error.URLError, ConnectionError) as error:
                if time.monotonic() > deadline or self._process.poll() is not None:
                    self.stop()
                    raise ScriptedGeminiStartError(
                        f"{self._module} at {self._ready_url} is not answering: {error}; "
                        f"{self._stderr_tail()}"
                    ) from error
                time.sleep(0.05)

    def stop(self) -> None:
        if self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait(timeout=5)
        # The child is gone, so the reader sees end of file and finishes before the pipe is closed.
        self._reader.join(timeout=5)
        if self._process.stdout is not None:
            self._process.stdout.close()

    def _read_stdout(self) -> None:
        stdout: IO[bytes] | None = self._process.stdout
        assert stdout is not None
        for raw in stdout:
            line = raw.decode(errors="replace").strip()
            if self._ready_url is None and READY_MARKER in line:
                self._ready_url = line.split(READY_MARKER, 1)[1]
                self._ready_line_seen.set()
        self._ready_line_seen.set()

    def _stderr_tail(self) -> str:
        return self._stderr_path.read_text(errors="replace")[-2000:]


def _request_json(method: str, url: str, body: bytes | None = None) -> dict[str, Any]:
    request = urllib.request.Request(url, data=body, method=method)
    if body is not None:
        request.add_header("Content-Type", "application/yaml")
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return dict(json.loads(response.read()))
    except urllib.error.HTTPError as error:
        detail = error.read().decode(errors="replace")
        raise RuntimeError(f"{method} {url} failed with {error.code}: {detail}") from error
