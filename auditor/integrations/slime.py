"""``import auditor.integrations.slime``: the old name of :mod:`auditor.trainer.slime`."""

from auditor.trainer.slime import PATCHED, TARGET, patch, set_step, step_context  # noqa: F401
