"""Run a benchmark function on N gloo ranks in fresh processes; rank 0's result comes back.

Fresh processes per measurement: no system inherits another's warmed memory or threads.
"""

from __future__ import annotations

import os
import queue as queue_mod
import socket
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(rank, ws, port, fn, args, queue):
    # as torchrun does: LOCAL_WORLD_SIZE tells bcp how many ranks share this host's cores
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_WORLD_SIZE=str(ws))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=ws, timeout=timedelta(minutes=20))
    try:
        res = fn(*args)
        if rank == 0:
            queue.put(res)
        # A gloo worker thread frees the last collective's work (and its tensor, which needs the GIL)
        # just after the caller returns; if the interpreter is finalizing by then, the process
        # aborts. Sleeping releases the GIL so that the thread finishes first.
        dist.barrier()
        time.sleep(0.2)
    finally:
        dist.destroy_process_group()


def run_ranks(fn, ranks: int, *args, name: str = ""):
    """`fn(*args)` on `ranks` fresh gloo processes (fn must be importable by name); rank 0's result."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=_worker, args=(r, ranks, port, fn, args, queue)) for r in range(ranks)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + 3600
    while True:  # a rank that dies before rank 0 reports must end the run, not leave it waiting an hour
        try:
            res = queue.get(timeout=1.0)
            break
        except queue_mod.Empty:
            dead = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
            if dead or time.monotonic() > deadline:
                for p in procs:
                    p.kill()
                    p.join()
                what = ", ".join(f"rank {r} exited with code {c}" for r, c in dead) or "no result within an hour"
                raise RuntimeError(f"bench: {name or fn.__name__}: {what} before rank 0 reported")
    for rank, p in enumerate(procs):
        p.join()
        if p.exitcode:
            print(f"bench: {name or fn.__name__}: rank {rank} exited with code {p.exitcode} after reporting",
                  file=sys.stderr)
    return res
