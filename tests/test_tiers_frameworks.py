"""Every framework entry point saves to tiers and resumes from them after a node is lost: Lightning
(`BCPCheckpointIO(tiers=...)`, `fit(ckpt_path=tiers)`), Accelerate (`register(acc, tiers=...)`,
`load_state()`), the HF Trainer (`BCPCallback(tiers=...)`, `BCPTrainer.train(resume_from_checkpoint=
tiers)`). 2 ranks under torchrun, each a simulated node with a memory directory of its own; after 4
steps saved, node 1's memory is removed and a replacement node (empty memory) resumes: step 4, every
parameter as saved, and training goes on; then, node 0's copy of a step-6 file damaged, the next
resume sets it aside and loads step 6 from the other node's copy; with both copies of a step-8 file
damaged, the resume takes the durable step 8; with both copies of the newer step 9 damaged, too.
(Megatron-LM: test_megatron_lm_tiers.py.)"""

from __future__ import annotations

import os
import shutil

import pytest
import torch

import bcp_core as bcp
from dist import Job
from tiered_state import flip_last_byte

pytestmark = pytest.mark.slow


def _run(base, framework: str, memory: str, *args: str) -> str:
    job = Job("tiered_frameworks.py", 2, "--framework", framework, "--base", str(base), "--memory", memory,
              "--out", str(base / "out"), *args, env={"BCP_LOCAL_WORLD_SIZE": "1"})
    assert job.finish(timeout=300) == 0, job.output[-6000:]
    return job.output


@pytest.mark.parametrize("framework", ["lightning", "accelerate", "hf"])
def test_framework_resumes_from_the_tiers_after_a_node_is_lost(tmp_path, framework):
    _run(tmp_path, framework, "0,1")
    shutil.rmtree(tmp_path / "mem1")
    _run(tmp_path, framework, "0,new", "--resume")
    for r in (0, 1):
        got = torch.load(tmp_path / "out" / f"resumed_rank{r}.pt")
        ref = torch.load(tmp_path / "out" / f"ref_{got['step']}.pt")
        assert got["step"] == 4
        assert got["params"].keys() == ref["params"].keys()
        for k, v in ref["params"].items():
            assert torch.equal(got["params"][k], v), (framework, r, k)
    # steps 2, 4 (and, once resumed, 6) were drained: ordinary checkpoints, the newest loads anywhere
    assert bcp.resolve(str(tmp_path / "durable")).root.endswith("step_00000006")
    assert os.listdir(tmp_path / "memnew" / "bcp-memory" / "job")  # the new node holds steps of its own now

    # node 0's copy of a step-6 file damaged (a flipped bit in RAM): the resume sets it aside and
    # loads step 6 with that file from the new node's copy
    step6 = tmp_path / "mem0" / "bcp-memory" / "job" / "step_00000006" / "data"
    victim = sorted(step6.iterdir())[0]
    flip_last_byte(victim)
    output = _run(tmp_path, framework, "0,new", "--resume", "--steps", "6")
    # (the step left memory since, with its damaged copy: steps 7 and 8 are kept)
    assert f"damaged copies of step 6 set aside (renamed *.damaged): memory://job/step_00000006/{victim.parent.name}/" \
        f"{victim.name} fails the checksum" in output, output[-6000:]
    _resumed_at(tmp_path, 6)

    # both nodes' copies of a step-8 file damaged (step 8 was drained before): no whole step 8 is left
    # in memory, and the newest whole step is the durable step 8 (the HF Trainer, which read step
    # 8's trainer state from memory first, starts again from it). Training goes on to step 9 only.
    _damage_both_copies(tmp_path, 8)
    output = _run(tmp_path, framework, "0,new", "--resume", "--steps", "7")
    assert "no whole step in memory newer than step 8 in durable storage" in output, output[-6000:]
    _resumed_at(tmp_path, 8)

    # both copies of a step-9 file damaged: step 9 (never drained) is found first, its load sets the
    # copies aside, and the job resumes from the durable step 8 with step 8's trainer state
    _damage_both_copies(tmp_path, 9)
    output = _run(tmp_path, framework, "0,new", "--resume", "--steps", "8")
    assert "leaves step 9 incomplete in memory: a new load finds step 8 (durable)" in output, output[-6000:]
    _resumed_at(tmp_path, 8)


def _damage_both_copies(base, step: int) -> None:
    for node in ("mem0", "memnew"):
        flip_last_byte(sorted((base / node / "bcp-memory" / "job" / f"step_{step:08d}" / "data").iterdir())[0])


def _resumed_at(base, step: int) -> None:
    """Every rank resumed at `step` with every parameter as saved there."""
    ref = torch.load(base / "out" / f"ref_{step}.pt")
    for r in (0, 1):
        got = torch.load(base / "out" / f"resumed_rank{r}.pt")
        assert got["step"] == step and all(torch.equal(got["params"][k], v) for k, v in ref["params"].items()), r
