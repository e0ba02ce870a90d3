"""The integrations on a GPU: HF Trainer and Accelerate with FSDP, Lightning's FSDPStrategy, each on
one device (tests/jobs/device_integration.py under torchrun): a checkpoint through bcp after step 3
holds the state of that step; the framework's own resume from it gives that state bit for bit and
the uninterrupted run's losses; one CPU process (no GPU, no FSDP) loads the model from it and reads
the optimizer's state, bit for bit.

Marked `cuda` (bench/gpu_check.sh runs them on a lent GPU, docs/gpu.md); the `cpu` twins run the
same jobs and checks where none of the three can run FSDP (HF and Accelerate fall back to DDP;
Lightning refuses FSDPStrategy on CPU and runs DDPStrategy, a distributed strategy too, whose
DistributedSampler a map-style loader would get): the integrations' code paths without FSDP and the test itself, in
the slow tier and in the GPU check's CPU rehearsal.
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch
from torch import nn

import bcp_core as bcp
from dist import Job

HAS_CUDA = torch.cuda.is_available()
DEVICES = [pytest.param("cpu", id="cpu", marks=pytest.mark.slow),
           pytest.param("cuda", id="cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(
               not HAS_CUDA, reason="needs a CUDA device (bench/gpu_check.sh runs these on a GPU)")])]
FRAMEWORKS = ["lightning", "hf", "accelerate"]  # the one not yet passed on a GPU first (bench/gpu_check.sh)

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "jobs"))
from device_integration import HF_MODEL, SAVE_AT, STEPS, mlp  # noqa: E402 - tests/jobs/device_integration.py


def _job(framework: str, device: str, root, *extra: str) -> None:
    job = Job("device_integration.py", 1, "--framework", framework, "--device", device, "--root", str(root), *extra)
    status = job.finish(timeout=240)
    assert status == 0, f"{framework} on {device} {' '.join(extra)} failed (status {status}):\n{job.output[-8000:]}"


def _cpu_model(framework: str) -> nn.Module:
    """The job's model, plain, on the CPU."""
    if framework == "hf":
        from transformers import LlamaConfig, LlamaForCausalLM
        return LlamaForCausalLM(LlamaConfig(**HF_MODEL, attn_implementation="eager"))
    if framework == "lightning":  # the LightningModule's tensors, by the same names
        holder = nn.Module()
        holder.net = mlp()
        return holder
    return mlp()


def _differ(a: dict, b: dict) -> list[str]:
    assert a.keys() == b.keys(), sorted(a.keys() ^ b.keys())
    return [k for k in a if a[k].dtype != b[k].dtype or not torch.equal(a[k], b[k])]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_checkpoint_resume_and_a_cpu_load_of_an_integration_on_one_device(framework, device, tmp_path):
    _job(framework, device, tmp_path)
    _job(framework, device, tmp_path, "--resume")
    ref = torch.load(tmp_path / "reference.pt", weights_only=True)
    assert ref["model"] and ref["optimizer"], "the reference holds no state"

    # the framework's resume: the state of step SAVE_AT bit for bit, then the same losses
    resumed = torch.load(tmp_path / "resumed.pt", weights_only=True)
    assert not _differ(ref["model"], resumed["model"]), _differ(ref["model"], resumed["model"])
    assert not _differ(ref["optimizer"], resumed["optimizer"]), _differ(ref["optimizer"], resumed["optimizer"])
    with open(tmp_path / "losses.json") as f:
        losses = {int(k): v for k, v in json.load(f).items()}
    with open(tmp_path / "losses_resumed.json") as f:
        after = {int(k): v for k, v in json.load(f).items()}
    assert sorted(losses) == list(range(1, STEPS + 1)) and sorted(after) == list(range(SAVE_AT + 1, STEPS + 1))
    assert after == {s: v for s, v in losses.items() if s > SAVE_AT}

    # one CPU process, no GPU and no FSDP: the model loaded in place, the optimizer's state read by name
    with open(tmp_path / "checkpoint.txt") as f:
        ckpt = f.read()
    model = _cpu_model(framework)
    bcp.load(ckpt, {"model": model})
    loaded = {k: v.detach() for k, v in model.state_dict().items()}
    assert not _differ(ref["model"], loaded), _differ(ref["model"], loaded)
    from bcp_core.tools import read_tensor
    st, md = bcp.resolve(ckpt), bcp.inspect(ckpt)
    key = "optimizer_0" if framework == "lightning" else "optimizer"
    saved = {name[len(key) + len(".state."):]: read_tensor(st, md, name) for name in md.tensors
             if name.startswith(f"{key}.state.")}
    assert not _differ(ref["optimizer"], saved), _differ(ref["optimizer"], saved)
