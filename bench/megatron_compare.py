"""bcp vs Megatron's torch_dist on the same GPTModel sharded state, in one run.

    python bench/megatron_compare.py [--hidden 512] [--layers 8] [--repeat 3] [--dir /tmp/bcp_mg_bench]

Two gloo ranks build a GPTModel at TP=2 on CPU and save/load its `sharded_state_dict()` through
`megatron.core.dist_checkpointing` with each backend (`("bcp", 1)` and `("torch_dist", 1)`).
torch_dist needs two CPU workarounds (notes/integrations.md §4): `torch.cuda.synchronize` and
`torch.cuda.current_device` replaced by no-ops while it runs; bcp needs none. Measured, as the
slowest rank's wall time between barriers, median of --repeat runs after one warm-up round:

- save (sync, durable): `dist_checkpointing.save`;
- async save stall: the `dist_checkpointing.save(..., async_sharded_save=True)` call plus the
  request's `preload_fn` (torch_dist's staging), i.e. what training waits for before the
  background part; the request is then completed with `execute_sync()` (Megatron's
  AsyncCallsQueue makes CUDA calls, so it cannot run here). On CPU, torch_dist's preload
  (`.to("cpu")` of CPU tensors) copies nothing: its stall here omits the snapshot copy it makes
  on GPU (D2H), and its later writes read the live tensors (Megatron relies on fork's
  copy-on-write there). bcp's stall is a real copy of the state;
- load into the same layout (TP=2) and resharded into TP=1 (DP=2): `dist_checkpointing.load`.

Prints one JSON row with the times and the ratios torch_dist / bcp (> 1: bcp is faster).
No assertion: this is a measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def _build(tp: int, hidden: int, layers: int):
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, create_gloo_process_groups=True)
    torch.manual_seed(0)
    cfg = TransformerConfig(num_layers=layers, hidden_size=hidden, num_attention_heads=8,
                            ffn_hidden_size=4 * hidden, tensor_model_parallel_size=tp,
                            use_cpu_initialization=True, params_dtype=torch.float32)
    return GPTModel(cfg, get_gpt_layer_local_spec(), vocab_size=8192, max_sequence_length=256,
                    share_embeddings_and_output_weights=False)


class _CpuTorchDist:
    """The two CUDA calls torch_dist makes for CPU tensors, as no-ops while it runs."""

    def __enter__(self):
        self.saved = torch.cuda.synchronize, torch.cuda.current_device
        torch.cuda.synchronize = lambda *a, **k: None
        torch.cuda.current_device = lambda: "cpu"

    def __exit__(self, *exc):
        torch.cuda.synchronize, torch.cuda.current_device = self.saved


def _timed(fn) -> float:
    dist.barrier()
    t = time.perf_counter()
    fn()
    dist.barrier()
    mine = torch.tensor([time.perf_counter() - t], dtype=torch.float64)
    dist.all_reduce(mine, op=dist.ReduceOp.MAX)
    return float(mine)


def _fresh(path: str) -> str:
    if dist.get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)
        os.makedirs(path)
    dist.barrier()
    return path


def _worker(rank, world, port, args, out_file):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from megatron.core import dist_checkpointing as dcp

    import bcp_integrations.megatron  # noqa: F401 - registers ("bcp", 1)

    model = _build(2, args.hidden, args.layers)
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    total = torch.tensor([nbytes])
    dist.all_reduce(total)
    backends = {"bcp": ("bcp", 1), "torch_dist": ("torch_dist", 1)}
    times: dict[str, dict[str, list[float]]] = {b: {} for b in backends}

    warm = {"up": True}

    def record(backend, what, seconds):
        if not warm["up"]:  # the first round pays one-time costs (torch_dist's Manager process, imports)
            times[backend].setdefault(what, []).append(seconds)

    for i in range(args.repeat + 1):
        warm["up"] = i == 0
        for name, strategy in backends.items():
            guard = _CpuTorchDist() if name == "torch_dist" else None
            if guard:
                guard.__enter__()
            try:
                path = _fresh(os.path.join(args.dir, name))
                record(name, "save", _timed(lambda: dcp.save(model.sharded_state_dict(), path, strategy)))
                apath = _fresh(os.path.join(args.dir, name + "_async"))
                holder = {}

                def stall():
                    req = dcp.save(model.sharded_state_dict(), apath, strategy, async_sharded_save=True)
                    if req.preload_fn is not None:  # torch_dist stages here; bcp staged inside save
                        staged = req.preload_fn()
                        args_ = list(req.async_fn_args)
                        args_[1] = staged
                        req = req._replace(async_fn_args=tuple(args_), preload_fn=None)
                    holder["req"] = req
                record(name, "async_stall", _timed(stall))
                record(name, "async_total_after_stall", _timed(lambda: holder["req"].execute_sync()))
                record(name, "load_same_layout", _timed(lambda: model.load_state_dict(
                    dcp.load(model.sharded_state_dict(), path))))
            finally:
                if guard:
                    guard.__exit__()

    # resharded load: TP=1 (the two ranks become DP replicas)
    small = _build(1, args.hidden, args.layers)
    for _ in range(args.repeat):
        for name in backends:
            guard = _CpuTorchDist() if name == "torch_dist" else None
            if guard:
                guard.__enter__()
            try:
                path = os.path.join(args.dir, name)
                record(name, "load_tp2_to_tp1", _timed(lambda: small.load_state_dict(
                    dcp.load(small.sharded_state_dict(), path))))
            finally:
                if guard:
                    guard.__exit__()
    if rank == 0:
        med = {b: {k: statistics.median(v) for k, v in t.items()} for b, t in times.items()}
        row = {"bench": "megatron_compare", "state_mib": round(int(total) / 2**20, 1), "ranks": world,
               "layout": "GPTModel TP=2 (load also into TP=1)", "repeat": args.repeat,
               "seconds": {b: {k: round(v, 4) for k, v in m.items()} for b, m in med.items()},
               "ratio_torch_dist_over_bcp": {k: round(med["torch_dist"][k] / med["bcp"][k], 2)
                                             for k in med["bcp"]}}
        with open(out_file, "w") as f:
            json.dump(row, f)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where checkpoints go (default: a temporary directory)")
    args = parser.parse_args()
    args.dir = args.dir or tempfile.mkdtemp(prefix="bcp_mg_bench_")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out_file = os.path.join(args.dir, "row.json")
    # spawned ranks are not daemonic, so torch_dist may start its writer-results Manager process
    mp.spawn(_worker, args=(2, port, args, out_file), nprocs=2, join=True)
    with open(out_file) as f:
        print(json.dumps(json.load(f)))
    shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":  # required: torch_dist starts a Manager process that re-imports __main__
    main()
