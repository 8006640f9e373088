"""Pagination of list routes: a bounded ``limit`` and an opaque-enough ``after`` cursor.

A full page carries the cursor of the next one in ``X-Next-Cursor`` and an RFC 8288
``Link: <...>; rel="next"`` header; a short page is the last. Bodies stay plain lists.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Sequence

from fastapi import Request, Response

from ringwatch.services.errors import BadInput


def link_next(request: Request, response: Response, items: Sequence[object], limit: int,
              cursor: str | int | None) -> None:
    """Point at the page after ``items`` when this one is full."""
    if len(items) < limit or cursor is None:
        return
    url = request.url.include_query_params(after=str(cursor), limit=limit)
    response.headers["X-Next-Cursor"] = str(cursor)
    response.headers["Link"] = f'<{url}>; rel="next"'


def encode_cursor(parts: Sequence[str]) -> str:
    """A cursor of several keys (a keyset position), safe in a query string."""
    return base64.urlsafe_b64encode(json.dumps(list(parts)).encode()).decode().rstrip("=")


def decode_cursor(text: str, n: int) -> tuple[str, ...]:
    """The ``n`` keys of a cursor ``encode_cursor`` made; a 422 for anything else."""
    try:
        parts = json.loads(base64.urlsafe_b64decode(text + "=" * (-len(text) % 4)))
        if isinstance(parts, list) and len(parts) == n and all(isinstance(p, str) for p in parts):
            return tuple(parts)
    except (ValueError, binascii.Error):
        pass
    raise BadInput("after: not a cursor this API gave (use X-Next-Cursor as it came)")
