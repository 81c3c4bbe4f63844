"""Fixtures of the `abada dev` tests."""

from __future__ import annotations

import pathlib
import tempfile
from collections.abc import Iterator

import pytest


@pytest.fixture
def workdir() -> Iterator[pathlib.Path]:
    """A project directory outside pytest's own temporary tree: the embedded PostgreSQL runs as another
    user and needs to traverse every parent, which pytest keeps private (and, in parallel runs,
    makes private again while another worker is starting)."""
    with tempfile.TemporaryDirectory(prefix="abada-dev-test-") as path:
        yield pathlib.Path(path)
