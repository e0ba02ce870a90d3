"""DeepSpeed ZeRO-3 on a GPU through the HF Trainer and Lightning's DeepSpeedStrategy (marked cuda).

Lightning's DeepSpeedStrategy runs on CUDA only, so it is tested here, on the lent GPU machine
(bench/gpu_check.sh, docs/gpu.md); the HF Trainer's CPU runs are in tests/test_deepspeed.py. Each
job runs under torchrun on one GPU, deterministically: a run resumed from a step-2 checkpoint (the
HF Trainer's stopped there, Lightning's from the uninterrupted run's own) ends with DeepSpeed's
full fp32 values and Adam moments equal to the uninterrupted run's, and
the checkpoint loads into a plain model in this CPU process with those values.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("deepspeed")
pytest.importorskip("transformers")

import bcp_core as bcp  # noqa: E402
from dist import JOBS, Job  # noqa: E402

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (bench/gpu_check.sh)")]
ENV = {"HF_HUB_OFFLINE": "1", "BCP_TEST_DEVICE": "cuda", "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}


def _run(name: str, *args: str) -> None:
    job = Job(name, 1, *args, env=ENV)
    assert job.finish(timeout=240) == 0, job.output[-6000:]


def _equal_values(a: dict, b: dict) -> None:
    assert a["model"].keys() == b["model"].keys() and a["model"]
    for n, v in a["model"].items():
        assert torch.equal(v, b["model"][n]), n
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(a["optimizer"][n][k], b["optimizer"][n][k]), (n, k)


@pytest.mark.timeout(600)
def test_lightning_deepspeed_strategy_zero3_resumes_bit_identical_and_loads_on_cpu(tmp_path):
    # the run's step-2 checkpoint was taken while it went on training (an async save): resumed
    # elsewhere, it must end where the run itself ended
    full, part = tmp_path / "full", tmp_path / "part"
    _run("lightning_deepspeed.py", "--root", str(full), "--steps", "4")
    ckpt = full / "step=2.ckpt"
    assert bcp.inspect(ckpt).framework == "deepspeed"
    _run("lightning_deepspeed.py", "--root", str(part), "--steps", "4", "--resume", str(ckpt))
    a, b = torch.load(full / "final.pt"), torch.load(part / "final.pt")
    assert a["global_step"] == b["global_step"] == 4
    _equal_values(b, a)

    # the GPU run's last checkpoint into the same LightningModule on the CPU of this process
    import importlib.util
    spec = importlib.util.spec_from_file_location("lightning_deepspeed", os.path.join(JOBS, "lightning_deepspeed.py"))
    job = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(job)
    lm = job.LM()
    bcp.load(part / "step=4.ckpt", {"model": lm})
    for n, p in lm.named_parameters():
        assert torch.equal(p.detach(), b["model"][n]), n


@pytest.mark.timeout(600)
def test_hf_trainer_zero3_on_gpu_stops_resumes_and_loads_on_cpu(tmp_path):
    full, part = tmp_path / "full", tmp_path / "part"
    common = ("--steps", "4", "--save-steps", "2", "--zero", "3")
    job = Job("hf_train.py", 1, "--root", str(full), *common, env=ENV)
    assert job.finish(timeout=240) == 0, job.output[-6000:]
    job = Job("hf_train.py", 1, "--root", str(part), *common, "--stop-at", "2", env=ENV)
    assert job.finish(timeout=240) == 0, job.output[-6000:]
    job = Job("hf_train.py", 1, "--root", str(part), *common, "--resume", env=ENV)
    assert job.finish(timeout=240) == 0, job.output[-6000:]
    a, b = torch.load(full / "reference_4.pt"), torch.load(part / "reference_4.pt")
    assert a["global_steps"] == b["global_steps"] == 4
    _equal_values(b, a)
    from test_deepspeed import _holds
    _holds(part / "checkpoint-4", full / "reference_4.pt")
