"""Keyset pagination cursors of the listings (``GET /v1/runs``, a statistic's steps, a step's
rank rows, the runs page): opaque URL-safe base64 of the position's compact JSON, checked
shape and range on the way back in, so a cursor that is not one of ours is a 422 naming
``cursor``, never a query with its values."""

from __future__ import annotations

import base64
import binascii
import json
import math
import re
from typing import Any

from fastapi.exceptions import RequestValidationError

from auditor.contract.names import RUN_ID_PATTERN


def encode_cursor(value: Any) -> str:
    """An opaque pagination cursor: the keyset position as URL-safe base64 of compact JSON."""
    return base64.urlsafe_b64encode(json.dumps(value, separators=(",", ":")).encode()).decode().rstrip("=")


#: The largest step (the wire's bound, auditor.contract): a steps cursor holds a step.
MAX_STEP = 2**62
_RUN_ID_RE = re.compile(RUN_ID_PATTERN)


def step_key(v: Any) -> int:
    """The keyset position of a steps cursor: a step, an integer in [0, :data:`MAX_STEP`].
    Anything else raises ValueError (a value outside the column's range reached the
    database before: OverflowError on SQLite, DataError on PostgreSQL, a 500)."""
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= MAX_STEP:
        raise ValueError(f"not a step: {v!r}")
    return v


def rank_key(v: Any) -> tuple[int, int]:
    """The keyset position of a step's rank-rows cursor: ``[rank, microbatch]``, two
    non-negative integers. Anything else raises ValueError."""
    if (not isinstance(v, list) or len(v) != 2
            or any(isinstance(x, bool) or not isinstance(x, int) or not 0 <= x <= MAX_STEP for x in v)):
        raise ValueError(f"not a rank position: {v!r}")
    return v[0], v[1]


def runs_key(v: Any) -> tuple[float, str]:
    """The keyset position of a runs cursor: ``[created_at, run_id]``, a finite number and a
    run id of the wire's pattern. Anything else raises ValueError (a NUL or a lone
    surrogate in the run id, or a number beyond float range, failed in the driver: a 500)."""
    if not isinstance(v, list) or len(v) != 2:
        raise ValueError("not [created_at, run_id]")
    at, run_id = v
    if isinstance(at, bool) or not isinstance(at, (int, float)):
        raise ValueError(f"not a time: {at!r}")
    at = float(at)  # OverflowError for an integer beyond float range
    if not math.isfinite(at):
        raise ValueError(f"not a time: {at!r}")
    if not isinstance(run_id, str) or len(run_id) > 128 or not _RUN_ID_RE.fullmatch(run_id):
        raise ValueError(f"not a run id: {run_id!r}")
    return at, run_id


def decode_cursor(cursor: str | None, parse) -> Any:
    """The position of :func:`encode_cursor`'s ``cursor`` (``parse`` checks its shape and the
    range of each value: :func:`step_key`, :func:`runs_key`); a cursor that is not one of
    ours is a 422 naming ``cursor``, never a query with its values."""
    if not cursor:  # absent, or empty (`?cursor=`: the first page)
        return None
    try:
        return parse(json.loads(base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))))
    except (ValueError, TypeError, IndexError, KeyError, RecursionError, OverflowError, binascii.Error):
        raise RequestValidationError([{"loc": ("query", "cursor"), "type": "value_error", "input": cursor,
                                       "msg": "not a cursor of this listing: pass back the next_cursor of the "
                                              "previous page unchanged"}]) from None
