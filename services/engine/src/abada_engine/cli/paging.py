"""Following the engine's page tokens: every list comes in pages; the CLI reads as many as it shows."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, TypeVar

Row = TypeVar("Row")


def follow(
    fetch: Callable[[int, str], Any],
    rows: Callable[[Any], Iterable[Row]],
    page_size: int,
    limit: int | None = None,
) -> tuple[list[Row], str]:
    """The rows of successive pages (`fetch(page_size, page_token)`), up to `limit` (None: every page), and
    the token of the page after them ("" when none is left)."""
    found: list[Row] = []
    token = ""
    while limit is None or len(found) < limit:
        size = page_size if limit is None else min(page_size, limit - len(found))
        response = fetch(size, token)
        found.extend(rows(response))
        token = response.next_page_token
        if not token:
            break
    return (found if limit is None else found[:limit]), token
