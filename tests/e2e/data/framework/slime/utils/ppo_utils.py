"""The advantage step of a Megatron-based RL trainer: whiten the GRPO advantages of this rank's
CP slices over the data-parallel group, taken from ``megatron.core.mpu`` at call time (so a
test's stub, or the audited wrapper patched in by ``import auditor.trainer.slime``, is used)."""

from megatron.core import mpu

from slime.utils import distributed_utils


def whiten_advantages(values, mask, with_context_parallel: bool):
    """``with_context_parallel=False`` is slime's bug (PR #2235): the group excludes the CP
    peers holding the other slices of the same sequences."""
    group = mpu.get_data_parallel_group(with_context_parallel=with_context_parallel)
    return distributed_utils.distributed_masked_whiten(values, mask, process_group=group)
