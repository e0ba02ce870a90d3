"""Lightning, Accelerate and the HF Trainer saving to tiers every step, and resuming after a node is
lost, each through its own API with the bcp integration's `tiers=` option.

    BCP_LOCAL_WORLD_SIZE=1 torchrun --standalone --nproc_per_node 2 tests/jobs/tiered_frameworks.py \
        --framework lightning|accelerate|hf --base DIR --memory 0,1 --steps 4 [--resume] --out DIR

Each rank is a simulated node (`BCP_LOCAL_WORLD_SIZE=1`) whose memory is DIR/mem<M>, M its entry of
`--memory`. The tiers: `Tiers("memory://job", durable=DIR/durable, replicas=1, persist_every=2)`.
Training saves every step; rank 0 writes OUT/ref_<step>.pt (the model's parameters as saved). With
--resume the framework resumes from the tiers (`fit(ckpt_path=tiers)`, `accelerator.load_state()`,
`BCPTrainer.train(resume_from_checkpoint=tiers)`), and each rank writes OUT/resumed_rank<r>.pt (the
step and the parameters right after the load), then trains on to --steps + 2.
"""

from __future__ import annotations

import argparse
import itertools
import os

import torch
import torch.distributed as dist
from torch import nn

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import bcp_core as bcp  # noqa: E402

FEATURES = 8


def _data(n: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, FEATURES, generator=g)
    return x, x.sum(dim=1, keepdim=True)


def _record(out: str, name: str, step: int, model: nn.Module) -> None:
    torch.save({"step": int(step), "params": {k: v.detach().clone() for k, v in model.state_dict().items()}},
               os.path.join(out, name))


def lightning(args, tiers) -> None:
    import lightning as L
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint

    from bcp_integrations.lightning import BCPCheckpointIO

    class Regressor(L.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(FEATURES, 16), nn.Tanh(), nn.Linear(16, 1))

        def training_step(self, batch, _):
            x, y = batch
            return nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    class Record(Callback):
        def on_train_start(self, trainer, module):
            if args.resume:
                _record(args.out, f"resumed_rank{trainer.global_rank}.pt", trainer.global_step, module)

        def on_train_batch_end(self, trainer, module, *_):
            if trainer.is_global_zero:
                _record(args.out, f"ref_{trainer.global_step}.pt", trainer.global_step, module)

    x, y = _data()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4)
    steps = args.steps + (2 if args.resume else 0)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=steps, max_epochs=3,
                        plugins=[BCPCheckpointIO(tiers=tiers)], enable_progress_bar=False, logger=False,
                        callbacks=[Record(), ModelCheckpoint(dirpath=os.path.join(args.base, "mc"),
                                                             every_n_train_steps=1, save_top_k=-1)])
    trainer.fit(Regressor(), loader, ckpt_path=tiers if args.resume else None)


def accelerate(args, tiers) -> None:
    from accelerate import Accelerator

    from bcp_integrations.accelerate import register

    acc = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(FEATURES, 16), nn.Tanh(), nn.Linear(16, 1))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = _data()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4)
    model, optim, loader = acc.prepare(model, optim, loader)
    ckpt = register(acc, tiers=tiers)
    start = 0
    if args.resume:
        acc.load_state()
        start = ckpt.step  # the tiers' step loaded: save_state() calls, one a step here
        _record(args.out, f"resumed_rank{acc.process_index}.pt", start, acc.unwrap_model(model))
    # pass after pass over the data (Accelerate sets accelerator.step back to 0 after each), the
    # batches already seen skipped
    batches = itertools.islice(itertools.chain.from_iterable(itertools.repeat(loader)), start, None)
    for step in range(start + 1, args.steps + (2 if args.resume else 0) + 1):
        bx, by = next(batches)
        with acc.accumulate(model):
            loss = nn.functional.mse_loss(model(bx), by)
            acc.backward(loss)
            optim.step()
            optim.zero_grad()
        acc.save_state()  # (accelerator.step goes back to 0 after the loader's last batch: not the step)
        if acc.is_main_process:
            _record(args.out, f"ref_{step}.pt", step, acc.unwrap_model(model))
    ckpt.wait()
    acc.end_training()


def hf(args, tiers) -> None:
    from transformers import TrainerCallback, TrainingArguments

    from bcp_integrations.hf import BCPCallback, BCPTrainer

    class Regressor(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(FEATURES, 16), nn.Tanh(), nn.Linear(16, 1))

        def forward(self, x, labels=None):
            out = self.net(x)
            return {"loss": nn.functional.mse_loss(out, labels), "logits": out}

    class Data(torch.utils.data.Dataset):
        def __init__(self):
            self.x, self.y = _data()

        def __len__(self):
            return len(self.x)

        def __getitem__(self, i):
            return {"x": self.x[i], "labels": self.y[i]}

    class Record(TrainerCallback):
        def on_train_begin(self, targs, state, control, model=None, **kw):
            if args.resume:
                _record(args.out, f"resumed_rank{targs.process_index}.pt", state.global_step, model)

        def on_step_end(self, targs, state, control, model=None, **kw):
            if state.is_world_process_zero:
                _record(args.out, f"ref_{state.global_step}.pt", state.global_step, model)

    targs = TrainingArguments(output_dir=os.path.join(args.base, "hf"), use_cpu=True, per_device_train_batch_size=4,
                              max_steps=args.steps + (2 if args.resume else 0), save_strategy="steps", save_steps=1,
                              learning_rate=1e-2, report_to="none", disable_tqdm=True, seed=0,
                              dataloader_num_workers=0)
    trainer = BCPTrainer(model=Regressor(), args=targs, train_dataset=Data(),
                         callbacks=[BCPCallback(tiers=tiers), Record()])
    trainer.train(resume_from_checkpoint=tiers if args.resume else None)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--framework", required=True, choices=["lightning", "accelerate", "hf"])
    p.add_argument("--base", required=True)
    p.add_argument("--memory", required=True)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    rank = int(os.environ["RANK"])
    os.environ["BCP_MEMORY_DIR"] = os.path.join(args.base, f"mem{args.memory.split(',')[rank]}")
    os.makedirs(os.environ["BCP_MEMORY_DIR"], exist_ok=True)
    os.makedirs(args.out, exist_ok=True)
    tiers = bcp.Tiers("memory://job", durable=os.path.join(args.base, "durable"), replicas=1, persist_every=2)
    {"lightning": lightning, "accelerate": accelerate, "hf": hf}[args.framework](args, tiers)
    if dist.is_initialized():
        dist.barrier()


if __name__ == "__main__":
    main()
