"""Run and statistic names on the wire: their patterns, bounds and the pydantic types that
carry them (DESIGN.md §3). A run id or a statistic is a URL path segment (a statistic may
span several, ``policy/grad_norm``), so a name is also refused when a part of it could not
be addressed (:func:`addressable`)."""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import AfterValidator, Field


def addressable(name: str) -> str:
    """``name`` if every ``/``-separated part of it holds a character other than ``.``, else
    ValueError: a run id or statistic is a URL path segment (a statistic may span several,
    ``policy/grad_norm``), and an empty, ``.`` or ``..`` part is dropped or resolved away
    by clients and proxies, so such a name could be stored but never read back."""
    parts = name.split("/")
    for part in parts:
        if not part.strip("."):
            if len(parts) == 1:  # a run id or workload (no '/'): say it of the whole name
                raise ValueError(f"{name!r} must hold a character other than '.' (an empty, '.' or '..' name "
                                 "cannot be addressed in a URL)")
            raise ValueError(f"{name!r}: every '/'-separated part must hold a character other than '.' "
                             "(no empty, '.' or '..' part: it cannot be addressed in a URL)")
    return name


#: Longest run id or statistic name, characters.
NAME_MAX = 128
RUN_ID_PATTERN = r"^[A-Za-z0-9._:-]+$"
STATISTIC_PATTERN = r"^[A-Za-z0-9._:/-]+$"
#: ``topology_source``: printable ASCII, at most 96 characters (DESIGN.md §3.1).
SOURCE_PATTERN = r"^[ -~]{1,96}$"
#: ``host``: a host name (letters, digits, ``.``, ``_``, ``:``, ``-``), at most 128 characters.
HOST_PATTERN = r"^[A-Za-z0-9._:-]{1,128}$"
RunId = Annotated[str, Field(min_length=1, max_length=NAME_MAX, pattern=RUN_ID_PATTERN), AfterValidator(addressable)]
StatisticName = Annotated[str, Field(min_length=1, max_length=NAME_MAX, pattern=STATISTIC_PATTERN),
                          AfterValidator(addressable)]


def search_pattern(pattern: str) -> str:
    """A pydantic pattern (Rust regex: ``$`` is the end of the text) for Python's
    ``re.search`` (where ``$`` also matches before a final newline): ``$`` becomes ``\\Z``."""
    assert pattern.startswith("^") and pattern.endswith("$")
    return pattern[:-1] + r"\Z"


RUN_ID_RE = re.compile(search_pattern(RUN_ID_PATTERN))
STATISTIC_RE = re.compile(search_pattern(STATISTIC_PATTERN))
SOURCE_RE = re.compile(search_pattern(SOURCE_PATTERN))
HOST_RE = re.compile(search_pattern(HOST_PATTERN))


def check_names(names, seen: set[str], rx: re.Pattern) -> None:
    """Raise ValueError unless every name (run ids, or statistics) matches its wire pattern
    ``rx`` and is :func:`addressable`; remember in ``seen`` those that do (at most 2^16)."""
    for name in names:
        if name not in seen:
            if rx.search(name) is None:
                raise ValueError(f"{name!r} does not match {rx.pattern}")
            addressable(name)
            if len(seen) >= 1 << 16:
                seen.clear()
            seen.add(name)
