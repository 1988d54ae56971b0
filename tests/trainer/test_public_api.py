"""The trainer API: what ``auditor`` exports, the old import paths users have, and the
runnable examples in the entry points' docstrings."""

from __future__ import annotations

import doctest
import importlib
import subprocess
import sys

import pytest

import auditor

#: The trainer API, plus the read client ``Reader`` (notebooks, CI scripts) and its errors.
#: Changing it is an API change: update this list, the README and the docs.
TRAINER_API = [
    "AuditorClient", "NotFoundError", "Reader", "ReaderError", "audited_norm_sq", "audited_sum", "client_from_env", "distributed_masked_whiten",
    "masked_moments", "report_statistic", "set_device_mesh", "set_step", "set_topology", "step_context",
    "watch_replicas", "wrap_distributed_whiten",
]


def test_the_trainer_api_is_pinned():
    """``auditor.__all__`` is exactly the trainer API, and every name resolves."""
    assert sorted(auditor.__all__) == TRAINER_API
    for name in TRAINER_API:
        assert callable(getattr(auditor, name)), name


def test_importing_auditor_or_the_engine_does_not_import_torch():
    """The names resolve lazily: the service side never pays for torch."""
    code = "import sys, auditor, auditor.core, auditor.service; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("old, new", [
    ("auditor.client.AuditorClient", "auditor.trainer.client.AuditorClient"),
    ("auditor.client.client_from_env", "auditor.trainer.client.client_from_env"),
    ("auditor.torch_hooks.distributed_masked_whiten", "auditor.trainer.hooks.distributed_masked_whiten"),
    ("auditor.torch_hooks.masked_moments", "auditor.trainer.hooks.masked_moments"),
    ("auditor.torch_hooks.audited_sum", "auditor.trainer.hooks.audited_sum"),
    ("auditor.torch_hooks.audited_norm_sq", "auditor.trainer.hooks.audited_norm_sq"),
    ("auditor.torch_hooks.report_statistic", "auditor.trainer.hooks.report_statistic"),
    ("auditor.integrations.patch", "auditor.trainer.wrap.patch"),
    ("auditor.integrations.whiten.wrap_distributed_whiten", "auditor.trainer.wrap.wrap_distributed_whiten"),
    ("auditor.integrations.whiten.set_step", "auditor.trainer.wrap.set_step"),
    ("auditor.integrations.slime.set_step", "auditor.trainer.wrap.set_step"),
    ("auditor.integrations.slime.TARGET", "auditor.trainer.slime.TARGET"),
    ("auditor.integrations.megatron.coords_and_sizes", "auditor.trainer.megatron.coords_and_sizes"),
])
def test_old_import_paths_are_the_new_objects(old, new):
    """Code written against the old layout keeps working: each old name is the new object."""
    def resolve(path):
        module, _, name = path.rpartition(".")
        return getattr(importlib.import_module(module), name)

    assert resolve(old) is resolve(new)


@pytest.mark.parametrize("module", ["auditor.trainer.client", "auditor.trainer.hooks", "auditor.trainer.wrap", "auditor.reader"])
def test_docstring_examples_run(module):
    """Every example in the entry points' docstrings runs and prints what it shows."""
    result = doctest.testmod(importlib.import_module(module), optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0
