"""Run a function on N gloo ranks in fresh processes, with a hard timeout."""

from __future__ import annotations

import multiprocessing as mp
import os
import queue as queue_mod
import time
import socket
import traceback
from datetime import timedelta


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world_size, port, fn, args, queue):
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=120))
        result = fn(rank, world_size, *args)
        queue.put((rank, "ok", result))
    except BaseException:  # noqa: BLE001 - reported to the parent
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(world_size: int, fn, *args, timeout: float = 180.0) -> list:
    """fn(rank, world_size, *args) on each rank; returns the results in rank order or raises."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, queue))
             for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, tuple] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) < world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"ranks {sorted(set(range(world_size)) - set(results))} did not finish "
                                   f"within {timeout}s")
            try:
                rank, status, value = queue.get(timeout=min(left, 1.0))
                results[rank] = (status, value)
            except queue_mod.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in results]
                if dead:
                    # give the other ranks a moment to report their own (usually more telling) errors
                    end = time.monotonic() + 5
                    while time.monotonic() < end and len(results) < world_size:
                        try:
                            rank, status, value = queue.get(timeout=0.5)
                            results[rank] = (status, value)
                        except queue_mod.Empty:
                            pass
                    errors = [f"--- rank {r} ---\n{v}" for r, (s, v) in sorted(results.items()) if s == "error"]
                    raise RuntimeError(f"ranks {dead} died with exit codes {[procs[r].exitcode for r in dead]}\n"
                                       + "\n".join(errors))
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    errors = [f"--- rank {r} ---\n{v}" for r, (s, v) in sorted(results.items()) if s == "error"]
    if errors:
        raise AssertionError("\n".join(errors))
    return [results[r][1] for r in range(world_size)]


RECIPES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "recipes")


def run_recipe(name: str, nproc: int, *args: str, timeout: float = 240, torchrun_for_one: bool = True,
               env: dict | None = None) -> None:
    """`recipes/<name> --phase run *args` on `nproc` processes (torchrun), with a hard timeout."""
    import subprocess
    import sys
    script = os.path.join(RECIPES, name)
    if nproc == 1 and not torchrun_for_one:
        cmd = [sys.executable, script]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc), script]
    full_env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    full_env.update(env or {})
    proc = subprocess.run([*cmd, "--phase", "run", *args], env=full_env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, f"{name} {' '.join(args)} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"


def losses_by_rank(d, rank: int = 0) -> dict[int, float]:
    """The `losses_rank<r>.json` a recipe wrote: step -> loss."""
    import json
    with open(os.path.join(d, f"losses_rank{rank}.json")) as f:
        return {step: loss for step, loss in json.load(f)}
