"""The external tools the test suite needs (``scripts/setup.sh --test`` installs them): a
missing one fails the test naming its package, never skips it."""

from __future__ import annotations

import shutil


def require_tool(executable: str, package: str) -> str:
    """The path of ``executable`` on PATH; when it is missing, fail the calling test naming
    the Debian ``package`` and ``scripts/setup.sh --test``."""
    path = shutil.which(executable)
    if path is None:
        import pytest

        pytest.fail(f"{executable} not found on PATH: run scripts/setup.sh --test (installs the Debian package "
                    f"'{package}')")
    return path
