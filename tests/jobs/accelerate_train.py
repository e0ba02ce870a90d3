"""A 2-process Accelerate training job (MULTI_CPU, DDP on gloo) saving through bcp, ended the ways
real jobs end.

    torchrun --nproc_per_node 2 tests/jobs/accelerate_train.py --root DIR [--steps N] [--end HOW]
        [--save-every K] [--total-limit L] [--preemption] [--resume DIR | --resume-newest] [--pause-at STEP]
        [--zero STAGE]

The only bcp line is `register(accelerator, ...)`; checkpoints are `accelerator.save_state(dir)`
(asynchronous, the integration's default) into DIR/step_<step>, at the last step and every
--save-every steps. With --total-limit, Accelerate names them instead:
`ProjectConfiguration(project_dir=DIR, automatic_checkpoint_naming=True, total_limit=L)` and
`save_state()` write DIR/checkpoints/checkpoint_<i>. --end: how the process ends right after its
last save_state: "script" (falls off the end), "end_training" (`accelerator.end_training()`, then
falls off the end), "sys_exit" (sys.exit(0)), "exception" (an uncaught exception). With
--preemption, `register(accelerator, preemption=True)`: on SIGTERM the job saves at the step every
process agrees on and exits 143. Each step writes DIR/progress_rank<r> ("<step reached> <pid>"),
and at --pause-at waits for the test to release it (tests/pause.py);
DIR/reference_<step>.pt holds, from process 0, the values the checkpoint of <step> must hold.
--resume DIR continues from `accelerator.load_state(DIR)` to --steps; --resume-newest from
`accelerator.load_state()` (the newest checkpoint; DIR/resumed.pt: the values loaded), then numbers
its checkpoints after the existing ones, as Accelerate leaves that to the script. BCP_TEST_FAULT
injects faults into the saves (tests/faults.py).

--zero STAGE prepares the model with DeepSpeed ZeRO-STAGE (`Accelerator(deepspeed_plugin=...)`, gloo,
DS_ACCELERATOR=cpu); the reference values are then DeepSpeed's full fp32 values and Adam moments, and
--resume also writes DIR/resumed.pt (the values loaded).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import ProjectConfiguration, set_seed
from torch import nn

from bcp_integrations.accelerate import register

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import faults  # noqa: E402 - tests/faults.py
from pause import pause_at  # noqa: E402 - tests/pause.py


class Progress:
    """The step counter, checkpointed with `register_for_checkpointing` (saved as `custom`)."""

    def __init__(self):
        self.step = 0

    def state_dict(self):
        return {"step": self.step}

    def load_state_dict(self, sd):
        self.step = sd["step"]


class Bulk:
    """Extra state that makes the save take a while (saved as `custom_1`); loaded back exactly."""

    def __init__(self, mib: int):
        self.t = torch.arange(mib * 2**18, dtype=torch.float32).reshape(-1, 1024)

    def state_dict(self):
        return {"t": self.t}

    def load_state_dict(self, sd):
        self.t = sd["t"]


def build(seed: int = 0, mib: int = 4):
    """Model, optimizer, scheduler and checkpointed objects, as the job and the test build them."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Dropout(0.1), nn.Linear(32, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    return model, opt, sched, Progress(), Bulk(mib)


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(8, 16, generator=g)
    return x, x.sum(dim=1, keepdim=True).sin()


def _deepspeed_values(engine, opt) -> dict:
    """DeepSpeed's full fp32 values and Adam moments by parameter name (every process calls it)."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
    values, moments = {}, {}
    for n, p in engine.module.named_parameters():
        values[n] = safe_get_full_fp32_param(p).detach().clone()
        moments[n] = {k: safe_get_full_optimizer_state(p, k).detach().clone() for k in ("exp_avg", "exp_avg_sq")}
    return {"model": values, "optimizer": moments}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--end", default="script", choices=["script", "end_training", "sys_exit", "exception"])
    p.add_argument("--save-every", type=int, default=0)
    p.add_argument("--total-limit", type=int, default=None, help="automatic checkpoint naming with this total_limit")
    p.add_argument("--preemption", action="store_true")
    p.add_argument("--resume", default=None, help="accelerator.load_state directory")
    p.add_argument("--resume-newest", action="store_true", help="accelerator.load_state()")
    p.add_argument("--pause-at", type=int, default=None, help="wait at this step until the test releases it")
    p.add_argument("--zero", type=int, choices=(1, 2, 3), default=None)
    args = p.parse_args()
    faults.install_from_env()

    project = None
    if args.total_limit is not None:
        project = ProjectConfiguration(project_dir=args.root, automatic_checkpoint_naming=True,
                                       total_limit=args.total_limit)
    if args.zero:
        from accelerate import DeepSpeedPlugin
        from accelerate.utils import InitProcessGroupKwargs
        plugin = DeepSpeedPlugin(hf_ds_config={
            "train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1, "steps_per_print": 10**6,
            "zero_optimization": {"stage": args.zero, "stage3_param_persistence_threshold": 0}})
        accelerator = Accelerator(deepspeed_plugin=plugin, project_config=project,
                                  kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")])
    else:
        accelerator = Accelerator(cpu=True, project_config=project)
    ckpt = register(accelerator, preemption=args.preemption)
    set_seed(0)
    model, opt, sched, progress, bulk = build()
    model, opt, sched = accelerator.prepare(model, opt, sched)
    accelerator.register_for_checkpointing(progress)
    accelerator.register_for_checkpointing(bulk)
    rank = accelerator.process_index

    def record(name: str) -> None:
        """From process 0: the values a checkpoint taken now holds, bit for bit."""
        if args.zero:
            values = _deepspeed_values(model, opt)  # collective
            if accelerator.is_main_process:
                torch.save({**values, "scheduler": sched.state_dict(), "step": progress.step,
                            "global_steps": model.global_steps, "rng": torch.get_rng_state()},
                           os.path.join(args.root, name))
            return
        if accelerator.is_main_process:
            torch.save({"model": accelerator.unwrap_model(model).state_dict(), "optimizer": opt.state_dict(),
                        "scheduler": sched.state_dict(), "step": progress.step, "rng": torch.get_rng_state()},
                       os.path.join(args.root, name))

    if args.resume:
        accelerator.load_state(args.resume)
        if args.zero:
            record("resumed.pt")
    if args.resume_newest:
        accelerator.load_state()
        names = os.listdir(os.path.join(args.root, "checkpoints"))
        accelerator.project_configuration.iteration = 1 + max(int(n.rsplit("_", 1)[1]) for n in names)
        record("resumed.pt")

    def save(step: int) -> None:
        accelerator.save_state(None if project else os.path.join(args.root, f"step_{step:08d}"))
        record(f"reference_{step}.pt")

    while progress.step < args.steps:
        x, y = batch(progress.step, rank)
        loss = F.mse_loss(model(x), y)
        accelerator.backward(loss)
        opt.step()
        sched.step()
        opt.zero_grad()
        progress.step += 1
        with open(os.path.join(args.root, f"progress_rank{rank}"), "w") as f:
            f.write(f"{progress.step} {os.getpid()}")
        if progress.step == args.pause_at:
            pause_at(args.root, progress.step)
        if args.preemption and ckpt.stop_requested():
            save(progress.step)
            ckpt.preemption.exit()  # commits the save, exits 143
        if args.save_every and progress.step % args.save_every == 0 and progress.step < args.steps:
            save(progress.step)

    save(progress.step)
    if args.end == "end_training":
        accelerator.end_training()
    elif args.end == "sys_exit":
        sys.exit(0)
    elif args.end == "exception":
        raise RuntimeError("the training script failed after its last save_state")


if __name__ == "__main__":
    main()
