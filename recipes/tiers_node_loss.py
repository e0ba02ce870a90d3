"""Tiered checkpoints: a node dies mid-run, the job resumes on the nodes left, from their memory.

    python recipes/tiers_node_loss.py [--out DIR]

Simulates 3 nodes of 2 ranks on this machine (`BCP_LOCAL_WORLD_SIZE=2`; each node keeps its
memory tier in a directory of its own, as each machine has its own RAM):

1. trains a small FSDP2 model with Adam on 6 ranks, saving every step to
   `bcp.Tiers("memory://recipe", durable=DIR/durable, replicas=1, persist_every=4)`: each node's
   pieces in its own memory and in one other node's, every 4th step also drained to DIR/durable;
2. after step 6 is committed, node 2's processes are killed (SIGKILL) and its memory is wiped, as
   when a machine is lost; torchrun ends the job;
3. restarts on the 2 nodes left (4 ranks): `bcp.load(tiers, state)` finds step 6, whole, in the
   survivors' memory (node 2's pieces in their replicas), loads it resharded from 6 ranks to 4, and
   checks every parameter and optimizer moment against what the first run had at step 6; then trains
   on and saves to the tiers again.

The code a training script needs is the `Tiers` value, `bcp.save(tiers, ..., step=n)` and
`bcp.load(tiers, ...)`; the rest here is the simulation. docs/tiers.md explains the design.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile

import torch
import torch.distributed as dist
from torch import nn

import bcp_core as bcp

KILLED_AFTER, STEPS, NODE_SIZE = 6, 8, 2


def _model():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 96), nn.GELU(), nn.Linear(96, 64))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def _step(model, optim, step: int) -> float:
    g = torch.Generator().manual_seed(step)  # the same batch for a step, whatever the world size
    x = torch.randn(12, 64, generator=g)
    rows = 12 // dist.get_world_size()
    x = x[dist.get_rank() * rows:(dist.get_rank() + 1) * rows]
    loss = (model(x) - x).square().mean()
    optim.zero_grad()
    loss.backward()
    optim.step()
    return loss.item()


def _full(model, optim) -> dict:
    """Every parameter and Adam moment, whole (collective: full_tensor gathers)."""
    out = {f"p.{n}": p.full_tensor() for n, p in model.named_parameters()}
    for n, p in model.named_parameters():
        for k in ("exp_avg", "exp_avg_sq"):
            out[f"{k}.{n}"] = optim.state[p][k].full_tensor()
    return out


def run(args) -> None:
    """One training job (a torchrun worker)."""
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    node = rank // NODE_SIZE
    # the simulation: each node's RAM is a directory of its own (on a cluster, /dev/shm of each machine)
    os.environ["BCP_MEMORY_DIR"] = os.path.join(args.out, f"node_memory_{args.memory.split(',')[node]}")
    os.makedirs(os.environ["BCP_MEMORY_DIR"], exist_ok=True)

    tiers = bcp.Tiers("memory://recipe", durable=os.path.join(args.out, "durable"), replicas=1, persist_every=4)
    model, optim = _model()
    state = {"model": model, "optimizer": optim, "extra_state": {"step": 0}}
    start = 0
    if args.resume:
        _step(model, optim, 0)  # the optimizer's state exists before loading into it (Adam creates it lazily)
        result = bcp.load(tiers, state)
        start = state["extra_state"]["step"]
        full = _full(model, optim)
        if rank == 0:
            saved = torch.load(os.path.join(args.out, f"state_{start}.pt"))
            same = all(torch.equal(full[k], v) for k, v in saved.items())
            print(f"resumed from step {start} ({result.tier}: {result.path}) on {dist.get_world_size()} ranks; "
                  f"every parameter and moment as at step {start}: {same}", flush=True)
            if not same:
                raise SystemExit("the resumed state differs from the saved one")
    for step in range(start + 1, STEPS + 1):
        loss = _step(model, optim, step)
        state["extra_state"]["step"] = step
        handle = bcp.save(tiers, state, step=step, async_save=True)
        full = _full(model, optim)
        if rank == 0:
            print(f"step {step}: loss {loss:.5f}", flush=True)
            if not args.resume:
                torch.save(full, os.path.join(args.out, f"state_{step}.pt"))
        if not args.resume and step == KILLED_AFTER:
            handle.wait()  # step 6 committed in memory, with its replicas
            dist.barrier()
            if node == 2:
                os.kill(os.getpid(), signal.SIGKILL)  # the machine is gone
    handle.wait()
    dist.barrier()
    dist.destroy_process_group()


def _torchrun(nproc: int, *extra: str) -> int:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env["BCP_LOCAL_WORLD_SIZE"] = str(NODE_SIZE)  # simulated nodes of 2 ranks
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
           os.path.abspath(__file__), "--phase", "run", *extra]
    print("+", " ".join(cmd[2:]), flush=True)
    return subprocess.run(cmd, env=env, timeout=600).returncode


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None)
    p.add_argument("--phase", default="all", choices=["all", "run"])
    p.add_argument("--memory", default="0,1,2", help="(run) each node's memory directory")
    p.add_argument("--resume", action="store_true", help="(run) resume from the tiers")
    args = p.parse_args()
    if args.phase == "run":
        run(args)
        return 0
    out = args.out or tempfile.mkdtemp(prefix="bcp_tiers_recipe_")
    os.makedirs(out, exist_ok=True)
    status = _torchrun(6, "--out", out)
    print(f"first job ended with status {status} after node 2 was killed", flush=True)
    shutil.rmtree(os.path.join(out, "node_memory_2"))  # its RAM is gone with it
    if _torchrun(4, "--out", out, "--memory", "0,1", "--resume") != 0:
        return 1
    print(f"durable checkpoints (ordinary bcp checkpoints): {bcp.layout.latest_complete(os.path.join(out, 'durable'))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
