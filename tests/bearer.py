"""A client interceptor that presents a bearer token on every call of a channel."""

from __future__ import annotations

import grpc


class BearerToken(grpc.aio.UnaryUnaryClientInterceptor):
    """Adds `authorization: Bearer <token>` to every call on a channel."""

    def __init__(self, token: str) -> None:
        self._metadata = ("authorization", f"Bearer {token}")

    async def intercept_unary_unary(self, continuation, client_call_details, request):  # type: ignore[no-untyped-def]
        metadata = [*list(client_call_details.metadata or []), self._metadata]
        return await continuation(client_call_details._replace(metadata=metadata), request)
