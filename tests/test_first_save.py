"""The first asynchronous save of a replicated (DDP) state copies only what this rank writes, and the
next save reuses its staging buffers.

A first save stages lazily every box the rank holds, since the plan (which replica writes which
box) is agreed in the background. Once it is, the boxes given to other ranks need no copy, not even
when the next optimizer step comes before the writer took them: with 2 replicas, each rank copies
half the state. The second save stages only its assigned boxes; their buffers are those the first
save used, already faulted in (no fresh memory in a training step).

The race is forced: the writer waits at a gate until the optimizer step (bcp's guard) has run.
"""

from __future__ import annotations

import os
import threading
import time

import torch
from torch import nn

import bcp_core as bcp
from dist import run_ranks


def _job(rank, world_size, root):
    from bcp_core import checkpointer
    from bcp_core.storage.faults import Fault, inject

    torch.manual_seed(0)  # the same model on both ranks: every box is replicated
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 64))
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    state = {"model": model, "optimizer": opt}
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    expected = {k: v.clone() for k, v in model.state_dict().items()}

    gate = threading.Event()

    def gated(call):
        assert gate.wait(60), "the test never opened the gate"
    held = inject(Fault("open_writer", hook=gated, path="*/data/*"))  # the data files wait for the gate
    try:
        handle = bcp.save(root, state, step=1, async_save=True, role="first")
        job = checkpointer.get_checkpointer("first").queue.pending[-1].progress
        deadline = time.monotonic() + 60
        while job.agreed is None:  # the plan is agreed in the background
            assert time.monotonic() < deadline, "the plan was never agreed"
            time.sleep(0.01)
        model(torch.ones(2, 64)).sum().backward()
        opt.step()  # the guard: copies what this rank still has to write, before the update
        gate.set()
        handle.wait()
    finally:
        held.remove()
    first = job.snapshot.lazy.copied_bytes

    cp = checkpointer.get_checkpointer("first")
    first_buffers = {b.data_ptr() for slot in cp.snapshots.pool._slots if slot for b in slot}
    bcp.save(root, state, step=2, async_save=True, role="first").wait()
    second_buffers = {b.data_ptr() for slot in cp.snapshots.pool._slots if slot for b in slot}

    target = {"model": nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 64))}
    bcp.load(os.path.join(root, "step_00000001"), target)
    same = all(torch.equal(v, expected[k]) for k, v in target["model"].state_dict().items())
    return {"total": total, "first_copied": first, "reused": bool(second_buffers) and second_buffers <= first_buffers,
            "values_of_the_call": same}


def test_first_save_copies_only_its_share_and_the_next_reuses_the_buffers(tmp_path):
    for r in run_ranks(2, _job, str(tmp_path), timeout=120):
        assert r["values_of_the_call"]
        # each rank writes about half of the replicated parameters; it copies no more than that
        assert 0 < r["first_copied"] < r["total"], r
        assert r["reused"], r
