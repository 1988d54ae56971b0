"""Issue 24: no hook reads a tensor value on the training thread, and the reports the
client's sender thread builds carry exactly the values the hooks sent before (bit for bit,
``hook_reports.json``, made by the hooks that read the values on the training thread)."""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path

import pytest
import torch

from auditor.testing import count_host_syncs, no_host_sync

sys.path.insert(0, str(Path(__file__).parent))
import hook_cases  # noqa: E402


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """Every hook of :mod:`hook_cases` on two gloo ranks, without and with a client."""
    return hook_cases.run_world(str(tmp_path_factory.mktemp("spool")))


@pytest.mark.multiprocess
def test_reports_built_on_the_sender_thread_are_bit_identical(world):
    """Each wire dict equals the one the hooks sent when they read the values on the
    training thread; floats compared by their bits (JSON's ``repr`` round-trips a float)."""
    old = json.loads(hook_cases.FIXTURE.read_text())
    for rank, (was, now) in enumerate(zip(old, world, strict=True)):
        assert len(now["reports"]) == len(was) == 29, rank
        for a, b in zip(was, now["reports"]):
            assert json.dumps(b, sort_keys=True) == json.dumps(a, sort_keys=True), (rank, a["step"])
        assert (now["stats"]["spooled"], now["stats"]["dropped"], now["stats"]["reports_dropped"]) == (29, 0, 0)


@pytest.mark.multiprocess
def test_no_hook_adds_a_host_sync(world):
    """Every hook makes exactly the host reads of the call without the auditor: the
    whitening's own (the empty-group check; the slime-style function's ``.item()``), none
    for the collectives; ``report_statistic`` none at all."""
    for rank in (0, 1):
        syncs = world[rank]["syncs"]
        assert len(syncs) == 25
        added = {name: counts[-1] - counts[0] for name, counts in syncs.items() if len(counts) == 2}
        assert added == dict.fromkeys(added, 0), (rank, syncs)
        assert syncs["report-statistic"] == [0]
        own = {name: counts[0] for name, counts in syncs.items()}
        assert own["sum-microbatches"] == own["norm-tensor"] == own["wrap-bound-fallback"] == 0
        assert own["whiten-f32"] == own["wrap-slime-f32"] == own["wrap-auditor-own"] == 1


def test_no_host_sync_catches_every_kind_of_host_read():
    """Each way of reading a tensor value is one sync; device-only work is none; another
    thread is not watched; ``allowed`` lets a block's own syncs through."""
    t = torch.arange(6.0)
    reads = [lambda: t.sum().item(), lambda: float(t[0]), lambda: int(t.argmax()), lambda: bool(t.any()),
             lambda: t.tolist(), lambda: t.numpy(), lambda: t[t > 2], lambda: t.nonzero(),
             lambda: torch.masked_select(t, t > 1), lambda: t.unique(), lambda: torch.equal(t, t),
             lambda: t.repeat_interleave(torch.tensor([1, 2, 0, 1, 1, 1])), lambda: t.clone().__setitem__(t > 3, 0.0)]
    for read in reads:
        with count_host_syncs() as seen:
            read()
        assert seen.count == 1, (seen.ops, read)
        assert "test_hook_syncs.py" in seen.where[0]
    with no_host_sync():
        m = t > 2
        torch.where(m, t, torch.inf).amin()
        t.take(torch.where(m, t, -torch.inf).argmax())
        t[1:3].sum() * 2
        threading.Thread(target=lambda: t.sum().item()).start()  # not this thread
    with no_host_sync(allowed=1):
        float(t.sum())
    with pytest.raises(AssertionError, match=r"2 host syncs on this thread \(allowed 1\)"):
        with no_host_sync(allowed=1):
            float(t.sum())
            t.tolist()
