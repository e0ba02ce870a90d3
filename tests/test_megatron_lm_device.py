"""Megatron-LM's `pretrain_gpt.py --ckpt-format bcp` on a GPU (issue #44): 0.16.1's training loop on one
CUDA device with NCCL, TP=1, saving through Megatron's persistent async worker. Resumed from the
uninterrupted run's iteration-3 checkpoint, iterations 4-6 log the same losses and the iteration-6
checkpoint holds the same tensors, bit for bit; both checkpoints are read whole by bcp in this
process, on the CPU.

The optimizer is Megatron's distributed optimizer where Apex or Transformer Engine is installed, and
its plain optimizer where neither is (the GPU image has neither): megatron-core 0.16.1's distributed
optimizer over torch's Adam cannot build the state a load fills before its first step, nor load
it (recipes/_megatron_cpu.py mends both for the CPU tests; here nothing of Megatron is mended).

Marked `cuda` (bench/gpu_check.sh runs it on a lent GPU, docs/gpu.md; it needs the 0.16.1 tree there,
which bench/fetch_gpu_wheels.sh puts beside the wheels). The `cpu` twin is the same test with one rank
on gloo and the CPU stand-ins (slow tier, and the GPU check's CPU rehearsal); tests/test_megatron_lm.py
runs the loop on two ranks in every layout.
"""

from __future__ import annotations

import pytest

import megatron_releases

megatron_releases.skip_without_megatron_core()

import importlib.util  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402

import torch  # noqa: E402

from test_megatron_lm import (  # noqa: E402 - its launcher and checks
    DISTRIBUTED_OPTIMIZER, ITERATIONS, SAVE_INTERVAL, assert_same_checkpoint, async_flags, iteration_dir, pretrain,
    resume_from, resumed_at)

RELEASE = "0.16.1"  # the release whose wheel (the dataset helpers) and tree the GPU check carries
DEVICES = [pytest.param("cpu", id="cpu", marks=pytest.mark.slow),
           pytest.param("cuda", id="cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(
               not torch.cuda.is_available(), reason="needs a CUDA device (bench/gpu_check.sh runs it on a GPU)")])]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("device", DEVICES)
def test_pretrain_gpt_resumes_bit_identical(device, tmp_path):
    reason = megatron_releases.skip_reason(RELEASE, need_tree=True)
    if reason is not None:
        pytest.skip(reason)
    fused_adam = any(importlib.util.find_spec(m) is not None for m in ("apex", "transformer_engine"))
    flags = [*(DISTRIBUTED_OPTIMIZER if fused_adam else []), *async_flags(RELEASE)]
    print(f"[{device}] {'distributed' if fused_adam else 'plain'} optimizer")
    first, second = str(tmp_path / "uninterrupted"), str(tmp_path / "resumed")
    reference = pretrain(RELEASE, first, *flags, fmt="bcp", ranks=1, device=device)
    assert sorted(reference.losses) == list(range(1, ITERATIONS + 1)), reference.output[-4000:]
    resume_from(first, second, SAVE_INTERVAL)
    resumed = pretrain(RELEASE, second, *flags, fmt="bcp", ranks=1, device=device)
    resumed_at(resumed, SAVE_INTERVAL)
    assert resumed.losses == {i: reference.losses[i] for i in range(SAVE_INTERVAL + 1, ITERATIONS + 1)}
    # read whole by bcp in this process, on the CPU: every tensor of both, compared bit for bit
    assert_same_checkpoint(iteration_dir(first, ITERATIONS), iteration_dir(second, ITERATIONS), "bcp")


def test_dataset_helpers_come_from_the_wheel_not_a_tree_that_built_its_own(tmp_path, monkeypatch):
    """On a GPU nothing stubs Megatron-LM's start-up `make` of its dataset helpers: the first launch
    builds them into the tree, against the machine's pybind11. The next launch must still load the
    wheel's build (the tree's crashed torch's import on an H200), though the tree comes first on the path."""
    import megatron_lm_cpu  # noqa: F401 - puts recipes/ on the path
    import _megatron_lm_cpu

    def helpers(root):
        os.makedirs(root / "megatron" / "core" / "datasets")
        so = root / "megatron" / "core" / "datasets" / "helpers_cpp.cpython-312-x86_64-linux-gnu.so"
        so.write_bytes(b"")
        return str(so)

    tree, target, empty = tmp_path / "core_v0.16.1", tmp_path / "bcp_site", tmp_path / "site-packages"
    helpers(tree)
    (tree / "pretrain_gpt.py").write_text("")
    wheel = helpers(target)
    empty.mkdir()
    monkeypatch.setattr(_megatron_lm_cpu, "site_packages", lambda: str(empty))
    monkeypatch.setattr(sys, "path", [str(tree), str(target)])
    assert _megatron_lm_cpu.wheel_helpers_so() == wheel
    monkeypatch.setattr(sys, "path", [str(tree)])
    assert _megatron_lm_cpu.wheel_helpers_so() is None
