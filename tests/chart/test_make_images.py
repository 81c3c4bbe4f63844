"""`make images REGISTRY=… TAG=…` builds the three images the chart runs (one Dockerfile, SERVICE
chosen with --build-arg) and pushes them.

A `docker` on PATH that records its arguments stands in for the Docker engine (none on CI machines);
what is checked is what the target asks of it.
"""

from __future__ import annotations

import os
import pathlib
import subprocess

import yaml

ROOT = pathlib.Path(__file__).resolve().parents[2]
COMPONENTS = ("engine", "credential-broker", "agent-worker")


def _docker_calls(tmp_path: pathlib.Path, *variables: str) -> list[str]:
    record = tmp_path / "docker-calls"
    fake = tmp_path / "bin" / "docker"
    fake.parent.mkdir()
    fake.write_text(f'#!/bin/sh\necho "$*" >> {record}\n')
    fake.chmod(0o755)
    done = subprocess.run(
        ["make", "--no-print-directory", "images", *variables],
        cwd=ROOT,
        env={**os.environ, "PATH": f"{fake.parent}:{os.environ['PATH']}"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return record.read_text().splitlines()


def test_images_are_built_and_pushed_under_the_registry_and_tag(tmp_path):
    calls = _docker_calls(tmp_path, "REGISTRY=registry.example.com/team", "TAG=1.2.3")
    expected = []
    for component in COMPONENTS:
        image = f"registry.example.com/team/abada/{component}:1.2.3"
        expected += [f"build --build-arg SERVICE={component} -t {image} .", f"push {image}"]
    assert calls == expected


def test_without_a_registry_the_images_are_only_built_with_the_charts_version(tmp_path):
    app_version = yaml.safe_load((ROOT / "charts" / "abada" / "Chart.yaml").read_text())["appVersion"]
    calls = _docker_calls(tmp_path)
    assert calls == [
        f"build --build-arg SERVICE={component} -t abada/{component}:{app_version} ."
        for component in COMPONENTS
    ]
