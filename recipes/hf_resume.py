"""HF Transformers + bcp: train a tiny Llama on 2 ranks, resume on 1, export a Hugging Face model.

    torchrun --nproc_per_node 2 recipes/hf_resume.py [--out DIR]

bcp is ``BCPTrainer(..., callbacks=[BCPCallback()])`` (BCPTrainer is ``transformers.Trainer`` with
the BCPTrainerMixin, needed to resume). The script:
1. trains a tiny LlamaForCausalLM (built from a LlamaConfig, no downloads, with dropout so RNG
   state matters) for 4 steps with DDP on 2 CPU ranks, ``save_steps=2``, ``save_total_limit=1``:
   checkpoints are written by bcp from both ranks, asynchronously;
2. relaunches itself on 1 process and resumes with ``train(resume_from_checkpoint=True)``;
3. exports the final checkpoint with ``export_pretrained`` and reloads it with ``from_pretrained``.
``--phase run`` runs one training alone (the tests use it).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

from _launch import exit_without_teardown, relaunch  # recipes/_launch.py

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments  # noqa: E402
from transformers.trainer_callback import TrainerCallback  # noqa: E402

from bcp_integrations.hf import BCPCallback, BCPTrainer, export_pretrained  # noqa: E402

MODEL = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=2, max_position_embeddings=32, attention_dropout=0.1)
SAMPLES, SEQ = 32, 8


class TokenData(torch.utils.data.Dataset):
    def __init__(self):
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, MODEL["vocab_size"], (SAMPLES, SEQ), generator=g)

    def __len__(self):
        return SAMPLES

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class Dump(TrainerCallback):
    """Writes rank 0's training state at train start (after a resume's load) and at one step."""

    def __init__(self, out: str, at_step: int | None):
        self.out, self.at_step = out, at_step

    def on_train_begin(self, args, state, control, model=None, optimizer=None, lr_scheduler=None, **kw):
        self._dump("start", state, model, optimizer, lr_scheduler)

    def on_step_end(self, args, state, control, model=None, optimizer=None, lr_scheduler=None, **kw):
        if state.global_step == self.at_step:
            self._dump(f"step{state.global_step}", state, model, optimizer, lr_scheduler)

    def _dump(self, tag, state, model, optimizer, lr_scheduler):
        if state.is_world_process_zero:
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                        "scheduler": lr_scheduler.state_dict(), "global_step": state.global_step},
                       os.path.join(self.out, f"state_{tag}.pt"))


def losses_recorded(trainer_cls):
    """`trainer_cls` that records every micro-batch loss of this rank, exactly (HF logs round them)."""

    class Recording(trainer_cls):
        losses: list[tuple[int, float]] = []

        def training_step(self, model, inputs, num_items_in_batch=None):
            loss = super().training_step(model, inputs, num_items_in_batch)
            self.losses.append((self.state.global_step + 1, loss.item()))
            return loss

    return Recording


# For --packed: documents of unique token ids (the model sees them modulo its vocabulary).
DOCS = {"web": [list(range(100 * i, 100 * i + 3 + i % 5)) for i in range(24)],
        "code": [list(range(5000 + 100 * i, 5000 + 100 * i + 2 + i % 3)) for i in range(12)]}


def packed_loader(out: str, rank: int, world: int):
    """bcp's PackedTokenLoader, mapped to the inputs a causal LM takes; writes each batch it yields
    with the loader's epoch."""
    from bcp_core.dataloader import MappedLoader, PackedTokenLoader

    seen = []

    def to_inputs(batch):
        seen.append((tokens.epoch, batch.tolist()))
        with open(os.path.join(out, f"batches_rank{rank}.json"), "w") as f:
            json.dump(seen, f)
        ids = batch.clamp(min=0) % MODEL["vocab_size"]
        return {"input_ids": ids, "labels": ids.masked_fill(batch < 0, -100)}

    tokens = PackedTokenLoader(DOCS, seq_len=4, batch_size=2, dp_rank=rank, dp_size=world, seed=0, pad_id=-1)
    return MappedLoader(tokens, to_inputs)


def run_phase(args) -> None:
    rank = int(os.environ.get("RANK", "0"))
    os.makedirs(args.out, exist_ok=True)
    targs = TrainingArguments(output_dir=args.ckpt_dir, use_cpu=True, per_device_train_batch_size=2,
                              max_steps=args.max_steps, save_strategy="steps", save_steps=args.save_steps,
                              save_total_limit=args.save_total_limit, learning_rate=1e-2, lr_scheduler_type="linear",
                              warmup_steps=1, logging_steps=1, report_to="none", disable_tqdm=True, seed=0,
                              dataloader_num_workers=0)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**MODEL, attn_implementation="eager"))
    callbacks = [Dump(args.out, args.dump_at_step)]
    trainer_cls = losses_recorded(Trainer if args.native else BCPTrainer)
    if not args.native:
        callbacks.append(BCPCallback())
    if args.packed:
        loader = packed_loader(args.out, rank, int(os.environ.get("WORLD_SIZE", "1")))
        trainer = trainer_cls(model=model, args=targs, train_dataloader=loader, callbacks=callbacks)
    else:
        trainer = trainer_cls(model=model, args=targs, train_dataset=TokenData(), callbacks=callbacks)
    resume = args.resume
    if resume == "last":
        resume = True
    trainer.train(resume_from_checkpoint=resume)
    with open(os.path.join(args.out, f"losses_rank{rank}.json"), "w") as f:
        json.dump(trainer.losses, f)
    if rank == 0:
        print("losses:", [(s, round(v, 6)) for s, v in trainer.losses])



def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--phase", choices=["demo", "run"], default="demo")
    p.add_argument("--out", default=None, help="working directory (default: a temporary one)")
    p.add_argument("--ckpt-dir", default=None, help="TrainingArguments.output_dir")
    p.add_argument("--max-steps", type=int, default=4)
    p.add_argument("--save-steps", type=int, default=2)
    p.add_argument("--save-total-limit", type=int, default=None)
    p.add_argument("--resume", default=None, help="checkpoint path, or 'last' for resume_from_checkpoint=True")
    p.add_argument("--dump-at-step", type=int, default=None)
    p.add_argument("--native", action="store_true", help="HF's own checkpoints instead of bcp (reference)")
    p.add_argument("--packed", action="store_true",
                   help="train on bcp's PackedTokenLoader (BCPTrainer(train_dataloader=...)), one epoch")
    args = p.parse_args()
    if args.phase == "run":
        run_phase(args)
        return
    if int(os.environ.get("WORLD_SIZE", "1")) != 2:
        sys.exit("run the demo with: torchrun --nproc_per_node 2 recipes/hf_resume.py")
    out = args.out or tempfile.mkdtemp(prefix="bcp_hf_")
    ckpt = os.path.join(out, "trainer")
    args.out, args.ckpt_dir, args.save_total_limit = os.path.join(out, "ws2"), ckpt, 1
    run_phase(args)
    if int(os.environ["RANK"]) == 0:
        print(f"checkpoints (save_total_limit=1): {sorted(os.listdir(ckpt))}")
        relaunch(__file__, 1, "--phase", "run", "--resume", "last", "--max-steps", "8",
                 "--out", os.path.join(out, "ws1"), "--ckpt-dir", ckpt)
        final = os.path.join(ckpt, "checkpoint-8")
        hf_dir = export_pretrained(final, os.path.join(out, "hf_model"))
        reloaded = LlamaForCausalLM.from_pretrained(hf_dir)
        print(f"exported {final} -> {hf_dir} {sorted(os.listdir(hf_dir))}; from_pretrained: "
              f"{sum(p.numel() for p in reloaded.parameters())} parameters")


if __name__ == "__main__":
    main()
    exit_without_teardown()
