"""A 2-rank Lightning job (DDP on gloo) training on torchdata's StatefulDataLoader, whose state bcp
keeps opaque (per DP rank, restored only at the same DP degree), checkpointed mid-epoch.

    torchrun --nproc_per_node 2 tests/jobs/lightning_opaque_loader.py --ckpt-dir DIR

`ModelCheckpoint(every_n_train_steps=2)` -> DIR/step=2.ckpt, in the middle of the first epoch.
`OpaqueNet` and `loader()` are what tests/test_lightning_safety.py resumes with on 1 process.
"""

from __future__ import annotations

import argparse

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torchdata.stateful_dataloader import StatefulDataLoader

from bcp_integrations.lightning import BCPCheckpointIO


class OpaqueNet(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Linear(4, 1)
        self.opt: torch.optim.Optimizer | None = None

    def training_step(self, batch, _):
        return self.net(batch[0]).pow(2).mean()

    def configure_optimizers(self):
        self.opt = torch.optim.Adam(self.parameters(), lr=0.1)
        return self.opt


def loader() -> StatefulDataLoader:
    g = torch.Generator().manual_seed(0)
    return StatefulDataLoader(torch.utils.data.TensorDataset(torch.randn(64, 4, generator=g)), batch_size=4)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--ckpt-dir", required=True)
    args = p.parse_args()
    L.seed_everything(0, verbose=False)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=2, plugins=[BCPCheckpointIO()],
                        callbacks=[ModelCheckpoint(dirpath=args.ckpt_dir, filename="{step}", every_n_train_steps=2,
                                                   save_top_k=-1)],
                        logger=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(OpaqueNet(), loader())


if __name__ == "__main__":
    main()
