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


def _large_messages(rank, world_size):
    import torch.distributed as dist
    comm = Comm(tag="large", fan_in=1)  # rank 1 a leader too: messages pass through it
    big = "x" * (9 << 20)  # more than the store takes in one value (8 MiB with torch's libuv TCPStore)
    keys = []
    for i in range(2):
        got = comm.gather(big if rank == 2 else rank, f"g{i}", timedelta(seconds=10))
        assert got is None or got == [0, 1, big]
        assert comm.broadcast(big if rank == 0 else None, f"b{i}", timedelta(seconds=10)) == big
        assert comm.scatter([0, 1, big] if rank == 0 else None, f"s{i}", timedelta(seconds=10)) == [0, 1, big][rank]
        assert comm.all_gather(big if rank == 1 else rank, f"a{i}", timedelta(seconds=10)) == [0, big, 2]
        comm.barrier(f"done{i}", timedelta(seconds=10))
        keys.append(dist.distributed_c10d._get_default_store().num_keys())
    return keys


def test_messages_larger_than_the_store_takes_arrive_whole(tmp_path):
    """torch's TCPStore drops the connection of a client that sets a value over 8 MiB (the sender saw
    'Connection reset by peer', its thread's connection stayed broken, the others waited for it until
    their timeout): a large message goes in parts, which its one reader removes once read."""
    keys = run_ranks(3, _large_messages, timeout=120)
    assert keys[0][0] == keys[0][1], keys  # the store does not grow from one round to the next

