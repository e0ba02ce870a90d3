"""One integration trained on one device, for tests/test_device_integrations.py: a checkpoint
through bcp, a resume from it, and dumps of the state to compare.

    torchrun --standalone --nproc_per_node 1 tests/jobs/device_integration.py --framework hf|accelerate|lightning
        --device cuda|cpu --root DIR [--resume]

Trains `STEPS` steps on fixed batches and checkpoints after step `SAVE_AT` (asynchronously, each
integration's default), with FSDP on CUDA: the HF Trainer's `fsdp="full_shard"`, Accelerate's
`FullyShardedDataParallelPlugin`, Lightning's `FSDPStrategy` (on CPU, where none of the three runs
FSDP, the same job without it: the tests' CPU twins). Writes into DIR:

- `reference.pt`: the full state (model and optimizer by parameter name, on the CPU, from torch's
  `get_model_state_dict` / `get_optimizer_state_dict`) as the checkpoint after step `SAVE_AT`
  must hold it, taken right after that step;
- `losses.json`: the loss of every step, {step: loss};
- `checkpoint.txt`: the path of the checkpoint of step `SAVE_AT`;
- with --resume (from that checkpoint, through the framework's own resume): `resumed.pt`, the
  state right after the load, before any step, and `losses_resumed.json`, steps `SAVE_AT+1` on.

Deterministic on CUDA (`torch.use_deterministic_algorithms`, CUBLAS_WORKSPACE_CONFIG), so a
resumed run's losses equal the uninterrupted run's bit for bit.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from torch import nn  # noqa: E402

STEPS, SAVE_AT = 6, 3
WIDTH, ROWS = 64, 8


def batch(step: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(ROWS, WIDTH, generator=g)
    return x.to(device), x.sin().sum(dim=1, keepdim=True).to(device)


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH), nn.GELU(),
                         nn.Linear(WIDTH, 1))


def full_state(model: nn.Module, optimizer) -> dict:
    """The model's and optimizer's full state on the CPU, by parameter name (FSDP gathered)."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict)
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    msd = get_model_state_dict(model, options=opts)
    osd = get_optimizer_state_dict(model, optimizer, options=opts)
    return {"model": {k: v.detach().to("cpu", copy=True) for k, v in msd.items()},
            "optimizer": {f"{fqn}.{k}": torch.as_tensor(v).detach().to("cpu", copy=True)
                          for fqn, st in osd["state"].items() for k, v in st.items()}}


class Out:
    def __init__(self, root: str, resume: bool):
        self.root, self.resume = root, resume
        self.losses: dict[int, float] = {}

    def dump(self, name: str, model, optimizer) -> None:
        torch.save(full_state(model, optimizer), os.path.join(self.root, name))

    def finish(self) -> None:
        name = "losses_resumed.json" if self.resume else "losses.json"
        with open(os.path.join(self.root, name), "w") as f:
            json.dump(self.losses, f)

    def checkpoint(self, path: str) -> None:
        with open(os.path.join(self.root, "checkpoint.txt"), "w") as f:
            f.write(path)

    def saved(self) -> str:
        with open(os.path.join(self.root, "checkpoint.txt")) as f:
            return f.read()


# ----------------------------------------------------------------------------- HF Transformers

HF_MODEL = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=2, max_position_embeddings=16)


def run_hf(args, out: Out) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM, TrainerCallback, TrainingArguments

    from bcp_integrations.hf import BCPCallback, BCPTrainer

    class Tokens(torch.utils.data.Dataset):
        def __init__(self):
            self.ids = torch.randint(0, HF_MODEL["vocab_size"], (ROWS * STEPS, 8),
                                     generator=torch.Generator().manual_seed(0))

        def __len__(self):
            return len(self.ids)

        def __getitem__(self, i):
            return {"input_ids": self.ids[i], "labels": self.ids[i]}

    class Recording(BCPTrainer):
        def training_step(self, *a, **kw):
            loss = super().training_step(*a, **kw)
            out.losses[self.state.global_step + 1] = loss.item()
            return loss

    class Dump(TrainerCallback):
        def __init__(self):
            self.trainer, self.started = None, False

        def on_step_begin(self, args, state, control, **kw):
            if out.resume and not self.started:  # after every part of the resume, before any update
                out.dump("resumed.pt", self.trainer.model_wrapped, self.trainer.optimizer)
            self.started = True

        def on_step_end(self, args, state, control, **kw):
            if state.global_step == SAVE_AT and not out.resume:
                out.dump("reference.pt", self.trainer.model_wrapped, self.trainer.optimizer)

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**HF_MODEL, attn_implementation="eager"))
    cuda = args.device == "cuda"
    common = dict(output_dir=args.root, use_cpu=not cuda, per_device_train_batch_size=ROWS, max_steps=STEPS,
                  save_strategy="steps", save_steps=SAVE_AT, learning_rate=1e-2, lr_scheduler_type="constant",
                  report_to="none", disable_tqdm=True, seed=0, dataloader_num_workers=0, logging_steps=1)
    if not cuda:
        targs = TrainingArguments(**common)
    else:
        try:  # transformers 4.x and 5.x (deprecated there in favour of fsdp=True)
            targs = TrainingArguments(**common, fsdp="full_shard", fsdp_config={"use_orig_params": True})
        except (TypeError, ValueError):
            targs = TrainingArguments(**common, fsdp=True, fsdp_config={"use_orig_params": True,
                                                                        "reshard_after_forward": True})
    dump = Dump()
    trainer = Recording(model=model, args=targs, train_dataset=Tokens(), callbacks=[BCPCallback(), dump])
    dump.trainer = trainer
    ckpt = os.path.join(args.root, f"checkpoint-{SAVE_AT}")
    trainer.train(resume_from_checkpoint=ckpt if out.resume else None)
    out.checkpoint(ckpt)


# ----------------------------------------------------------------------------- Accelerate

def run_accelerate(args, out: Out) -> None:
    from accelerate import Accelerator

    from bcp_integrations.accelerate import register

    cuda = args.device == "cuda"
    kwargs = {"cpu": not cuda}
    if cuda:
        from accelerate.utils import FullyShardedDataParallelPlugin
        kwargs["fsdp_plugin"] = FullyShardedDataParallelPlugin(use_orig_params=True)
    acc = Accelerator(**kwargs)
    ckpt_handle = register(acc)
    model = mlp()
    model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    ckpt = os.path.join(args.root, f"step_{SAVE_AT}")
    first = 1
    if out.resume:
        acc.load_state(ckpt)
        out.dump("resumed.pt", model, opt.optimizer)
        first = SAVE_AT + 1
    for step in range(first, STEPS + 1):
        x, y = batch(step, acc.device)
        loss = nn.functional.mse_loss(model(x).float(), y)
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        out.losses[step] = loss.item()
        if step == SAVE_AT and not out.resume:
            out.dump("reference.pt", model, opt.optimizer)
            acc.save_state(ckpt)
    ckpt_handle.wait()
    out.checkpoint(ckpt)
    acc.end_training()


# ----------------------------------------------------------------------------- Lightning

def run_lightning(args, out: Out) -> None:
    import lightning as L
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint
    from lightning.pytorch.strategies import FSDPStrategy

    from bcp_integrations.lightning import BCPCheckpointIO

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = mlp()

        def training_step(self, b, _):
            x, y = b
            loss = nn.functional.mse_loss(self.net(x).float(), y)
            out.losses[self.trainer.global_step + 1] = loss.item()
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    class Batches(torch.utils.data.IterableDataset):
        """The batches of steps `first`.. (an iterable: Lightning puts no DistributedSampler on it,
        which would shuffle a map-style list under FSDPStrategy / DDPStrategy)."""

        def __init__(self, first: int = 1):
            self.first = first

        def __iter__(self):
            return iter(batch(s, "cpu") for s in range(self.first, STEPS + 1))

    class Dump(Callback):
        def __init__(self):
            self.started = False

        def on_train_batch_start(self, trainer, pl_module, b, i):
            if out.resume and not self.started:
                out.dump("resumed.pt", trainer.strategy.model, trainer.optimizers[0])
            self.started = True

        def on_train_batch_end(self, trainer, pl_module, outputs, b, i):
            if trainer.global_step == SAVE_AT and not out.resume:
                out.dump("reference.pt", trainer.strategy.model, trainer.optimizers[0])

    cuda = args.device == "cuda"
    dirpath = os.path.join(args.root, "ckpts")
    # on CPU DDP (one process), where FSDPStrategy refuses: still a distributed strategy, as on the GPU
    trainer = L.Trainer(accelerator="cuda" if cuda else "cpu", devices=1, strategy=FSDPStrategy() if cuda else "ddp",
                        plugins=[BCPCheckpointIO()], max_steps=STEPS, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, deterministic="warn",
                        callbacks=[Dump(), ModelCheckpoint(dirpath=dirpath, filename="{step}",
                                                           every_n_train_steps=SAVE_AT, save_top_k=-1)])
    ckpt = os.path.join(dirpath, f"step={SAVE_AT}.ckpt")
    # on resume the batches after the checkpoint's (an iterable has no sampler state to restore)
    batches = torch.utils.data.DataLoader(Batches(SAVE_AT + 1 if out.resume else 1), batch_size=None)
    trainer.fit(Module(), batches, ckpt_path=ckpt if out.resume else None)
    out.checkpoint(ckpt)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--framework", required=True, choices=["hf", "accelerate", "lightning"])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--root", required=True)
    p.add_argument("--resume", action="store_true")
    args = p.parse_args()
    if args.device == "cuda":
        if not torch.cuda.is_available():
            sys.exit("--device cuda: torch sees no CUDA device")
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        torch.use_deterministic_algorithms(True, warn_only=True)
    torch.manual_seed(0)
    out = Out(args.root, args.resume)
    {"hf": run_hf, "accelerate": run_accelerate, "lightning": run_lightning}[args.framework](args, out)
    out.finish()


if __name__ == "__main__":
    main()
