"""The first checkpoint step through each integration on one GPU: HF Trainer (`BCPTrainer` +
`BCPCallback`), Accelerate (`register`), Lightning (`BCPCheckpointIO`), each saving asynchronously.

    python bench/gpu_integrations.py [--device cuda] [--gib 2] [--runs hf,accelerate,lightning,accelerate-unprepared]
                                     [--step-ms 100] [--first 6] [--every 12] [--json out.json]

Each run is a fresh process training the same model: a residual stack of `--hidden`-wide bf16
linear layers (GIB of weights and AdamW moments, 6 bytes per parameter), applied `repeat` times
per forward so that a step takes about `--step-ms` (calibrated once, in the parent, on the bare
model). Every integration allocates its staging buffers after the first optimizer step
(`bcp.prepare_save`, in the background) so that its first checkpoint does not: `-unprepared`
runs the same integration with that preparation turned off, for comparison.

Checkpoints come after step `--first` and `--every` steps later, through the framework's own
save (HF: `save_steps`; Accelerate: `save_state`; Lightning: `ModelCheckpoint`). Every step's
start is timed (the device synchronised), so an interval holds the step and whatever the
framework did after it. Reported per run: the normal step (median of the intervals without a
checkpoint), the first interval (step 1 and the preparation's call) over it, and for each
checkpoint the checkpoint step: its interval and the next one (which waits for the snapshot's
copies) less one normal step, over a normal step (1.0: the checkpoint cost nothing). No
assertion: this is a measurement. `--device cpu` runs it with a tiny state (the smoke run).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import torch
from torch import nn

GIB = 1 << 30
BYTES_PER_PARAM = 6  # bf16 weight + AdamW's two bf16 moments
RUNS = ("hf", "accelerate", "lightning")


class Stack(nn.Module):
    """Residual bf16 linear layers applied `repeat` times to a fixed batch kept on the device; the
    forward takes the batch's sample indices (what a data loader hands over) and returns the loss."""

    def __init__(self, gib: float, hidden: int, rows: int, repeat: int, device: str):
        super().__init__()
        layers = max(1, round(gib * GIB / (BYTES_PER_PARAM * hidden * hidden)))
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.Linear(hidden, hidden, bias=False, device=device, dtype=torch.bfloat16)
                                    for _ in range(layers))
        self.repeat = repeat
        self.register_buffer("x", torch.randn(rows, hidden, device=device, dtype=torch.bfloat16), persistent=False)

    def forward(self, idx=None, **_):
        h = self.x
        for _ in range(self.repeat):
            for layer in self.layers:
                h = h + 0.1 * torch.relu(layer(h))
        return {"loss": h.float().square().mean()}


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


class Clock:
    """The start of every step, the device synchronised first."""

    def __init__(self, device: str):
        self.device, self.starts = device, []

    def tick(self) -> None:
        sync(self.device)
        self.starts.append(time.perf_counter())


class Indices(torch.utils.data.Dataset):
    def __init__(self, n: int):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return {"idx": torch.tensor(i)}


# ----------------------------------------------------------------------------- the integrations

def run_hf(a: dict, model: Stack, clock: Clock, root: str) -> None:
    from transformers import TrainerCallback, TrainingArguments

    from bcp_integrations.hf import BCPCallback, BCPTrainer

    class Tick(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            clock.tick()

        def on_train_end(self, args, state, control, **kw):
            clock.tick()

    saves = list(range(a["first"], a["steps"], a["every"]))
    targs = TrainingArguments(output_dir=root, use_cpu=a["device"] == "cpu", per_device_train_batch_size=a["rows"],
                              max_steps=a["steps"], save_strategy="steps", save_steps=a["every"],
                              learning_rate=1e-4, report_to="none", disable_tqdm=True, seed=0,
                              dataloader_num_workers=0, lr_scheduler_type="constant", save_only_model=False)

    class Saving(BCPCallback):  # checkpoints at the steps asked for (HF's save_steps counts from 0)
        def on_step_end(self, args, state, control, **kw):
            control.should_save = state.global_step in saves
            return super().on_step_end(args, state, control, **kw)

    trainer = BCPTrainer(model=model, args=targs, train_dataset=Indices(a["rows"] * a["steps"]),
                         callbacks=[Tick(), Saving()])
    trainer.train()


def run_accelerate(a: dict, model: Stack, clock: Clock, root: str) -> None:
    from accelerate import Accelerator

    from bcp_integrations.accelerate import register

    acc = Accelerator(cpu=a["device"] == "cpu")
    ckpt = register(acc)
    model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-4))
    saves = set(range(a["first"], a["steps"], a["every"]))
    for step in range(1, a["steps"] + 1):
        clock.tick()
        acc.backward(model()["loss"])
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step in saves:
            acc.save_state(os.path.join(root, f"step_{step}"))
    clock.tick()
    ckpt.wait()


def run_lightning(a: dict, model: Stack, clock: Clock, root: str) -> None:
    import lightning as L
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint

    from bcp_integrations.lightning import BCPCheckpointIO

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.stack = model

        def training_step(self, batch, _):
            return self.stack()["loss"]

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    class Tick(Callback):
        def on_train_batch_start(self, *args):
            clock.tick()

        def on_train_end(self, *args):
            clock.tick()

    class Saving(ModelCheckpoint):  # a checkpoint callback saving at the steps asked for, and at no other
        def on_train_batch_end(self, trainer, *args):
            if trainer.global_step in range(a["first"], a["steps"], a["every"]):
                trainer.save_checkpoint(os.path.join(root, f"step={trainer.global_step}.ckpt"))

        def on_train_epoch_end(self, *args):
            pass

        def on_validation_end(self, *args):
            pass

    trainer = L.Trainer(accelerator=a["device"], devices=1, plugins=[BCPCheckpointIO()], max_steps=a["steps"],
                        logger=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[Tick(), Saving(dirpath=root)], num_sanity_val_steps=0)
    loader = torch.utils.data.DataLoader(Indices(a["rows"] * a["steps"]), batch_size=a["rows"])
    trainer.fit(Module(), loader)


def worker(a: dict) -> dict:
    """One run, in this fresh process."""
    name = a["run"]
    framework, _, variant = name.partition("-")
    if a["device"] == "cuda":
        torch.cuda.set_device(0)
    if variant == "unprepared":  # the integration's preparation turned off
        import bcp_core as bcp
        from concurrent.futures import Future

        def no_prepare(*_, **__):
            f = Future()
            f.set_result(None)
            return f
        bcp.prepare_save = no_prepare
    root = tempfile.mkdtemp(prefix=f"{name}_", dir=a["dir"])
    clock = Clock(a["device"])
    model = Stack(a["gib"], a["hidden"], a["rows"], a["repeat"], a["device"])
    t0 = time.perf_counter()
    try:
        {"hf": run_hf, "accelerate": run_accelerate, "lightning": run_lightning}[framework](a, model, clock, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    starts = clock.starts
    intervals = [b - s for s, b in zip(starts, starts[1:])]  # intervals[k - 1]: step k and what followed it
    saves = list(range(a["first"], a["steps"], a["every"]))
    special = {1} | {s for c in saves for s in (c, c + 1)}
    normal = statistics.median(t for k, t in enumerate(intervals, 1) if k not in special)
    ckpt = [(intervals[c - 1] + intervals[c] - normal) / normal for c in saves if c < len(intervals)]
    return {"run": name, "state_gib": sum(p.numel() * 6 for p in model.parameters()) / GIB,
            "steps_timed": len(intervals), "normal_step_s": normal, "first_interval_over_normal": intervals[0] / normal,
            "checkpoints_after_steps": saves, "ckpt_step_over_normal": ckpt,
            "first_ckpt_step_over_normal": ckpt[0] if ckpt else None,
            "later_ckpt_step_over_normal": statistics.mean(ckpt[1:]) if len(ckpt) > 1 else None,
            "intervals_s": intervals, "run_s": time.perf_counter() - t0}


def calibrate(a: dict) -> tuple[int, float]:
    """`repeat` for a step of about `step_ms` on the bare model (forward, backward, AdamW step)."""
    model = Stack(a["gib"], a["hidden"], a["rows"], 1, a["device"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step() -> float:
        sync(a["device"])
        t = time.perf_counter()
        model()["loss"].backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync(a["device"])
        return time.perf_counter() - t
    step()
    one = min(step() for _ in range(3))
    repeat = max(1, round(a["step_ms"] / 1000 / one))
    return repeat, one * repeat


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--gib", type=float, default=2.0, help="weights and AdamW moments, GiB (default 2)")
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--rows", type=int, default=1024, help="rows of the batch")
    ap.add_argument("--runs", default="hf,accelerate,lightning,accelerate-unprepared",
                    help=f"comma-separated, of {', '.join(RUNS)}, each optionally with -unprepared")
    ap.add_argument("--step-ms", type=float, default=100.0)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--first", type=int, default=6, help="the first checkpoint after this step (default 6)")
    ap.add_argument("--every", type=int, default=12, help="then every this many steps (default 12)")
    ap.add_argument("--timeout-s", type=float, default=180, help="per run (default 180)")
    ap.add_argument("--dir", default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    runs = args.runs.split(",")
    if unknown := {r for r in runs if r.partition("-")[0] not in RUNS or r.partition("-")[2] not in ("", "unprepared")}:
        raise SystemExit(f"unknown runs {sorted(unknown)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device")
    if args.first < 2 or args.steps < args.first + 2:
        raise SystemExit("--first must leave step 1 alone (>= 2) and --steps a step after the first checkpoint")
    root = args.dir or tempfile.mkdtemp(prefix="bcp_gpu_integrations_")
    os.makedirs(root, exist_ok=True)
    a = {k: v for k, v in vars(args).items() if k not in ("json", "runs")} | {"dir": root}
    start = time.perf_counter()
    a["repeat"], calibrated = calibrate(a)
    table = {"config": a | {"torch": torch.__version__, "calibrated_step_s": calibrated,
                            "device_name": torch.cuda.get_device_name() if args.device == "cuda" else "cpu"},
             "runs": {}}
    try:
        for name in runs:
            with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
                out = f.name
            cmd = [sys.executable, os.path.abspath(__file__), "--worker", json.dumps(a | {"run": name}), out]
            try:
                proc = subprocess.run(cmd, timeout=args.timeout_s, capture_output=True, text=True)
                with open(out) as f:
                    text = f.read()
                table["runs"][name] = json.loads(text) if text else {
                    "error": f"status {proc.returncode}: {proc.stderr[-3000:]}"}
            except subprocess.TimeoutExpired:
                table["runs"][name] = {"error": f"did not end within {args.timeout_s:.0f} s"}
            finally:
                os.remove(out)
            if args.json:  # the runs so far: a bench stopped at its time limit keeps them
                with open(args.json, "w") as f:
                    json.dump(table | {"incomplete": f"ended after {name}"}, f, indent=2)
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    table["total_s"] = time.perf_counter() - start
    text = json.dumps(table, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--worker":
        result = worker(json.loads(sys.argv[2]))
        with open(sys.argv[3], "w") as f:
            json.dump(result, f)
        sys.exit(0)
    sys.exit(main())
