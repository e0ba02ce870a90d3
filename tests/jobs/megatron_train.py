"""A 2-rank Megatron-core training job (tensor parallel, TP=2 on gloo) saving through bcp's
dist_checkpointing backend with Megatron's AsyncCallsQueue, ended the ways real jobs end.

    torchrun --nproc_per_node 2 tests/jobs/megatron_train.py --root DIR [--steps N] [--end HOW]
        [--save-interval K] [--preemption] [--resume] [--pause-at STEP]

The model is Megatron's ColumnParallelLinear -> tanh -> RowParallelLinear, trained with a torch
Adam whose state is saved as Megatron does for non-distributed optimizers (`optim_state_to_sharding_
state`: ShardedTensors with their parameters' TP sharding; param groups and the common Adam step in
common.pt). Checkpoints go to DIR/iter_<7 digits> as Megatron-LM schedules them:
`dist_checkpointing.save(..., sharded_strategy=("bcp", 1), async_sharded_save=True)` on an
`AsyncCallsQueue`, with a finalize function writing DIR/latest_checkpointed_iteration.txt (as
Megatron-LM does), every --save-interval iterations and after the last one. --end: how the process
ends right after its last save: "finalize" (as Megatron-LM's training ends: the queue finalized,
blocking, and closed; then the process ends, its exit handlers run), or without finalizing: "script" (falls
off the end), "sys_exit" (sys.exit(0)), "exception" (an uncaught exception). With --preemption,
SIGTERM leads to a checkpoint at the iteration every rank agrees on, the queue finalized, exit 143.
Each iteration writes DIR/progress_rank<r> ("<iteration> <pid>"), and at --pause-at waits for the
test to release it (tests/pause.py); DIR/reference_<it>_rank<r>.pt
holds each rank's local shards (key -> (global offset, values)) the checkpoint of <it> must hold.
--resume loads the checkpoint the tracker names with `dist_checkpointing.load` and trains on.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

import bcp_core as bcp
from bcp_integrations.megatron import exit_after_preemption

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from pause import pause_at  # noqa: E402 - tests/pause.py

TRACKER = "latest_checkpointed_iteration.txt"  # Megatron-LM's name
HIDDEN, FFN = 256, 1024  # 6 MiB of model and Adam state: the last save is still being written at the end


@contextlib.contextmanager
def megatron_queue_on_cpu():
    """Megatron's AsyncCallsQueue puts the flags it all-reduces on torch.cuda.current_device(), a
    CUDA-only call of Megatron's (bcp needs no CUDA): on CPU with gloo they go on the CPU."""
    saved = torch.cuda.current_device
    torch.cuda.current_device = lambda: "cpu"
    try:
        yield
    finally:
        torch.cuda.current_device = saved


def build_model():
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.module import MegatronModule

    config = TransformerConfig(num_layers=1, hidden_size=HIDDEN, num_attention_heads=4, tensor_model_parallel_size=2,
                               use_cpu_initialization=True, params_dtype=torch.float32)

    class Mlp(MegatronModule):
        def __init__(self):
            super().__init__(config)
            init = torch.nn.init.xavier_normal_
            self.fc1 = ColumnParallelLinear(HIDDEN, FFN, config=config, init_method=init, bias=True,
                                            gather_output=False)
            self.fc2 = RowParallelLinear(FFN, HIDDEN, config=config, init_method=init, bias=True,
                                         input_is_parallel=True, skip_bias_add=False)

        def forward(self, x):
            h, _ = self.fc1(x)
            out, _ = self.fc2(torch.tanh(h))
            return out

    torch.manual_seed(0)  # the same on both ranks: each keeps its TP part of one initialisation
    return Mlp()


def batch(it: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch of iteration `it` ([seq, batch, hidden]); the same on both TP ranks."""
    g = torch.Generator().manual_seed(1000 + it)
    x = torch.randn(4, 2, HIDDEN, generator=g)
    return x, x.flip(-1).sin()


def sharded_state_dict(model, opt, iteration: int) -> dict:
    """Model and optimizer as Megatron describes them (Megatron's FP32Optimizer does the same)."""
    from megatron.core.dist_checkpointing.optimizer import (get_param_id_to_sharded_param_map,
                                                            optim_state_to_sharding_state)
    model_sd = model.sharded_state_dict()
    opt_sd = opt.state_dict()
    steps = {float(s["step"]) for s in opt_sd["state"].values()}
    assert len(steps) == 1, steps
    params = [p for group in opt.param_groups for p in group["params"]]
    optim_state_to_sharding_state(opt_sd, get_param_id_to_sharded_param_map(model_sd, params), exclude_keys=("step",))
    return {"model": model_sd, "optimizer": opt_sd, "adam_step": steps.pop(), "iteration": iteration}


def init_optimizer_state(opt) -> None:
    """Adam's state tensors, for the checkpoint to be loaded into."""
    for group in opt.param_groups:
        for p in group["params"]:
            opt.state[p] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p),
                            "exp_avg_sq": torch.zeros_like(p)}


def resume(root: str, model, opt) -> int:
    from megatron.core import dist_checkpointing

    with open(os.path.join(root, TRACKER)) as f:
        iteration = int(f.read())
    init_optimizer_state(opt)
    loaded = dist_checkpointing.load(sharded_state_dict(model, opt, 0), os.path.join(root, f"iter_{iteration:07d}"))
    model.load_state_dict(loaded["model"])
    for state in loaded["optimizer"]["state"].values():
        state["step"] = torch.tensor(loaded["adam_step"])
    opt.load_state_dict(loaded["optimizer"])
    assert loaded["iteration"] == iteration
    return iteration


def local_shards(sd: dict) -> dict:
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    return {sh.key: (tuple(sh.global_offset), sh.data.detach().clone())
            for sh in nested_values(sd) if isinstance(sh, ShardedTensor)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--end", default="finalize", choices=["finalize", "script", "sys_exit", "exception"])
    p.add_argument("--save-interval", type=int, default=0)
    p.add_argument("--preemption", action="store_true")
    p.add_argument("--resume", action="store_true")
    p.add_argument("--pause-at", type=int, default=None, help="wait at this iteration until the test releases it")
    args = p.parse_args()

    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    ps.initialize_model_parallel(tensor_model_parallel_size=2, create_gloo_process_groups=True)
    model = build_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    start = resume(args.root, model, opt) if args.resume else 0
    preemption = bcp.handle_preemption() if args.preemption else None
    queue = AsyncCallsQueue()

    def save(iteration: int) -> None:
        path = os.path.join(args.root, f"iter_{iteration:07d}")
        os.makedirs(path, exist_ok=True)
        dist.barrier()  # Megatron's common-state writer lists the directory
        sd = sharded_state_dict(model, opt, iteration)
        request = dist_checkpointing.save(sd, path, sharded_strategy=("bcp", 1), async_sharded_save=True)

        def write_tracker():  # Megatron-LM's iter_finalize_fn: the iteration a resume starts from
            if rank == 0:
                with open(os.path.join(args.root, TRACKER), "w") as f:
                    f.write(str(iteration))
        request.add_finalize_fn(write_tracker)
        queue.schedule_async_request(request)
        torch.save({**local_shards(sd), "adam_step": sd["adam_step"]},  # staged: what it must hold
                   os.path.join(args.root, f"reference_{iteration}_rank{rank}.pt"))

    saved_at = None
    for it in range(start, args.steps):
        x, y = batch(it)
        loss = F.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        iteration = it + 1
        with open(os.path.join(args.root, f"progress_rank{rank}"), "w") as f:
            f.write(f"{iteration} {os.getpid()}")
        if iteration == args.pause_at:
            pause_at(args.root, iteration)
        with megatron_queue_on_cpu():
            queue.maybe_finalize_async_calls(blocking=False)  # as Megatron-LM does every iteration
        if args.save_interval and iteration % args.save_interval == 0:
            save(iteration)
            saved_at = iteration
        if preemption is not None and preemption.stop_requested():
            if saved_at != iteration:
                save(iteration)
            with megatron_queue_on_cpu():
                exit_after_preemption(preemption, queue)  # finalized (metadata.json), exit 143

    if saved_at != args.steps:
        save(args.steps)
    if args.end == "finalize":  # as Megatron-LM's maybe_finalize_async_save(blocking=True, terminate=True)
        with megatron_queue_on_cpu():
            queue.maybe_finalize_async_calls(blocking=True)
            queue.close()
        # every save is committed by now: the process ends past the torch 2.13 + gloo abort at
        # interpreter teardown (docs/integrations.md, "Shared notes"), exit handlers run; the endings
        # below end naturally
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "recipes"))
        from _launch import exit_without_teardown
        exit_without_teardown()
    elif args.end == "sys_exit":
        sys.exit(0)
    elif args.end == "exception":
        raise RuntimeError("the training script failed after its last save")


if __name__ == "__main__":  # Megatron may start helper processes that re-import this module
    main()
