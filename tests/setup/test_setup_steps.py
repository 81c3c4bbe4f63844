"""`make demo` and `make test` set up in quiet steps (scripts/step.sh): one line per step, the installers'
output in .abada/setup.log, and that log's tail printed when a step fails."""

from __future__ import annotations

import pathlib
import subprocess

STEP = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "step.sh"


def run_step(log: pathlib.Path, what: str, *command: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(STEP), str(log), what, *command], capture_output=True, text=True, timeout=30, check=False
    )


def test_a_step_that_succeeds_prints_one_line_and_keeps_the_banner_in_the_log(tmp_path: pathlib.Path) -> None:
    log = tmp_path / "setup.log"
    banner = "Editable installation of abada-engine; Writing mypy to build/"
    done = run_step(log, "services", "bash", "-c", f"echo '{banner}'; echo warning >&2")
    assert done.returncode == 0
    assert done.stdout == "services ... ok\n" and done.stderr == ""
    assert banner in log.read_text() and "warning" in log.read_text()


def test_a_step_that_fails_prints_the_logs_tail_and_fails_with_its_status(tmp_path: pathlib.Path) -> None:
    log = tmp_path / "setup.log"
    failing = "for i in $(seq 1 100); do echo line-$i; done; echo 'No matching distribution' >&2; exit 3"
    done = run_step(log, "tools", "bash", "-c", failing)
    assert done.returncode == 3
    first, *rest = done.stdout.splitlines()
    assert first == "tools ... FAILED (exit 3)"
    assert "No matching distribution" in done.stdout and "line-100" in done.stdout
    assert "line-1\n" not in done.stdout  # the tail, not the whole log
    assert rest[-1] == f"--- the whole log: {log} ---"
