"""Files holding secrets (development keys and tokens): owner-only from the moment they exist."""

from __future__ import annotations

import os
import pathlib


def write_private(path: pathlib.Path, text: str) -> None:
    """Write `path` as a new file with mode 0600 from its first byte: no window before a chmod.

    A file already there is replaced, not rewritten in place, so its old mode cannot carry over.
    """
    path.unlink(missing_ok=True)
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(descriptor, "w", encoding="utf-8") as handle:
        handle.write(text)
