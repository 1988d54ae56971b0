"""The ``auditor`` command run as a user runs it: a child ``python -m auditor`` process."""

from __future__ import annotations

import os
import subprocess
import sys


def clean_environ() -> dict[str, str]:
    """This process's environment without its ``AUDITOR_*`` variables (a developer's
    ``AUDITOR_URL`` or token must not reach the command under test)."""
    return {k: v for k, v in os.environ.items() if not k.startswith("AUDITOR_")}


def run_auditor(*args: str, env: dict[str, str] | None = None, extra_env: dict[str, str] | None = None,
                clean: bool = False, cwd=None, timeout: float = 120.0, **kw) -> subprocess.CompletedProcess:
    """``python -m auditor ARGS`` in a child process, stdout and stderr captured as text;
    raises ``subprocess.TimeoutExpired`` past ``timeout`` seconds. ``env``: the child's whole
    environment (default this process's, without ``AUDITOR_*`` when ``clean``);
    ``extra_env``: variables set on top of it; ``kw``: :func:`subprocess.run`'s."""
    base = env if env is not None else clean_environ() if clean else dict(os.environ)
    return subprocess.run([sys.executable, "-m", "auditor", *args], capture_output=True, text=True, timeout=timeout,
                          env={**base, **(extra_env or {})}, cwd=cwd, **kw)
