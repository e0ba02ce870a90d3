"""Lightning + bcp: train on 2 ranks with DDP, resume on 1 rank and on FSDP2 (ModelParallelStrategy).

    torchrun --nproc_per_node 2 recipes/lightning_resume.py [--out DIR]

The only bcp line is ``Trainer(plugins=[BCPCheckpointIO()])``. The script:
1. trains a tiny MLP (built from a config, no downloads) for 2 steps with DDP on 2 CPU ranks;
   ModelCheckpoint(every_n_train_steps=2) writes a sharded, asynchronous bcp checkpoint;
2. relaunches itself on 1 process and resumes from that checkpoint with ``fit(ckpt_path=...)``;
3. relaunches itself on 2 processes with ModelParallelStrategy (FSDP2) and resumes again.
Each resumed run prints its losses. ``--phase`` runs one step alone (the tests use it).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

from _launch import exit_without_teardown, relaunch  # recipes/_launch.py

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from bcp_integrations.lightning import BCPCheckpointIO

CONFIG = {"dim": 8, "hidden": 16, "samples": 16, "batch_size": 4, "lr": 1e-2}


class TinyRegressor(L.LightningModule):
    def __init__(self, dim: int, hidden: int, lr: float, **_):
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(dim, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(),
                                 nn.Linear(hidden, 1))

    def configure_model(self):
        # ModelParallelStrategy gives a device mesh: tensor parallelism over its "tensor_parallel"
        # dimension, then FSDP2 over "data_parallel".
        if self.device_mesh is None:
            return
        tp = self.device_mesh["tensor_parallel"]
        if tp.size() > 1:
            from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
            parallelize_module(self.net, tp, {"0": ColwiseParallel(), "2": RowwiseParallel()})
            return
        from torch.distributed.fsdp import fully_shard
        mesh = self.device_mesh["data_parallel"]
        for layer in self.net:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(self, mesh=mesh)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
        return [opt], [{"scheduler": sched, "interval": "step"}]

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(CONFIG["samples"], self.hparams.dim, generator=g)
        y = x.sum(dim=1, keepdim=True).sin()
        return DataLoader(TensorDataset(x, y), batch_size=CONFIG["batch_size"])


class PackedTokens(L.LightningModule):
    """Token batches from bcp's PackedTokenLoader. Its state leaves Lightning's loop state for bcp's
    dataloader entry, so it is split and merged when the number of ranks changes. Writes the batches
    this rank trained on, with their global step."""

    DOCS = {"web": [list(range(100 * i, 100 * i + 3 + i % 5)) for i in range(24)],
            "code": [list(range(5000 + 100 * i, 5000 + 100 * i + 2 + i % 3)) for i in range(12)]}

    def __init__(self, out: str):
        super().__init__()
        self.out, self.seen = out, []
        self.emb = nn.EmbeddingBag(8000, 4)

    def train_dataloader(self):
        from bcp_core.dataloader import PackedTokenLoader
        dp = getattr(self.trainer.strategy, "distributed_sampler_kwargs", None) or {}  # the DP rank and degree
        return PackedTokenLoader(self.DOCS, seq_len=4, batch_size=2, dp_rank=dp.get("rank", 0),
                                 dp_size=dp.get("num_replicas", 1), seed=0, pad_id=-1)

    def training_step(self, batch, batch_idx):
        self.seen.append((self.trainer.global_step + 1, batch.tolist()))
        return self.emb(batch.clamp(min=0)).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=CONFIG["lr"])

    def on_train_end(self):
        with open(os.path.join(self.out, f"batches_rank{self.trainer.global_rank}.json"), "w") as f:
            json.dump(self.seen, f)


class Recorder(Callback):
    """Writes the mean loss of every step, and the full training state at chosen points, from rank 0."""

    def __init__(self, out: str | None, dump_at_step: int | None = None, dump_at_start: bool = False):
        self.out, self.dump_at_step, self.dump_at_start = out, dump_at_step, dump_at_start
        self.losses: dict[int, float] = {}

    def on_train_start(self, trainer, pl_module):
        if self.dump_at_start:
            self._dump(trainer, "start")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        loss = trainer.strategy.reduce(outputs["loss"].detach(), reduce_op="mean")
        self.losses[trainer.global_step] = float(loss)
        if trainer.global_step == self.dump_at_step:
            self._dump(trainer, f"step{trainer.global_step}")

    def on_train_end(self, trainer, pl_module):
        if self.out and trainer.is_global_zero:
            with open(os.path.join(self.out, "losses.json"), "w") as f:
                json.dump(self.losses, f)
        if trainer.is_global_zero:
            print("losses:", {k: round(v, 6) for k, v in self.losses.items()})

    def _dump(self, trainer, tag: str) -> None:
        # Full (unsharded) model and optimizer state keyed by FQN: comparable across layouts.
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                             get_optimizer_state_dict)
        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        model = trainer.strategy.model
        msd = get_model_state_dict(model, options=opts)
        osd = get_optimizer_state_dict(model, trainer.optimizers[0], options=opts)
        sched = trainer.lr_scheduler_configs[0].scheduler.state_dict()
        if self.out and trainer.is_global_zero:
            torch.save({"model": {k.removeprefix("module."): v for k, v in msd.items()}, "optimizer": osd,
                        "scheduler": sched, "global_step": trainer.global_step, "epoch": trainer.current_epoch,
                        "rng": torch.get_rng_state()},
                       os.path.join(self.out, f"state_{tag}.pt"))


class CPUFSDPStrategy(FSDPStrategy):
    """FSDPStrategy (FSDP1) on CPU, for trying it without a GPU: Lightning refuses CPU for FSDP, and
    FSDP1 needs device_id=cpu, which Lightning does not pass. On GPUs use FSDPStrategy itself."""

    def _setup_model(self, model):
        from torch.distributed.fsdp import FullyShardedDataParallel
        model = FullyShardedDataParallel(model, sharding_strategy=self.sharding_strategy,
                                         device_id=torch.device("cpu"), **self.kwargs)
        return super()._setup_model(model)


def build_trainer(args, world: int, callbacks: list) -> L.Trainer:
    if args.strategy == "fsdp2":
        strategy = ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1)
    elif args.strategy == "tp":
        strategy = ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=world)
    elif args.strategy == "fsdp":
        strategy = "fsdp" if torch.cuda.is_available() else CPUFSDPStrategy()
    else:
        strategy = "ddp" if world > 1 else "auto"
    plugins = [] if args.native else [BCPCheckpointIO()]
    return L.Trainer(accelerator="cpu", devices=world, strategy=strategy, plugins=plugins, max_steps=args.max_steps,
                     callbacks=callbacks, logger=False, enable_checkpointing=bool(args.ckpt_dir),
                     default_root_dir=args.out, enable_progress_bar=False, enable_model_summary=False,
                     num_sanity_val_steps=0, deterministic=True, max_epochs=1 if args.packed else None)


def run_phase(args) -> None:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    L.seed_everything(0, verbose=False)
    os.makedirs(args.out, exist_ok=True)
    # (FSDP1 full state dicts segfault on CPU, so the fsdp runs record losses only)
    dumps = args.strategy != "fsdp" and not args.packed
    callbacks = [Recorder(args.out, dump_at_step=args.dump_at_step if dumps else None,
                          dump_at_start=dumps and args.resume is not None)]
    if args.ckpt_dir:
        # keep every checkpoint here; keep only the newest one (the highest step) in a second directory
        callbacks.append(ModelCheckpoint(dirpath=args.ckpt_dir, filename="{step}", every_n_train_steps=args.every,
                                         save_top_k=-1))
        callbacks.append(ModelCheckpoint(dirpath=args.ckpt_dir + "_newest", filename="newest-{step}",
                                         every_n_train_steps=args.every, save_top_k=1, monitor="step", mode="max"))
    trainer = build_trainer(args, world, callbacks)
    trainer.fit(PackedTokens(args.out) if args.packed else TinyRegressor(**CONFIG), ckpt_path=args.resume)



def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--phase", choices=["demo", "run"], default="demo")
    p.add_argument("--out", default=None, help="working directory (default: a temporary one)")
    p.add_argument("--strategy", choices=["ddp", "fsdp2", "tp", "fsdp"], default="ddp")
    p.add_argument("--max-steps", type=int, default=2)
    p.add_argument("--every", type=int, default=2, help="ModelCheckpoint every_n_train_steps")
    p.add_argument("--ckpt-dir", default=None)
    p.add_argument("--resume", default=None, help="checkpoint to resume from (fit(ckpt_path=...))")
    p.add_argument("--dump-at-step", type=int, default=None)
    p.add_argument("--native", action="store_true", help="Lightning's own checkpoints instead of bcp (reference)")
    p.add_argument("--packed", action="store_true", help="train on bcp's PackedTokenLoader (one epoch)")
    args = p.parse_args()
    if args.phase == "run":
        run_phase(args)
        return
    out = args.out or tempfile.mkdtemp(prefix="bcp_lightning_")
    if int(os.environ.get("WORLD_SIZE", "1")) != 2:
        sys.exit("run the demo with: torchrun --nproc_per_node 2 recipes/lightning_resume.py")
    args.out, args.ckpt_dir, args.max_steps = os.path.join(out, "train"), os.path.join(out, "ckpt"), 2
    run_phase(args)
    if int(os.environ["RANK"]) == 0:
        ckpt = os.path.join(out, "ckpt", "step=2.ckpt")
        print(f"bcp checkpoint: {ckpt} -> {sorted(os.listdir(ckpt))}")
        relaunch(__file__, 1, "--phase", "run", "--resume", ckpt, "--max-steps", "6", "--out", os.path.join(out, "ws1"))
        relaunch(__file__, 2, "--phase", "run", "--resume", ckpt, "--max-steps", "6", "--strategy", "fsdp2",
                 "--out", os.path.join(out, "fsdp2"))
        print(f"done; outputs under {out}")


if __name__ == "__main__":
    main()
    exit_without_teardown()
