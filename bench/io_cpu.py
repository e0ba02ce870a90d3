"""Where a save's background CPU time goes, per GiB, and a warm load against its floor, one run.

    python bench/io_cpu.py [--ranks 2] [--tf-layers 4] [--d-model 1024] [--load-gib 2] [--repeat 3]
                           [--train-steps 0] [--only save|load] [--dir DIR]

On a machine whose cores all train (2 ranks on 2 cores), every CPU second an asynchronous save
spends in the background is taken from training. Two measurements, each on `--ranks` fresh gloo
processes:

- save: the state of bench/train_loop.py's `ddp-transformer` loop (DDP over `--tf-layers`
  `nn.TransformerEncoderLayer` of d=`--d-model`, AdamW with its moments), saved asynchronously
  (`snapshot="lazy"`, the default) `--repeat` times while the caller only waits (the first save
  plans; later ones reuse the plan), or, with `--train-steps N`, while each rank runs N steps of
  that loop (forward, backward, optimizer step) before it waits: the save's CPU beside training,
  with the steps' own CPU left out (the training thread's, and that of the other threads in as
  many steps without a save, measured just before: gloo's all-reduce). The CPU time of the whole
  process over each save (user and kernel, `getrusage`) is split, per thread that did the work
  (`RUSAGE_THREAD` around the hot functions; a probed call inside another counts in its own
  category only), into hashing (with bcp's hashing fused into the writes: the first read of the
  bytes from memory and handing them to the writer), the lazy snapshot's copies, copying into the
  aligned write buffers, the write syscalls, closing the files (fsync), the save call, the plan
  round, the commit round (metadata, directory syncs, pruning) and the rest (threads, headers,
  metrics): seconds per GiB written by the rank. Run it with PYTHONPATH naming another bcp
  checkout to compare two versions.
- load: `--load-gib` of Shard(0) DTensors over the ranks, saved once, then loaded `--repeat` times
  into the same layout with the files in the page cache, alternated with the floor: a `preadv` of
  the same data files' bytes into the same destination tensors (one kernel copy, nothing
  verified). A load that verifies before it writes reads the bytes twice: it hashes them, then
  copies them into place, so its bound is XXH3 of the bytes out of a memory map, measured alone
  (`hash`), plus the cheapest of three copies into place: the floor's, a copy out of the map by
  the CPU (`map_copy`, one numpy memcpy per piece), and the same with non-temporal stores
  (`map_stream`, bcp_core/memcopy.py, what bcp's load copies with); and the one pass a load can
  make where it writes no caller's state (`fused`: each 1 MiB of a checksum block hashed, then
  copied while in the core's cache, bcp_core/engine/read.py's `copy_verified`). Best of
  `--repeat`, ratios to the floor, the load's phases (busy seconds of its metadata, read, checksum and copy records)
  and its CPU time.

Prints JSON with the load average before and after (`/proc/loadavg`: the machine is shared, so
compare figures within one run). No assertion: this is a measurement.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import mmap
import os
import resource
import shutil
import sys
import tempfile
import threading
import time
import types

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from _spawn import run_ranks  # bench/_spawn.py

GIB = float(1 << 30)


def _loadavg() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def _max(x: float) -> float:
    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


# ----------------------------------------------------------------------------- CPU attribution

class ThreadCPU:
    """CPU seconds (user, system) spent inside wrapped functions, whatever thread runs them."""

    def __init__(self):
        self.user: dict[str, float] = {}
        self.sys: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self._lock = threading.Lock()
        self._undo: list = []
        self._stack = threading.local()

    def wrap(self, module, name: str, category: str) -> None:
        """Count the CPU time of `module.name` under `category` (skipped if the function is gone).
        A wrapped call inside another counts in its own category, not in the outer one's."""
        fn = getattr(module, name, None)
        if fn is None:
            return

        @functools.wraps(fn)
        def inner(*args, **kwargs):
            stack = self._stack.__dict__.setdefault("frames", [])
            stack.append([0.0, 0.0])  # CPU of wrapped calls inside this one: user, system
            r0 = resource.getrusage(resource.RUSAGE_THREAD)
            try:
                return fn(*args, **kwargs)
            finally:
                r1 = resource.getrusage(resource.RUSAGE_THREAD)
                user, system = r1.ru_utime - r0.ru_utime, r1.ru_stime - r0.ru_stime
                inside = stack.pop()
                if stack:
                    stack[-1][0] += user
                    stack[-1][1] += system
                with self._lock:
                    self.user[category] = self.user.get(category, 0.0) + user - inside[0]
                    self.sys[category] = self.sys.get(category, 0.0) + system - inside[1]
                    self.calls[category] = self.calls.get(category, 0) + 1
        setattr(module, name, inner)
        self._undo.append((module, name, fn))

    def reset(self) -> None:
        with self._lock:
            self.user.clear()
            self.sys.clear()
            self.calls.clear()

    def restore(self) -> None:
        for module, name, fn in reversed(self._undo):
            setattr(module, name, fn)


def _probes() -> ThreadCPU:
    """The save path's hot functions, by what they do. Functions a version of bcp lacks are skipped."""
    from bcp_core import checkpointer, engine, staging
    from bcp_core.storage import local
    try:
        from bcp_core.save_rounds import SaveRounds  # the rounds, out of the Checkpointer since the split
    except ImportError:
        SaveRounds = checkpointer.Checkpointer
    probe = ThreadCPU()
    probe.wrap(engine, "_checksum_blocks", "hash")  # bcp before hashing was fused with the writes
    # hashing and handing the steps over, less the copies (engine.write since the engine was split in two)
    probe.wrap(getattr(engine, "write", engine), "_write_hashed", "hash")
    probe.wrap(staging.LazyCopy, "_copy", "snapshot_copy")
    try:  # the writer, out of local.py since the split
        from bcp_core.storage import local_writer as writer
    except ImportError:
        writer = local
    probe.wrap(writer, "_copy", "copy")
    probe.wrap(writer, "_pwrite_all", "write_syscalls")
    probe.wrap(getattr(writer, "LocalWriter", None) or local._LocalWriter, "close", "fsync_close")
    # the rest, by where it runs: the save call (caller's thread), the plan and commit rounds
    probe.wrap(checkpointer.Checkpointer, "save", "call")
    probe.wrap(SaveRounds, "agree", "plan_round")
    probe.wrap(SaveRounds, "_agree", "plan_round")
    probe.wrap(SaveRounds, "commit", "commit_round")
    probe.wrap(SaveRounds, "_commit", "commit_round")
    return probe


def _transformer(d_model: int, layers: int):
    from torch.nn.parallel import DistributedDataParallel as DDP
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.TransformerEncoderLayer(d_model, nhead=16, dim_feedforward=4 * d_model,
                                                       batch_first=True) for _ in range(layers)])
    ddp = DDP(model)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(4, 64, d_model)  # train_loop.py's ddp-transformer batch

    def step():
        ddp(x).square().mean().backward()
        optim.step()
        optim.zero_grad(set_to_none=True)
    for _ in range(2):  # optimizer state exists
        step()
    return model, optim, types.SimpleNamespace(step=step)


def _save_cpu(root: str, a: dict) -> dict:
    import bcp_core as bcp
    model, optim, training = _transformer(a["d_model"], a["tf_layers"])
    state = {"model": model, "optimizer": optim}
    probe = _probes()
    # beside training: the training steps' own CPU is a category of its own, left out of the save's
    # (a save's work on the training thread, the optimizer step's wait for it, stays the save's)
    probe.wrap(training, "step", "training")
    path = os.path.join(root, "save_cpu")
    runs = []
    try:
        for k in range(a["repeat"]):
            os.sync()
            base_user = base_sys = 0.0
            if a["train_steps"]:  # the same steps without a save: training's other threads (gloo's all-reduce)
                dist.barrier()
                probe.reset()
                b0 = resource.getrusage(resource.RUSAGE_SELF)
                for _ in range(a["train_steps"]):
                    training.step()
                b1 = resource.getrusage(resource.RUSAGE_SELF)
                base_user = b1.ru_utime - b0.ru_utime - probe.user.get("training", 0.0)
                base_sys = b1.ru_stime - b0.ru_stime - probe.sys.get("training", 0.0)
            dist.barrier()
            probe.reset()
            r0 = resource.getrusage(resource.RUSAGE_SELF)
            t0 = time.perf_counter()
            handle = bcp.save(path, state, step=k, async_save=True, keep=2)
            call = time.perf_counter() - t0
            for _ in range(a["train_steps"]):  # the same number on every rank: DDP's all-reduce
                training.step()
            handle.wait()
            wall = time.perf_counter() - t0
            r1 = resource.getrusage(resource.RUSAGE_SELF)
            written = sum(r["bytes"] for r in _save_records(path, k, dist.get_rank()) if r["phase"] == "write")
            user, system = r1.ru_utime - r0.ru_utime, r1.ru_stime - r0.ru_stime
            # the training thread's steps, and training's other threads as much as without a save
            trained_user = probe.user.pop("training", 0.0) + base_user
            trained_sys = probe.sys.pop("training", 0.0) + base_sys
            trained = trained_user + trained_sys
            user, system = user - trained_user, system - trained_sys
            parts = {c: probe.user.get(c, 0.0) + probe.sys.get(c, 0.0) for c in sorted(probe.user)}
            parts["other_user"] = user - sum(probe.user.values())
            parts["other_sys"] = system - sum(probe.sys.values())
            gib = max(written, 1) / GIB
            runs.append({"written_gib": gib, "wall_s": wall, "call_s": call, "cpu_s": user + system,
                         "user_s": user, "sys_s": system, "training_cpu_s": trained,
                         "cpu_s_per_gib": (user + system) / gib,
                         "per_gib": {c: v / gib for c, v in parts.items()},
                         "sys_in": {c: probe.sys.get(c, 0.0) / gib for c in sorted(probe.sys)}})
    finally:
        probe.restore()
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, runs)
    return {"ranks": every}


def _save_records(path: str, step: int, rank: int) -> list[dict]:
    from bcp_core import metrics
    from bcp_core.layout import BCP_STEPS
    step_dir = os.path.join(path, BCP_STEPS.name(step))
    with open(os.path.join(step_dir, metrics.METRICS_FILE), "rb") as f:
        return [r for r in metrics.load_jsonl(f.read(), f.name) if r["rank"] == rank]


# ----------------------------------------------------------------------------- warm load

N_TENSORS = 16


def _dtensors(gib: float):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    ws = dist.get_world_size()
    mesh = init_device_mesh("cpu", (ws,))
    cols = 1024
    rows = max(ws, int(gib * GIB / 4 / N_TENSORS) // cols) // ws
    out = {}
    for i in range(N_TENSORS):
        torch.manual_seed(i * ws + dist.get_rank())
        out[f"layer{i}.weight"] = DTensor.from_local(torch.randn(rows, cols), mesh, [Shard(0)], run_check=False)
    return out


def _load_vs_floor(root: str, a: dict) -> dict:
    import xxhash

    import bcp_core as bcp
    from bcp_core import memcopy
    from bcp_core import metadata as md_mod
    rank = dist.get_rank()
    state = _dtensors(a["load_gib"])
    path = os.path.join(root, "load")
    bcp.save(path, state, step=0).wait()
    target = _dtensors(a["load_gib"])
    for t in target.values():
        t.to_local().zero_()
    ckpt = os.path.join(path, sorted(d for d in os.listdir(path) if d.startswith("step"))[-1])
    md = md_mod.CheckpointMetadata.loads(open(os.path.join(ckpt, md_mod.METADATA_FILE), "rb").read())
    # this rank's pieces: (file, offset, nbytes), each read by the floor into the very tensor bcp
    # loads it into (the target's local shard, as bytes). The same destination memory matters: on
    # this VM a copy into one set of tensors ran 1.2-1.4x as long as into another of the same size,
    # for the kernel's copy and numpy's alike (physical placement), so a floor writing elsewhere
    # would not be the floor of this load.
    mine, dests = [], []
    for fqn, tm in md.tensors.items():
        for p in tm.pieces:
            if f"r{rank}_" in md.files[p.file]:
                dest = target[fqn].to_local().reshape(-1).view(torch.uint8)
                assert dest.numel() == p.nbytes, (fqn, dest.numel(), p.nbytes)
                mine.append((md.files[p.file], p.byte_offset, p.nbytes))
                dests.append(dest)
    nbytes = sum(n for _, _, n in mine)

    def floor():
        fds = {}
        try:
            for (f, off, n), d in zip(mine, dests):
                fd = fds.get(f) or fds.setdefault(f, os.open(os.path.join(ckpt, f), os.O_RDONLY))
                view = memoryview(d.numpy())
                got = 0
                while got < n:
                    got += os.preadv(fd, [view[got:]], off + got)
        finally:
            for fd in fds.values():
                os.close(fd)

    def hash_only():
        for f, off, n in mine:
            with open(os.path.join(ckpt, f), "rb") as fh:
                m = mmap.mmap(fh.fileno(), 0, prot=mmap.PROT_READ)
            view = memoryview(m)[off:off + n]
            for i in range(0, n, md.checksum_block_bytes):
                xxhash.xxh3_64_intdigest(view[i:i + md.checksum_block_bytes])
            view.release()
            m.close()

    def map_copy(copy=np.copyto):
        for (f, off, n), d in zip(mine, dests):
            with open(os.path.join(ckpt, f), "rb") as fh:
                m = mmap.mmap(fh.fileno(), 0, prot=mmap.PROT_READ)
            view = memoryview(m)[off:off + n]
            copy(d.numpy(), np.frombuffer(view, dtype=np.uint8))
            view.release()
            m.close()

    def fused():  # one pass: each 1 MiB of a checksum block hashed, then copied (engine.read.copy_verified)
        from bcp_core.engine.read import FUSED_BYTES
        block = md.checksum_block_bytes
        for (f, off, n), d in zip(mine, dests):
            with open(os.path.join(ckpt, f), "rb") as fh:
                m = mmap.mmap(fh.fileno(), 0, prot=mmap.PROT_READ)
            view = memoryview(m)[off:off + n]
            src, dst = np.frombuffer(view, dtype=np.uint8), d.numpy()
            for b in range(0, n, block):
                h = xxhash.xxh3_64()
                for i in range(b, min(b + block, n), FUSED_BYTES):
                    j = min(i + FUSED_BYTES, b + block, n)
                    h.update(src[i:j])
                    memcopy.copy(dst[i:j], src[i:j])
                h.intdigest()
            del src
            view.release()
            m.close()

    def timed(fn):
        dist.barrier()
        c0 = time.process_time()
        t0 = time.perf_counter()
        out = fn()
        wall = time.perf_counter() - t0
        cpu = time.process_time() - c0
        dist.barrier()
        return _max(wall), cpu, out

    rows: dict[str, list] = {"floor": [], "bcp": [], "hash": [], "map_copy": [], "map_stream": [], "fused": []}
    phases = []
    floor()  # the files in the page cache, the destinations faulted in
    for _ in range(a["repeat"]):
        rows["floor"].append(timed(floor)[:2])
        wall, cpu, res = timed(lambda: bcp.load(path, target))
        rows["bcp"].append((wall, cpu))
        phases.append({r["phase"]: round(r["busy"], 4) for r in res.metrics})
        rows["hash"].append(timed(hash_only)[:2])
        rows["map_copy"].append(timed(map_copy)[:2])
        rows["map_stream"].append(timed(lambda: map_copy(memcopy.copy))[:2])
        rows["fused"].append(timed(fused)[:2])
    for t in target.values():  # the floor writes the same bytes: bcp's load is checked on its own
        t.to_local().zero_()
    bcp.load(path, target)
    assert all(torch.equal(s.to_local(), t.to_local()) for s, t in zip(state.values(), target.values()))
    best = {k: min(v) for k, v in rows.items()}
    return {"bytes_per_rank_gib": nbytes / GIB,
            "best_s": {k: round(v[0], 4) for k, v in best.items()},
            "cpu_s_of_best": {k: round(v[1], 4) for k, v in best.items()},
            "bcp_over_floor": round(best["bcp"][0] / best["floor"][0], 3),
            "bound_over_floor": round((best["hash"][0] + min(best[k][0] for k in ("floor", "map_copy", "map_stream")))
                                      / best["floor"][0], 3),
            "map_copy_over_floor": round(best["map_copy"][0] / best["floor"][0], 3),
            "map_stream_over_floor": round(best["map_stream"][0] / best["floor"][0], 3),
            "fused_over_floor": round(best["fused"][0] / best["floor"][0], 3),
            "non_temporal": memcopy.NON_TEMPORAL,
            "runs_s": {k: [round(x[0], 4) for x in v] for k, v in rows.items()},
            "bcp_phases_busy_s": phases}


def _measure(what: str, root: str, a: dict) -> dict:
    return {"save": _save_cpu, "load": _load_vs_floor}[what](root, a)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--d-model", type=int, default=1024)
    ap.add_argument("--tf-layers", type=int, default=4)
    ap.add_argument("--load-gib", type=float, default=2.0, help="load: GiB over all ranks")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--train-steps", type=int, default=0,
                    help="save: training steps each rank runs beside each save (0: the ranks only wait)")
    ap.add_argument("--only", choices=("save", "load"), default=None)
    ap.add_argument("--dir", default=None, help="where checkpoints go (default: a temp dir, removed after)")
    args = ap.parse_args()
    root = args.dir or tempfile.mkdtemp(prefix="bcp_io_cpu_")
    os.makedirs(root, exist_ok=True)
    out: dict = {"config": vars(args) | {"torch": torch.__version__, "cpus": os.cpu_count()},
                 "loadavg_before": _loadavg()}
    try:
        for what in ("save", "load"):
            if args.only in (None, what):
                out[what] = run_ranks(_measure, args.ranks, what, root, vars(args), name=what)
                if what == "save":
                    out["save"]["summary"] = _save_summary(out["save"]["ranks"])
    finally:
        if args.dir is None:
            with contextlib.suppress(OSError):
                shutil.rmtree(root)
    out["loadavg_after"] = _loadavg()
    print(json.dumps(out, indent=1))
    return 0


def _save_summary(ranks: list[list[dict]]) -> dict:
    """Per save (first, later ones), the mean over ranks of the CPU seconds per GiB by category."""
    out = {}
    for k in range(len(ranks[0])):
        runs = [r[k] for r in ranks]
        cats = sorted({c for r in runs for c in r["per_gib"]})
        out["first" if k == 0 else f"later_{k}"] = {
            "written_gib_per_rank": round(sum(r["written_gib"] for r in runs) / len(runs), 3),
            "wall_s": round(max(r["wall_s"] for r in runs), 3),
            "cpu_s_per_gib": round(sum(r["cpu_s_per_gib"] for r in runs) / len(runs), 4),
            "per_gib": {c: round(sum(r["per_gib"].get(c, 0.0) for r in runs) / len(runs), 4) for c in cats}}
    return out


if __name__ == "__main__":
    sys.exit(main())
