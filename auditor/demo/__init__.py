"""The reference case and fault injection, run for real on gloo worlds.

:mod:`~auditor.demo.reference` — slime PR #2235 (GRPO advantage whitening under CP) end to
end (``auditor demo``), and at several layouts compared (:mod:`~auditor.demo.layouts`,
``auditor demo --layouts``); :mod:`~auditor.demo.faults` — every fault kind of DESIGN.md §5
injected by real ranks into a live service (``benchmarks/fault_matrix.py``).
"""

from auditor.demo.reference import (  # noqa: F401
    DEFAULT_TIMEOUT, REFERENCE_REWARDS, REFERENCE_SAMPLES, REFERENCE_SHAPES, DemoResult, LocalBatch, RankResult, Sample,
    cp_response_mask, cp_response_token_counts, dp_rank_of, grpo_advantages, local_batch, run_demo, run_workers,
    whiten_reference, zigzag_chunks,
)
