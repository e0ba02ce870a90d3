"""recipes/megatron_to_hf.py: Megatron TP=2 (DDP + DistributedOptimizer) -> Hugging Face under FSDP2 on
2 processes with mapping="auto", training continued."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("megatron.core")
pytest.importorskip("transformers")

from dist import run_recipe  # noqa: E402


def test_megatron_tp2_checkpoint_continues_training_as_hf_fsdp2(tmp_path):
    report = tmp_path / "report.json"
    run_recipe("megatron_to_hf.py", 2, "--out", str(tmp_path / "ckpt"), "--report", str(report), timeout=240,
               env={"HF_HUB_OFFLINE": "1"})
    r = json.loads(report.read_text())
    assert r["hf_start_step"] == 3  # Megatron's step, carried into every AdamW state
    # the Hugging Face model's first loss is the loss Megatron's model had on that batch
    assert abs(r["hf_losses"][0] - r["megatron_losses"][-1]) <= 1e-5, r
    assert len(r["hf_losses"]) == 3 and r["hf_losses"][-1] < r["hf_losses"][0], r
