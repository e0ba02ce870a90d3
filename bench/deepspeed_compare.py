"""bcp vs DeepSpeed's own checkpoints on the same ZeRO-3 state, in one run.

    python bench/deepspeed_compare.py [--hidden 768] [--layers 6] [--repeat 3] [--dir /tmp/bcp_ds_bench]

Two ranks (torchrun, DS_ACCELERATOR=cpu, gloo) train a Llama-style model (built from a config) under
ZeRO-3 for one step, then, for each of --repeat rounds, on the same state:

- DeepSpeed `engine.save_checkpoint(dir)`: the call (what training waits for; DeepSpeed writes with
  torch.save and syncs nothing) and durable (the call plus an fsync of each file it wrote);
- bcp `bcp.save(dir, engine_state(engine))`, synchronous (returns durable and committed), and
  asynchronous: the call (the training stall) and the time until `wait()` returns;
- loads at the same world size, cold (both checkpoints' files dropped from the page cache with
  posix_fadvise) and warm (read into it first): DeepSpeed's `load_checkpoint`, bcp's `load` of its
  own checkpoint and of DeepSpeed's (read as it is, `bcp_core.foreign`: its metadata built anew each
  time, one more pass over the files). bcp writes large pieces
  with direct I/O, so its fresh files are not in the page cache: without this, its loads would be
  cold and DeepSpeed's warm.

Then one rank loads at another world size (2 ranks' checkpoint into ZeRO-3 on 1): bcp's `load`
against DeepSpeed's way, `ds_to_universal.py` (run as DeepSpeed documents it) and
`load_checkpoint(..., load_universal)`.
Times are the slowest rank's wall time between barriers, median of the rounds. Prints one JSON row
with the times and the ratios DeepSpeed / bcp (> 1: bcp is faster). No assertion: this is a measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def _model(hidden: int, layers: int):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=32000, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                                        num_hidden_layers=layers, num_attention_heads=max(1, hidden // 64),
                                        num_key_value_heads=max(1, hidden // 64), max_position_embeddings=256,
                                        attn_implementation="eager"))


def _engine(hidden: int, layers: int):
    import deepspeed
    import torch.distributed as dist
    model = _model(hidden, layers)
    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "steps_per_print": 10**6,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
           "checkpoint": {"load_universal": False}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    _ = dist
    return engine


def _step(engine) -> None:
    import torch
    ids = torch.randint(0, 32000, (1, 64), generator=torch.Generator().manual_seed(1))
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    engine.step()


def _timed(fn) -> float:
    """The slowest rank's wall time of `fn` between barriers."""
    import torch
    import torch.distributed as dist
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    t = torch.tensor([time.perf_counter() - t0])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _page_cache(path: str, keep: bool) -> None:
    """Every file under `path` read into the page cache (`keep`), or dropped from it (posix_fadvise
    DONTNEED, which needs no privileges): loads are measured warm and cold alike for both systems."""
    for d, _, files in os.walk(path):
        for f in files:
            with open(os.path.join(d, f), "rb") as fh:
                if keep:
                    while fh.read(64 << 20):
                        pass
                else:
                    os.fsync(fh.fileno())
                    os.posix_fadvise(fh.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def _fsync_tree(path: str) -> None:
    for d, _, files in os.walk(path):
        for f in files:
            fd = os.open(os.path.join(d, f), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


def worker_same(args) -> None:
    import deepspeed
    import torch.distributed as dist

    import bcp_core as bcp
    from bcp_core import foreign
    from bcp_integrations.deepspeed import engine_state
    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    engine = _engine(args.hidden, args.layers)
    _step(engine)
    rows: dict[str, list[float]] = {}

    def add(name: str, seconds: float) -> None:
        rows.setdefault(name, []).append(seconds)

    for r in range(args.repeat):
        ds_dir, bcp_dir, bcp_async = (os.path.join(args.dir, f"{n}{r}") for n in ("ds", "bcp", "bcp_async"))
        add("ds_save_call", _timed(lambda: engine.save_checkpoint(ds_dir)))
        add("ds_save_durable", rows["ds_save_call"][-1] + _timed(
            lambda: _fsync_tree(ds_dir) if rank == 0 else None))
        add("bcp_save_sync", _timed(lambda: bcp.save(bcp_dir, engine_state(engine))))
        handle = []
        add("bcp_save_async_call", _timed(lambda: handle.append(bcp.save(bcp_async, engine_state(engine),
                                                                           async_save=True))))
        add("bcp_save_async_durable", rows["bcp_save_async_call"][-1] + _timed(lambda: handle[0].wait()))
        state = engine_state(engine)
        for temp, keep in (("cold", False), ("warm", True)):
            for d in (ds_dir, bcp_dir):
                if rank == 0:
                    _page_cache(d, keep)
            add(f"ds_load_{temp}", _timed(lambda: engine.load_checkpoint(ds_dir)))
            if rank == 0:
                _page_cache(bcp_dir, keep)
            add(f"bcp_load_{temp}", _timed(lambda: bcp.load(bcp_dir, state)))
            if rank == 0:
                _page_cache(ds_dir, keep)
            foreign._CACHE.clear()  # a job reads DeepSpeed's files once: the metadata is built each time
            add(f"bcp_load_ds_files_{temp}", _timed(lambda: bcp.load(ds_dir, state)))
    if rank == 0:
        info = {"params": sum(p.ds_numel for p in engine.module.parameters()),
                "state_bytes": sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in
                                   os.walk(os.path.join(args.dir, "bcp0")) for f in fs)}
        with open(os.path.join(args.dir, "same.json"), "w") as f:
            json.dump({"rows": rows, **info}, f)


def worker_other(args) -> None:
    import deepspeed

    import bcp_core as bcp
    from bcp_integrations.deepspeed import engine_state
    deepspeed.init_distributed(dist_backend="gloo")
    engine = _engine(args.hidden, args.layers)
    _page_cache(os.path.join(args.dir, "bcp0"), True)
    _page_cache(os.path.join(args.dir, "ds0"), True)  # both warm, as ds_to_universal leaves its output
    rows = {"bcp_load_1rank": _timed(lambda: bcp.load(os.path.join(args.dir, "bcp0"), engine_state(engine)))}
    src = os.path.join(args.dir, "ds0")
    tag = open(os.path.join(src, "latest")).read().strip()
    universal = os.path.join(src, f"{tag}_universal")
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
                    os.path.join(src, tag), "--output_folder", universal], check=True, capture_output=True)
    rows["ds_to_universal"] = time.perf_counter() - t0
    engine._config.load_universal_checkpoint = True
    rows["ds_load_universal"] = _timed(lambda: engine.load_checkpoint(src, tag=f"{tag}_universal"))
    with open(os.path.join(args.dir, "other.json"), "w") as f:
        json.dump({"rows": rows}, f)


def _launch(nproc: int, phase: str, args) -> None:
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "HF_HUB_OFFLINE": "1", "PYTHONPATH": ROOT}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
           os.path.abspath(__file__), "--phase", phase, "--dir", args.dir, "--hidden", str(args.hidden),
           "--layers", str(args.layers), "--repeat", str(args.repeat)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"{phase} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--dir", default="/tmp/bcp_ds_bench")
    p.add_argument("--phase", choices=("same", "other"), default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.phase == "same":
        return worker_same(args)
    if args.phase == "other":
        return worker_other(args)
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    _launch(2, "same", args)
    _launch(1, "other", args)
    same = json.load(open(os.path.join(args.dir, "same.json")))
    other = json.load(open(os.path.join(args.dir, "other.json")))["rows"]
    t = {k: statistics.median(v) for k, v in same["rows"].items()}
    convert_and_load = other["ds_to_universal"] + other["ds_load_universal"]
    out = {
        "params": same["params"], "checkpoint_gib": round(same["state_bytes"] / 2**30, 3),
        "seconds": {**{k: round(v, 4) for k, v in t.items()},
                    **{k: round(v, 4) for k, v in other.items()}},
        "ratios_deepspeed_over_bcp": {
            "save_stall (ds call / bcp async call)": round(t["ds_save_call"] / t["bcp_save_async_call"], 2),
            "save_durable (ds call+fsync / bcp sync)": round(t["ds_save_durable"] / t["bcp_save_sync"], 2),
            "save_durable_async (ds call+fsync / bcp async to durable)":
                round(t["ds_save_durable"] / t["bcp_save_async_durable"], 2),
            **{f"load_same_world_{temp} (ds / bcp)": round(t[f"ds_load_{temp}"] / t[f"bcp_load_{temp}"], 2)
               for temp in ("cold", "warm")},
            **{f"load_ds_files_{temp} (ds / bcp reading them)":
               round(t[f"ds_load_{temp}"] / t[f"bcp_load_ds_files_{temp}"], 2) for temp in ("cold", "warm")},
            "load_other_world (ds_to_universal + load / bcp load)":
                round(convert_and_load / other["bcp_load_1rank"], 2),
        },
    }
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
