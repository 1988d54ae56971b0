"""Old home of the trainer integrations, kept so that existing imports keep working.

Everything moved to :mod:`auditor.trainer`: ``auditor.integrations.patch`` is
:func:`auditor.trainer.wrap.patch`, ``auditor.integrations.whiten`` is
:mod:`auditor.trainer.wrap`, ``auditor.integrations.megatron`` is
:mod:`auditor.trainer.megatron`, ``import auditor.integrations.slime`` is
``import auditor.trainer.slime``.
"""

from auditor.trainer.wrap import patch  # noqa: F401
