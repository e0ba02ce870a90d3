"""What checkpointing costs a training loop: bcp lazy, bcp eager copy and DCP async_save, one run.

    python bench/train_loop.py [--ranks 2] [--hidden 3072] [--layers 9] [--batch 32]
                               [--steps 40] [--every 10] [--repeat 2] [--dir DIR]

Each rank trains an FSDP2-sharded MLP (`--layers` square layers of `--hidden`, Adam: with the
defaults about 0.5 GiB of parameters and optimizer state per rank on 2 ranks). Every `--every`
steps a checkpoint is asked for at the start of the step, asynchronously, after waiting for the
previous one (k is chosen so one write fits in k steps). Per system, in fresh processes, systems
alternated `--repeat` times (best run kept):

- none: no checkpoints (the reference step time);
- floor: a bare thread that copies the shards into reused buffers and writes them with direct I/O
  (what any asynchronous checkpoint costs on this machine at least);
- bcp_lazy: `bcp.save(async_save=True)` (snapshot="lazy", the default: parameters and optimizer
  state are copied while forward and backward run; the optimizer step waits if it comes first);
- bcp_prepared: bcp_lazy after `bcp.prepare_save(state)` (planned, staging faulted in before the
  timed steps: the first save then costs what later ones do);
- bcp_copy: `bcp.save(async_save=True, snapshot="copy")` (everything copied before returning);
- dcp: `torch.distributed.checkpoint.async_save` of `get_model_state_dict` / `get_optimizer_state_dict`
  (what torchtitan does).

Reported, as the slowest rank: the mean normal step, the first checkpoint step (the first save of
the structure: planning, fresh staging memory) and the mean of later checkpoint steps, each as a
ratio to the normal step of the same run; the throughput over all steps relative to the run with
no checkpoints (the paper's ETTR view); and each system's peak RSS per rank. No assertion: this is
a measurement, printed as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import sys
import tempfile
import time

import torch
import torch.distributed as dist
from torch import nn

from _spawn import run_ranks  # bench/_spawn.py

SYSTEMS = ("none", "floor", "bcp_lazy", "bcp_prepared", "bcp_copy", "dcp")


def _model(hidden: int, layers: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(hidden, hidden), nn.ReLU()) for _ in range(layers)])
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.Adam(model.parameters(), lr=1e-4)


def _max_all(values: list[float]) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def _saver(system: str, root: str, model, optim):
    """A function that starts one asynchronous save of step k and returns its waiter."""
    if system.startswith("bcp"):
        import bcp_core as bcp
        snapshot = "copy" if system == "bcp_copy" else "lazy"
        state = {"model": model, "optimizer": optim}
        if system == "bcp_prepared":  # planned and staging faulted in before the timed steps
            bcp.prepare_save(state).result()
        return lambda k: bcp.save(os.path.join(root, system), state, step=k, async_save=True,
                                  snapshot=snapshot).wait
    if system == "floor":
        return _floor_saver(os.path.join(root, system), model, optim)
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    # DCP's background thread runs collectives: on the training group they would interleave with
    # FSDP's all-gathers, so it gets a group of its own (as torchtitan does).
    group = dist.new_group(backend="gloo")

    def save(k):
        sd = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optim)}
        return dcp.async_save(sd, checkpoint_id=os.path.join(root, system, f"step_{k}"), process_group=group).result
    return save


def _floor_saver(root: str, model, optim):
    """What any asynchronous checkpoint costs here at least: a thread copies this rank's shards into
    reused page-aligned buffers and writes them, as they are, into one new file around the page
    cache (O_DIRECT, as bcp writes), then fsyncs it. No planning, no format, no checksums, no commit."""
    import mmap
    import threading

    def local(t):
        return t.to_local() if hasattr(t, "to_local") else t
    tensors = [local(p) for p in model.parameters()]
    tensors += [local(v) for st in optim.state.values() for v in st.values() if torch.is_tensor(v) and v.dim()]
    sizes = [-(-t.numel() * t.element_size() // 4096) * 4096 for t in tensors]
    maps = [mmap.mmap(-1, n) for n in sizes]  # page-aligned, faulted in once (as reused staging is)
    bufs = [torch.frombuffer(m, dtype=t.dtype, count=t.numel()).view(t.shape) for m, t in zip(maps, tensors)]
    for b in bufs:
        b.zero_()
    os.makedirs(root, exist_ok=True)

    def save(k):
        def run():
            for b, t in zip(bufs, tensors):
                b.copy_(t)
            path = os.path.join(root, f"step_{k}_rank{dist.get_rank()}")
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_DIRECT", 0), 0o644)
            try:
                pos = 0
                for m in maps:
                    pos += os.pwrite(fd, m, pos)
                os.fsync(fd)
            finally:
                os.close(fd)
        th = threading.Thread(target=run)
        th.start()
        return th.join
    return save


def _job(system: str, root: str, hidden: int, layers: int, batch: int, steps: int, every: int) -> dict:
    model, optim = _model(hidden, layers)
    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(batch, hidden, generator=gen)

    phases: list[tuple[float, float]] = []  # per step: forward+backward, optimizer step

    def step():
        t0 = time.perf_counter()
        loss = model(x).square().mean()
        optim.zero_grad(set_to_none=True)
        loss.backward()
        t1 = time.perf_counter()
        optim.step()
        phases.append((t1 - t0, time.perf_counter() - t1))

    for _ in range(3):  # warm-up: optimizer state exists, allocator settled
        step()
    phases.clear()
    save = _saver(system, root, model, optim) if system != "none" else None
    waiter, times, waits, calls = None, [], [], []
    dist.barrier()
    for s in range(steps):
        t0 = time.perf_counter()
        if save is not None and s and s % every == 0:
            if waiter is not None:
                waiter()  # at most one checkpoint in flight: k steps are meant to cover one write
            t1 = time.perf_counter()
            waiter = save(s)
            waits.append(t1 - t0)
            calls.append(time.perf_counter() - t1)
        step()
        times.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    if waiter is not None:
        waiter()
    tail = time.perf_counter() - t0
    times = _max_all(times)
    total = _max_all([sum(times) + tail])[0]
    rss = _max_all([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20])[0]  # GiB (ru_maxrss is KiB)
    ckpt = [s for s in range(steps) if save is not None and s and s % every == 0]
    normal = [t for s, t in enumerate(times) if s not in ckpt and s - 1 not in ckpt]
    out = {"step_s": sum(normal) / len(normal), "total_s": total, "peak_rss_gib": rss, "steps": times,
           "wait_s": _max_all(waits) if waits else [], "call_s": _max_all(calls) if calls else []}
    if ckpt:
        out["first_ckpt_step_s"] = times[ckpt[0]]
        out["later_ckpt_step_s"] = sum(times[s] for s in ckpt[1:]) / max(1, len(ckpt) - 1)
        out["after_ckpt_step_s"] = sum(times[s + 1] for s in ckpt if s + 1 < steps) / len(ckpt)
        # where a checkpoint step's time goes: forward+backward, then the optimizer step (which
        # waits for lazy copies still to make), each over the mean of normal steps
        fb, op = (_max_all([p[i] for p in phases]) for i in (0, 1))
        out["ckpt_phases_over_normal"] = [
            (round(fb[s] / (sum(fb[n] for n in range(steps) if n not in ckpt) / (steps - len(ckpt))), 2),
             round(op[s] / (sum(op[n] for n in range(steps) if n not in ckpt) / (steps - len(ckpt))), 2))
            for s in ckpt]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=3072)
    ap.add_argument("--layers", type=int, default=9)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated subset (none is always run)")
    ap.add_argument("--dir", default=None, help="where checkpoints go (default: a temp dir, removed after)")
    args = ap.parse_args()
    root = args.dir or tempfile.mkdtemp(prefix="bcp_train_loop_")
    os.makedirs(root, exist_ok=True)
    runs: dict[str, list[dict]] = {s: [] for s in SYSTEMS}
    try:
        for _ in range(args.repeat):
            for system in [s for s in SYSTEMS if s == "none" or s in args.systems.split(",")]:
                os.sync()
                runs[system].append(run_ranks(_job, args.ranks, system, root, args.hidden, args.layers, args.batch,
                                              args.steps, args.every, name=system))
                shutil.rmtree(os.path.join(root, system), ignore_errors=True)
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    best = {s: min(r, key=lambda x: x["total_s"]) for s, r in runs.items() if r}
    state_gib = 3 * 4 * args.layers * (args.hidden ** 2 + args.hidden) / 2**30 / args.ranks
    table: dict = {"config": vars(args) | {"state_per_rank_gib": round(state_gib, 3), "torch": torch.__version__,
                                           "cpus": os.cpu_count()}}
    for s, r in best.items():
        row = {"normal_step_s": round(r["step_s"], 4), "peak_rss_gib": round(r["peak_rss_gib"], 3),
               "throughput_vs_none": round(best["none"]["total_s"] / r["total_s"], 3)}
        if "dcp" in best:
            row["peak_rss_vs_dcp"] = round(r["peak_rss_gib"] / best["dcp"]["peak_rss_gib"], 3)
        if "first_ckpt_step_s" in r:
            row |= {"first_ckpt_step_over_normal": round(r["first_ckpt_step_s"] / r["step_s"], 3),
                    "later_ckpt_step_over_normal": round(r["later_ckpt_step_s"] / r["step_s"], 3),
                    "step_after_ckpt_over_normal": round(r["after_ckpt_step_s"] / r["step_s"], 3),
                    "first_ckpt_step_s": round(r["first_ckpt_step_s"], 4),
                    "later_ckpt_step_s": round(r["later_ckpt_step_s"], 4),
                    # where a checkpoint step's time goes: waiting for the previous save, the save call
                    "wait_previous_s": [round(x, 3) for x in r["wait_s"]],
                    "save_call_s": [round(x, 3) for x in r["call_s"]],
                    "ckpt_fwd_bwd_and_optim_step_over_normal": r["ckpt_phases_over_normal"]}
        row["runs_total_s"] = [round(x["total_s"], 3) for x in runs[s]]
        table[s] = row
    if {"bcp_lazy", "dcp"} <= best.keys():
        table["ratios"] = {
            f"{k}_bcp_lazy_over_dcp": round(table["bcp_lazy"][k] / table["dcp"][k], 3)
            for k in ("first_ckpt_step_s", "later_ckpt_step_s", "peak_rss_gib")}
    print(json.dumps(table, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
