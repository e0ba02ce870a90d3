"""A 2-rank HF Transformers training job (Trainer with DDP on gloo) saving through bcp, ended the
ways real jobs end.

    torchrun --nproc_per_node 2 tests/jobs/hf_train.py --root DIR [--steps N] [--save-steps K]
        [--save-total-limit L] [--trainer bcp|callback] [--end HOW] [--preemption] [--resume] [--pause-at STEP]
        [--zero STAGE] [--stop-at STEP]

A tiny Llama (built from a config, attention dropout so the RNG states matter) trains on 32 fixed
sequences, 2 per rank per step (an epoch is 8 steps). --trainer: "bcp" is
`BCPTrainer(callbacks=[BCPCallback(...)])`, "callback" a plain `Trainer` with `BCPCallback(...)`;
either way the Trainer saves DIR/checkpoint-<step> every --save-steps steps and at the last one
(through bcp, asynchronously; `save_total_limit=L` with --save-total-limit), then `train()`
returns and the script ends, --end: "script" (falls
off the end), "sys_exit" (sys.exit(0)), "exception" (an uncaught exception). With --preemption,
`BCPCallback(preemption=True)`: SIGTERM leads to checkpoint-<step> at the step every rank stops at,
and exit 143; --resume continues with `BCPTrainer.train(resume_from_checkpoint=True)`.
Each optimizer step writes DIR/progress_rank<r> ("<step> <pid>") and at --pause-at waits for the
test to release it (tests/pause.py); at
each step's end rank 0 writes DIR/reference_<step>.pt, the values a checkpoint of that step
holds (the optimizer's state by parameter name, as bcp saves it). BCP_TEST_FAULT injects faults
into the saves (tests/faults.py). Each rank writes its logged losses to DIR/losses_rank<r>.json.

--zero STAGE trains under DeepSpeed ZeRO-STAGE (``TrainingArguments(deepspeed=...)``; DS_ACCELERATOR=cpu),
and the reference values are DeepSpeed's full fp32 values and Adam moments
(``safe_get_full_fp32_param`` / ``safe_get_full_optimizer_state``) and the engine's ``global_steps``.
--stop-at STEP ends training after STEP (its checkpoint saved), as a job stopped there would.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments  # noqa: E402

from bcp_integrations.hf import BCPCallback, BCPTrainer  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import faults  # noqa: E402 - tests/faults.py
from pause import pause_at  # noqa: E402 - tests/pause.py

MODEL = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=2, max_position_embeddings=32, attention_dropout=0.1)
SAMPLES, SEQ = 32, 8


def build_model(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**MODEL, attn_implementation="eager"))


class TokenData(torch.utils.data.Dataset):
    def __init__(self):
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, MODEL["vocab_size"], (SAMPLES, SEQ), generator=g)

    def __len__(self):
        return SAMPLES

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class Job(TrainerCallback):
    """Progress files and pauses for the test; reference values at every step's end."""

    def __init__(self, args):
        self.args = args

    def on_optimizer_step(self, args, state, control, **kwargs):
        with open(os.path.join(self.args.root, f"progress_rank{args.process_index}"), "w") as f:
            f.write(f"{state.global_step + 1} {os.getpid()}")
        if state.global_step + 1 == self.args.pause_at:
            pause_at(self.args.root, self.args.pause_at)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            path = os.path.join(self.args.root, f"losses_rank{args.process_index}.json")
            losses = json.load(open(path)) if os.path.exists(path) else []
            json.dump(losses + [[state.global_step, logs["loss"]]], open(path, "w"))

    def on_step_end(self, args, state, control, model=None, optimizer=None, lr_scheduler=None, **kwargs):
        if self.args.stop_at is not None and state.global_step >= self.args.stop_at:
            control.should_training_stop = True
            control.should_save = True
        if self.args.zero is not None:
            self._deepspeed_reference(state, model, optimizer, lr_scheduler, kwargs)
        elif state.is_world_process_zero:
            # the optimizer's state by parameter name, as bcp saves it
            names = {id(p): n for n, p in model.named_parameters()}
            order = [names[id(p)] for g in optimizer.param_groups for p in g["params"]]
            sd = optimizer.state_dict()
            torch.save({"model": model.state_dict(),
                        "optimizer": {order[i]: s for i, s in sd["state"].items()},
                        "param_groups": [{**g, "params": [order[i] for i in g["params"]]} for g in sd["param_groups"]],
                        "scheduler": lr_scheduler.state_dict(), "rng": torch.get_rng_state()},
                       os.path.join(self.args.root, f"reference_{state.global_step}.pt"))


    def _deepspeed_reference(self, state, model, optimizer, lr_scheduler, kwargs) -> None:
        """DeepSpeed's full values (collective: every rank takes part, rank 0 writes them)."""
        from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
        values, moments = {}, {}
        for n, p in model.named_parameters():
            values[n] = safe_get_full_fp32_param(p).detach().clone()
            moments[n] = {k: safe_get_full_optimizer_state(p, k).detach().clone() for k in ("exp_avg", "exp_avg_sq")}
        inner = optimizer.optimizer.optimizer  # Accelerate's wrapper -> ZeRO -> torch's AdamW
        steps = sorted({float(s["step"]) for s in inner.state.values() if "step" in s})
        engine = self.trainer.model_wrapped
        if state.is_world_process_zero:
            torch.save({"model": values, "optimizer": moments, "step": steps, "global_steps": engine.global_steps,
                        "scheduler": lr_scheduler.state_dict(), "rng": torch.get_rng_state()},
                       os.path.join(self.args.root, f"reference_{state.global_step}.pt"))


def deepspeed_config(stage: int) -> dict:
    return {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
            "train_batch_size": "auto", "gradient_clipping": "auto",
            "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto", "betas": "auto",
                                                      "eps": "auto", "torch_adam": True}},
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--save-steps", type=int, default=4)
    p.add_argument("--save-total-limit", type=int, default=None)
    p.add_argument("--trainer", default="bcp", choices=["bcp", "callback"])
    p.add_argument("--end", default="script", choices=["script", "sys_exit", "exception"])
    p.add_argument("--preemption", action="store_true")
    p.add_argument("--resume", action="store_true", help="train(resume_from_checkpoint=True) (BCPTrainer)")
    p.add_argument("--pause-at", type=int, default=None, help="wait at this step until the test releases it")
    p.add_argument("--zero", type=int, choices=(1, 2, 3), default=None)
    p.add_argument("--stop-at", type=int, default=None)
    args = p.parse_args()
    if args.resume and args.trainer != "bcp":
        p.error("--resume needs --trainer bcp: a plain Trainer cannot read bcp checkpoints")
    faults.install_from_env()

    on_gpu = os.environ.get("BCP_TEST_DEVICE", "cpu") == "cuda"  # the GPU check's runs (tests/test_cuda_deepspeed.py)
    targs = TrainingArguments(output_dir=args.root, use_cpu=not on_gpu, full_determinism=on_gpu,
                              per_device_train_batch_size=2,
                              max_steps=args.steps, save_strategy="steps", save_steps=args.save_steps,
                              save_total_limit=args.save_total_limit,
                              learning_rate=1e-2, lr_scheduler_type="linear", warmup_steps=2, report_to="none",
                              disable_tqdm=True, seed=0, dataloader_num_workers=0, logging_steps=1,
                              deepspeed=deepspeed_config(args.zero) if args.zero else None)
    job = Job(args)
    callbacks = [job, BCPCallback(preemption=args.preemption)]
    trainer_cls = BCPTrainer if args.trainer == "bcp" else Trainer
    trainer = trainer_cls(model=build_model(), args=targs, train_dataset=TokenData(), callbacks=callbacks)
    job.trainer = trainer
    trainer.train(resume_from_checkpoint=True if args.resume else None)
    if args.end == "sys_exit":
        sys.exit(0)
    if args.end == "exception":
        raise RuntimeError("the training script failed after its last save")


if __name__ == "__main__":
    main()
