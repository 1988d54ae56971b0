"""A framework's regression test of advantage whitening under context parallelism, audited by
``auditor.pytest_plugin`` (the case of slime PR #2235; docs/pytest-plugin.md).

Two gloo ranks with Megatron-core groups (cp=2) hold the zigzag CP slices of the reference
sequences and whiten them over ``get_data_parallel_group()`` (the bug: CP excluded) or over
``get_data_parallel_group(with_context_parallel=True)`` (the fix). The ranks only report —
through the client ``AUDITOR_URL`` configures, set by the ``audited`` marker — and the
plugin fails the buggy case with the auditor's diagnosis.
"""

import os
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from auditor import client_from_env, distributed_masked_whiten
from auditor.demo import REFERENCE_SAMPLES, local_batch
from auditor.server import free_port


def whiten_on_rank(rank: int, world: int, port: int, with_cp: bool) -> None:
    from megatron.core import parallel_state as ps

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    ps.initialize_model_parallel(context_parallel_size=2)
    try:
        batch = local_batch(REFERENCE_SAMPLES, 1, 2, 0, ps.get_context_parallel_rank())
        client = client_from_env()  # AUDITOR_URL: the plugin's service
        distributed_masked_whiten(torch.from_numpy(batch.values), torch.from_numpy(batch.mask),
                                  process_group=ps.get_data_parallel_group(with_context_parallel=with_cp),
                                  client=client, run_id=f"grpo-{'fixed' if with_cp else 'buggy'}",
                                  statistic="advantages", step=0)
        client.close()  # flush (also done at exit)
    finally:
        ps.destroy_model_parallel()
        dist.destroy_process_group()


@pytest.mark.audited
@pytest.mark.parametrize("with_cp", [False, True], ids=["buggy", "fixed"])
def test_cp_whitening(with_cp):
    ctx = mp.spawn(whiten_on_rank, args=(2, free_port(), with_cp), nprocs=2, join=False)
    deadline = time.monotonic() + 120  # bounded join: a hang fails instead of stalling CI
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail("ranks did not finish within 120 s")
