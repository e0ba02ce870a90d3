"""A 2-rank DDP training job on the plain bcp API, ended the ways real jobs end.

    torchrun --nproc_per_node 2 tests/jobs/plain_train.py --root DIR [--steps N] [--end HOW]
        [--preemption] [--resume] [--pause-at STEP] [--fail-write] [--die-rank R] [--timeout S]

--end: how the process ends right after its last (asynchronous) save: "script" (falls off the
end), "sys_exit" (sys.exit(0)), "exception" (an uncaught exception), "destroy" (destroys the
process group, then falls off the end). Without --preemption the job saves once, after its last
step, and ends; with it, SIGTERM leads to a checkpoint at the agreed step boundary and exit 143.
Each step writes DIR/progress_rank<r> ("<step reached> <pid>") for the test that sends the signal,
and at --pause-at waits for the test to release it (tests/pause.py);
DIR/reference_<step>.pt holds, from rank 0, the values the checkpoint of <step> must hold.
"""

from __future__ import annotations

import argparse
import errno
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

import bcp_core as bcp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from pause import pause_at  # noqa: E402 - tests/pause.py


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(16, 32, generator=g)
    return x, x.sum(dim=1, keepdim=True)


def save_reference(root: str, step: int, model, optim) -> None:
    """The values the checkpoint of `step` must hold, written with torch.save for the test to compare."""
    if dist.get_rank() == 0:
        torch.save({"model": model.module.state_dict(), "optimizer": optim.state_dict()},
                   os.path.join(root, f"reference_{step}.pt"))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--end", default="script", choices=["script", "sys_exit", "exception", "destroy"])
    p.add_argument("--preemption", action="store_true")
    p.add_argument("--resume", action="store_true")
    p.add_argument("--pause-at", type=int, default=None, help="wait at this step until the test releases it")
    p.add_argument("--fail-write", action="store_true", help="inject ENOSPC into this job's data writes")
    p.add_argument("--die-rank", type=int, default=None, help="this rank exits at once after the save call")
    p.add_argument("--timeout", type=float, default=10.0, help="each save's timeout, in seconds")
    p.add_argument("--mib", type=int, default=4, help="size of the extra state tensor")
    args = p.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1)))
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    # bulk that makes the save take a while: written by the ranks, loaded back exactly
    bulk = torch.arange(args.mib * 2**18, dtype=torch.float32).reshape(-1, 1024)
    state = {"model": model, "optimizer": optim, "extra_state": {"step": 0}, "bulk": {"t": bulk}}
    start = 0
    if args.resume:
        bcp.load(args.root, state)
        start = state["extra_state"]["step"]
    preemption = bcp.handle_preemption() if args.preemption else None
    if args.fail_write:
        from bcp_core.storage.faults import Fault, inject
        inject(Fault("write", error=OSError(errno.ENOSPC, "No space left on device")))
    timeout = timedelta(seconds=args.timeout)

    for step in range(start, args.steps):
        x, y = batch(step, rank)
        loss = nn.functional.mse_loss(model(x), y)
        optim.zero_grad()
        loss.backward()
        optim.step()
        with open(os.path.join(args.root, f"progress_rank{rank}"), "w") as f:
            f.write(f"{step + 1} {os.getpid()}")
        if step + 1 == args.pause_at:
            pause_at(args.root, step + 1)
        if preemption is not None and preemption.stop_requested():
            state["extra_state"]["step"] = step + 1
            bcp.save(args.root, state, step=step + 1, async_save=True, timeout=timeout)
            save_reference(args.root, step + 1, model, optim)
            preemption.exit()

    state["extra_state"]["step"] = args.steps
    bcp.save(args.root, state, step=args.steps, async_save=True, timeout=timeout)
    save_reference(args.root, args.steps, model, optim)
    if args.die_rank == rank:
        os._exit(0)  # gone before its share is written: the others must fail, naming this rank
    if args.end == "sys_exit":
        sys.exit(0)
    if args.end == "exception":
        raise RuntimeError("the training script failed after its last save")
    if args.end == "destroy":
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
