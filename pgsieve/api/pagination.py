"""One list convention for every collection: ``limit`` and ``cursor``, the body an array,
``Link: <…>; rel="next"`` while more remain (as GitHub's API does).

A cursor is opaque to clients: base64url of the JSON list of the last item's sort key
(with a unique tie-breaker, so a page boundary never splits or repeats rows with equal
sort values). Paging is by key, not by offset: an item inserted or deleted while a client
pages does not shift the rest, and every item present throughout is returned exactly
once. A cursor that does not decode is 400 ``invalid_cursor``; ``limit`` above the
route's maximum is refused (422 ``validation_error``), never silently clamped.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Annotated, Any, TypeVar

from fastapi import Depends, Query, Request, Response
from sqlalchemy import Select, and_, or_
from sqlalchemy.orm import InstrumentedAttribute, Session
from sqlalchemy.sql.elements import ColumnElement

from pgsieve.platform.errors import ErrorCode, PgsieveError

T = TypeVar("T")

DEFAULT_LIMIT = 500
"""Collections' default page size: above what any of them held before pagination, so a
client that ignores ``Link`` sees what it saw before."""
MAX_LIMIT = 1000
CURSOR_MAX_CHARS = 1024

LINK_HEADER_DOC = {
    "Link": {
        "description": 'RFC 8288 `<URL>; rel="next"` while more items remain (the URL has '
                       "`cursor` and `limit` set); absent on the last page",
        "schema": {"type": "string"},
    }
}

Key = tuple[Any, ...]


class InvalidCursor(PgsieveError):
    def __init__(self) -> None:
        super().__init__("the cursor is not one this API gave out: take it from a Link "
                         'rel="next" header, unchanged', code=ErrorCode.INVALID_CURSOR,
                         status=400, title="Invalid cursor")


def _encode_value(value: Any) -> Any:
    if isinstance(value, datetime):
        return {"t": value.isoformat()}
    return value


def _decode_value(value: Any) -> Any:
    if isinstance(value, dict):
        if set(value) != {"t"} or not isinstance(value["t"], str):
            raise InvalidCursor()
        try:
            return datetime.fromisoformat(value["t"])
        except ValueError:
            raise InvalidCursor() from None
    if value is None or isinstance(value, str | int | float | bool):
        return value
    raise InvalidCursor()


def encode_cursor(key: Key) -> str:
    raw = json.dumps([_encode_value(v) for v in key], separators=(",", ":"))
    return base64.urlsafe_b64encode(raw.encode()).decode().rstrip("=")


def decode_cursor(cursor: str, arity: int) -> Key:
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        values = json.loads(raw)
    except (binascii.Error, ValueError, UnicodeDecodeError):
        raise InvalidCursor() from None
    if not isinstance(values, list) or len(values) != arity:
        raise InvalidCursor()
    return tuple(_decode_value(v) for v in values)


@dataclass(frozen=True)
class Page:
    """A request's page: its ``limit``, the cursor it came with, and how to answer."""

    limit: int
    cursor: str | None
    request: Request
    response: Response

    def after(self, arity: int) -> Key | None:
        """The previous page's last key (``None`` on the first page)."""
        return None if self.cursor is None else decode_cursor(self.cursor, arity)

    def finish(self, rows: Sequence[T], key: Callable[[T], Key]) -> list[T]:
        """``rows`` are up to ``limit + 1`` items from the cursor on: the first ``limit``,
        and a ``Link rel=next`` header when there were more."""
        out = list(rows[:self.limit])
        if len(rows) > self.limit and out:
            self.set_next(encode_cursor(key(out[-1])))
        return out

    def set_next(self, cursor: str) -> None:
        url = self.request.url.include_query_params(cursor=cursor, limit=self.limit)
        self.response.headers["Link"] = f'<{url}>; rel="next"'

    # ---------------------------------------------------------------------------------

    def of_list(self, items: Sequence[T], key: Callable[[T], Key], arity: int) -> list[T]:
        """A page of an in-memory list in ascending ``key`` order (a tuple of ``arity``
        values; collections read live from a source: slots, publications). The items are
        sorted here by Python's comparison, the one the cursor is compared by (a
        database's collation may order names otherwise)."""
        after = self.after(arity)
        items = sorted(items, key=lambda i: _comparable(key(i)))
        if after is not None:
            items = [i for i in items if _comparable(key(i)) > _comparable(after)]
        return self.finish(items[:self.limit + 1], key)

    def of_query(self, session: Session, stmt: Select[T],
                 columns: Sequence[InstrumentedAttribute[Any]], *,
                 descending: bool = False) -> list[T]:
        """A page of ``stmt`` ordered by ``columns`` (ascending, or all descending); the
        columns together are unique, and each row's key is read from its attributes."""
        after = self.after(len(columns))
        if after is not None:
            stmt = stmt.where(_beyond(columns, after, descending))
        order = [c.desc() if descending else c.asc() for c in columns]
        rows = list(session.scalars(stmt.order_by(*order).limit(self.limit + 1)))
        names = [c.key for c in columns]
        return self.finish(rows, lambda r: tuple(getattr(r, n) for n in names))


def _comparable(key: Key) -> tuple[tuple[bool, Any], ...]:
    return tuple((v is not None, v) for v in key)


def _beyond(columns: Sequence[InstrumentedAttribute[Any]], after: Key,
            descending: bool) -> ColumnElement[bool]:
    """Rows after ``after`` in the order: (a > x) OR (a = x AND b > y) OR …"""
    clauses = []
    for i, column in enumerate(columns):
        equal = [columns[j] == after[j] for j in range(i)]
        step = column < after[i] if descending else column > after[i]
        clauses.append(and_(*equal, step))
    return or_(*clauses)


def paged(default: int = DEFAULT_LIMIT, maximum: int = MAX_LIMIT
          ) -> Callable[..., Page]:
    """The ``limit`` / ``cursor`` dependency of a collection route."""

    def page(
        request: Request,
        response: Response,
        # (the closure's bounds are defaults, not annotations: annotations are strings here)
        limit: int = Query(
            default, ge=1, le=maximum,
            description=f"items per page (default {default}, at most {maximum}; more is "
                        "a 422)"),
        cursor: str | None = Query(
            None, max_length=CURSOR_MAX_CHARS,
            description='where the page starts: from the previous page\'s `Link: <…>; '
                        'rel="next"` header, unchanged'),
    ) -> Page:
        return Page(limit=limit, cursor=cursor, request=request, response=response)

    return page


PageDep = Annotated[Page, Depends(paged())]
"""A collection's ``limit`` (default :data:`DEFAULT_LIMIT`, at most :data:`MAX_LIMIT`)
and ``cursor``."""
