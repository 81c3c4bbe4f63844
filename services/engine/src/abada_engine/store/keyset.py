"""Keyset pages: a page starts after the last row of the one before, found by an index, never skipped to."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import ColumnElement, Select, literal, tuple_


def after(columns: Sequence[Any], key: Sequence[Any], descending: bool = False) -> ColumnElement[bool]:
    """Rows past `key` in the order of `columns` (all ascending, or all descending): a row comparison,
    which PostgreSQL answers as one range of an index on those columns."""
    row = tuple_(*columns)
    bound = tuple_(*(literal(value, column.type) for value, column in zip(key, columns, strict=True)))
    return row < bound if descending else row > bound


def ordered(query: Select[Any], columns: Sequence[Any], after_key: Sequence[Any] | None) -> Select[Any]:
    """`query` in the order of `columns` (ascending), from the row after `after_key` (None: the first)."""
    query = query.order_by(*columns)
    return query if after_key is None else query.where(after(columns, after_key))
