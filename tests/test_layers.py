"""The package layers of README "How it works", checked by import-linter (contracts in
pyproject.toml): cli -> offline | server -> service -> db -> core; the trainer side imports
nothing of the service side; the engine is pure numpy; the store speaks no wire schema."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_import_contracts_are_kept(tmp_path):
    """``lint-imports`` reports every contract kept (exit 0)."""
    exe = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or "lint-imports"
    out = subprocess.run([exe, "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert "0 broken" in out.stdout


def test_every_package_is_installed():
    """pyproject's ``packages`` lists every package under ``auditor/`` (a non-editable
    install, e.g. the Docker image, ships only those)."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "auditor").rglob("__init__.py")}
    assert found <= listed, sorted(found - listed)
