"""HF Trainer runs under DeepSpeed (DS_ACCELERATOR=cpu) resuming in the two ways bcp must leave alone or
carry: a plain Trainer resuming DeepSpeed's own checkpoints, and BCPTrainer resuming from tiers.

    torchrun --nproc_per_node N tests/jobs/hf_deepspeed_resume.py --root DIR --zero STAGE
        [--steps S] [--save-steps K] [--stop-at STEP] [--resume] [--native | --tiers BASE]

The model, data and reference values are tests/jobs/hf_train.py's (its `Job` callback: DIR/reference_<step>.pt,
DeepSpeed's full fp32 values and Adam moments, at each step's end).

--native: a plain `transformers.Trainer` with no bcp callback, in a process that imported
bcp_integrations.hf: the Trainer writes DeepSpeed's own checkpoints (ZeRO-3 without
stage3_gather_16bit_weights_on_model_save: no model.safetensors), and with --resume
`train(resume_from_checkpoint=True)` reads them back through DeepSpeed, as without bcp.

--tiers BASE: `BCPTrainer(callbacks=[BCPCallback(tiers=Tiers("memory://job", durable=BASE/durable,
replicas=1, persist_every=2))])`; each rank is a simulated node (BCP_LOCAL_WORLD_SIZE=1) whose memory is
BASE/mem<rank>. With --resume, `train(resume_from_checkpoint=tiers)`.

With --resume, at train begin (the state loaded) DIR/resumed/reference_<step>.pt gets the values the run
starts from.
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("DS_ACCELERATOR", "cpu")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import hf_train  # noqa: E402 - tests/jobs/hf_train.py
from transformers import Trainer, TrainingArguments  # noqa: E402

import bcp_core as bcp  # noqa: E402
from bcp_integrations.hf import BCPCallback, BCPTrainer  # noqa: E402


class Job(hf_train.Job):
    def on_train_begin(self, args, state, control, model=None, optimizer=None, lr_scheduler=None, **kwargs):
        if self.args.resume:  # the values the resumed run starts from (collective): DIR/resumed/
            root, self.args.root = self.args.root, os.path.join(self.args.root, "resumed")
            os.makedirs(self.args.root, exist_ok=True)
            try:
                self._deepspeed_reference(state, model, optimizer, lr_scheduler, kwargs)
            finally:
                self.args.root = root


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--zero", type=int, choices=(1, 2, 3), required=True)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--save-steps", type=int, default=2)
    p.add_argument("--stop-at", type=int, default=None)
    p.add_argument("--resume", action="store_true")
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--native", action="store_true")
    mode.add_argument("--tiers", metavar="BASE")
    args = p.parse_args()
    args.pause_at = None

    targs = TrainingArguments(output_dir=args.root, use_cpu=True, per_device_train_batch_size=2,
                              max_steps=args.steps, save_strategy="steps", save_steps=args.save_steps,
                              learning_rate=1e-2, lr_scheduler_type="linear", warmup_steps=2, report_to="none",
                              disable_tqdm=True, seed=0, dataloader_num_workers=0, logging_steps=1,
                              deepspeed=hf_train.deepspeed_config(args.zero))
    job = Job(args)
    if args.native:
        trainer = Trainer(model=hf_train.build_model(), args=targs, train_dataset=hf_train.TokenData(),
                          callbacks=[job])
        job.trainer = trainer
        trainer.train(resume_from_checkpoint=True if args.resume else None)
        return
    rank = int(os.environ["RANK"])
    os.environ["BCP_MEMORY_DIR"] = os.path.join(args.tiers, f"mem{rank}")
    os.makedirs(os.environ["BCP_MEMORY_DIR"], exist_ok=True)
    tiers = bcp.Tiers("memory://job", durable=os.path.join(args.tiers, "durable"), replicas=1, persist_every=2)
    trainer = BCPTrainer(model=hf_train.build_model(), args=targs, train_dataset=hf_train.TokenData(),
                         callbacks=[job, BCPCallback(tiers=tiers)])
    job.trainer = trainer
    trainer.train(resume_from_checkpoint=tiers if args.resume else None)


if __name__ == "__main__":
    main()
