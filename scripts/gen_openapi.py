"""Write the OpenAPI 3.1 documents of the HTTP/JSON side (api/openapi/) from the protos' HTTP rules.

Run by `make proto` after the stubs are generated; `--check` only compares (the suite runs it too):
the checked-in documents must be what the protos say.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
OUT = ROOT / "api" / "openapi"


def documents() -> dict[str, str]:
    from abada.broker.v1 import credential_pb2
    from abada_common import openapi
    from abada_engine.api.server import SERVICE_DESCRIPTORS

    made = {
        "engine.openapi.json": openapi.document(SERVICE_DESCRIPTORS, title="Abada engine"),
        "broker.openapi.json": openapi.document(
            [credential_pb2.DESCRIPTOR.services_by_name["CredentialService"]], title="Abada credential broker"
        ),
    }
    return {name: json.dumps(document, indent=2, sort_keys=False) + "\n" for name, document in made.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="compare only; exit 1 when a document differs")
    arguments = parser.parse_args()
    stale = []
    for name, text in documents().items():
        path = OUT / name
        if arguments.check:
            if not path.exists() or path.read_text() != text:
                stale.append(name)
        else:
            OUT.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    if stale:
        print(f"stale OpenAPI documents (run `make proto`): {', '.join(stale)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
