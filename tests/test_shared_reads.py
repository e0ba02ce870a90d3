"""Shared reads: replicas read each byte range once across hosts; on one host each checksum block
is verified once."""

from __future__ import annotations

import os

import pytest
import torch

import bcp_core as bcp
from dist import run_ranks
from layouts import assert_same, build, full_state

ROWS, COLS = 4096, 1024  # 16 MiB of float32: each rank's Shard(0) piece is two 4 MiB checksum blocks


def _counting(cls_or_module, name, log, key):
    real = getattr(cls_or_module, name)

    def counting(*args):
        log.append(key(*args))
        return real(*args)
    setattr(cls_or_module, name, counting)
    return real


def _byte_sharing(rank, root) -> list:
    """Each rank on a host of its own: replicas need every byte, and each range is read once."""
    from bcp_core import shared_reads
    from bcp_core.load_config import LOAD_CONFIG, configure_load
    from bcp_core.storage.faults import Fault, inject

    window, budget = LOAD_CONFIG.transfer_window_bytes, LOAD_CONFIG.buffer_bytes
    model, optim = build("fsdp2")  # saved sharded...
    bcp.save(os.path.join(root, "ck"), {"model": model, "optimizer": optim}).wait()
    ref = full_state(model, optim)
    host = shared_reads._host
    shared_reads._host = lambda comm: f"host{rank}"
    reads: list = []
    try:
        ddp, ddp_opt = build("ddp", seed=5)  # ...loaded replicated: both ranks need every byte
        with inject(Fault("read_into", hook=lambda c: reads.append((c.path, c.offset, c.offset + c.nbytes)))):
            bcp.load(os.path.join(root, "ck"), {"model": ddp, "optimizer": ddp_opt}, share_reads=True)
        if rank == 0:
            assert_same(ref, full_state(ddp, ddp_opt), "fsdp2 -> ddp with shared reads")
        # A second shared load must not see the first one's messages. With a transfer window of one
        # byte each range travels alone (in the same order on both ranks, so the windows cannot
        # deadlock); with no buffer budget every received range is verified, dropped, and read again
        # into place once both ranks have verified everything.
        configure_load(transfer_window_bytes=1, buffer_bytes=0)
        again, again_opt = build("ddp", seed=6)
        bcp.load(os.path.join(root, "ck"), {"model": again, "optimizer": again_opt}, share_reads=True)
        if rank == 0:
            assert_same(ref, full_state(again, again_opt), "second load with shared reads")
    finally:
        shared_reads._host = host
        configure_load(transfer_window_bytes=window, buffer_bytes=budget)
    return [r for r in reads if not r[0].endswith(".json")]


def _verification_sharing(rank, root) -> dict:
    """One host, Shard(0) saved and Shard(1) loaded: each rank needs half of every block."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from bcp_core.engine import read as engine_read  # where the load's verification looks its checksum up
    from bcp_core.errors import ChecksumError

    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    full = torch.randn(ROWS, COLS)
    path = os.path.join(root, "resharded")
    bcp.save(path, {"w": distribute_tensor(full, mesh, [Shard(0)])}).wait()
    out: dict = {}
    # share_reads=None (default) shares: the target holds a DTensor over the whole group
    for share in (False, True, None, "plain"):
        target = {"w": distribute_tensor(torch.zeros(ROWS, COLS), mesh, [Shard(1)])}
        if share == "plain":  # plain tensors on one host: by default each rank loads on its own
            target = {"w": torch.zeros(ROWS, COLS)}
        hashed: list = []
        real = _counting(engine_read, "checksum", hashed, lambda data: len(data))
        try:
            bcp.load(path, target, share_reads=None if share == "plain" else share)
        finally:
            engine_read.checksum = real
        expected = full if share == "plain" else full[:, rank * COLS // 2:(rank + 1) * COLS // 2]
        got = target["w"] if share == "plain" else target["w"].to_local()
        assert torch.equal(got, expected), f"rank {rank}, share_reads={share!r}: loaded values differ"
        out[f"hashed_bytes_shared_{share}"] = sum(hashed)
    # One flipped byte: whichever rank verifies that block, every rank fails the load. The plain load
    # above is each rank's own, so wait for both before touching the file.
    dist.barrier()
    md = bcp.inspect(path)
    piece = md.tensors["w"].pieces[1]
    if rank == 0:
        with open(os.path.join(path, md.files[piece.file]), "r+b") as f:
            f.seek(piece.byte_offset + 5 * (1 << 20))  # in the piece's second block
            b = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([b[0] ^ 0x10]))
    dist.barrier()
    try:
        bcp.load(path, {"w": distribute_tensor(torch.zeros(ROWS, COLS), mesh, [Shard(1)])}, share_reads=True)
    except ChecksumError as e:
        out["corrupt_error"] = str(e)
    return out


def _scenarios(rank, world_size, root):
    return {"reads": _byte_sharing(rank, root), **_verification_sharing(rank, root)}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("shared_reads")
    return root, run_ranks(2, _scenarios, str(root))


def test_each_byte_range_read_once_across_hosts(results):
    root, per_rank = results
    reads = [r["reads"] for r in per_rank]
    every = sorted(r for rank_reads in reads for r in rank_reads)
    assert every and all(reads)  # both ranks did part of the reading
    for a, b in zip(every, every[1:]):
        assert a[0] != b[0] or a[2] <= b[1], f"byte range read twice: {a} and {b}"
    md = bcp.inspect(str(root / "ck"))
    tensor_bytes = sum(p.nbytes for t in md.tensors.values() for p in t.pieces)
    assert sum(r[2] - r[1] for r in every) == tensor_bytes  # every saved byte read exactly once


def test_each_block_verified_once_on_one_host_by_default_for_dtensors(results):
    _, per_rank = results
    total = ROWS * COLS * 4
    # without sharing both ranks hash the whole checkpoint (each needs half of every block) ...
    assert [r["hashed_bytes_shared_False"] for r in per_rank] == [total, total]
    # ... with it, each block is hashed by one rank, and the work is split evenly
    assert [r["hashed_bytes_shared_True"] for r in per_rank] == [total // 2, total // 2]
    # the default shares for DTensors over the whole group, not for plain tensors
    assert [r["hashed_bytes_shared_None"] for r in per_rank] == [total // 2, total // 2]
    assert [r["hashed_bytes_shared_plain"] for r in per_rank] == [total, total]


def test_a_corrupted_block_fails_the_load_on_every_rank(results):
    _, per_rank = results
    errors = [r.get("corrupt_error") for r in per_rank]
    assert all(errors), errors
    own = [e for e in errors if e.startswith("checksum mismatch")]
    told = [e for e in errors if e.startswith("rank ") and "checksum mismatch" in e]
    assert len(own) == 1 and len(told) == 1, errors


def test_a_block_is_verified_once_per_host_by_a_rank_of_that_host():
    """Four ranks read the same two blocks: on one host each block is verified by one rank; on two
    hosts (nodes simulated on one machine, memory:// copies of their own) once on each, never by a
    rank of the other host."""
    from bcp_core.shared_reads import block_owners
    wanted = [[(0, 0, 0, 2, 8)]] * 4  # file 0, its piece at offset 0: blocks 0 and 1 of 4 bytes
    one = [block_owners(wanted, ["h#0"] * 4, me, 4) for me in range(4)]
    assert one[0] == one[3] and sorted(one[0].values()) == [0, 1]
    two = ["h#0", "h#0", "h#1", "h#1"]
    for me in range(4):
        owners = block_owners(wanted, two, me, 4)
        assert set(owners) == {(0, 0, 0), (0, 0, 1)} and all(two[r] == two[me] for r in owners.values()), (me, owners)
