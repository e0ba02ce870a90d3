"""bcp vs PyTorch DCP on the same sharded state, in one run, with the physical floors.

    python bench/compare.py [--gib 1.0] [--ranks 2] [--dir /tmp/bcp_bench] [--json out.json] [--only load|save]

Every rank holds its shard of a set of FSDP-style Shard(0) DTensors (GIB in all). Measured, as
the slowest rank (wall time between barriers):

- floors: a plain `copy_` of the local shards into preallocated memory (any copying snapshot's
  floor), an fsync'd sequential write of the same bytes from aligned buffers into a new file
  around the page cache (the disk's floor, alternated with the durable saves below), and a read
  of those bytes back from the page cache (the load floor);
- save stall (time until training may continue) of an asynchronous save in steady state: bcp
  `save(async_save=True)`, DCP `async_save` as shipped, and DCP `async_save` with a cached
  staging stager (its best configuration on CPU);
- the first save's stall, each system in fresh processes of its own, the systems alternated
  twice (best of 2): fresh memory costs what the machine's page faults cost at that moment (on
  the VM this was built on, 0.2 to 3 s per GiB), so each system gets the same chances. bcp is
  measured copying (default), with `snapshot="fork"` (copy-on-write), and after `prepare_save`
  (training steps run until its buffers are ready, timed against a plain step), each with the
  time of an in-place update of every shard right after the call (where a fork's cost goes);
- end-to-end save (durable): the disk floor, bcp `save` and DCP `save`, alternated three times
  (best of 3). The floor writes new files like the checkpoints do: on a thin-provisioned virtual
  disk, rewriting one file reuses blocks the host has already backed and runs 2-3x faster;
- load into the same layout and into a different one (Shard(1)): bcp `load` (by default each
  checksum block is verified by one rank of the host, as the state holds DTensors over the whole
  group; also with `share_reads=False`, where each rank verifies every block it reads), DCP `load`;
  the resharded floor is a strided copy of exactly the needed half of every row out of memory
  maps of the floor files. Cold-cache loads too: the checkpoint's files are dropped from the page
  cache first (POSIX_FADV_DONTNEED, no privilege needed), against the direct-read floor (O_DIRECT
  reads of the floor files into aligned buffers);
- peak RSS of the steady-state runs (separate processes: saves and loads), and their peak
  anonymous memory (RSS less the pages of memory-mapped checkpoint files, which are page cache).

Prints a JSON table with the ratios the issue asks for. No assertion: this is a measurement.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import resource
import shutil
import sys
import tempfile
import time
import warnings

import torch
import torch.distributed as dist

from _spawn import run_ranks  # bench/_spawn.py

N_TENSORS = 16
FIRST_SYSTEMS = ("bcp", "dcp", "bcp_fork", "dcp_best", "bcp_prepared")


def _state(gib: float, placement: str):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    ws = dist.get_world_size()
    mesh = init_device_mesh("cpu", (ws,))
    numel = int(gib * (1 << 30) / 4 / N_TENSORS)
    cols = 1024
    rows = max(ws, numel // cols)
    out = {}
    for i in range(N_TENSORS):
        torch.manual_seed(i)
        local_rows = rows // ws
        # build the shard directly (no full tensor per rank): DTensor.from_local of Shard(0) pieces
        from torch.distributed.tensor import DTensor
        local = torch.randn(local_rows, cols)
        dt = DTensor.from_local(local, mesh, [Shard(0)], run_check=False)
        if placement == "shard1":
            dt = distribute_tensor(torch.zeros(local_rows * ws, cols), mesh, [Shard(1)])
        out[f"layer{i}.weight"] = dt
    return out


def _settle() -> None:
    """Flush dirty pages of earlier phases so no measurement pays for another's writeback."""
    os.sync()
    dist.barrier()


def _timed(fn) -> float:
    _settle()
    t = time.perf_counter()
    fn()
    dist.barrier()
    return _max(time.perf_counter() - t)


class AnonPeak:
    """Peak anonymous memory (RssAnon) of this process, sampled every 5 ms: ru_maxrss also counts
    the pages of memory-mapped checkpoint files a load touches, which are page cache the kernel
    reclaims at will, not memory the job holds."""

    def __init__(self):
        import threading
        self.mib = 0.0
        threading.Thread(target=self._sample, daemon=True).start()

    def _sample(self):
        while True:
            with open("/proc/self/status") as f:
                for line in f:
                    if line.startswith("RssAnon:"):
                        self.mib = max(self.mib, int(line.split()[1]) / 1024)
            time.sleep(0.005)


def _evict(path: str) -> None:
    """Drop the page-cache pages of every file under `path` (POSIX_FADV_DONTNEED on clean pages:
    no privilege needed, unlike dropping every cache), so the next read comes from the disk."""
    os.sync()
    walk = os.walk(path) if os.path.isdir(path) else [(os.path.dirname(path), [], [os.path.basename(path)])]
    for d, _, names in walk:
        for n in names:
            fd = os.open(os.path.join(d, n), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _cold(fn, *paths) -> float:
    """`fn`'s time with the files under `paths` out of the page cache (best of 2)."""
    times = []
    for _ in range(2):
        dist.barrier()
        if dist.get_rank() == 0:
            for p in paths:
                _evict(p)
        times.append(_timed(fn))
    return min(times)


def _max(x: float) -> float:
    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _stall_then_wait(save_fn) -> float:
    """Time until save_fn returns (the stall); then wait for completion outside the timing."""
    _settle()
    t = time.perf_counter()
    waiter = save_fn()
    stall = time.perf_counter() - t
    waiter()
    dist.barrier()
    return _max(stall)


def _write_fsynced(path: str, tensors) -> None:
    """The disk's floor: the tensors' bytes written sequentially into `path`, then fsync'd."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    for t in tensors:
        mv = memoryview(t.view(-1).view(torch.uint8).numpy())
        while len(mv):
            mv = mv[os.write(fd, mv):]
    os.fsync(fd)
    os.close(fd)


def _aligned_copies(tensors) -> list[mmap.mmap]:
    """The tensors' bytes in page-aligned buffers padded to 4 KiB, as direct I/O takes them."""
    out = []
    for t in tensors:
        raw = t.reshape(-1).view(torch.uint8)
        m = mmap.mmap(-1, -(-raw.numel() // 4096) * 4096)
        torch.frombuffer(m, dtype=torch.uint8, count=raw.numel()).copy_(raw)
        out.append(m)
    return out


def _write_direct(path: str, buffers: list[mmap.mmap]) -> None:
    """The disk's floor: aligned buffers written sequentially around the page cache, then fsync'd."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_DIRECT", 0), 0o644)
    pos = 0
    for m in buffers:
        view = memoryview(m)
        while len(view):
            n = os.pwrite(fd, view, pos)
            view, pos = view[n:], pos + n
    os.fsync(fd)
    os.close(fd)


def _floors(gib, root):
    rank = dist.get_rank()
    state = _state(gib, "shard0")
    locals_ = [t.to_local() for t in state.values()]
    dst = [torch.empty_like(t) for t in locals_]
    copy_first = _timed(lambda: [d.copy_(s) for d, s in zip(dst, locals_)])
    copy_steady = min(_timed(lambda: [d.copy_(s) for d, s in zip(dst, locals_)]) for _ in range(3))
    path = os.path.join(root, f"floor_r{rank}.bin")

    _write_fsynced(path, locals_)  # the file the read floors read (the disk floor is measured in _e2e)

    def read():
        fd = os.open(path, os.O_RDONLY)
        off = 0
        for d in dst:
            mv = memoryview(d.view(-1).view(torch.uint8).numpy())
            off += os.preadv(fd, [mv], off)
        os.close(fd)

    read_s = min(_timed(read) for _ in range(3))
    aligned = _aligned_copies(locals_)

    def read_direct():  # from the disk around the page cache, into aligned buffers: the cold floor
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
        off = 0
        for m in aligned:
            off += os.preadv(fd, [m], off)
        os.close(fd)

    direct_s = min(_timed(read_direct) for _ in range(3))
    cold_buffered_s = _cold(read, *[os.path.join(root, f"floor_r{r}.bin") for r in range(dist.get_world_size())])

    # Shard(0) -> Shard(1): this rank's half of every row, out of every rank's file
    ws, cols = dist.get_world_size(), locals_[0].shape[1]
    part = slice(rank * cols // ws, (rank + 1) * cols // ws)
    halves = [torch.empty(t.shape[0] * ws, part.stop - part.start) for t in locals_]

    def read_resharded():
        for r in range(ws):
            with open(os.path.join(root, f"floor_r{r}.bin"), "rb") as f:
                mapped = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # read-only buffer, only read from
                flat = torch.frombuffer(mapped, dtype=torch.float32)
            off = 0
            for t, h in zip(locals_, halves):
                n = t.numel()
                h[r * t.shape[0]:(r + 1) * t.shape[0]].copy_(flat[off:off + n].view(t.shape)[:, part])
                off += n
            del flat

    resharded_s = min(_timed(read_resharded) for _ in range(3))
    return {"copy_first_s": copy_first, "copy_s": copy_steady, "page_cache_read_s": read_s,
            "page_cache_read_resharded_s": resharded_s, "direct_read_s": direct_s,
            "cold_buffered_read_s": cold_buffered_s}


def _first(gib, root, system):
    """The first asynchronous save of a fresh process, and an in-place update of every shard
    right after the call (the next optimizer step)."""
    state = _state(gib, "shard0")
    locals_ = [t.to_local() for t in state.values()]
    path = os.path.join(root, f"first_{system}")
    out = {}
    if system == "bcp_prepared":  # prepare_save, then training steps until its buffers are ready
        import bcp_core as bcp
        out["plain_step_s"] = _timed(lambda: [x.add_(1.0) for x in locals_])
        t = time.perf_counter()
        ready = bcp.prepare_save(state)
        out["prepare_call_s"] = _max(time.perf_counter() - t)
        steps = []
        while not ready.done():
            t = time.perf_counter()
            for x in locals_:
                x.add_(1.0)
            steps.append(time.perf_counter() - t)
        out["steps_while_preparing"] = len(steps)
        out["step_while_preparing_s"] = _max(max(steps, default=0.0))
        dist.barrier()
    _settle()
    t = time.perf_counter()
    if system in ("bcp", "bcp_fork", "bcp_prepared"):
        import bcp_core as bcp
        handle = bcp.save(path, state, async_save=True, snapshot="fork" if system == "bcp_fork" else "copy")
        wait = handle.wait
    else:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
        stager = DefaultStager(StagingOptions(False, False, False, False)) if system == "dcp_best" else None
        resp = dcp.async_save(state, checkpoint_id=path, async_stager=stager)
        wait = (resp.upload_completion if hasattr(resp, "upload_completion") else resp).result
    stall = time.perf_counter() - t
    t = time.perf_counter()
    for x in locals_:
        x.add_(1.0)
    step = time.perf_counter() - t
    wait()
    dist.barrier()
    return {"stall_s": _max(stall), "step_after_s": _max(step), **out}


def _bcp(gib, root):
    anon = AnonPeak()
    import bcp_core as bcp

    state = _state(gib, "shard0")
    out = {}
    path = os.path.join(root, "bcp_async")
    stalls = [_stall_then_wait(lambda k=k: bcp.save(path, state, step=k, async_save=True, role="bench").wait)
              for k in range(3)]
    out["stall_steady_s"] = min(stalls[1:])
    out.update(_bcp_loads(gib, root, state))
    out["peak_rss_mib"] = _max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    out["peak_anon_mib"] = _max(anon.mib)
    return out


def _bcp_loads(gib, root, state) -> dict:
    """bcp's loads of `state` saved once: into the same layout, resharded (shared and not); best of 3."""
    import bcp_core as bcp

    out = {}
    bcp.save(os.path.join(root, "bcp_sync"), state, step=0, role="bench-sync").wait()
    target = _state(gib, "shard0")
    out["load_s"] = min(_timed(lambda: bcp.load(os.path.join(root, "bcp_sync"), target)) for _ in range(3))
    assert all(torch.equal(a.to_local(), b.to_local()) for a, b in zip(state.values(), target.values()))
    resharded = _state(gib, "shard1")
    out["load_resharded_s"] = min(_timed(lambda: bcp.load(os.path.join(root, "bcp_sync"), resharded))
                                  for _ in range(3))
    out["load_resharded_unshared_s"] = min(_timed(lambda: bcp.load(os.path.join(root, "bcp_sync"), resharded,
                                                                   share_reads=False)) for _ in range(3))
    assert all(torch.equal(a.full_tensor(), b.full_tensor()) for a, b in zip(state.values(), resharded.values()))
    out["load_cold_s"] = _cold(lambda: bcp.load(os.path.join(root, "bcp_sync"), target), os.path.join(root, "bcp_sync"))
    out["load_resharded_cold_s"] = _cold(lambda: bcp.load(os.path.join(root, "bcp_sync"), resharded),
                                         os.path.join(root, "bcp_sync"))
    return out


def _dcp(gib, root):
    anon = AnonPeak()
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    state = _state(gib, "shard0")
    out = {}
    stalls = []
    for k in range(3):
        path = os.path.join(root, f"dcp_async_{k}")
        stalls.append(_stall_then_wait(lambda p=path: dcp.async_save(state, checkpoint_id=p).result))
    out["stall_steady_s"] = min(stalls[1:])
    # best configuration on CPU: a stager that caches its staging copies across saves
    stager = DefaultStager(StagingOptions(use_pinned_memory=False, use_shared_memory=False,
                                          use_async_staging=False, use_non_blocking_copy=False))
    stalls = []
    for k in range(3):
        path = os.path.join(root, f"dcp_best_{k}")

        def go(p=path):
            resp = dcp.async_save(state, checkpoint_id=p, async_stager=stager)
            fut = resp.upload_completion if hasattr(resp, "upload_completion") else resp
            return fut.result
        stalls.append(_stall_then_wait(go))
    stager.close()
    out["best_stall_steady_s"] = min(stalls[1:])
    out.update(_dcp_loads(gib, root, state))
    out["peak_rss_mib"] = _max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    out["peak_anon_mib"] = _max(anon.mib)
    return out


def _dcp_loads(gib, root, state) -> dict:
    """DCP's loads of `state` saved once: into the same layout and resharded; best of 3."""
    import torch.distributed.checkpoint as dcp

    out = {}
    dcp.save(state, checkpoint_id=os.path.join(root, "dcp_sync_1"))
    target = _state(gib, "shard0")
    out["load_s"] = min(_timed(lambda: dcp.load(target, checkpoint_id=os.path.join(root, "dcp_sync_1")))
                        for _ in range(3))
    assert all(torch.equal(a.to_local(), b.to_local()) for a, b in zip(state.values(), target.values()))
    resharded = _state(gib, "shard1")
    out["load_resharded_s"] = min(_timed(lambda: dcp.load(resharded, checkpoint_id=os.path.join(root, "dcp_sync_1")))
                                  for _ in range(3))
    path = os.path.join(root, "dcp_sync_1")
    out["load_cold_s"] = _cold(lambda: dcp.load(target, checkpoint_id=path), path)
    out["load_resharded_cold_s"] = _cold(lambda: dcp.load(resharded, checkpoint_id=path), path)
    return out


def _loads_only(gib, root, system):
    """One system's loads in processes of their own (`--only load`), with their peak memory."""
    anon = AnonPeak()
    state = _state(gib, "shard0")
    out = (_bcp_loads if system == "bcp" else _dcp_loads)(gib, root, state)
    out["peak_rss_mib"] = _max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    out["peak_anon_mib"] = _max(anon.mib)
    return out


def _e2e(gib, root):
    """Durable saves of both systems and the disk floor (an fsync'd sequential direct-I/O write of
    this rank's bytes into a new file, as a checkpoint writes new files), alternated so that all three see the
    same disk conditions; best of 3. The first save of each runs in round 0, planning included."""
    import torch.distributed.checkpoint as dcp

    import bcp_core as bcp

    state = _state(gib, "shard0")
    locals_ = [t.to_local() for t in state.values()]
    rank = dist.get_rank()

    outputs = {"disk": lambda k: os.path.join(root, f"e2e_disk_{k}_r{rank}.bin"),
               "bcp": lambda k: os.path.join(root, f"e2e_bcp_{k}"),
               "dcp": lambda k: os.path.join(root, f"e2e_dcp_{k}")}
    aligned = _aligned_copies(locals_)  # made before the timing: the floor is the write alone
    run = {"disk": lambda k: _write_direct(outputs["disk"](k), aligned),
           "bcp": lambda k: bcp.save(outputs["bcp"](k), state, role="e2e"),
           "dcp": lambda k: dcp.save(state, checkpoint_id=outputs["dcp"](k))}
    times: dict[str, list[float]] = {"disk": [], "bcp": [], "dcp": []}
    order = list(run)
    for k in range(3):
        for name in order[k:] + order[:k]:  # each goes first once
            # Keep only the newest output of each, as a job rotating its checkpoints does: every
            # writer then lands on blocks freed alike, not one on recycled blocks and one on new ones.
            if k and (name == "disk" or rank == 0):
                old = outputs[name](k - 1)
                if name == "disk":
                    os.remove(old)
                else:
                    shutil.rmtree(old)
            dist.barrier()
            times[name].append(_timed(lambda: run[name](k)))
    return {"disk_write_s": min(times["disk"]), "bcp_save_first_s": times["bcp"][0], "bcp_save_s": min(times["bcp"]),
            "dcp_save_first_s": times["dcp"][0], "dcp_save_s": min(times["dcp"]), "runs": times}


def _measure(what, gib, root):
    if what.startswith("first:"):
        return _first(gib, root, what.split(":")[1])
    if what.startswith("loads:"):
        return _loads_only(gib, root, what.split(":")[1])
    return {"floors": _floors, "bcp": _bcp, "dcp": _dcp, "e2e": _e2e}[what](gib, root)


def _run(what, ranks, gib, root):
    return run_ranks(_measure, ranks, what, gib, root, name=what)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=1.0, help="total state size in GiB (default 1)")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--dir", default=None, help="where checkpoints go (default: a temp dir, removed after)")
    ap.add_argument("--json", default=None, help="also write the table to this file")
    ap.add_argument("--only", choices=("all", "load", "save"), default="all",
                    help="'load': only the read floors and the loads of both systems; 'save': only the durable "
                         "saves against the disk's floor (default: all)")
    args = ap.parse_args()
    root = args.dir or tempfile.mkdtemp(prefix="bcp_bench_")
    os.makedirs(root, exist_ok=True)
    if args.only == "load":
        return _print(_load_table(args, root), args.json)
    if args.only == "save":
        return _print(_save_table(args, root), args.json)
    try:
        floors = _run("floors", args.ranks, args.gib, root)
        first: dict[str, list[dict]] = {s: [] for s in FIRST_SYSTEMS}
        for _ in range(2):
            for system in FIRST_SYSTEMS:
                first[system].append(_run(f"first:{system}", args.ranks, args.gib, root))
                shutil.rmtree(os.path.join(root, f"first_{system}"), ignore_errors=True)
        first = {s: min(runs, key=lambda r: r["stall_s"]) | {"stall_runs_s": [r["stall_s"] for r in runs]}
                 for s, runs in first.items()}
        bcp_r = _run("bcp", args.ranks, args.gib, root)
        dcp_r = _run("dcp", args.ranks, args.gib, root)
        e2e = _run("e2e", args.ranks, args.gib, root)
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    floor_copy, floor_read, floor_resh = floors["copy_s"], floors["page_cache_read_s"], \
        floors["page_cache_read_resharded_s"]
    table = {
        "config": {"gib": args.gib, "ranks": args.ranks, "torch": torch.__version__, "cpus": os.cpu_count()},
        "floors": floors, "first_save": first, "bcp": bcp_r, "dcp": dcp_r, "save_e2e": e2e,
        "ratios": {
            "stall_steady_bcp_over_copy": bcp_r["stall_steady_s"] / floor_copy,
            "stall_steady_bcp_over_dcp": bcp_r["stall_steady_s"] / dcp_r["stall_steady_s"],
            "stall_steady_bcp_over_dcp_best": bcp_r["stall_steady_s"] / dcp_r["best_stall_steady_s"],
            "stall_first_bcp_over_dcp": first["bcp"]["stall_s"] / first["dcp"]["stall_s"],
            "stall_first_bcp_over_dcp_best": first["bcp"]["stall_s"] / first["dcp_best"]["stall_s"],
            "stall_first_fork_over_dcp": first["bcp_fork"]["stall_s"] / first["dcp"]["stall_s"],
            "stall_first_fork_over_dcp_best": first["bcp_fork"]["stall_s"] / first["dcp_best"]["stall_s"],
            "stall_first_prepared_over_dcp": first["bcp_prepared"]["stall_s"] / first["dcp"]["stall_s"],
            "stall_first_prepared_over_dcp_best": first["bcp_prepared"]["stall_s"] / first["dcp_best"]["stall_s"],
            "stall_plus_next_step_fork_over_copy":
                (first["bcp_fork"]["stall_s"] + first["bcp_fork"]["step_after_s"])
                / (first["bcp"]["stall_s"] + first["bcp"]["step_after_s"]),
            "save_bw_bcp_over_disk": e2e["disk_write_s"] / e2e["bcp_save_s"],
            "save_speedup_vs_dcp": e2e["dcp_save_s"] / e2e["bcp_save_s"],
            "load_speedup_vs_dcp": dcp_r["load_s"] / bcp_r["load_s"],
            "load_bcp_over_page_cache": bcp_r["load_s"] / floor_read,
            "load_cold_bcp_over_direct_read": bcp_r["load_cold_s"] / floors["direct_read_s"],
            "load_cold_speedup_vs_dcp": dcp_r["load_cold_s"] / bcp_r["load_cold_s"],
            "resharded_load_cold_bcp_over_direct_read": bcp_r["load_resharded_cold_s"] / floors["direct_read_s"],
            "resharded_load_cold_speedup_vs_dcp": dcp_r["load_resharded_cold_s"] / bcp_r["load_resharded_cold_s"],
            "resharded_load_speedup_vs_dcp": dcp_r["load_resharded_s"] / bcp_r["load_resharded_s"],
            "resharded_load_bcp_over_resharded_floor": bcp_r["load_resharded_s"] / floor_resh,
            "resharded_load_bcp_over_page_cache": bcp_r["load_resharded_s"] / floor_read,
            "resharded_unshared_load_speedup_vs_dcp": dcp_r["load_resharded_s"] / bcp_r["load_resharded_unshared_s"],
            "resharded_unshared_load_bcp_over_resharded_floor": bcp_r["load_resharded_unshared_s"] / floor_resh,
            "peak_rss_bcp_over_dcp": bcp_r["peak_rss_mib"] / dcp_r["peak_rss_mib"],
            "peak_anon_bcp_over_dcp": bcp_r["peak_anon_mib"] / dcp_r["peak_anon_mib"],
        },
        "bandwidth_gib_s": {"disk_write": args.gib / e2e["disk_write_s"],
                            "bcp_save": args.gib / e2e["bcp_save_s"], "dcp_save": args.gib / e2e["dcp_save_s"]},
    }
    return _print(table, args.json)


def _load_table(args, root) -> dict:
    try:
        floors = _run("floors", args.ranks, args.gib, root)
        bcp_r = _run("loads:bcp", args.ranks, args.gib, root)
        dcp_r = _run("loads:dcp", args.ranks, args.gib, root)
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    floor_read, floor_resh = floors["page_cache_read_s"], floors["page_cache_read_resharded_s"]
    return {
        "config": {"gib": args.gib, "ranks": args.ranks, "torch": torch.__version__, "cpus": os.cpu_count()},
        "floors": floors, "bcp": bcp_r, "dcp": dcp_r,
        "ratios": {
            "load_speedup_vs_dcp": dcp_r["load_s"] / bcp_r["load_s"],
            "load_bcp_over_page_cache": bcp_r["load_s"] / floor_read,
            "load_cold_bcp_over_direct_read": bcp_r["load_cold_s"] / floors["direct_read_s"],
            "load_cold_speedup_vs_dcp": dcp_r["load_cold_s"] / bcp_r["load_cold_s"],
            "resharded_load_cold_bcp_over_direct_read": bcp_r["load_resharded_cold_s"] / floors["direct_read_s"],
            "resharded_load_cold_speedup_vs_dcp": dcp_r["load_resharded_cold_s"] / bcp_r["load_resharded_cold_s"],
            "resharded_load_speedup_vs_dcp": dcp_r["load_resharded_s"] / bcp_r["load_resharded_s"],
            "resharded_load_bcp_over_resharded_floor": bcp_r["load_resharded_s"] / floor_resh,
            "resharded_unshared_load_speedup_vs_dcp": dcp_r["load_resharded_s"] / bcp_r["load_resharded_unshared_s"],
            "peak_anon_bcp_over_dcp": bcp_r["peak_anon_mib"] / dcp_r["peak_anon_mib"],
        },
    }


def _save_table(args, root) -> dict:
    try:
        e2e = _run("e2e", args.ranks, args.gib, root)
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    return {
        "config": {"gib": args.gib, "ranks": args.ranks, "torch": torch.__version__, "cpus": os.cpu_count()},
        "save_e2e": e2e,
        "ratios": {"save_bw_bcp_over_disk": e2e["disk_write_s"] / e2e["bcp_save_s"],
                   "save_speedup_vs_dcp": e2e["dcp_save_s"] / e2e["bcp_save_s"]},
    }


def _print(table: dict, json_path: str | None) -> int:
    text = json.dumps(table, indent=2)
    print(text)
    if json_path:
        with open(json_path, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
