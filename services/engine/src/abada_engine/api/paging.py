"""Page tokens: opaque to callers, an offset inside."""

from __future__ import annotations

import base64
from dataclasses import dataclass

from abada_engine.errors import invalid

DEFAULT_PAGE_SIZE = 50
MAX_PAGE_SIZE = 500


@dataclass(frozen=True)
class Window:
    limit: int
    offset: int

    def next_token(self, fetched: int) -> str:
        """`fetched` counts rows read with limit + 1; one more than a page means there is a next one."""
        if fetched <= self.limit:
            return ""
        return base64.urlsafe_b64encode(f"o:{self.offset + self.limit}".encode()).decode()


def page(page_size: int, page_token: str) -> Window:
    if page_size < 0 or page_size > MAX_PAGE_SIZE:
        raise invalid("INVALID_ARGUMENT", "page_size", f"must be between 0 and {MAX_PAGE_SIZE}")
    offset = 0
    if page_token:
        try:
            kind, value = base64.urlsafe_b64decode(page_token.encode()).decode().split(":", 1)
            offset = int(value)
            if kind != "o" or offset < 0:
                raise ValueError
        except ValueError:
            raise invalid("INVALID_ARGUMENT", "page_token", "is not a token this engine issued") from None
    return Window(page_size or DEFAULT_PAGE_SIZE, offset)
