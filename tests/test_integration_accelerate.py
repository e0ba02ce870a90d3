"""Accelerate + register(accelerator) end to end: real Accelerators under torchrun (MULTI_CPU, gloo).

Runs recipes/accelerate_resume.py in its `--phase run` mode (MLP with dropout, seedable sampler,
16 samples, 2 per process per step; save_state after epoch 1):
  A   bcp, 2 processes, 2 epochs (also the uninterrupted reference)
  N   Accelerate's own save_state, 2 processes, 2 epochs (reference for the 1-process resume)
  R2  bcp load_state of A's checkpoint on 2 processes; R1 on 1 process; N1 Accelerate's load of N's on 1
"""

from __future__ import annotations

import json
import os

import pytest

pytest.importorskip("accelerate")
import torch  # noqa: E402

import bcp_core as bcp  # noqa: E402
from dist import losses_by_rank, run_recipe  # noqa: E402




def _run(nproc: int, *args: str) -> None:
    run_recipe("accelerate_resume.py", nproc, *args, timeout=180)



_losses = losses_by_rank


def _state(path) -> dict:
    return torch.load(path, weights_only=False)


def _assert_same_state(a: dict, b: dict, rng: bool = True) -> None:
    assert a["model"].keys() == b["model"].keys()
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    sa, sb = a["optimizer"]["state"], b["optimizer"]["state"]
    assert sa.keys() == sb.keys() and len(sa) > 0
    for i in sa:
        for name in sa[i]:
            assert torch.equal(torch.as_tensor(sa[i][name]), torch.as_tensor(sb[i][name])), (i, name)
    assert a["optimizer"]["param_groups"] == b["optimizer"]["param_groups"]
    assert a["scheduler"] == b["scheduler"]
    assert a["progress"] == b["progress"] and a["step"] == b["step"]
    if rng:
        assert torch.equal(a["rng"], b["rng"])


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_accelerate_save_load_state_across_num_processes(tmp_path):
    a, ckpt = tmp_path / "a", tmp_path / "state"
    _run(2, "--out", str(a), "--epochs", "2", "--save-dir", str(ckpt))
    _run(2, "--native", "--out", str(tmp_path / "n"), "--epochs", "2", "--save-dir", str(tmp_path / "native"))
    uninterrupted = _losses(a)
    assert sorted(uninterrupted) == list(range(1, 9))
    assert _losses(tmp_path / "n") == uninterrupted  # bcp does not disturb training

    # one bcp checkpoint written by both processes, and nothing written by Accelerate itself
    names = set(os.listdir(ckpt))
    assert "bcp_metadata.json" in names and all(n == "data" or n.startswith("bcp_") for n in names), names
    md = bcp.inspect(ckpt)
    assert md.world_size == 2 and {p.rank for t in md.tensors.values() for p in t.pieces} == {0, 1}
    assert {"model.net.0.weight", "optimizer.param_groups", "custom.epoch"} <= md.keys()
    saved = _state(a / "state_epoch1.pt")
    assert saved["progress"] == {"epoch": 1, "step": 4}

    # same number of processes: bit-identical state (RNG included), same losses (dropout included)
    _run(2, "--out", str(tmp_path / "r2"), "--epochs", "2", "--resume", str(ckpt))
    _assert_same_state(saved, _state(tmp_path / "r2" / "state_start.pt"))
    assert _losses(tmp_path / "r2") == {s: v for s, v in uninterrupted.items() if s > 4}
    assert _losses(tmp_path / "r2", rank=1) == {s: v for s, v in _losses(a, rank=1).items() if s > 4}

    # 2 -> 1 process: bit-identical state, same losses as Accelerate loading its own checkpoint of
    # the same run on 1 process (both give the single process rank 0's RNG states)
    _run(1, "--out", str(tmp_path / "r1"), "--epochs", "2", "--resume", str(ckpt))
    _run(1, "--native", "--out", str(tmp_path / "n1"), "--epochs", "2", "--resume", str(tmp_path / "native"))
    r1 = _state(tmp_path / "r1" / "state_start.pt")
    _assert_same_state(saved, r1)
    _assert_same_state(r1, _state(tmp_path / "n1" / "state_start.pt"))
    assert _losses(tmp_path / "r1") == _losses(tmp_path / "n1")
    assert sorted(_losses(tmp_path / "r1")) == list(range(5, 13))


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_accelerate_one_process_checkpoint_resumes_on_two(tmp_path):
    """1 -> 2 processes: the job starts from the single process's exact state (a new rank gets rank
    0's RNG states) and trains on from the saved epoch with the steps of the new world size."""
    _run(1, "--out", str(tmp_path / "a"), "--epochs", "1", "--save-dir", str(tmp_path / "state"))
    saved = _state(tmp_path / "a" / "state_epoch1.pt")
    _run(2, "--out", str(tmp_path / "r2"), "--epochs", "2", "--resume", str(tmp_path / "state"))
    _assert_same_state(saved, _state(tmp_path / "r2" / "state_start.pt"))  # DDP: rank 1 holds the same
    assert sorted(_losses(tmp_path / "r2")) == list(range(9, 13))  # 8 steps per epoch on 1 process


@pytest.mark.timeout(300)
def test_accelerate_packed_token_loader_state_resharded_2_to_1(tmp_path):
    """A bcp PackedTokenLoader registered with register_for_checkpointing: saved mid-epoch on 2
    processes, loaded on 1, the rest of the epoch holds exactly the tokens not yet seen."""
    from collections import Counter

    _run(2, "--packed", "--max-steps", "4", "--save-after-step", "2", "--out", str(tmp_path / "a"),
         "--save-dir", str(tmp_path / "state"))
    _run(1, "--packed", "--out", str(tmp_path / "r1"), "--resume", str(tmp_path / "state"))

    def tokens(batches) -> Counter:
        return Counter(t for b in batches for row in b for t in row if t != -1)

    before = Counter()
    for rank in (0, 1):
        with open(tmp_path / "a" / f"batches_rank{rank}.json") as f:
            seen = json.load(f)
        before += tokens(seen[:seen.index("saved")])
    with open(tmp_path / "r1" / "batches_rank0.json") as f:
        after = tokens(json.load(f))
    # the recipe's documents: "web" i -> 100i .. 100i+2+i%5, "code" i -> 5000+100i .. +1+i%3
    epoch = Counter([t for i in range(24) for t in range(100 * i, 100 * i + 3 + i % 5)]
                    + [t for i in range(12) for t in range(5000 + 100 * i, 5000 + 100 * i + 2 + i % 3)])
    assert before and after
    assert before + after == epoch  # nothing skipped, nothing repeated


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_stateful_dataloader_position_goes_through_bcp_loader_support(tmp_path):
    """use_stateful_dataloader=True, saved mid-epoch on 2 processes: the prepared loader's state is
    one bcp loader part per process (`dataloader.rank`); resuming on 2 processes continues exactly
    as Accelerate resuming its own checkpoint does; on 1 process the opaque state is refused with
    an error instead of silently skipping or repeating data."""
    _run(2, "--stateful", "--out", str(tmp_path / "a"), "--epochs", "2", "--save-at-step", "2",
         "--save-dir", str(tmp_path / "state"))
    _run(2, "--stateful", "--native", "--out", str(tmp_path / "n"), "--epochs", "2", "--save-at-step", "2",
         "--save-dir", str(tmp_path / "native"))
    md = bcp.inspect(tmp_path / "state")
    assert md.objects["dataloader.format"].encoded == "bcp.OpaqueLoader/1"
    assert [s.index for s in md.sharded_objects["dataloader.rank"].shards] == [(0,), (1,)]

    _run(2, "--stateful", "--out", str(tmp_path / "r2"), "--epochs", "2", "--resume", str(tmp_path / "state"))
    _run(2, "--stateful", "--native", "--out", str(tmp_path / "nr2"), "--epochs", "2",
         "--resume", str(tmp_path / "native"))
    resumed = _losses(tmp_path / "r2")
    assert sorted(resumed) == list(range(3, 9))
    assert resumed == _losses(tmp_path / "nr2")

    with pytest.raises(AssertionError, match="saved at data-parallel degree 2 and this job has 1"):
        _run(1, "--stateful", "--out", str(tmp_path / "r1"), "--epochs", "2", "--resume", str(tmp_path / "state"))


@pytest.mark.timeout(300)
def test_the_first_save_state_uses_staging_prepared_after_the_first_step(tmp_path, monkeypatch):
    """One process: once the prepared optimizer has stepped, register()'s step post-hook prepares
    the saves (`bcp.prepare_save` with the state save_state holds): the only planning of the run,
    both save_state calls reuse its plan, and the first stages into the buffers prepared (none
    allocated in its call). Another optimizer's steps do not trigger it; the hook is then gone."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    from bcp_core import staging
    from bcp_core.checkpointer import get_checkpointer
    from bcp_integrations.accelerate import register

    prepared, allocated = [], []
    real_prepare, real_buffer = bcp.prepare_save, staging.host_buffer
    monkeypatch.setattr(bcp, "prepare_save", lambda state, **kw: prepared.append(sorted(state)) or
                        real_prepare(state, **kw).result())  # ready before the next step, for the count below
    monkeypatch.setattr(staging, "host_buffer", lambda src: allocated.append(src.shape) or real_buffer(src))
    try:
        acc = Accelerator(cpu=True)
        ckpt = register(acc)
        torch.manual_seed(0)
        model = torch.nn.Linear(64, 64)
        other = torch.nn.Linear(4, 4)
        other_opt = torch.optim.SGD(other.parameters(), lr=0.1)  # not prepared: its steps do not count
        other(torch.ones(1, 4)).sum().backward()
        other_opt.step()
        model, opt = acc.prepare(model, torch.optim.Adam(model.parameters(), lr=0.1))
        assert prepared == []
        cp = get_checkpointer()
        before = dict(cp.stats)
        for step in range(1, 5):
            acc.backward(model(torch.randn(4, 64)).square().mean())
            opt.step()
            opt.zero_grad()
            if step == 1:
                assert prepared == [["extra_state", "model", "optimizer"]]
                staged_by_prepare = len(allocated)
            if step % 2 == 0:
                acc.save_state(str(tmp_path / f"step_{step}"))
        ckpt.wait()
        assert len(prepared) == 1 and staged_by_prepare > 0 and len(allocated) == staged_by_prepare
        assert cp.stats["plans"] - before["plans"] == 1 and cp.stats["cache_hits"] - before["cache_hits"] == 2
        assert ckpt._prepare_hook is None
        assert {"model.weight", "optimizer.state.weight.exp_avg"} <= bcp.inspect(tmp_path / "step_2").keys()
    finally:
        AcceleratorState._reset_state(True)
