"""A training job saving to tiers every step, as a user writes one; optionally a node dies in it.

    BCP_LOCAL_WORLD_SIZE=2 torchrun --standalone --nproc_per_node 6 tests/jobs/tiered_train.py \
        --base DIR --memory 0,1,2 --steps 10 [--resume] [--kill PHASE:STEP:NODE] --out DIR

Simulated nodes: `BCP_LOCAL_WORLD_SIZE` ranks per node, and node x's memory is DIR/mem<M> where M is
the x-th entry of `--memory` (a restart names the surviving directories, and a new one for a
replaced node). Durable storage is DIR/durable. Every step saves asynchronously to
`Tiers(memory, durable, replicas=1, persist_every=4, keep_in_memory=2)`.

The state: "w" and "exp_avg" (DTensors, rows sharded over every rank), "bias" (replicated), and the
step. Training step s changes each element by a formula of s and its global index only
(`tiered_state.advance`), so the state at any step is known exactly whatever the world size; a test
compares what a job loads and ends with against it, bit for bit.

`--kill PHASE:STEP:NODE`: both ranks of node NODE kill themselves (SIGKILL) at step STEP:
"between" (once STEP is committed, before the next step), "write" (as the memory write of STEP
starts), "replicate" (once the manifest of STEP's replicas arrived, as the first replica is
written), "drain" (as the drain of STEP to durable storage starts); the last three through bcp's
storage fault seam (`bcp_core.storage.faults`). Each rank writes DIR_out/rank<r>.json: the step and tier it resumed
from, and at the end its rows of the state.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys

import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tiered_state import ROWS, advance, initial  # noqa: E402  (tests/tiered_state.py)

import bcp_core as bcp  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--base", required=True)
    p.add_argument("--memory", required=True)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--kill", default="")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    node = rank // int(os.environ["BCP_LOCAL_WORLD_SIZE"])
    # each simulated node its own RAM directory, as each machine has its own /dev/shm
    memory = args.memory.split(",")[node]
    os.environ["BCP_MEMORY_DIR"] = os.path.join(args.base, f"mem{memory}")
    os.makedirs(os.environ["BCP_MEMORY_DIR"], exist_ok=True)
    durable = os.path.join(args.base, "durable")
    if args.kill:
        _arm(args.kill, node, rank, durable)
    tiers = bcp.Tiers("memory://job", durable=durable, replicas=1, persist_every=4, keep_in_memory=2)
    mesh = init_device_mesh("cpu", (world,))
    state = initial(mesh)
    report = {"rank": rank, "world": world}
    start = 0
    if args.resume:
        result = bcp.load(tiers, state)
        start = result.step
        report.update(resumed=result.step, tier=result.tier, path=result.path, loaded=_rows(state))
    handle = None
    for step in range(start + 1, args.steps + 1):
        advance(state, step)
        handle = bcp.save(tiers, state, step=step, async_save=True)
        if KILL.get("between") == step:
            handle.wait()
            _die()
    if handle is not None:
        handle.wait()
    report["final"] = _rows(state)
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)
    dist.barrier()
    dist.destroy_process_group()


def _rows(state: dict) -> dict:
    """This rank's rows of each tensor (global row offset -> values), and the step."""
    out = {"step": state["step"], "bias": state["bias"].tolist()}
    for key in ("w", "exp_avg"):
        local = state[key].to_local()
        first = state[key].device_mesh.get_local_rank() * (ROWS // state[key].device_mesh.size())
        out[key] = {str(first + i): row for i, row in enumerate(local.tolist())}
    return out


KILL: dict[str, int] = {}


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _arm(spec: str, node: int, rank: int, durable: str) -> None:
    """Make this node's ranks kill themselves at the point `spec` names (module doc), through bcp's
    storage fault seam: at the first file of the step each rank's role opens."""
    phase, step, victim = spec.split(":")
    if node != int(victim):
        return
    step = int(step)
    KILL[phase] = step
    from bcp_core.storage.faults import Fault, inject
    name = bcp.layout.BCP_STEPS.name(step)
    mine = f"-r{rank}_"  # in the names of this rank's own data files

    def die_at(own: bool):
        def hook(call) -> None:
            if (mine in call.path) == own:
                _die()
        return hook
    if phase == "write":  # as it starts writing its own data files of the step into its memory
        inject(Fault("open_writer", hook=die_at(True), path=f"memory://*/{name}/data/*"))
    elif phase == "replicate":  # as the first replica of the step reaches it (its manifest has arrived)
        inject(Fault("open_writer", hook=die_at(False), path=f"memory://*/{name}/data/*"))
    elif phase == "drain":  # as the drain of the step starts writing to durable storage
        inject(Fault("open_writer", hook=lambda call: _die(), path=f"{durable}/*{name}/*"))
    elif phase != "between":
        raise SystemExit(f"unknown kill phase {phase!r}")


if __name__ == "__main__":
    main()
