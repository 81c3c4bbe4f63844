"""Generating the Python stubs (messages, typed .pyi, gRPC services) from the protos.

Used by `make proto` (scripts/gen_protos.py) and by this package's build (setup.py), so that
`pip install ./api/python` works from a clone in which nobody ran `make proto`. Not installed.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import sys

HERE = pathlib.Path(__file__).resolve().parent
STAMP = ".generated"
# The vendored google.api annotations (http rules) under proto/: an include path, never generated here
# (their Python modules come from googleapis-common-protos, which the stubs import).
THIRD_PARTY = "third_party"
DESCRIPTOR_SET = "descriptors.binpb"


def _ours(protos: pathlib.Path) -> list[pathlib.Path]:
    return [p for p in protos.rglob("*.proto") if p.relative_to(protos).parts[0] != THIRD_PARTY]


def proto_dir(project: pathlib.Path = HERE) -> pathlib.Path | None:
    """ABADA_PROTO_DIR, else `proto/` beside this project (an sdist), else the repository's `proto/`."""
    configured = os.environ.get("ABADA_PROTO_DIR")
    candidates = [pathlib.Path(configured)] if configured else []
    candidates += [project / "proto", project.parent.parent / "proto"]
    return next((path for path in candidates if any(path.rglob("*.proto"))), None)


def packages(project: pathlib.Path = HERE) -> list[str]:
    """The Python packages the stubs make: one per directory holding protos, and their parents."""
    protos = proto_dir(project)
    if protos is not None:
        found = {p.parent.relative_to(protos) for p in _ours(protos)}
    else:  # no protos, only stubs generated before (an sdist of them)
        found = {p.parent.relative_to(project) for p in (project / "abada").rglob("*_pb2.py")}
    names: set[str] = set()
    for directory in found:
        parts = directory.parts
        names.update(".".join(parts[:depth]) for depth in range(1, len(parts) + 1))
    return sorted(names)


def up_to_date(out_dir: pathlib.Path, protos: pathlib.Path) -> bool:
    stamp = out_dir / "abada" / STAMP
    if not stamp.exists() or not (out_dir / "abada" / DESCRIPTOR_SET).exists():
        return False
    built = stamp.stat().st_mtime
    return all(p.stat().st_mtime <= built for p in protos.rglob("*.proto"))


def generate(protos: pathlib.Path, out_dir: pathlib.Path) -> None:
    """Run protoc (grpcio-tools) over every proto into `out_dir`; regular packages, each typed."""
    import grpc_tools
    from grpc_tools import protoc

    sources = sorted(str(p.relative_to(protos)) for p in _ours(protos))
    well_known = pathlib.Path(grpc_tools.__file__).parent / "_proto"
    args = [
        "grpc_tools.protoc",
        f"-I{protos}",
        f"-I{protos / THIRD_PARTY}",
        f"-I{well_known}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        # The protos' comments, which the generated modules leave out: the OpenAPI documents of the
        # HTTP side describe every operation and field with them (abada_common.openapi).
        f"--descriptor_set_out={out_dir / 'abada' / DESCRIPTOR_SET}",
        "--include_source_info",
    ]
    # Typed service stubs where mypy-protobuf is installed (the repository's .venv); optional elsewhere.
    mypy_grpc = pathlib.Path(sys.executable).parent / "protoc-gen-mypy_grpc"
    found = str(mypy_grpc) if mypy_grpc.exists() else shutil.which("protoc-gen-mypy_grpc")
    if found:
        args += [f"--plugin=protoc-gen-mypy_grpc={found}", f"--mypy_grpc_out={out_dir}"]
    (out_dir / "abada").mkdir(parents=True, exist_ok=True)
    if protoc.main([*args, *sources]) != 0:
        raise RuntimeError(f"protoc failed on the protos in {protos}")
    # Regular packages (not namespace ones) so imports and editable installs behave alike.
    for directory, _, _ in os.walk(out_dir / "abada"):
        init = pathlib.Path(directory) / "__init__.py"
        if not init.exists():
            init.write_text("")
        (pathlib.Path(directory) / "py.typed").touch()
    (out_dir / "abada" / STAMP).touch()


def ensure(project: pathlib.Path = HERE) -> None:
    """Generate the stubs into `project` unless they are there and newer than every proto."""
    protos = proto_dir(project)
    if protos is None:
        if (project / "abada").is_dir():
            return
        raise RuntimeError(
            "abada-api: no protos to build the stubs from: expected the repository's proto/ two "
            "directories up, proto/ here, or ABADA_PROTO_DIR"
        )
    if not up_to_date(project, protos):
        generate(protos, project)
