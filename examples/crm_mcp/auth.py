"""Bearer-token authentication in front of every route, with credentials that can rotate without a restart."""

from __future__ import annotations

import hmac
import logging
import os
from pathlib import Path
from typing import Protocol

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

logger = logging.getLogger(__name__)


def parse_token_list(text: str) -> frozenset[str]:
    """Commas or newlines separate tokens, so old and new can be valid together during a rotation."""
    return frozenset(token.strip() for token in text.replace("\n", ",").split(",") if token.strip())


class TokenSource(Protocol):
    def valid_tokens(self) -> frozenset[str]: ...


class StaticTokens:
    def __init__(self, tokens: frozenset[str]) -> None:
        if not tokens:
            raise ValueError("at least one bearer token is required")
        self._tokens = tokens

    def valid_tokens(self) -> frozenset[str]:
        return self._tokens


class TokenFile:
    """Reads the accepted tokens from a file, again whenever the file changes.

    A missing or empty file accepts nobody: failing closed is safer than remembering a credential
    the operator just tried to revoke.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._seen_version: tuple[int, int, int] | None = None
        self._tokens: frozenset[str] = frozenset()
        if not self.valid_tokens():
            logger.warning("token file %s holds no token yet; refusing every request until it does", path)

    def valid_tokens(self) -> frozenset[str]:
        try:
            stat = os.stat(self.path)
        except FileNotFoundError:
            if self._seen_version is not None or self._tokens:
                logger.warning("token file %s is missing; refusing every request until it is back", self.path)
            self._seen_version, self._tokens = None, frozenset()
            return self._tokens
        version = (stat.st_ino, stat.st_mtime_ns, stat.st_size)
        if version != self._seen_version:
            self._tokens = parse_token_list(self.path.read_text(encoding="utf-8"))
            self._seen_version = version
            logger.info("token file %s (re)loaded: %d valid token(s)", self.path, len(self._tokens))
        return self._tokens


def _is_valid(candidate: str, tokens: frozenset[str]) -> bool:
    candidate_bytes = candidate.encode()
    # No short-circuit, so timing does not reveal which (or whether an earlier) token matched.
    matches = [hmac.compare_digest(candidate_bytes, token.encode()) for token in tokens]
    return any(matches)


class BearerAuthMiddleware:
    """Answers 401 to any HTTP request without a valid `Authorization: Bearer` token, before MCP sees it."""

    def __init__(self, app: ASGIApp, tokens: TokenSource, public_paths: frozenset[str]) -> None:
        self.app = app
        self.tokens = tokens
        self.public_paths = public_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.public_paths:
            await self.app(scope, receive, send)
            return
        authorization = ""
        for name, value in scope["headers"]:
            if name == b"authorization":
                authorization = value.decode("latin-1")
                break
        scheme, _, credential = authorization.partition(" ")
        if scheme.lower() != "bearer" or not _is_valid(credential.strip(), self.tokens.valid_tokens()):
            client = scope.get("client")
            logger.warning(
                "refused %s %s from %s: %s",
                scope["method"],
                scope["path"],
                client[0] if client else "?",
                "no bearer token" if not authorization else "invalid bearer token",
            )
            response = JSONResponse(
                {
                    "error": "unauthorized",
                    "message": "a valid 'Authorization: Bearer <token>' header is required",
                },
                status_code=401,
                headers={"WWW-Authenticate": 'Bearer realm="crm-mcp"'},
            )
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)
