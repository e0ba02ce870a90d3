"""How long a preempted job needs between SIGTERM and its exit with a committed checkpoint.

    python bench/preemption_grace.py [--gib 1.0] [--ranks 2] [--dir /tmp/bcp_grace] [--repeat 3]

Launches a training job under torchrun whose ranks together hold GIB of state (each rank its own
shard, as with FSDP or ZeRO, plus a small DDP model trained every step), with
`bcp.handle_preemption()`. Once the job trains, SIGTERM goes to torchrun, which forwards it to
every worker; the workers agree on a step boundary, save (async) and `preemption.exit()`. Timed:
from the signal to torchrun's exit, which is the grace period the scheduler must allow. Also
prints the same for a job with no state beyond the model (the fixed cost: the step finishing,
the agreement, process teardown), and the difference per GiB. Best of `--repeat` (the disk's
speed varies from run to run on shared machines).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time


def worker(root: str, gib: float) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn

    import bcp_core as bcp

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = nn.parallel.DistributedDataParallel(nn.Linear(256, 256))
    optim = torch.optim.SGD(model.parameters(), lr=1e-3)
    per_rank = int(gib * 2**30 / world) // 4
    shard = torch.rand(per_rank // 1024, 1024) if per_rank else torch.empty(0, 1024)
    state = {"model": model, "optimizer": optim, "shard": {f"rank{rank}": shard}}
    preemption = bcp.handle_preemption()
    step = 0
    while True:
        loss = model(torch.randn(64, 256)).square().mean()
        optim.zero_grad()
        loss.backward()
        optim.step()
        step += 1
        if step == 3 and rank == 0:
            open(os.path.join(root, "training"), "w").close()
        time.sleep(0.05)
        if preemption.stop_requested():
            bcp.save(root, state, step=step, async_save=True)
            preemption.exit()


def run_once(root: str, gib: float, ranks: int) -> float:
    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(root)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                             str(ranks), __file__, "--worker", "--dir", root, "--gib", str(gib)],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    marker = os.path.join(root, "training")
    deadline = time.monotonic() + 300
    while not os.path.exists(marker):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"the job did not start training:\n{proc.stderr.read()[-4000:]}")
        time.sleep(0.05)
    subprocess.run(["sync"], check=True)  # no other writeback competes with the checkpoint's
    t0 = time.perf_counter()
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=600)
    elapsed = time.perf_counter() - t0
    latest = os.path.join(root, "latest")
    if not os.path.exists(latest):
        raise RuntimeError(f"no committed checkpoint after SIGTERM:\n{err[-4000:]}")
    if "exitcode" in err and "143" not in err:
        raise RuntimeError(f"a worker exited abnormally:\n{err[-4000:]}")
    return elapsed


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--gib", type=float, default=1.0)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--dir", default="/tmp/bcp_grace")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--worker", action="store_true")
    args = p.parse_args()
    if args.worker:
        worker(args.dir, args.gib)
        return
    base = min(run_once(args.dir, 0.0, args.ranks) for _ in range(args.repeat))
    full = min(run_once(args.dir, args.gib, args.ranks) for _ in range(args.repeat))
    shutil.rmtree(args.dir, ignore_errors=True)
    print(json.dumps({
        "ranks": args.ranks, "gib": args.gib,
        "sigterm_to_exit_s": {"no_state": round(base, 2), f"{args.gib}_gib": round(full, 2)},
        "grace_s_per_gib": round((full - base) / args.gib, 2) if args.gib else None,
    }, indent=2))


if __name__ == "__main__":
    main()
