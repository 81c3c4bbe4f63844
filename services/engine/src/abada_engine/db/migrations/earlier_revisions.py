"""A revision that puts back or rewrites SQL an earlier revision wrote reads it from that revision's file.

So the SQL stays written once, as the earlier revision ran it. The revisions' file names are no Python
identifiers, so an `import` cannot name them: each is loaded from its path instead. This module sits
beside `versions/`, not in it, because Alembic takes every file there for a revision.
"""

from __future__ import annotations

import importlib.util
import pathlib

VERSIONS = pathlib.Path(__file__).with_name("versions")


def constant_from(revision_file: str, name: str) -> str:
    """The string constant `name` as the revision in `versions/<revision_file>` defines it."""
    path = VERSIONS / revision_file
    spec = importlib.util.spec_from_file_location(f"abada_migration_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return str(getattr(module, name))
