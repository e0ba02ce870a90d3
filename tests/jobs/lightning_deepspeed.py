"""Lightning's DeepSpeedStrategy (ZeRO-3, CUDA only) checkpointing through BCPCheckpointIO, on one GPU.

    torchrun --nproc_per_node 1 tests/jobs/lightning_deepspeed.py --root DIR [--steps N] [--resume CKPT]

A LightningModule holding a tiny LlamaForCausalLM (built from a config) trains deterministically
(`Trainer(deterministic=True)`) with `DeepSpeedStrategy(stage=3)` and `plugins=[BCPCheckpointIO()]`
on bcp's PackedTokenLoader (its position is in the checkpoint: a resume from step 2 trains on the
batches the uninterrupted run trained on after step 2, which a map-style loader under Lightning's
DistributedSampler would not give);
`ModelCheckpoint(every_n_train_steps=2, save_top_k=-1)` writes DIR/step=<n>.ckpt (bcp checkpoints).
--resume continues from a checkpoint with `fit(ckpt_path=...)`. At the end DIR/final.pt holds
DeepSpeed's full fp32 values and Adam moments (`safe_get_full_fp32_param` /
`safe_get_full_optimizer_state`) and the global step.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import lightning as L  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from lightning.pytorch.strategies import DeepSpeedStrategy  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from bcp_core.dataloader import PackedTokenLoader  # noqa: E402
from bcp_integrations.lightning import BCPCheckpointIO  # noqa: E402

MODEL = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=2, max_position_embeddings=32)


def build_model(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**MODEL, attn_implementation="eager"))


# documents of distinct token ids (padding is -1): more batches than a run takes, so it stays in one epoch
DOCS = {"web": [list(range(10 * i, 10 * i + 3 + i % 5)) for i in range(64)]}


class LM(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.llama = build_model()

    def training_step(self, batch, _):
        ids = batch.clamp(min=0) % MODEL["vocab_size"]
        return self.llama(input_ids=ids, labels=torch.where(batch < 0, -100, ids)).loss

    def train_dataloader(self):
        dp = self.trainer.strategy.distributed_sampler_kwargs or {}  # this rank's DP rank and degree
        return PackedTokenLoader(DOCS, seq_len=8, batch_size=4, dp_rank=dp.get("rank", 0),
                                 dp_size=dp.get("num_replicas", 1), seed=0)

    def on_train_end(self):
        # before the strategy's teardown moves the optimizer's state to the CPU, where NCCL cannot gather it
        from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
        self.final = {"model": {}, "optimizer": {}}
        for n, prm in self.named_parameters():
            self.final["model"][n] = safe_get_full_fp32_param(prm).detach().cpu()
            self.final["optimizer"][n] = {k: safe_get_full_optimizer_state(prm, k).detach().cpu()
                                          for k in ("exp_avg", "exp_avg_sq")}

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.01)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--resume", default=None)
    args = p.parse_args()
    strategy = DeepSpeedStrategy(config={
        "train_micro_batch_size_per_gpu": 4,  # not gradient_accumulation_steps: the Trainer sets it
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}})
    trainer = L.Trainer(accelerator="gpu", devices=1, strategy=strategy, plugins=[BCPCheckpointIO()],
                        max_steps=args.steps, deterministic=True, logger=False, enable_progress_bar=False,
                        callbacks=[ModelCheckpoint(dirpath=args.root, every_n_train_steps=2, save_top_k=-1,
                                                   filename="{step}")])
    lm = LM()
    trainer.fit(lm, ckpt_path=args.resume)
    if trainer.is_global_zero:
        torch.save({**lm.final, "global_step": trainer.global_step}, os.path.join(args.root, "final.pt"))

if __name__ == "__main__":
    main()
