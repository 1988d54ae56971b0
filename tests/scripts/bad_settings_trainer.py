"""A small gloo trainer as a new user writes it (docs/integrations/torch_distributed.md):
`python newuser_trainer.py STEPS` spawns a world of 2 with `mp.spawn` (no RANK in the
environment), creates the client with `client_from_env()` from whatever AUDITOR_* the test
sets, whitens random advantages over WORLD with the audited hook for STEPS steps, and
prints one JSON line per rank: the client's counters, its url, and the median step time.
Warnings go to stderr through logging's last-resort handler, as in a trainer that
configures no logging (tests/trainer/test_bad_settings_fall_back.py)."""

import json
import os
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def work(rank: int, world: int, port: int, steps: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from auditor import client_from_env, distributed_masked_whiten

    client = client_from_env()
    g = torch.Generator().manual_seed(rank)
    times = []
    for step in range(steps):
        adv = torch.randn(4, 64, generator=g)
        mask = (torch.rand(4, 64, generator=g) > 0.3).float()
        t = time.perf_counter()
        distributed_masked_whiten(adv, mask, process_group=dist.group.WORLD, client=client, step=step)
        times.append(time.perf_counter() - t)
    client.close()
    times.sort()
    line = json.dumps({"rank": rank, "stats": client.stats, "url": client.url, "file_only": client.file_only,
                       "max_queue": client.max_queue, "flush_timeout": client.flush_timeout,
                       "step_median_ms": 1e3 * times[len(times) // 2]})
    os.write(1, (line + "\n").encode())  # one write: the two ranks' lines never interleave
    dist.destroy_process_group()


if __name__ == "__main__":
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    mp.spawn(work, args=(2, port, int(sys.argv[1])), nprocs=2)
