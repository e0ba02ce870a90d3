"""A 2-rank DDP job on the plain bcp API that checkpoints after every step, sync and async saves
alternating, while tests/faults.py injects faults into some saves (BCP_TEST_FAULT).

    torchrun --nproc_per_node 2 tests/jobs/fault_matrix.py --root DIR --steps N

The loop handles a failed save as a careful user does: it logs it and goes on training (a failed
asynchronous save surfaces at `wait()` or, as PreviousSaveError, at the next save, which goes on).
Each rank writes DIR/outcomes_rank<r>.json: step -> "committed", "failed: <error>" or
"committed, on_commit failed: <error>"; rank 0 writes DIR/reference_<step>.pt, the values the
checkpoint of <step> must hold.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

import bcp_core as bcp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import faults  # noqa: E402 - tests/faults.py


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--steps", type=int, default=13)
    p.add_argument("--timeout", type=float, default=120.0, help="each save's timeout, in seconds")
    p.add_argument("--short-timeout", type=float, default=3.0,
                   help="the timeout of a save in which another rank stalls (the timeout is what it tests)")
    args = p.parse_args()
    faults.install_from_env()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1)))
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    state = {"model": model, "optimizer": optim, "extra_state": {"step": 0}}
    outcomes: dict[int, str] = {}
    handles: dict[int, bcp.SaveHandle] = {}

    for step in range(1, args.steps + 1):
        g = torch.Generator().manual_seed(100 * step + rank)
        x = torch.randn(8, 16, generator=g)
        nn.functional.mse_loss(model(x), x.sum(1, keepdim=True)).backward()
        optim.step()
        optim.zero_grad()
        state["extra_state"]["step"] = step
        # one save per step: save number `step` on every rank
        timeout = timedelta(seconds=args.short_timeout if faults.waits_for_a_stalled_rank(step) else args.timeout)
        try:
            handles[step] = bcp.save(args.root, state, step=step, async_save=step % 2 == 1, timeout=timeout)
        except bcp.PreviousSaveError as e:  # an earlier async save failed; this one goes on
            handles[step] = e.handle
        except bcp.SaveError as e:
            outcomes[step] = f"failed: {e}"
        except bcp.CommitCallbackError as e:  # a synchronous save committed, its on_commit raised
            outcomes[step] = f"committed, on_commit failed: {e}"
        if rank == 0:
            torch.save({"model": model.module.state_dict(), "optimizer": optim.state_dict()},
                       os.path.join(args.root, f"reference_{step}.pt"))
    for step, handle in handles.items():
        try:
            handle.wait()
            outcomes[step] = "committed"
        except bcp.CommitCallbackError as e:
            outcomes[step] = f"committed, on_commit failed: {e}"
        except bcp.SaveError as e:
            outcomes[step] = f"failed: {e}"
    with open(os.path.join(args.root, f"outcomes_rank{rank}.json"), "w") as f:
        json.dump(dict(sorted(outcomes.items())), f)


if __name__ == "__main__":
    main()
