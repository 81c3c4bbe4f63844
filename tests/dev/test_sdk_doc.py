"""docs/sdk.md as a newcomer follows it: abada-api and abada-sdk installed into a fresh virtualenv
outside the repository, the doc's worker and client run as written against `abada dev`."""

from __future__ import annotations

import pathlib
import re
import shutil
import signal
import subprocess
import sys
import venv

import pytest
from dev_support import ROOT, abada_dev, clean_environment, started_in_shell

DOC = ROOT / "docs" / "sdk.md"
# What a clone holds of the two packages: never what `make proto` or an earlier build left there.
_NOT_IN_A_CLONE = shutil.ignore_patterns("abada", "build", "*.egg-info", "__pycache__", ".generated")


def python_blocks() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", DOC.read_text(), re.MULTILINE | re.DOTALL)


@pytest.fixture(scope="module")
def fresh_python(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """A new virtualenv with `pip install ./api/python ./sdk/python` from a copy of the clone's files."""
    base = tmp_path_factory.mktemp("sdk-install")
    clone = base / "clone"
    shutil.copytree(ROOT / "proto", clone / "proto")
    shutil.copytree(ROOT / "api" / "python", clone / "api" / "python", ignore=_NOT_IN_A_CLONE)
    shutil.copytree(ROOT / "sdk" / "python", clone / "sdk" / "python", ignore=_NOT_IN_A_CLONE)
    assert not (clone / "api" / "python" / "abada").exists()
    environment = base / "venv"
    venv.create(environment, with_pip=False)  # this pip installs into it (--python): no bootstrap
    python = environment / "bin" / "python"
    installed = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(python),
            "install",
            "--quiet",
            "./api/python",
            "./sdk/python",
        ],
        cwd=clone,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert installed.returncode == 0, installed.stdout + installed.stderr
    return python


def test_the_doc_has_a_worker_and_a_client() -> None:
    worker, client = python_blocks()
    assert "Worker(" in worker and "AsyncEngineClient(" in client


def test_the_sdk_installs_outside_the_repository_and_the_docs_examples_run_against_abada_dev(
    workdir: pathlib.Path, fresh_python: pathlib.Path
) -> None:
    imported = subprocess.run(
        [
            str(fresh_python),
            "-c",
            "import abada_sdk, abada.engine.v1.process_pb2_grpc; print(abada_sdk.__file__)",
        ],
        cwd=workdir,
        capture_output=True,
        text=True,
    )
    assert imported.returncode == 0, imported.stderr
    assert str(ROOT) not in imported.stdout  # the installed copy, not the repository's sources

    worker_code, client_code = python_blocks()
    (workdir / "mail_worker.py").write_text(worker_code)
    (workdir / "client.py").write_text(client_code)
    with abada_dev(workdir) as dev:
        worker_log = workdir / "mail_worker.log"
        worker = started_in_shell(workdir, f"{fresh_python} {workdir / 'mail_worker.py'}", ROOT, worker_log)
        try:
            client = subprocess.run(
                [
                    "bash",
                    "-c",
                    f"source {workdir / '.abada/dev/env'} && exec {fresh_python} {workdir / 'client.py'}",
                ],
                cwd=ROOT,  # the doc runs from the repository's root: examples/welcome-mail.yaml
                env=clean_environment(),
                capture_output=True,
                text=True,
                timeout=180,
            )
            assert client.returncode == 0, client.stdout + client.stderr + worker_log.read_text()
            assert client.stdout.strip() == "COMPLETED C-42"
        finally:
            worker.send_signal(signal.SIGTERM)
            worker.wait(60)
        assert worker.returncode == 0, worker_log.read_text()
        assert "mail to C-42: Welcome aboard!" in worker_log.read_text()
        dev.send_signal(signal.SIGINT)
        dev.wait(60)
