"""Save stall of an FSDP1 model: bcp's decomposed flat shards vs DCP with SHARDED_STATE_DICT.

The stall is the time from the save call until the training loop may continue:
  bcp        bcp.save(..., async_save=True) returning (plan + copy of this rank's boxes)
  bcp_sync   bcp.save(...) returning (everything durable and committed)
  dcp_sync   FSDP SHARDED_STATE_DICT model + optimizer state dicts, then dcp.save
  dcp_async  the same state dicts, then dcp.async_save returning
The same model and optimizer state are saved by every method in one run, several times each; the
median of each rank's stall is taken and the slowest rank reported. Prints one JSON object with
the table and the ratios of DCP's stalls to bcp's.

    python bench/fsdp1_stall.py --ranks 2 --layers 8 --width 1024 --repeats 3

Runs on CPU with gloo (FSDP1 with device_id=cpu) or, with --device cuda, one GPU per rank with NCCL.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import socket
import statistics
import tempfile
import time
import warnings
from datetime import timedelta


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _model(layers: int, width: int):
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.up = nn.Linear(width, 2 * width + 3)  # odd sizes: parameters straddle shard edges
            self.down = nn.Linear(2 * width + 3, width)
            self.norm = nn.LayerNorm(width)

        def forward(self, x):
            return self.norm(x + self.down(torch.relu(self.up(x))))

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(Block() for _ in range(layers))
            self.out = nn.Linear(width, 1)

        def forward(self, x):
            for b in self.blocks:
                x = b(x)
            return self.out(x)

    return Model()


def _worker(rank, world, port, args, root, queue):
    import torch
    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    try:
        cuda = args.device == "cuda"
        if cuda:
            torch.cuda.set_device(rank)
        dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world,
                                timeout=timedelta(minutes=10))
        queue.put((rank, "ok", _run(rank, world, args, root, cuda)))
    except BaseException:  # noqa: BLE001 - reported to the parent
        import traceback
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _run(rank, world, args, root, cuda):
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import ShardedOptimStateDictConfig, ShardedStateDictConfig, StateDictType

    import bcp_core as bcp

    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    torch.manual_seed(0)
    model = _model(args.layers, args.width)
    # A device mesh lets FSDP1's sharded state dict hold DTensors, which DCP's async stager can
    # copy (it cannot copy the ShardedTensors FSDP1 gives without one).
    mesh = init_device_mesh(device.type, (world,))
    kw = dict(device_id=device, use_orig_params=args.use_orig_params, device_mesh=mesh)
    for i, block in enumerate(model.blocks):
        model.blocks[i] = FSDP(block, **kw)
    model = FSDP(model, **kw)
    optim = torch.optim.Adam(model.parameters(), lr=1e-3)
    x = torch.randn(4, args.width, device=device)
    model(x).sum().backward()
    optim.step()  # the optimizer state exists, as in a real job
    dcp_pg = dist.new_group(backend="gloo") if cuda else None  # DCP's async_save wants a CPU group

    def sync():
        if cuda:
            torch.cuda.synchronize()
        dist.barrier()

    def dcp_state():
        with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT,
                                  ShardedStateDictConfig(_use_dtensor=True),
                                  ShardedOptimStateDictConfig(_use_dtensor=True)):
            return {"model": model.state_dict(), "optim": FSDP.optim_state_dict(model, optim)}

    stalls: dict[str, list[float]] = {k: [] for k in ("bcp", "bcp_sync", "dcp_sync", "dcp_async")}
    totals: dict[str, list[float]] = {k: [] for k in stalls}
    for rep in range(args.repeats + 1):  # the first round warms up (plan caches, process groups)
        for method in stalls:
            path = os.path.join(root, f"{method}_{rep}")
            sync()
            t0 = time.perf_counter()
            if method == "bcp":
                handle = bcp.save(path, {"model": model, "optimizer": optim}, async_save=True)
                stall = time.perf_counter() - t0
                handle.wait()
            elif method == "bcp_sync":
                bcp.save(path, {"model": model, "optimizer": optim})
                stall = time.perf_counter() - t0
            elif method == "dcp_sync":
                dcp.save(dcp_state(), checkpoint_id=path)
                stall = time.perf_counter() - t0
            else:
                future = dcp.async_save(dcp_state(), checkpoint_id=path, process_group=dcp_pg)
                stall = time.perf_counter() - t0
                future.result()
            total = time.perf_counter() - t0
            sync()
            if rep:
                stalls[method].append(stall)
                totals[method].append(total)
            if rank == 0:
                shutil.rmtree(path, ignore_errors=True)
    return {"stall": {k: statistics.median(v) for k, v in stalls.items()},
            "total": {k: statistics.median(v) for k, v in totals.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--use-orig-params", action="store_true")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--dir", default=None, help="where checkpoints are written (default: a temp dir)")
    args = ap.parse_args()

    root = tempfile.mkdtemp(prefix="bcp_fsdp1_bench_", dir=args.dir)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, args.ranks, port, args, root, queue)) for r in range(args.ranks)]
    for p in procs:
        p.start()
    results = {}
    try:
        while len(results) < args.ranks:
            rank, status, value = queue.get(timeout=3600)
            if status != "ok":
                raise SystemExit(f"rank {rank} failed:\n{value}")
            results[rank] = value
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
        shutil.rmtree(root, ignore_errors=True)
    stall = {k: max(results[r]["stall"][k] for r in results) for k in results[0]["stall"]}
    total = {k: max(results[r]["total"][k] for r in results) for k in results[0]["total"]}
    table = {
        "setup": {"ranks": args.ranks, "device": args.device, "layers": args.layers, "width": args.width,
                  "parameters": sum(p.numel() for p in _model(args.layers, args.width).parameters()),
                  "use_orig_params": args.use_orig_params,
                  "repeats": args.repeats, "statistic": "median per rank, slowest rank"},
        "stall_s": {k: round(v, 4) for k, v in stall.items()},
        "total_s": {k: round(v, 4) for k, v in total.items()},
        "stall_ratio_vs_bcp_async": {
            "dcp_sync": round(stall["dcp_sync"] / stall["bcp"], 2),
            "dcp_async": round(stall["dcp_async"] / stall["bcp"], 2),
        },
        "stall_ratio_vs_bcp_sync": {
            "dcp_sync": round(stall["dcp_sync"] / stall["bcp_sync"], 2),
            "dcp_async": round(stall["dcp_async"] / stall["bcp_sync"], 2),
        },
    }
    print(json.dumps(table, indent=2))


if __name__ == "__main__":
    main()
