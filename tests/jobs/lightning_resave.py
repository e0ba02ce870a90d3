"""A 2-rank Lightning job (DDP on gloo) that saves one global step to one path three times.

    BCP_TEST_FAULT=write:rank=1:save=2 torchrun --nproc_per_node 2 tests/jobs/lightning_resave.py --root DIR

After `fit` (2 steps): `trainer.save_checkpoint(DIR/final.ckpt)` (asynchronous, BCPCheckpointIO's
default); again (the fault makes it fail on rank 1: each rank records the error it got in
DIR/second_rank<r>.txt, and what DIR/final.ckpt resolves to then in DIR/after_failure_rank<r>.txt);
and a third time, succeeding. Rank 0 writes DIR/reference.pt: the model's parameters as saved.
"""

from __future__ import annotations

import argparse
import os
import sys

import lightning as L
import torch
from torch import nn

import bcp_core as bcp
from bcp_integrations.lightning import BCPCheckpointIO

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import faults  # noqa: E402 - tests/faults.py


class Net(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Linear(4, 1)

    def training_step(self, batch, _):
        return self.net(batch[0]).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.1)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    args = p.parse_args()
    faults.install_from_env()
    L.seed_everything(0, verbose=False)
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(32, 4, generator=g)), batch_size=4)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=2, plugins=[BCPCheckpointIO()],
                        enable_checkpointing=False, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0)
    module = Net()
    trainer.fit(module, data)
    rank = trainer.global_rank
    path = os.path.join(args.root, "final.ckpt")
    if rank == 0:
        torch.save({k: v.clone() for k, v in module.state_dict().items()}, os.path.join(args.root, "reference.pt"))
    trainer.save_checkpoint(path)
    trainer.save_checkpoint(path)  # asynchronous: its error comes from the next wait
    try:
        trainer.strategy.bcp_io.wait()
        error = "none"
    except bcp.SaveError as e:
        error = f"SaveError: {e}"
    with open(os.path.join(args.root, f"second_rank{rank}.txt"), "w") as f:
        f.write(error)
    with open(os.path.join(args.root, f"after_failure_rank{rank}.txt"), "w") as f:
        f.write(bcp.resolve(path).root)
    trainer.strategy.barrier()
    trainer.save_checkpoint(path)
    trainer.strategy.bcp_io.wait()


if __name__ == "__main__":
    main()
