"""Bounded waits for tests, benchmarks and the demo: poll a condition, fail after a deadline."""

from __future__ import annotations

import time
from typing import Callable, TypeVar

T = TypeVar("T")


def wait_until(fn: Callable[[], T], timeout: float = 30.0, what: str = "condition", interval: float = 0.1) -> T:
    """Call ``fn`` every ``interval`` seconds until it returns a truthy value, and return it.

    Raises
    ------
    AssertionError
        ``fn`` stayed falsy for ``timeout`` seconds (the message names ``what``).
    """
    deadline = time.monotonic() + timeout
    while True:
        value = fn()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(interval)
