"""Redundant-read elimination: replicas read each byte range once across the job."""

from __future__ import annotations

import os


import bcp_core as bcp
from dist import run_ranks
from layouts import assert_same, build, full_state


def _load_counting_reads(rank, world_size, root):
    from bcp_core.storage import LocalStorage
    reads = []
    real = LocalStorage.read_into

    def counting(self, relpath, offset, out):
        reads.append((relpath, offset, offset + len(memoryview(out).cast("B"))))
        return real(self, relpath, offset, out)

    model, optim = build("fsdp2")  # saved sharded...
    bcp.save(os.path.join(root, "ck"), {"model": model, "optimizer": optim}).wait()
    ref = full_state(model, optim)
    LocalStorage.read_into = counting
    try:
        ddp, ddp_opt = build("ddp", seed=5)  # ...loaded replicated: both ranks need every byte
        bcp.load(os.path.join(root, "ck"), {"model": ddp, "optimizer": ddp_opt}, share_reads=True)
    finally:
        LocalStorage.read_into = real
    loaded = full_state(ddp, ddp_opt)
    if rank == 0:
        assert_same(ref, loaded, "fsdp2 -> ddp with shared reads")
    again, again_opt = build("ddp", seed=6)  # a second shared load must not see the first one's messages
    bcp.load(os.path.join(root, "ck"), {"model": again, "optimizer": again_opt}, share_reads=True)
    loaded = full_state(again, again_opt)
    if rank == 0:
        assert_same(ref, loaded, "second load with shared reads")
    return [r for r in reads if not r[0].endswith(".json")]


def test_each_byte_range_read_once_across_ranks(tmp_path):
    reads = run_ranks(2, _load_counting_reads, str(tmp_path))
    every = sorted(r for rank_reads in reads for r in rank_reads)
    assert every and all(rank_reads for rank_reads in reads)  # both ranks did part of the reading
    for a, b in zip(every, every[1:]):
        assert a[0] != b[0] or a[2] <= b[1], f"byte range read twice: {a} and {b}"
    md = bcp.inspect(str(tmp_path / "ck"))
    tensor_bytes = sum(p.nbytes for t in md.tensors.values() for p in t.pieces)
    assert sum(r[2] - r[1] for r in every) == tensor_bytes  # every saved byte read exactly once
