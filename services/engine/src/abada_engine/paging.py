"""Page tokens: opaque to callers, the last row's sort key inside, signed by the engine.

Every list pages by keyset: a token holds the sort key of the last row a page showed, and the next
page starts after it. A page so costs the same at any depth, and rows that arrive while a caller
walks the list never make it see a row twice. A token is bound to the listing and filters it was
issued for, and signed with a key every replica derives from the shared idempotency secret, so a
token that was altered, forged, or sent with other filters is refused with `PAGE_TOKEN_INVALID`.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol, TypeVar

from abada.engine.v1.error_reason_pb2 import ErrorReason

from abada_engine.errors import invalid

DEFAULT_PAGE_SIZE = 50
MAX_PAGE_SIZE = 500
# Lists that returned everything before they paged keep that default, up to this many.
MAX_LISTED = 1000

# The types a sort key is made of, and how each travels in a token.
KeyPart = datetime | uuid.UUID | str | int
_DIGEST_BYTES = 16

Row = TypeVar("Row")


class PageRequest(Protocol):
    """What every list request carries to page: the size it asks for and the token of a previous page."""

    @property
    def page_size(self) -> int: ...

    @property
    def page_token(self) -> str: ...


@dataclass(frozen=True)
class Page:
    """One page to read: its size, and the sort key of the row it starts after (None: the first)."""

    size: int
    after: tuple[Any, ...] | None
    listing: str


def _encode(part: KeyPart) -> str | int:
    if isinstance(part, datetime):
        return part.isoformat()
    if isinstance(part, uuid.UUID):
        return str(part)
    return part


def _decode(value: object, kind: type) -> KeyPart:
    if kind is datetime and isinstance(value, str):
        parsed = datetime.fromisoformat(value)
        if parsed.tzinfo is None:
            raise ValueError("a sort key's time carries its zone")
        return parsed
    if kind is uuid.UUID and isinstance(value, str):
        return uuid.UUID(value)
    if kind is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if kind is str and isinstance(value, str):
        return value
    raise ValueError(f"expected a {kind.__name__}")


def listing(name: str, **filters: object) -> str:
    """What a token is bound to: the list and every filter it was asked with."""
    return json.dumps([name, sorted((k, str(v)) for k, v in filters.items())], separators=(",", ":"))


class PageTokens:
    """Issues and checks page tokens under one key."""

    def __init__(self, key: bytes) -> None:
        self._key = key

    @classmethod
    def derived_from(cls, secret: bytes) -> PageTokens:
        """The page-token key, derived from a secret every replica shares (a token from one replica
        is good on the others) and used for nothing else."""
        return cls(hmac.new(secret, b"abada page tokens v1", hashlib.sha256).digest())

    def _mac(self, listing_name: str, body: bytes) -> bytes:
        return hmac.new(self._key, listing_name.encode() + b"\n" + body, hashlib.sha256).digest()[
            :_DIGEST_BYTES
        ]

    def page(
        self,
        page_size: int,
        page_token: str,
        listing_name: str,
        key_types: Sequence[type],
        default_size: int = DEFAULT_PAGE_SIZE,
        max_size: int = MAX_PAGE_SIZE,
    ) -> Page:
        """The page a request asks for; refuses a size out of range or a token this engine did not issue
        for this listing with these filters."""
        if page_size < 0 or page_size > max_size:
            raise invalid(ErrorReason.INVALID_ARGUMENT, "page_size", f"must be between 0 and {max_size}")
        size = page_size or default_size
        if not page_token:
            return Page(size, None, listing_name)
        try:
            encoded_body, encoded_mac = page_token.split(".", 1)
            body = base64.urlsafe_b64decode(_padded(encoded_body))
            mac = base64.urlsafe_b64decode(_padded(encoded_mac))
            if not hmac.compare_digest(mac, self._mac(listing_name, body)):
                raise ValueError("signature")
            values = json.loads(body)
            if not isinstance(values, list) or len(values) != len(key_types):
                raise ValueError("shape")
            after = tuple(_decode(value, kind) for value, kind in zip(values, key_types, strict=True))
        except (ValueError, binascii.Error, UnicodeDecodeError):
            raise invalid(
                ErrorReason.PAGE_TOKEN_INVALID,
                "page_token",
                "is not a token this engine issued for this list with these filters; "
                "start again without a page_token",
            ) from None
        return Page(size, after, listing_name)

    def next_token(self, page: Page, fetched: int, last_key: Sequence[KeyPart]) -> str:
        """`fetched` counts rows read with a limit of size + 1: one more than a page means another page
        follows, which starts after `last_key`, the sort key of the page's last row."""
        if fetched <= page.size:
            return ""
        body = json.dumps([_encode(part) for part in last_key], separators=(",", ":")).encode()
        mac = self._mac(page.listing, body)
        return _unpadded(body) + "." + _unpadded(mac)

    def shown(
        self, page: Page, found: Sequence[Row], sort_key: Callable[[Row], Sequence[KeyPart]]
    ) -> tuple[Sequence[Row], str]:
        """What a page shows of `found` (rows read with a limit of size + 1), and the token of the page
        after it ("" on the last page); `sort_key` gives a row's key, where the next page starts."""
        shown = found[: page.size]
        if len(found) <= page.size:
            return shown, ""
        return shown, self.next_token(page, len(found), sort_key(shown[-1]))

    async def read(
        self,
        request: PageRequest,
        listing_name: str,
        key_types: Sequence[type],
        fetch: Callable[[int, tuple[Any, ...] | None], Awaitable[Sequence[Row]]],
        sort_key: Callable[[Row], Sequence[KeyPart]],
        default_size: int = DEFAULT_PAGE_SIZE,
        max_size: int = MAX_PAGE_SIZE,
    ) -> tuple[Sequence[Row], str]:
        """The page a request asks for, read by `fetch(limit, after_key)`, and the token of the next
        page ("" on the last): the one way every list handler pages."""
        page = self.page(
            request.page_size, request.page_token, listing_name, key_types, default_size, max_size
        )
        return self.shown(page, await fetch(page.size + 1, page.after), sort_key)


def _unpadded(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


def _padded(text: str) -> bytes:
    return (text + "=" * (-len(text) % 4)).encode()
