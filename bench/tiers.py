"""Tiered checkpoints: what a memory save every step costs training, how fast recovery is, and the
bytes each step moves. One run, the same state, ratios.

    python bench/tiers.py [--ranks 2] [--d-model 1024] [--tf-layers 4] [--steps 30] [--repeat 2]

The state is bench/train_loop.py's DDP-transformer loop (DDP over `--tf-layers`
`nn.TransformerEncoderLayer`s of width `--d-model`, AdamW). Each rank is a simulated node of its own
(`BCP_LOCAL_WORLD_SIZE=1`, a memory directory of its own under /dev/shm), so every replica crosses
between ranks over gloo, as it crosses between machines on a cluster.

- step: the loop with no checkpoint, then with `bcp.save(Tiers(replicas=R, persist_every=10),
  step=s, async_save=True)` (R: `--replicas`, 1) after every optimizer step (where the Trainer and ModelCheckpoint ask):
  the mean of later steps (save call included) over the mean normal step, and the first checkpoint
  step's (planning, fresh staging memory). Also the bytes each step moved per node: written to its
  memory, sent to its replica node, and drained to disk per persisted step.
- cpu: where a tiered save's CPU goes, without training beside it: the process's CPU time (all
  threads, `getrusage`) per save of the same state, with the memory write alone (`replicas=0`)
  and with one replica, and the CPU of the transport alone: this rank's bytes sent to the other
  rank while it receives as many, over a gloo pair of the same kind, tensor to tensor (the
  replication's floor here: TCP on the loopback copies every byte into the kernel and out again).
- recovery: the same state saved (1) to the tiers, loaded on the same nodes (the processes
  restarted, every node's memory survived), then again once node 1's memory is removed (a node
  lost; its replacement's memory is empty: its pieces come from node 0 over the network), (2) with
  bcp to a local directory, (3) with torch DCP to a local directory (the model only); each loaded
  into a fresh model and optimizer, the slowest rank timed. The files on disk
  are evicted from the page cache first (POSIX_FADV_DONTNEED: as after a restart on new processes),
  so the disk loads read the disk. Ratios: local disk over tiers, DCP over tiers.

No assertion: a measurement, printed as JSON, best of `--repeat` alternated runs.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

import torch
import torch.distributed as dist

from _spawn import run_ranks  # bench/_spawn.py
from train_loop import _max_all, _model  # the DDP-transformer loop's model and reduction


def _as_node(root: str) -> None:
    """This rank is a simulated node: its own memory directory (each machine has its own RAM)."""
    os.environ["BCP_LOCAL_WORLD_SIZE"] = "1"
    os.environ["BCP_MEMORY_DIR"] = os.path.join(root, f"mem{dist.get_rank()}")
    os.makedirs(os.environ["BCP_MEMORY_DIR"], exist_ok=True)


def _tiers(root: str, replicas: int = 1):
    import bcp_core as bcp
    return bcp.Tiers("memory://bench", durable=os.path.join(root, "durable"), replicas=replicas, persist_every=10)


def _step_job(system: str, root: str, a: dict) -> dict:
    import bcp_core as bcp
    model, optim = _model("ddp-transformer", 0, 0, a["d_model"], a["tf_layers"])
    gen = torch.Generator().manual_seed(dist.get_rank())
    x = torch.randn(a["tf_batch"], a["seq"], a["d_model"], generator=gen)

    def train() -> None:
        loss = model(x).square().mean()
        optim.zero_grad(set_to_none=True)
        loss.backward()
        optim.step()

    for _ in range(3):
        train()
    state = {"model": model.module, "optimizer": optim}
    tiers = None
    if system == "tiers":
        _as_node(root)
        tiers = _tiers(root, a["replicas"])
    handles, times = [], []
    dist.barrier()
    for s in range(1, a["steps"] + 1):
        t0 = time.perf_counter()
        train()
        if tiers is not None:
            handles.append(bcp.save(tiers, state, step=s, async_save=True))
        times.append(time.perf_counter() - t0)
    for h in handles:
        h.wait()
    times = _max_all(times)
    out = {"steps": times}
    if handles:
        from bcp_core.checkpointer import get_checkpointer
        get_checkpointer()._tiers.drains.queue.wait_all(600)
        per = {"written": [], "replicated": []}
        for h in handles[2:]:
            for r in h.metrics:
                if r["phase"] == "write":
                    per["written"].append(r["bytes"])
                elif r["phase"] == "replicated":
                    per["replicated"].append(r["bytes"])
        # each rank drains the files it wrote: their size in the durable root's latest step
        latest = bcp.resolve(os.path.join(root, "durable")).root
        mine = [f for f in os.listdir(os.path.join(latest, "data")) if f"-r{dist.get_rank()}_" in f]
        drained = sum(os.path.getsize(os.path.join(latest, "data", f)) for f in mine)
        out["bytes_per_step"] = {k: _max_all([sum(v) / max(1, len(v))])[0] for k, v in per.items()}
        out["drained_per_persisted_step"] = _max_all([drained])[0]
    return out


def _trained(a: dict):
    """The DDP transformer and its AdamW after two steps (the moments exist)."""
    model, optim = _model("ddp-transformer", 0, 0, a["d_model"], a["tf_layers"])
    x = torch.randn(a["tf_batch"], a["seq"], a["d_model"])
    for _ in range(2):
        loss = model(x).square().mean()
        optim.zero_grad(set_to_none=True)
        loss.backward()
        optim.step()
    return model, optim


def _process_cpu() -> float:
    import resource
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def _cpu_job(root: str, a: dict) -> dict:
    """Per save: CPU and wall seconds of tiered saves with 0 and 1 replicas (the mean of the later
    saves, the first plans), and of the bare exchange of as many bytes over gloo."""
    import threading

    import bcp_core as bcp
    _as_node(root)
    model, optim = _trained(a)
    state = {"model": model.module, "optimizer": optim}
    out, written = {}, 0
    for k in (0, 1):
        tiers = bcp.Tiers(f"memory://cpu{k}", replicas=k)
        cpu, wall = [], []
        for s in range(1, a["saves"] + 1):
            dist.barrier()
            c0, t0 = _process_cpu(), time.perf_counter()
            h = bcp.save(tiers, state, step=s, async_save=True)
            h.wait()
            cpu.append(_process_cpu() - c0)
            wall.append(time.perf_counter() - t0)
            written = sum(r["bytes"] for r in h.metrics if r["phase"] == "write")
        out[f"replicas{k}"] = {"cpu_s": _max_all([sum(cpu[1:]) / len(cpu[1:])])[0],
                               "wall_s": _max_all([sum(wall[1:]) / len(wall[1:])])[0]}
    # the transport alone: `written` bytes each way between ranks 0 and 1, in the parts replication uses
    from bcp_core.tiers.transport import PART_BYTES
    group = dist.new_group([0, 1], backend="gloo")  # (every rank calls it)
    me, other = dist.get_rank(), 1 - dist.get_rank()
    if me > 1:
        return out
    src = torch.randint(0, 255, (written,), dtype=torch.uint8)
    dst = torch.empty(written, dtype=torch.uint8)
    cpu = []
    for _ in range(3):
        dist.barrier(group)
        c0 = _process_cpu()

        def send() -> None:
            for lo in range(0, written, PART_BYTES):
                dist.send(src[lo:lo + PART_BYTES], other, group=group, tag=1)
        sender = threading.Thread(target=send)
        sender.start()
        for lo in range(0, written, PART_BYTES):
            dist.recv(dst[lo:lo + PART_BYTES], other, group=group, tag=1)
        sender.join()
        cpu.append(_process_cpu() - c0)
    slowest = torch.tensor([min(cpu)], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)  # of the pair only
    out["exchange_alone"] = {"bytes": written, "cpu_s": slowest.item()}
    return out


def _evict(path: str) -> None:
    """Drop the files under `path` from the page cache (clean pages: no root needed)."""
    for d, _, files in os.walk(path):
        for f in files:
            fd = os.open(os.path.join(d, f), os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _timed(fn) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dt = time.perf_counter() - t0
    return _max_all([dt])[0]


def _recovery_job(mem_root: str, root: str, a: dict) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    import bcp_core as bcp
    _as_node(mem_root)
    model, optim = _trained(a)
    state = {"model": model.module, "optimizer": optim}
    tiers = _tiers(root)
    bcp.save(tiers, state, step=1, async_save=True).wait()
    disk = os.path.join(root, "disk")
    bcp.save(disk, state).wait()
    dcp_dir = os.path.join(root, "dcp")
    dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=dcp_dir)
    dist.barrier()
    if dist.get_rank() == 0:
        _evict(disk)
        _evict(dcp_dir)
        _evict(os.path.join(root, "durable"))
    out = {"state_gib": sum(t.numel() * t.element_size() for t in model.parameters()) * 3 / 2**30}
    # a first load in a process pays one-time costs (lazy imports, first allocations): not timed
    fresh, fresh_opt = _model("ddp-transformer", 0, 0, a["d_model"], a["tf_layers"])
    bcp.load(disk, {"model": fresh.module, "optimizer": fresh_opt})
    if dist.get_rank() == 0:
        _evict(disk)
    fresh, fresh_opt = _model("ddp-transformer", 0, 0, a["d_model"], a["tf_layers"])
    out["disk_s"] = _timed(lambda: bcp.load(disk, {"model": fresh.module, "optimizer": fresh_opt}))
    # the same nodes again (the processes restarted, every node's memory survived): no transfer
    fresh, fresh_opt = _model("ddp-transformer", 0, 0, a["d_model"], a["tf_layers"])
    out["tiers_same_nodes_s"] = _timed(lambda: bcp.load(tiers, {"model": fresh.module, "optimizer": fresh_opt}))
    dist.barrier()
    if dist.get_rank() == 1:  # node 1 is lost: its replacement's memory is empty
        shutil.rmtree(os.environ["BCP_MEMORY_DIR"])
        os.makedirs(os.environ["BCP_MEMORY_DIR"])
    fresh, fresh_opt = _model("ddp-transformer", 0, 0, a["d_model"], a["tf_layers"])
    out["tiers_s"] = _timed(lambda: bcp.load(tiers, {"model": fresh.module, "optimizer": fresh_opt}))
    assert all(torch.equal(p, q) for p, q in zip(fresh.parameters(), model.parameters()))
    fresh, _ = _model("ddp-transformer", 0, 0, a["d_model"], a["tf_layers"])

    def dcp_load():
        sd = {"model": get_model_state_dict(fresh)}
        dcp.load(sd, checkpoint_id=dcp_dir)
        set_model_state_dict(fresh, sd["model"])
    out["dcp_model_only_s"] = _timed(dcp_load)
    # DCP's load above reads the model only (its optimizer state dict needs the optimizer's own
    # structure); bcp's loads read model and optimizer: 3x the bytes.
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--d-model", type=int, default=1024)
    ap.add_argument("--tf-layers", type=int, default=4)
    ap.add_argument("--tf-batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--replicas", type=int, default=1, help="of the step measurement (0: the memory write alone)")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--dir", default=None, help="for disk checkpoints (default: a temp dir); memory under /dev/shm")
    ap.add_argument("--saves", type=int, default=6, help="of the cpu measurement")
    ap.add_argument("--parts", default="step,recovery", help="which measurements: step, recovery, cpu")
    args = ap.parse_args()
    a = vars(args)
    table: dict = {"config": a | {"torch": torch.__version__, "cpus": os.cpu_count()}}
    runs: dict[str, list] = {"none": [], "tiers": [], "recovery": []}
    parts = args.parts.split(",")
    for _ in range(args.repeat):
        for system in ("none", "tiers") if "step" in parts else ():
            root = tempfile.mkdtemp(prefix="bcp_tiers_", dir="/dev/shm")
            durable = tempfile.mkdtemp(prefix="bcp_tiers_", dir=args.dir)
            try:
                os.symlink(durable, os.path.join(root, "durable"))
                runs[system].append(run_ranks(_step_job, args.ranks, system, root, a, name=f"step/{system}"))
            finally:
                shutil.rmtree(root, ignore_errors=True)
                shutil.rmtree(durable, ignore_errors=True)
        if "cpu" in parts:
            root = tempfile.mkdtemp(prefix="bcp_tiers_cpu_", dir="/dev/shm")
            try:
                runs.setdefault("cpu", []).append(run_ranks(_cpu_job, args.ranks, root, a, name="cpu"))
            finally:
                shutil.rmtree(root, ignore_errors=True)
        if "recovery" not in parts:
            continue
        mem_root = tempfile.mkdtemp(prefix="bcp_tiers_rec_", dir="/dev/shm")
        disk_root = tempfile.mkdtemp(prefix="bcp_tiers_rec_", dir=args.dir)
        try:
            runs["recovery"].append(run_ranks(_recovery_job, args.ranks, mem_root, disk_root, a, name="recovery"))
        finally:
            shutil.rmtree(mem_root, ignore_errors=True)
            shutil.rmtree(disk_root, ignore_errors=True)

    def mean(xs):
        return sum(xs) / len(xs)
    if "step" in parts:
        table["step"] = _step_table(runs, mean)
    if "recovery" in parts:
        table["recovery"] = _recovery_table(runs)
    if "cpu" in parts:
        table["cpu_per_save"] = _cpu_table(runs["cpu"])
    print(json.dumps(table, indent=2))
    return 0


def _step_table(runs: dict, mean) -> dict:
    none = min(mean(r["steps"][2:]) for r in runs["none"])
    best = min(runs["tiers"], key=lambda r: mean(r["steps"][2:]))
    return {
        "normal_step_s": round(none, 4),
        "ckpt_every_step_s": round(mean(best["steps"][2:]), 4),
        "ckpt_step_over_normal": round(mean(best["steps"][2:]) / none, 3),
        "first_ckpt_step_over_normal": round(best["steps"][0] / none, 3),
        "bytes_per_step_per_node": {k: int(v) for k, v in best["bytes_per_step"].items()},
        "drained_bytes_per_persisted_step_per_node": int(best["drained_per_persisted_step"]),
        "runs_ckpt_step_over_normal": [round(mean(r["steps"][2:]) / none, 3) for r in runs["tiers"]],
    }


def _cpu_table(runs: list) -> dict:
    best = {k: min(r[k]["cpu_s"] for r in runs) for k in ("replicas0", "replicas1", "exchange_alone")}
    return {
        "bytes_per_rank": runs[0]["exchange_alone"]["bytes"],
        "memory_write_cpu_s": round(best["replicas0"], 3),
        "with_one_replica_cpu_s": round(best["replicas1"], 3),
        "replication_cpu_s": round(best["replicas1"] - best["replicas0"], 3),
        "exchange_alone_cpu_s": round(best["exchange_alone"], 3),
        "wall_s": {k: round(min(r[k]["wall_s"] for r in runs), 3) for k in ("replicas0", "replicas1")},
    }


def _recovery_table(runs: dict) -> dict:
    rec = {k: min(r[k] for r in runs["recovery"])
           for k in ("tiers_s", "tiers_same_nodes_s", "disk_s", "dcp_model_only_s")}
    return {
        "state_gib_per_rank": round(runs["recovery"][0]["state_gib"], 3),
        **{k: round(v, 3) for k, v in rec.items()},
        "disk_over_tiers": round(rec["disk_s"] / rec["tiers_s"], 2),
        "disk_over_tiers_same_nodes": round(rec["disk_s"] / rec["tiers_same_nodes_s"], 2),
        "dcp_model_only_over_tiers": round(rec["dcp_model_only_s"] / rec["tiers_s"], 2),
    }


if __name__ == "__main__":
    sys.exit(main())
