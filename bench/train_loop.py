"""What checkpointing costs a training loop: bcp lazy, bcp eager copy and DCP async_save, one run.

    python bench/train_loop.py [--loops fsdp2-mlp,ddp-transformer] [--ranks 2] [--steps 40]
                               [--every 10] [--repeat 2] [--systems ...] [--dir DIR]

Two loop shapes, each run for every system:

- `fsdp2-mlp`: an FSDP2-sharded MLP (`--layers` square layers of `--hidden`, Adam: with the
  defaults about 0.5 GiB of parameters and optimizer state per rank on 2 ranks); the checkpoint is
  asked for at the start of a step. Its cost: that step (save call included) over a normal step.
- `ddp-transformer`: the usual shape of a Lightning / HF Trainer loop. DDP over a stack of
  `--tf-layers` `nn.TransformerEncoderLayer` (d=`--d-model`, ff=4·d; 4 layers of d=1024 are about
  50M parameters in 64 tensors), AdamW; the checkpoint is asked for right after the optimizer
  step, where ModelCheckpoint and the Trainer ask. Its cost: the save call plus the next whole
  step, over a normal step.

Every `--every` steps a checkpoint is asked for, asynchronously, after waiting for the previous one
(k is chosen so one write fits in k steps). No system is given the state before its first save
(`bcp_prepared` aside). Per loop and system, in fresh processes, systems alternated `--repeat`
times (best run kept):

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
no checkpoints (the paper's ETTR view); each system's peak RSS per rank; and rank 0's CPU seconds
per checkpoint step beyond a normal step's, on the training thread and on all other threads (the
save's background work: on a machine whose cores all train, it is taken from training). No
assertion: this is a measurement, printed as JSON.
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
LOOPS = ("fsdp2-mlp", "ddp-transformer")


def _model(loop: str, hidden: int, layers: int, d_model: int, tf_layers: int):
    if loop == "ddp-transformer":
        from torch.nn.parallel import DistributedDataParallel as DDP
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.TransformerEncoderLayer(d_model, nhead=16, dim_feedforward=4 * d_model,
                                                           batch_first=True) for _ in range(tf_layers)])
        return DDP(model), torch.optim.AdamW(model.parameters(), lr=1e-4)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(hidden, hidden), nn.ReLU()) for _ in range(layers)])
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.Adam(model.parameters(), lr=1e-4)


def _cpu() -> tuple[float, float]:
    """CPU seconds so far: of the calling thread, of the whole process."""
    me, proc = resource.getrusage(resource.RUSAGE_THREAD), resource.getrusage(resource.RUSAGE_SELF)
    return me.ru_utime + me.ru_stime, proc.ru_utime + proc.ru_stime


def _cpu_since(c0: tuple[float, float]) -> tuple[float, float]:
    """CPU seconds since `c0` (from _cpu): of the calling thread, of every other thread."""
    me, proc = _cpu()
    return me - c0[0], (proc - c0[1]) - (me - c0[0])


def _max_all(values: list[float]) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def _saver(system: str, root: str, model, optim):
    """A function that starts one asynchronous save of step k and returns its waiter."""
    if system.startswith("bcp"):
        import bcp_core as bcp
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            model = model.module  # what Lightning and the Trainer hand over
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
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):  # replicated: each rank writes its share
        tensors = tensors[dist.get_rank()::dist.get_world_size()]
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


def _job(loop: str, system: str, root: str, a: dict) -> dict:
    model, optim = _model(loop, a["hidden"], a["layers"], a["d_model"], a["tf_layers"])
    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(rank)
    after = loop == "ddp-transformer"  # the checkpoint is asked for after the optimizer step
    x = torch.randn(a["tf_batch"], a["seq"], a["d_model"], generator=gen) if after else \
        torch.randn(a["batch"], a["hidden"], generator=gen)
    steps, every = a["steps"], a["every"]

    phases: list[tuple[float, float]] = []  # per step: forward+backward, optimizer step
    cpu: list[tuple[float, float]] = []  # per step: CPU seconds of this (training) thread, of the others

    def step():
        c0 = _cpu()
        t0 = time.perf_counter()
        loss = model(x).square().mean()
        optim.zero_grad(set_to_none=True)
        loss.backward()
        t1 = time.perf_counter()
        optim.step()
        phases.append((t1 - t0, time.perf_counter() - t1))
        cpu.append(_cpu_since(c0))

    for _ in range(3):  # warm-up: optimizer state exists, allocator settled
        step()
    phases.clear()
    cpu.clear()
    save = _saver(system, root, model, optim) if system != "none" else None
    waiter, times, waits, calls, call_cpu = None, [], [], [], []

    def checkpoint(s: int) -> None:
        nonlocal waiter
        t0 = time.perf_counter()
        if waiter is not None:
            waiter()  # at most one checkpoint in flight: k steps are meant to cover one write
        t1 = time.perf_counter()
        c1 = _cpu()
        waiter = save(s)
        waits.append(t1 - t0)
        calls.append(time.perf_counter() - t1)
        call_cpu.append(_cpu_since(c1))

    dist.barrier()
    for s in range(steps):
        due = save is not None and s and s % every == 0
        t0 = time.perf_counter()
        if due and not after:
            checkpoint(s)
        step()
        times.append(time.perf_counter() - t0)  # with the save call when it comes first
        if due and after:
            checkpoint(s)
    t0 = time.perf_counter()
    if waiter is not None:
        waiter()
    tail = time.perf_counter() - t0
    outside = sum(waits) + sum(calls) if after else 0.0  # not inside a step's time when after it
    times = _max_all(times)
    total = _max_all([sum(times) + tail + outside])[0]
    rss = _max_all([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20])[0]  # GiB (ru_maxrss is KiB)
    ckpt = [s for s in range(steps) if save is not None and s and s % every == 0]
    normal = [t for s, t in enumerate(times) if s not in ckpt and s - 1 not in ckpt and s - 2 not in ckpt]
    waits, calls = (_max_all(w) if w else [] for w in (waits, calls))
    local = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]
    state_gib = 3 * sum(p.numel() * p.element_size() for p in local) / 2**30  # weights and two moments
    out = {"state_gib": state_gib, "step_s": sum(normal) / len(normal), "total_s": total,
           "peak_rss_gib": rss, "steps": times, "wait_s": waits, "call_s": calls}
    if ckpt:
        # the checkpoint step: the step that holds the save call, or (after) the call + the next step
        # (after: a checkpoint at the last step has no next step to count)
        cost = [calls[i] + times[s + 1] for i, s in enumerate(ckpt) if s + 1 < steps] if after else \
            [times[s] for s in ckpt]
        out["first_ckpt_step_s"] = cost[0]
        out["later_ckpt_step_s"] = sum(cost[1:]) / max(1, len(cost) - 1)
        nxt = [s + 2 if after else s + 1 for s in ckpt]
        out["after_ckpt_step_s"] = sum(times[s] for s in nxt if s < steps) / len(ckpt)
        # where a checkpoint step's time goes: forward+backward, then the optimizer step (which
        # waits for lazy copies still to make), each over the mean of normal steps
        fb, op = (_max_all([p[i] for p in phases]) for i in (0, 1))
        hit = [s + 1 if after else s for s in ckpt]  # the step that runs beside the save's copies
        out["ckpt_phases_over_normal"] = [
            (round(fb[s] / (sum(fb[n] for n in range(steps) if n not in hit) / (steps - len(hit))), 2),
             round(op[s] / (sum(op[n] for n in range(steps) if n not in hit) / (steps - len(hit))), 2))
            for s in hit if s < steps]
        # CPU seconds of the checkpoint step (the call and the step that runs beside the save's
        # background work) over a normal step's: on the training thread, and on every other thread
        # (the save's threads; gloo's too, as in any step), as this rank's mean over checkpoints
        busy = [n for n in range(steps) if n not in hit]
        norm = [sum(cpu[n][i] for n in busy) / len(busy) for i in (0, 1)]
        extra = [[call_cpu[k][i] + cpu[s][i] - norm[i] for i in (0, 1)]
                 for k, s in enumerate(hit) if s < steps]
        out["normal_step_cpu_s"] = norm
        out["ckpt_step_extra_cpu_s"] = extra
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--loops", default=",".join(LOOPS), help="comma-separated loop shapes")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=3072, help="fsdp2-mlp: layer width")
    ap.add_argument("--layers", type=int, default=9, help="fsdp2-mlp: layers")
    ap.add_argument("--batch", type=int, default=32, help="fsdp2-mlp: batch")
    ap.add_argument("--d-model", type=int, default=1024, help="ddp-transformer: model width")
    ap.add_argument("--tf-layers", type=int, default=4, help="ddp-transformer: encoder layers")
    ap.add_argument("--tf-batch", type=int, default=4, help="ddp-transformer: sequences per rank")
    ap.add_argument("--seq", type=int, default=64, help="ddp-transformer: sequence length")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated subset (none is always run)")
    ap.add_argument("--dir", default=None, help="where checkpoints go (default: a temp dir, removed after)")
    args = ap.parse_args()
    root = args.dir or tempfile.mkdtemp(prefix="bcp_train_loop_")
    os.makedirs(root, exist_ok=True)
    table: dict = {"config": vars(args) | {"torch": torch.__version__, "cpus": os.cpu_count()}}
    try:
        for loop in args.loops.split(","):
            table[loop] = _run_loop(loop, args, root)
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    print(json.dumps(table, indent=2))
    return 0


def _run_loop(loop: str, args, root: str) -> dict:
    """Every system on one loop shape, alternated `--repeat` times; the best run of each, as ratios."""
    if loop not in LOOPS:
        raise SystemExit(f"unknown loop {loop!r}: choose from {', '.join(LOOPS)}")
    runs: dict[str, list[dict]] = {s: [] for s in SYSTEMS}
    for _ in range(args.repeat):
        for system in [s for s in SYSTEMS if s == "none" or s in args.systems.split(",")]:
            os.sync()
            runs[system].append(run_ranks(_job, args.ranks, loop, system, root, vars(args), name=f"{loop}/{system}"))
            shutil.rmtree(os.path.join(root, system), ignore_errors=True)
    best = {s: min(r, key=lambda x: x["total_s"]) for s, r in runs.items() if r}
    table: dict = {"state_per_rank_gib": round(best["none"]["state_gib"], 3)}
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
                    "ckpt_fwd_bwd_and_optim_step_over_normal": r["ckpt_phases_over_normal"],
                    # rank 0's CPU seconds per checkpoint step beyond a normal step's: (training
                    # thread, other threads); a normal step's CPU for scale
                    "ckpt_step_extra_cpu_s": [[round(v, 3) for v in c] for c in r["ckpt_step_extra_cpu_s"]],
                    "normal_step_cpu_s": [round(v, 3) for v in r["normal_step_cpu_s"]]}
        row["runs_total_s"] = [round(x["total_s"], 3) for x in runs[s]]
        table[s] = row
    if {"bcp_lazy", "dcp"} <= best.keys():
        table["ratios"] = {
            f"{k}_bcp_lazy_over_dcp": round(table["bcp_lazy"][k] / table["dcp"][k], 3)
            for k in ("first_ckpt_step_s", "later_ckpt_step_s", "peak_rss_gib")}
    return table


if __name__ == "__main__":
    sys.exit(main())
