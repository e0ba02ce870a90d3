"""A 2-rank Lightning training job (DDP on gloo) saving through BCPCheckpointIO, ended the ways real
jobs end.

    torchrun --nproc_per_node 2 tests/jobs/lightning_train.py --root DIR [--steps N] [--end HOW]
        [--top-k K] [--save-last] [--preemption] [--resume [hpc|last]] [--pause-at STEP]

The only bcp line is `Trainer(plugins=[BCPCheckpointIO(...)])`; its saves are asynchronous (the
default). The model trains on bcp's PackedTokenLoader (its position is in the checkpoint, so a
mid-epoch resume is exact) with dropout (so the RNG states matter). Checkpoints, all to DIR:
`ModelCheckpoint(every_n_train_steps=4, save_top_k=K, save_last=...)` -> mc/step=<s>.ckpt (every one by
default, the best K by --top-k: the newest, as nothing is monitored) and with --save-last mc/last.ckpt
at each of them; `trainer.save_checkpoint` inside
fit at the last step, from a callback -> in_fit.ckpt; `trainer.save_checkpoint` after fit returns
-> after_fit.ckpt. Then the script ends right after that last save, --end: "script" (falls off the
end), "sys_exit" (sys.exit(0)), "exception" (an uncaught exception).
With --preemption, `BCPCheckpointIO(preemption=True)`: SIGTERM leads to hpc_ckpt_<n>.ckpt at the
step every rank stops at, and exit 143; --resume continues with `fit(ckpt_path="hpc")`, --resume last
with `fit(ckpt_path="last")`. BCP_TEST_FAULT injects faults into the saves (tests/faults.py).
Each step writes DIR/progress_rank<r> ("<global step> <pid>"; "0 <pid>" in on_fit_start, before
Lightning installs its SIGTERM handler), and at --pause-at (0: in on_fit_start) waits for the test
to release it (tests/pause.py); every save writes, from
rank 0, DIR/reference_<global step>.pt: the values the checkpoint must hold, taken at the save.
"""

from __future__ import annotations

import argparse
import os
import sys

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch import nn

from bcp_core.dataloader import PackedTokenLoader
from bcp_integrations.lightning import BCPCheckpointIO

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import faults  # noqa: E402 - tests/faults.py
from pause import pause_at  # noqa: E402 - tests/pause.py

VOCAB = 64
# documents of distinct token ids: about 30 batches per rank, so every run stays in one epoch
DOCS = {"web": [list(range(100 * i, 100 * i + 3 + i % 7)) for i in range(64)],
        "code": [list(range(10000 + 100 * i, 10000 + 100 * i + 2 + i % 3)) for i in range(32)]}


class TokenRegressor(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.emb = nn.EmbeddingBag(VOCAB, 16)
        self.head = nn.Sequential(nn.Dropout(0.2), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))

    def forward(self, ids):
        return self.head(self.emb(ids)).squeeze(-1)

    def training_step(self, batch, batch_idx):
        ids = batch.clamp(min=0) % VOCAB
        target = (ids % 7).float().mean(dim=1)
        return F.mse_loss(self(ids), target)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.7)
        return [opt], [{"scheduler": sched, "interval": "step"}]

    def train_dataloader(self):
        dp = self.trainer.strategy.distributed_sampler_kwargs or {}  # this rank's DP rank and degree
        return PackedTokenLoader(DOCS, seq_len=4, batch_size=2, dp_rank=dp.get("rank", 0),
                                 dp_size=dp.get("num_replicas", 1), seed=0, pad_id=-1)


class Job(Callback):
    """Progress files and pauses for the test; the reference values of every save."""

    def __init__(self, args):
        self.args = args

    def _progress(self, trainer, step: int) -> None:
        with open(os.path.join(self.args.root, f"progress_rank{trainer.global_rank}"), "w") as f:
            f.write(f"{step} {os.getpid()}")

    def on_fit_start(self, trainer, pl_module):
        self._progress(trainer, 0)
        if self.args.pause_at == 0:
            pause_at(self.args.root, 0)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self._progress(trainer, trainer.global_step)
        if trainer.global_step == self.args.pause_at:
            pause_at(self.args.root, trainer.global_step)
        if trainer.global_step == self.args.steps:
            trainer.save_checkpoint(os.path.join(self.args.root, "in_fit.ckpt"))

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        if trainer.is_global_zero:
            torch.save({"model": pl_module.state_dict(), "optimizer": trainer.optimizers[0].state_dict(),
                        "scheduler": trainer.lr_scheduler_configs[0].scheduler.state_dict(),
                        "global_step": trainer.global_step, "rng": torch.get_rng_state()},
                       os.path.join(self.args.root, f"reference_{trainer.global_step}.pt"))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--end", default="script", choices=["script", "sys_exit", "exception"])
    p.add_argument("--top-k", type=int, default=-1, help="ModelCheckpoint(save_top_k=...)")
    p.add_argument("--save-last", action="store_true", help="ModelCheckpoint(save_last=True)")
    p.add_argument("--preemption", action="store_true")
    p.add_argument("--resume", nargs="?", const="hpc", choices=["hpc", "last"], help="fit(ckpt_path=...)")
    p.add_argument("--pause-at", type=int, default=None, help="wait at this step until the test releases it")
    args = p.parse_args()
    faults.install_from_env()

    L.seed_everything(0, verbose=False)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=args.steps, max_epochs=1,
                        plugins=[BCPCheckpointIO(preemption=args.preemption)],
                        callbacks=[Job(args), ModelCheckpoint(dirpath=os.path.join(args.root, "mc"), filename="{step}",
                                                              every_n_train_steps=4, save_top_k=args.top_k,
                                                              save_last=args.save_last or None)],
                        default_root_dir=args.root, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, deterministic=True)
    trainer.fit(TokenRegressor(), ckpt_path=args.resume)
    trainer.save_checkpoint(os.path.join(args.root, "after_fit.ckpt"))
    if args.end == "sys_exit":
        sys.exit(0)
    if args.end == "exception":
        raise RuntimeError("the training script failed after its last save")


if __name__ == "__main__":
    main()
