"""Generate the Python stubs (messages, typed .pyi, gRPC services) into api/python."""

from __future__ import annotations

import os
import pathlib
import sys

import grpc_tools
from grpc_tools import protoc

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "proto"
OUT_DIR = ROOT / "api" / "python"


def main() -> int:
    protos = sorted(str(p.relative_to(PROTO_DIR)) for p in PROTO_DIR.rglob("*.proto"))
    well_known = pathlib.Path(grpc_tools.__file__).parent / "_proto"
    mypy_grpc = pathlib.Path(sys.executable).parent / "protoc-gen-mypy_grpc"
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_DIR}",
        f"-I{well_known}",
        f"--python_out={OUT_DIR}",
        f"--pyi_out={OUT_DIR}",
        f"--grpc_python_out={OUT_DIR}",
    ]
    if mypy_grpc.exists():
        args += [f"--plugin=protoc-gen-mypy_grpc={mypy_grpc}", f"--mypy_grpc_out={OUT_DIR}"]
    status = protoc.main([*args, *protos])
    if status != 0:
        return status
    # Regular packages (not namespace ones) so imports and editable installs behave alike.
    for directory, _, _ in os.walk(OUT_DIR / "abada"):
        init = pathlib.Path(directory) / "__init__.py"
        if not init.exists():
            init.write_text("")
        (pathlib.Path(directory) / "py.typed").touch()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
