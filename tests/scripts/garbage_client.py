"""Child of tests/cli/test_non_auditor_answers.py: one AuditorClient per URL given (argv[2:]),
each fed 50 reports, given 3 s and closed; prints {url: stats} as JSON. argv[1]: the
spool directory."""

import json
import logging
import sys
import time
from pathlib import Path

from auditor.trainer.client import AuditorClient

logging.basicConfig(level=logging.WARNING)
spool, urls = Path(sys.argv[1]), sys.argv[2:]
clients = {u: AuditorClient(u, timeout=1.0, flush_timeout=3.0, spool_after=0.5, max_backoff=0.2,
                            spool_dir=spool / str(i), rank=0) for i, u in enumerate(urls)}
for u, c in clients.items():
    for step in range(25):
        for rank in (0, 1):
            c.report({"run_id": "g", "statistic": "advantages", "step": step, "rank": rank, "world_size": 2,
                      "local": {"count": 2.0, "sum": 1.0, "sum_sq": 0.5},
                      "applied": {"count": 4.0, "sum": 2.0, "sum_sq": 1.0}})
time.sleep(3.0)  # every sender meets its server's garbage at once
for c in clients.values():
    c.close(timeout=0.0)
print(json.dumps({u: c.stats for u, c in clients.items()}))
