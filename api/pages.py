"""Pagination of list routes: a bounded ``limit`` and an opaque-enough ``after`` cursor.

A full page carries the cursor of the next one in ``X-Next-Cursor`` and an RFC 8288
``Link: <...>; rel="next"`` header; a short page is the last. Bodies stay plain lists.
"""

from __future__ import annotations

from collections.abc import Sequence

from fastapi import Request, Response


def link_next(request: Request, response: Response, items: Sequence[object], limit: int,
              cursor: str | int | None) -> None:
    """Point at the page after ``items`` when this one is full."""
    if len(items) < limit or cursor is None:
        return
    url = request.url.include_query_params(after=str(cursor), limit=limit)
    response.headers["X-Next-Cursor"] = str(cursor)
    response.headers["Link"] = f'<{url}>; rel="next"'
