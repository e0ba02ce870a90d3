"""Accelerate + bcp: train on 2 CPU processes, save_state, load_state on 1 process, continue.

    torchrun --nproc_per_node 2 recipes/accelerate_resume.py [--out DIR]

The only bcp line is ``bcp_integrations.accelerate.register(accelerator)``. The script:
1. trains a tiny MLP with dropout (built from a config, no downloads) with DDP on 2 CPU
   processes (``Accelerator(cpu=True)`` under torchrun) for one epoch, then calls
   ``accelerator.save_state(dir)``: model, optimizer, scheduler, RNG states, the dataloader's
   position and a ``register_for_checkpointing`` object go to one bcp checkpoint, from both ranks;
2. relaunches itself on 1 process, ``load_state(dir)`` and trains the next epoch.
``--phase run`` runs one training alone (the tests use it).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

from _launch import exit_without_teardown, relaunch  # recipes/_launch.py

import torch
import torch.nn.functional as F
from accelerate import Accelerator, DataLoaderConfiguration
from accelerate.utils import set_seed
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from bcp_integrations.accelerate import register

CONFIG = {"dim": 8, "hidden": 16, "dropout": 0.2, "samples": 16, "batch_size": 2, "lr": 1e-2}


class Net(nn.Module):
    def __init__(self, dim, hidden, dropout, **_):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(dim, hidden), nn.Tanh(), nn.Dropout(dropout), nn.Linear(hidden, 1))

    def forward(self, x):
        return self.net(x)


class Progress:
    """Epoch and step counters, checkpointed through accelerator.register_for_checkpointing."""

    def __init__(self):
        self.epoch, self.step = 0, 0

    def state_dict(self):
        return {"epoch": self.epoch, "step": self.step}

    def load_state_dict(self, sd):
        self.epoch, self.step = sd["epoch"], sd["step"]


def dump(path, accelerator, model, opt, sched, progress) -> None:
    if accelerator.is_main_process:
        torch.save({"model": accelerator.unwrap_model(model).state_dict(), "optimizer": opt.state_dict(),
                    "scheduler": sched.state_dict(), "progress": progress.state_dict(), "step": accelerator.step,
                    "rng": torch.get_rng_state()}, path)


def run_phase(args) -> None:
    accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(
        use_seedable_sampler=True, use_stateful_dataloader=args.stateful))
    if not args.native:
        register(accelerator)
    set_seed(0)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(CONFIG["samples"], CONFIG["dim"], generator=g)
    data = DataLoader(TensorDataset(x, x.sum(1, keepdim=True).sin()), batch_size=CONFIG["batch_size"], shuffle=True)
    model = Net(**CONFIG)
    opt = torch.optim.AdamW(model.parameters(), lr=CONFIG["lr"])
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    model, opt, data, sched = accelerator.prepare(model, opt, data, sched)
    progress = Progress()
    accelerator.register_for_checkpointing(progress)
    os.makedirs(args.out, exist_ok=True)
    if args.resume:
        accelerator.load_state(args.resume)
        dump(os.path.join(args.out, "state_start.pt"), accelerator, model, opt, sched, progress)
    losses = []
    while progress.epoch < args.epochs:
        data.set_epoch(progress.epoch)
        for xb, yb in data:
            loss = F.mse_loss(model(xb), yb)
            accelerator.backward(loss)
            opt.step()
            sched.step()
            opt.zero_grad()
            progress.step += 1
            losses.append((progress.step, loss.item()))
            if args.save_dir and progress.step == args.save_at_step:  # mid-epoch: needs --stateful
                accelerator.save_state(args.save_dir)
        progress.epoch += 1
        if args.save_dir and args.save_at_step is None and progress.epoch == args.save_after_epoch:
            accelerator.save_state(args.save_dir)
            dump(os.path.join(args.out, f"state_epoch{progress.epoch}.pt"), accelerator, model, opt, sched, progress)
    with open(os.path.join(args.out, f"losses_rank{accelerator.process_index}.json"), "w") as f:
        json.dump(losses, f)
    if accelerator.is_main_process:
        print(f"{accelerator.num_processes} process(es), losses:", [(s, round(v, 6)) for s, v in losses])
    accelerator.end_training()  # waits for the last asynchronous save


def run_packed(args) -> None:
    """Token batches from bcp's PackedTokenLoader, registered with register_for_checkpointing: its
    state goes through bcp's dataloader support and is split/merged when the process count changes."""
    from bcp_core.dataloader import PackedTokenLoader

    accelerator = Accelerator(cpu=True)
    if not args.native:
        register(accelerator)
    set_seed(0)
    docs = {"web": [list(range(100 * i, 100 * i + 3 + i % 5)) for i in range(24)],
            "code": [list(range(5000 + 100 * i, 5000 + 100 * i + 2 + i % 3)) for i in range(12)]}
    loader = PackedTokenLoader(docs, seq_len=4, batch_size=2, dp_rank=accelerator.process_index,
                               dp_size=accelerator.num_processes, seed=0, pad_id=-1)
    model = nn.EmbeddingBag(8000, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=CONFIG["lr"])
    model, opt = accelerator.prepare(model, opt)
    accelerator.register_for_checkpointing(loader)
    if args.resume:
        accelerator.load_state(args.resume)
    seen = []
    for step, batch in enumerate(loader, start=1):
        if args.max_steps and step > args.max_steps:
            break  # ranks may hold different numbers of batches; DDP needs the same number of steps
        seen.append(batch.tolist())
        loss = model(batch.clamp(min=0)).pow(2).mean()
        accelerator.backward(loss)
        opt.step()
        opt.zero_grad()
        if args.save_dir and step == args.save_after_step:
            accelerator.save_state(args.save_dir)
            seen.append("saved")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"batches_rank{accelerator.process_index}.json"), "w") as f:
        json.dump(seen, f)
    accelerator.end_training()



def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--phase", choices=["demo", "run"], default="demo")
    p.add_argument("--out", default=None, help="working directory (default: a temporary one)")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--save-dir", default=None, help="accelerator.save_state directory")
    p.add_argument("--save-after-epoch", type=int, default=1)
    p.add_argument("--resume", default=None, help="accelerator.load_state directory")
    p.add_argument("--native", action="store_true", help="Accelerate's own checkpoints instead of bcp (reference)")
    p.add_argument("--stateful", action="store_true", help="use_stateful_dataloader=True (torchdata)")
    p.add_argument("--save-at-step", type=int, default=None, help="save_state after this step, mid-epoch")
    p.add_argument("--packed", action="store_true", help="train on bcp's PackedTokenLoader (one epoch)")
    p.add_argument("--save-after-step", type=int, default=2, help="with --packed: save_state after this batch")
    p.add_argument("--max-steps", type=int, default=None, help="with --packed: stop after this many batches")
    args = p.parse_args()
    if args.phase == "run":
        if args.packed:
            run_packed(args)
        else:
            run_phase(args)
        return
    if int(os.environ.get("WORLD_SIZE", "1")) != 2:
        sys.exit("run the demo with: torchrun --nproc_per_node 2 recipes/accelerate_resume.py")
    out = args.out or tempfile.mkdtemp(prefix="bcp_accelerate_")
    ckpt = os.path.join(out, "state")
    args.out, args.save_dir, args.epochs = os.path.join(out, "ws2"), ckpt, 1
    run_phase(args)
    if int(os.environ["RANK"]) == 0:
        print(f"save_state wrote {sorted(os.listdir(ckpt))}")
        relaunch(__file__, 1, "--phase", "run", "--resume", ckpt, "--epochs", "2", "--out", os.path.join(out, "ws1"))
        print(f"done; outputs under {out}")


if __name__ == "__main__":
    main()
    exit_without_teardown()
