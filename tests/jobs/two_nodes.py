"""One process per node of a 2-node job (two torchrun node groups), saving the way a user does.

    torchrun --nnodes 2 --node_rank K --nproc_per_node 1 --master_addr 127.0.0.1 --master_port P \
        tests/jobs/two_nodes.py --path PATH [--path PATH2 ...] --out DIR

Saves a state whose tensor "w" rank 0 and rank 1 each hold half of (rank 1 also holds "b"), once
to each PATH (a root) in turn; prints "COMMITTED <path>" or "REFUSED <error>" and writes the same to
DIR/result_rank<r>_<i> for the i-th path. With node-local storage (memory:// with a BCP_MEMORY_DIR
of each node's own) bcp must refuse the save, naming the storage, instead of committing a
checkpoint some node cannot read; the job goes on to its next path.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

import bcp_core as bcp
from bcp_core.shards import Box, ShardedView
from bcp_core.storage.faults import Fault, inject


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--path", action="append", required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    full = torch.arange(8.0)
    half = full[4 * rank:4 * rank + 4]
    state = {"w": ShardedView((8,), torch.float32, [Box((4 * rank,), (4,), half)])}
    if rank == 1:
        state["b"] = torch.ones(3)
    for i, path in enumerate(args.path):
        _save_and_load(path, state, half, rank, os.path.join(args.out, f"result_rank{rank}_{i}"))
    dist.barrier()
    dist.destroy_process_group()


def _save_and_load(path: str, state: dict, half: torch.Tensor, rank: int, out: str) -> None:
    try:
        handle = bcp.save(path, state, step=1, async_save=True)
        result = f"COMMITTED {handle.wait()}"
    except bcp.SaveError as e:
        result = f"REFUSED {e}"
    if result.startswith("COMMITTED"):
        # a collective load: the metadata is read once per node (here each node has one process)
        reads = []
        target = {"w": ShardedView((8,), torch.float32, [Box((4 * rank,), (4,), torch.zeros(4))])}
        with inject(Fault("read_bytes", hook=lambda call: reads.append(call.path), path="*/bcp_metadata.json")):
            bcp.load(path, target, share_reads=True, strict=False)
        got = target["w"].boxes[0].view
        result += f"\nLOADED {torch.equal(got, half)} metadata_reads={len(reads)}"
    with open(out, "w") as f:
        f.write(result)
    print(result, flush=True)


if __name__ == "__main__":
    main()
