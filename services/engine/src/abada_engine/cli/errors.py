"""Turning failed calls and bad input into one clear message and an exit code."""

from __future__ import annotations

from collections.abc import Sequence

import grpc
from abada_sdk.status import RpcStatus

INVALID_INPUT = 2
FAILURE = 1

# Codes that mean the request itself was wrong, so a script can tell "fix your input" from "try later".
_INVALID_INPUT_CODES = frozenset({grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE})


class CliError(Exception):
    """A failure the user can act on: printed as `error: ...` lines, never as a traceback."""

    def __init__(self, message: str, exit_code: int = FAILURE, details: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.message = message
        self.exit_code = exit_code
        self.details = list(details)

    def lines(self) -> list[str]:
        return [f"error: {self.message}", *(f"  {detail}" for detail in self.details)]


def invalid_input(message: str) -> CliError:
    return CliError(message, INVALID_INPUT)


NO_TOKEN_HINT = "give --token-file FILE (or set ABADA_TOKEN_FILE), or --token / ABADA_TOKEN"


def from_status(
    status: RpcStatus, address: str, timeout: float, has_token: bool = True, token_source: str = ""
) -> CliError:
    """A refused call (as the SDK read it) in the CLI's words: which flag to fix, or what the engine said."""
    code = status.code
    # The status stands in its code's name for an empty message; said once here, not twice.
    text = "" if status.message == code.name else status.message
    violations = status.violations
    exit_code = INVALID_INPUT if code in _INVALID_INPUT_CODES else FAILURE
    if code == grpc.StatusCode.UNAUTHENTICATED:
        # Said in the CLI's terms: which flag or variable to set, not which gRPC metadata to send.
        if not has_token:
            return CliError(f"the engine at {address} wants a token (UNAUTHENTICATED): {NO_TOKEN_HINT}")
        source = token_source or "--token-file / ABADA_TOKEN_FILE"
        return CliError(f"the engine at {address} does not know the token from {source} (UNAUTHENTICATED)")
    if not status.has_error_info:
        # Without ErrorInfo the status came from the transport, not from the engine's own checks.
        if code == grpc.StatusCode.UNAVAILABLE:
            return CliError(f"cannot reach the engine at {address} (UNAVAILABLE)", exit_code)
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return CliError(
                f"the engine at {address} did not answer within {timeout:g}s (DEADLINE_EXCEEDED)", exit_code
            )
        return CliError(f"{code.name}: {text}" if text else code.name, exit_code, violations)
    message = f"{status.reason or code.name}: {text}"
    field = status.field
    if field and field not in text:
        message += f" (field {field})"
    if violations == [text]:
        violations = []
    return CliError(message, exit_code, violations)
