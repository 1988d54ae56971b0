"""Old name of :mod:`auditor.trainer.hooks`: ``from auditor.torch_hooks import ...`` keeps working."""

from auditor.trainer.hooks import (  # noqa: F401
    audited_norm_sq, audited_sum, distributed_masked_whiten, masked_moments, report_statistic,
)
