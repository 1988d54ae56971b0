"""A torchrun job with no run id configured (tests/test_torchrun_jobs.py).

`torchrun --nproc-per-node 2 --master-port P torchrun_job.py {correct|buggy}` with AUDITOR_URL
and AUDITOR_TOPOLOGY=cp=2 in the environment, and neither AUDITOR_RUN_ID nor --rdzv-id (so
torchrun sets TORCHELASTIC_RUN_ID=none): the two ranks hold the reference case's CP slices
and whiten them over WORLD (correct) or each over itself (the seed's bug), through the
audited hook without run_id=.
"""

import sys

import torch
import torch.distributed as dist

from auditor.client import client_from_env
from auditor.torch_hooks import distributed_masked_whiten

ADVANTAGES = (1.5, -0.5, -1.0)
TOKENS = ((16, 40, 9), (32, 50, 3))  # DESIGN.md §4: tokens per sequence on CP rank 0 / 1


def main(mode: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    values = torch.tensor([a for a, n in zip(ADVANTAGES, TOKENS[rank]) for _ in range(n)])
    mask = torch.ones_like(values)
    own = [dist.new_group([0]), dist.new_group([1])][rank]
    client = client_from_env()
    for step in range(2):
        distributed_masked_whiten(values, mask, process_group=None if mode == "correct" else own,
                                  client=client, step=step)
    client.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
