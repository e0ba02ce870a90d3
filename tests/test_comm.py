"""Planning messages: ordering, and a clear error instead of a hang when a rank never arrives."""

from __future__ import annotations

import os
from datetime import timedelta

import pytest
import torch

import bcp_core as bcp
from bcp_core.comm import Comm
from dist import mark, run_ranks, wait_for_file


def _exchange_and_timeout(rank, world_size, root):
    comm = Comm(tag="test")
    assert comm.gather({"r": rank}, "plan") == ([{"r": r} for r in range(world_size)] if rank == 0 else None)
    assert comm.broadcast({"x": 1} if rank == 0 else None, "bcast") == {"x": 1}
    assert comm.all_gather(rank * 10, "allgather") == [r * 10 for r in range(world_size)]
    # rank 2 never joins the save: ranks 0 and 1 get an error naming it (and the phase) in time. Only
    # the coordinator's 3 s are tested, and it starts waiting once rank 1 is in the save (an event);
    # rank 1 waits up to 60 s for the answer naming rank 2.
    if rank == 2:
        return "skipped"
    called = os.path.join(root, "rank1_called")
    with pytest.raises(bcp.SaveError, match=r"rank\(s\) \[2\] that never arrived"):
        if rank == 1:
            handle = bcp.save(root, {"w": torch.ones(4)}, role="timeout", async_save=True,
                              timeout=timedelta(seconds=60))
            mark(called)
            handle.wait()
        else:
            wait_for_file(called)
            bcp.save(root, {"w": torch.ones(4)}, role="timeout", timeout=timedelta(seconds=3))
    return "raised"


def test_missing_rank_is_named_instead_of_hanging(tmp_path):
    assert run_ranks(3, _exchange_and_timeout, str(tmp_path), timeout=120) == ["raised", "raised", "skipped"]
