"""DeepSpeed + bcp: ZeRO-3 on 2 ranks through the HF Trainer, resumed as ZeRO-2 on 1, exported for Hugging Face.

    torchrun --nproc_per_node 2 recipes/deepspeed_resume.py [--out DIR]

On a machine without CUDA it sets DS_ACCELERATOR=cpu (DeepSpeed then builds a small communication
op with g++ at its first start). The script:
1. trains a tiny LlamaForCausalLM (built from a LlamaConfig, no downloads) with
   ``TrainingArguments(deepspeed={... "zero_optimization": {"stage": 3}})`` on 2 ranks for 4 steps,
   ``BCPTrainer(..., callbacks=[BCPCallback()])``: each checkpoint-<step> is written by bcp from both
   ranks' ZeRO-3 partitions (fp32 master weights, Adam moments, step, scheduler, the engine's
   counters), asynchronously, nothing gathered;
2. relaunches itself on 1 process under ZeRO-2 and resumes with ``train(resume_from_checkpoint=True)``:
   bcp reshards the partitions at load time (DeepSpeed itself needs ds_to_universal.py for that);
3. loads the last checkpoint into a plain LlamaForCausalLM with ``bcp.load`` and writes it with
   ``save_pretrained``.
``--phase run`` runs one training alone.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

from _launch import exit_without_teardown, relaunch  # recipes/_launch.py

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")

from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments  # noqa: E402

import bcp_core as bcp  # noqa: E402
from bcp_integrations.hf import BCPCallback, BCPTrainer  # noqa: E402

MODEL = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=2, max_position_embeddings=32)


class TokenData(torch.utils.data.Dataset):
    def __init__(self):
        self.ids = torch.randint(0, MODEL["vocab_size"], (32, 8), generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def deepspeed_config(stage: int) -> dict:
    # "auto" values come from TrainingArguments; torch_adam avoids compiling DeepSpeed's fused Adam
    return {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
            "train_batch_size": "auto", "gradient_clipping": "auto",
            "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto", "torch_adam": True}},
            # parameters under this many elements stay whole under ZeRO-3: 0 shards even a tiny model
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}


def run_phase(args) -> None:
    targs = TrainingArguments(output_dir=args.ckpt_dir, use_cpu=not torch.cuda.is_available(),
                              per_device_train_batch_size=4 // int(os.environ.get("WORLD_SIZE", "1")),
                              max_steps=args.max_steps, save_steps=2, learning_rate=1e-2, logging_steps=1,
                              report_to="none", disable_tqdm=True, seed=0, deepspeed=deepspeed_config(args.zero))
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**MODEL, attn_implementation="eager"))
    trainer = BCPTrainer(model=model, args=targs, train_dataset=TokenData(), callbacks=[BCPCallback()])
    trainer.train(resume_from_checkpoint=True if args.resume else None)
    if trainer.args.process_index == 0:
        print(f"ZeRO-{args.zero} on {trainer.args.world_size} rank(s): losses",
              [(h["step"], round(h["loss"], 5)) for h in trainer.state.log_history if "loss" in h], flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--phase", choices=["demo", "run"], default="demo")
    p.add_argument("--out", default=None, help="working directory (default: a temporary one)")
    p.add_argument("--ckpt-dir", default=None)
    p.add_argument("--zero", type=int, default=3)
    p.add_argument("--max-steps", type=int, default=4)
    p.add_argument("--resume", action="store_true")
    args = p.parse_args()
    if args.phase == "run":
        run_phase(args)
        return
    if int(os.environ.get("WORLD_SIZE", "1")) != 2:
        sys.exit("run the demo with: torchrun --nproc_per_node 2 recipes/deepspeed_resume.py")
    out = args.out or tempfile.mkdtemp(prefix="bcp_deepspeed_")
    args.ckpt_dir = os.path.join(out, "trainer")
    run_phase(args)
    if int(os.environ["RANK"]) == 0:
        print(f"checkpoints: {sorted(os.listdir(args.ckpt_dir))}; "
              f"{bcp.inspect(os.path.join(args.ckpt_dir, 'checkpoint-4')).framework} layout, keyed by parameter name")
        relaunch(__file__, 1, "--phase", "run", "--zero", "2", "--resume", "--max-steps", "8",
                 "--ckpt-dir", args.ckpt_dir)
        model = LlamaForCausalLM(LlamaConfig(**MODEL))
        bcp.load(os.path.join(args.ckpt_dir, "checkpoint-8"), {"model": model})
        model.save_pretrained(os.path.join(out, "hf_model"))
        print(f"checkpoint-8 -> {os.path.join(out, 'hf_model')}: {sorted(os.listdir(os.path.join(out, 'hf_model')))}")


if __name__ == "__main__":
    main()
    exit_without_teardown()
