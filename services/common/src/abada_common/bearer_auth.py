"""Bearer-token authentication for the httpx2 clients that call tool servers (the engine at deploy,
the worker at run time)."""

from __future__ import annotations

from collections.abc import Callable, Generator

import httpx2


class BearerAuth(httpx2.Auth):
    """Sends `Authorization: Bearer <token>`. The token is asked for as each request leaves, so a
    secret held sealed (the worker's) is opened only into the header, never kept in the client."""

    def __init__(self, token: Callable[[], str]) -> None:
        self._token = token

    def auth_flow(self, request: httpx2.Request) -> Generator[httpx2.Request, httpx2.Response, None]:
        request.headers["Authorization"] = f"Bearer {self._token()}"
        yield request
