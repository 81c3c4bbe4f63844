"""Generate the Python stubs (messages, typed .pyi, gRPC services) into api/python (`make proto`).

The same generator builds them when abada-api is installed (api/python/stub_builder.py).
"""

from __future__ import annotations

import importlib.util
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent


def main() -> int:
    spec = importlib.util.spec_from_file_location("stub_builder", ROOT / "api" / "python" / "stub_builder.py")
    assert spec is not None and spec.loader is not None
    builder = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(builder)
    builder.generate(ROOT / "proto", ROOT / "api" / "python")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
