"""Refusals written by abada_common.rpc_status and read by abada_sdk.status, over a real gRPC socket.

Every reader (the SDK, the engine CLI, the agent worker, the credential broker) goes through
`abada_sdk.status.read_status`, so a malformed `grpc-status-details-bin` never hides the
status itself: garbage bytes, a detail that is not what it says, or no details at all.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import AsyncIterator, Callable

import grpc
import pytest
from abada_broker.engine_client import _error_info as broker_error_info
from abada_common.errors import Category
from abada_common.rpc_status import DETAILS_KEY, Violation, status_message
from abada_engine.cli.errors import from_status
from abada_sdk.status import read_status, status_from_trailers
from abada_worker.rpc_errors import failure_of
from google.protobuf import any_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2

METHOD = "/abada.test.v1.Refuser/Refuse"


def _any(type_url: str, value: bytes) -> any_pb2.Any:
    return any_pb2.Any(type_url=type_url, value=value)


def _status(*details: any_pb2.Any) -> bytes:
    return status_pb2.Status(code=9, message="no", details=list(details)).SerializeToString()


_ERROR_INFO_URL = "type.googleapis.com/google.rpc.ErrorInfo"
_GOOD_INFO = error_details_pb2.ErrorInfo(
    reason="LEASE_EXPIRED", domain="abada.dev", metadata={"field": "task_id"}
)

# What the server puts in grpc-status-details-bin, by case; None sends no trailer at all.
TRAILERS: dict[str, bytes | None] = {
    "no details": None,
    "garbage bytes": b"\xff\x00\x13not a status\x80",
    "a detail that is not ErrorInfo": _status(
        _any(
            "type.googleapis.com/google.rpc.DebugInfo",
            error_details_pb2.DebugInfo(detail="x").SerializeToString(),
        )
    ),
    "an ErrorInfo whose bytes do not decode": _status(_any(_ERROR_INFO_URL, b"\xff\xff\xff")),
    "a broken detail before a good ErrorInfo": _status(
        _any(_ERROR_INFO_URL, b"\xff\xff\xff"), _any(_ERROR_INFO_URL, _GOOD_INFO.SerializeToString())
    ),
}


@pytest.fixture(scope="module")
async def refuser() -> AsyncIterator[Callable[[str], grpc.aio.UnaryUnaryMultiCallable]]:
    """A real server whose one method fails with FAILED_PRECONDITION and the case's trailer."""

    async def refuse(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        trailer = TRAILERS[request.decode()]
        metadata = () if trailer is None else ((DETAILS_KEY, trailer),)
        await context.abort(
            grpc.StatusCode.FAILED_PRECONDITION, "refused on purpose", trailing_metadata=metadata
        )
        return b""

    server = grpc.aio.server()
    server.add_generic_rpc_handlers(
        [
            grpc.method_handlers_generic_handler(
                "abada.test.v1.Refuser", {"Refuse": grpc.unary_unary_rpc_method_handler(refuse)}
            )
        ]
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    call = channel.unary_unary(METHOD)

    async def failed(case: str) -> grpc.aio.AioRpcError:
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await call(case.encode(), timeout=10)
        return raised.value

    yield failed
    await channel.close()
    await server.stop(None)


@pytest.mark.parametrize(
    "case", [case for case in TRAILERS if case != "a broken detail before a good ErrorInfo"]
)
async def test_a_status_without_a_readable_error_info_keeps_its_code_and_message(refuser, case):
    error = await refuser(case)

    status = read_status(error)
    assert (status.code, status.message) == (grpc.StatusCode.FAILED_PRECONDITION, "refused on purpose")
    assert (status.reason, status.metadata, status.has_error_info) == ("", {}, False)
    # Each service's reader survives it too, and still tells the caller what happened.
    assert failure_of(error).code is grpc.StatusCode.FAILED_PRECONDITION and failure_of(error).reason == ""
    assert broker_error_info(error) == ("", None)
    assert from_status(read_status(error), "127.0.0.1:1", 5).lines() == [
        "error: FAILED_PRECONDITION: refused on purpose"
    ]


async def test_a_broken_detail_does_not_hide_a_good_error_info_after_it(refuser):
    error = await refuser("a broken detail before a good ErrorInfo")

    status = read_status(error)
    assert (status.reason, status.field, status.has_error_info) == ("LEASE_EXPIRED", "task_id", True)
    assert failure_of(error).lease_lost
    assert broker_error_info(error) == ("LEASE_EXPIRED", "task_id")


def test_what_is_written_reads_back_whole_and_bounded():
    refusal = status_message(
        Category.INVALID_ARGUMENT,
        "DEFINITION_INVALID",
        "x" * 5_000,
        field="nodes[0]",
        metadata={"node": "triage"},
        retry_after_seconds=1.5,
        violations=[Violation(f"nodes[{i}]", "y" * 400) for i in range(40)],
    )
    code = grpc.StatusCode[code_pb2.Code.Name(refusal.code)]
    message, details = refusal.message, refusal.SerializeToString()
    assert code is grpc.StatusCode.INVALID_ARGUMENT and len(message.encode()) <= 1_000
    status = status_from_trailers(code, message, [(DETAILS_KEY, details)])
    assert status.reason == "DEFINITION_INVALID"
    assert status.metadata == {"field": "nodes[0]", "node": "triage"}
    assert status.retry_after_seconds == 1.5
    # Every violation that fits, then one line saying how many were left out, all under the 8 KiB limit.
    assert status.violations[-1].endswith("more problems, not shown") and len(details) < 4_000


def test_the_domain_error_modules_do_not_import_grpc():
    code = (
        "import sys, abada_common.errors, abada_engine.errors, abada_broker.errors; "
        "print(sorted(m for m in sys.modules if m == 'grpc' or m.startswith('grpc.')))"
    )
    shown = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert shown.strip() == "[]"
