"""HF Trainer + BCPCallback/BCPTrainer end to end: real Trainers, DDP on 2 gloo ranks and 1 process.

Runs recipes/hf_resume.py in its `--phase run` mode (tiny Llama with attention dropout, so the
RNG state matters; 32 samples, 2 per rank per step, so every checkpoint here is mid-epoch and
the data position comes from the trainer state):
  A   bcp, 2 ranks, 6 steps, save_steps=2, save_total_limit=2 (also the uninterrupted reference)
  N   HF's own checkpoints, 2 ranks, 6 steps (reference for the 1-process resume)
  R2  bcp resume of A's checkpoint-4 on 2 ranks; R1 on 1 process; N1 HF's resume of N's on 1 process
"""

from __future__ import annotations

import json
import os
import sys

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
import torch  # noqa: E402

import bcp_core as bcp  # noqa: E402
from dist import RECIPES, losses_by_rank, run_recipe  # noqa: E402




def _run(nproc: int, *args: str) -> None:
    run_recipe("hf_resume.py", nproc, *args, timeout=240, env={"HF_HUB_OFFLINE": "1"})



_losses = losses_by_rank


def _state(path) -> dict:
    return torch.load(path, weights_only=False)


def _assert_same_state(a: dict, b: dict) -> None:
    assert a["global_step"] == b["global_step"]
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


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_hf_trainer_save_resume_across_world_sizes_and_export(tmp_path):
    from transformers import LlamaForCausalLM

    from bcp_integrations.hf import export_pretrained, last_checkpoint

    a_out, a_ckpt = tmp_path / "a", tmp_path / "a_trainer"
    _run(2, "--out", str(a_out), "--ckpt-dir", str(a_ckpt), "--max-steps", "6", "--save-total-limit", "2",
         "--dump-at-step", "4")
    _run(2, "--native", "--out", str(tmp_path / "n"), "--ckpt-dir", str(tmp_path / "n_trainer"),
         "--max-steps", "6")
    uninterrupted = _losses(a_out)
    assert sorted(uninterrupted) == [1, 2, 3, 4, 5, 6]
    assert _losses(tmp_path / "n") == uninterrupted  # bcp does not disturb training

    # save_total_limit=2 applied; the checkpoints are bcp's, written by both ranks
    assert sorted(os.listdir(a_ckpt)) == ["checkpoint-4", "checkpoint-6"]
    md = bcp.inspect(a_ckpt / "checkpoint-4")
    assert md.world_size == 2 and {p.rank for t in md.tensors.values() for p in t.pieces} == {0, 1}
    assert not (a_ckpt / "checkpoint-4" / "model.safetensors").exists()
    assert not (a_ckpt / "checkpoint-4" / "optimizer.pt").exists()
    # resume_from_checkpoint=True takes the newest committed checkpoint, not an unfinished one
    (a_ckpt / "checkpoint-8").mkdir()
    (a_ckpt / "checkpoint-8" / "trainer_state.json").write_text("{}")
    assert last_checkpoint(str(a_ckpt)) == str(a_ckpt / "checkpoint-6")

    ckpt4 = str(a_ckpt / "checkpoint-4")
    saved = _state(a_out / "state_step4.pt")

    # same world size: bit-identical state after load; same losses (dropout included) as uninterrupted
    _run(2, "--out", str(tmp_path / "r2"), "--ckpt-dir", str(tmp_path / "r2_trainer"), "--resume", ckpt4,
         "--max-steps", "6")
    _assert_same_state(saved, _state(tmp_path / "r2" / "state_start.pt"))
    assert _losses(tmp_path / "r2") == {5: uninterrupted[5], 6: uninterrupted[6]}
    assert _losses(tmp_path / "r2", rank=1) == {s: v for s, v in _losses(a_out, rank=1).items() if s > 4}

    # 2 -> 1 process: bit-identical state, and the same losses as HF resuming its own checkpoint
    # of the same run on 1 process. bcp gives the single process rank 0's RNG states; HF would look
    # for rng_state.pth and start without, so hand it rank 0's file to compare like with like.
    native4 = tmp_path / "n_trainer" / "checkpoint-4"
    (native4 / "rng_state.pth").write_bytes((native4 / "rng_state_0.pth").read_bytes())
    _run(1, "--out", str(tmp_path / "r1"), "--ckpt-dir", str(tmp_path / "r1_trainer"), "--resume", ckpt4,
         "--max-steps", "6")
    _run(1, "--native", "--out", str(tmp_path / "n1"), "--ckpt-dir", str(tmp_path / "n1_trainer"),
         "--resume", str(native4), "--max-steps", "6")
    r1 = _state(tmp_path / "r1" / "state_start.pt")
    _assert_same_state(saved, r1)
    _assert_same_state(r1, _state(tmp_path / "n1" / "state_start.pt"))
    assert _losses(tmp_path / "r1") == _losses(tmp_path / "n1")
    assert sorted(_losses(tmp_path / "r1")) == [5, 6]

    # export as a Hugging Face directory that from_pretrained loads, with the checkpoint's weights
    hf_dir = export_pretrained(ckpt4, str(tmp_path / "hf"))
    assert {"config.json", "model.safetensors"} <= set(os.listdir(hf_dir))
    reloaded = LlamaForCausalLM.from_pretrained(hf_dir).state_dict()
    assert reloaded.keys() == saved["model"].keys()
    for k, v in saved["model"].items():
        assert torch.equal(reloaded[k], v), k


def _tiny_trainer(trainer_cls, tmp_path, callbacks, **targs):
    from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments

    sys.path.insert(0, RECIPES)
    from hf_resume import MODEL, TokenData

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**MODEL, attn_implementation="eager"))
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, per_device_train_batch_size=4,
                             learning_rate=1e-2, report_to="none", disable_tqdm=True, seed=0, **targs)
    return trainer_cls(model=model, args=args, train_dataset=TokenData(), eval_dataset=TokenData(),
                       callbacks=callbacks)


@pytest.mark.timeout(300)
def test_hf_callback_alone_saves_with_bcp_and_best_needs_the_mixin(tmp_path, monkeypatch):
    from transformers import Trainer, TrainerCallback

    from bcp_core.checkpointer import get_checkpointer
    from bcp_integrations.hf import BCPCallback, BCPTrainer

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # the callback alone: steps checkpoints are bcp's, save_total_limit applies
    trainer = _tiny_trainer(Trainer, tmp_path / "cb", [BCPCallback()], max_steps=4, save_strategy="steps",
                            save_steps=2, save_total_limit=1)
    stats = dict(get_checkpointer().stats)
    trainer.train()
    # prepared after the first step: that was the only planning, both saves reused its plan
    assert get_checkpointer().stats["plans"] - stats["plans"] == 1
    assert get_checkpointer().stats["cache_hits"] - stats["cache_hits"] == 2
    assert os.listdir(tmp_path / "cb") == ["checkpoint-4"]
    ckpt = tmp_path / "cb" / "checkpoint-4"
    assert {"model.model.embed_tokens.weight", "optimizer.param_groups", "scheduler.last_epoch"} <= bcp.inspect(
        ckpt).keys()
    assert not (ckpt / "model.safetensors").exists() and (ckpt / "trainer_state.json").exists()

    # ... and BCPTrainer resumes from it (resume_from_checkpoint=True)
    class StartStep(TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, **kw):
            self.step = state.global_step
            self.weights = {k: v.clone() for k, v in model.state_dict().items()}

    start = StartStep()
    resumed = _tiny_trainer(BCPTrainer, tmp_path / "cb", [start], max_steps=6, save_strategy="steps", save_steps=2,
                            logging_steps=1)
    resumed.train(resume_from_checkpoint=True)
    assert start.step == 4 and resumed.state.global_step == 6
    # the resume's phase timings were logged through on_log
    logged = {k for entry in resumed.state.log_history for k in entry}
    assert {"bcp/load/total_s", "bcp/load/read_s"} <= logged, logged  # (the step-6 save commits after the last log)
    for k, v in trainer.model.state_dict().items():
        assert torch.equal(start.weights[k], v), k

    # save_strategy="best" is decided inside the Trainer: the callback alone refuses it
    with pytest.raises(ValueError, match="BCPTrainer"):
        _tiny_trainer(Trainer, tmp_path / "best_cb", [BCPCallback()], max_steps=2, save_strategy="best",
                      eval_strategy="steps", eval_steps=1, metric_for_best_model="loss").train()

    # with BCPTrainer: best checkpoints are bcp's, and load_best_model_at_end loads the best one
    class LastWeights(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kw):
            self.weights = {k: v.clone() for k, v in model.state_dict().items()}

    last = LastWeights()
    best = _tiny_trainer(BCPTrainer, tmp_path / "best", [last], max_steps=4, save_strategy="best",
                         eval_strategy="steps", eval_steps=1, metric_for_best_model="loss",
                         greater_is_better=True, load_best_model_at_end=True)
    best.train()
    best_dir = best.state.best_model_checkpoint
    # the loss falls at every step, so with greater_is_better the best is step 1, not the last
    assert best.state.best_global_step == 1 and os.listdir(tmp_path / "best") == ["checkpoint-1"]
    assert best_dir == str(tmp_path / "best" / f"checkpoint-{best.state.best_global_step}")
    from transformers import LlamaConfig, LlamaForCausalLM

    from hf_resume import MODEL
    fresh = LlamaForCausalLM(LlamaConfig(**MODEL, attn_implementation="eager"))
    bcp.load(best_dir, {"model": fresh})
    for k, v in fresh.state_dict().items():
        assert torch.equal(best.model.state_dict()[k], v), k
    assert not torch.equal(last.weights["lm_head.weight"], fresh.state_dict()["lm_head.weight"])


@pytest.mark.timeout(300)
def test_plain_trainer_resuming_a_bcp_checkpoint_says_to_use_bcp_trainer(tmp_path, monkeypatch):
    """A plain Trainer with BCPCallback saves through bcp, but only BCPTrainer/the mixin resumes:
    train(resume_from_checkpoint=...) fails before any step with one line naming them, instead of
    HF's "Can't find a valid checkpoint". HF's own checkpoints still resume on a plain Trainer."""
    from transformers import Trainer

    from bcp_integrations.hf import BCPCallback

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = tmp_path / "out"
    _tiny_trainer(Trainer, out, [BCPCallback()], max_steps=2, save_strategy="steps", save_steps=2).train()
    ckpt = out / "checkpoint-2"
    bcp.inspect(ckpt)
    for resume in (str(ckpt), True):
        trainer = _tiny_trainer(Trainer, out, [BCPCallback()], max_steps=4, save_strategy="steps", save_steps=2)
        with pytest.raises(ValueError) as info:
            trainer.train(resume_from_checkpoint=resume)
        assert str(info.value) == (
            f"bcp: {ckpt} is a bcp checkpoint; a plain transformers.Trainer cannot resume from it (BCPCallback alone "
            "only saves): use bcp_integrations.hf.BCPTrainer, or put BCPTrainerMixin in front of your Trainer class")
        assert trainer.state.global_step == 0
    assert os.listdir(out) == ["checkpoint-2"]

    native = tmp_path / "native"
    _tiny_trainer(Trainer, native, [], max_steps=2, save_strategy="steps", save_steps=2).train()
    resumed = _tiny_trainer(Trainer, native, [], max_steps=3, save_strategy="no")
    resumed.train(resume_from_checkpoint=True)
    assert resumed.state.global_step == 3


@pytest.mark.slow  # the default tier stays under 6 minutes; CI runs both
@pytest.mark.timeout(300)
def test_bcp_trainer_train_dataloader_state_resharded_2_to_1(tmp_path):
    """BCPTrainer(train_dataloader=MappedLoader(PackedTokenLoader(...))) on 2 ranks checkpoints the
    loader's state per DP rank with every save; resumed on 1 process, the loader (not the Trainer's
    batch skipping) picks up: the rest of the epoch holds exactly the tokens not trained on before."""
    from collections import Counter

    _run(2, "--packed", "--out", str(tmp_path / "a"), "--ckpt-dir", str(tmp_path / "a_trainer"),
         "--max-steps", "4", "--save-steps", "2")
    ckpt = tmp_path / "a_trainer" / "checkpoint-2"
    md = bcp.inspect(ckpt)
    assert md.objects["dataloader.format"].encoded == "bcp.PackedTokenLoader/1"
    assert [s.index for s in md.sharded_objects["dataloader.units.0"].shards] == [(0,), (1,)]
    _run(1, "--packed", "--out", str(tmp_path / "r1"), "--ckpt-dir", str(tmp_path / "r1_trainer"),
         "--max-steps", "20", "--save-steps", "100", "--resume", str(ckpt))

    def tokens(batches) -> Counter:
        return Counter(t for b in batches for row in b for t in row if t != -1)

    before = Counter()
    for rank in (0, 1):
        with open(tmp_path / "a" / f"batches_rank{rank}.json") as f:
            before += tokens(b for _, b in json.load(f)[:2])  # steps 1 and 2, one batch each
    with open(tmp_path / "r1" / "batches_rank0.json") as f:
        after = tokens(b for epoch, b in json.load(f) if epoch == 0)
    # the recipe's documents: "web" i -> 100i .. 100i+2+i%5, "code" i -> 5000+100i .. +1+i%3
    epoch = Counter([t for i in range(24) for t in range(100 * i, 100 * i + 3 + i % 5)]
                    + [t for i in range(12) for t in range(5000 + 100 * i, 5000 + 100 * i + 2 + i % 3)])
    assert before and after
    assert before + after == epoch  # nothing skipped, nothing repeated


def _scores(*values: float):
    """compute_metrics giving `values` in turn as the "score" of each evaluation."""
    it = iter(values)
    return lambda prediction: {"score": next(it)}


@pytest.mark.timeout(300)
def test_bcp_trainer_last_async_save_commits_before_the_trainer_removes_all_but_the_best(tmp_path, monkeypatch):
    """save_total_limit=1 with metric_for_best_model, the best checkpoint not the last: after the last
    step the Trainer removes every checkpoint-* but the best, before `on_train_end`. The last save
    (asynchronous) is held at its first data write until that removal has run (3 s at most): once
    train() has logged its final metrics it waits for the save, so the removal comes after the commit:
    train() returns, only the best checkpoint is left, whole. (Before, the removal ran under the
    write: train() raised the save's error, or a half-removed checkpoint-4 was left.)"""
    import shutil
    import threading

    from transformers import TrainerCallback

    from bcp_core.storage.faults import Fault, inject
    from bcp_integrations.hf import BCPTrainer
    from dist import bcp_verify

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = tmp_path / "out"
    removed = threading.Event()
    real_rmtree = shutil.rmtree

    def rmtree(path, *args, **kwargs):
        real_rmtree(path, *args, **kwargs)
        if os.path.basename(os.path.normpath(path)) == "checkpoint-4":
            removed.set()

    held = []

    def hold(call):
        if not held:
            held.append(call.path)
            removed.wait(timeout=3)

    class Weights(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kw):
            if state.global_step == 2:
                self.step2 = {k: v.clone() for k, v in model.state_dict().items()}

    weights = Weights()
    monkeypatch.setattr(shutil, "rmtree", rmtree)
    trainer = _tiny_trainer(BCPTrainer, out, [weights], max_steps=4, save_strategy="steps", save_steps=2,
                            eval_strategy="steps", eval_steps=2, save_total_limit=1, metric_for_best_model="score",
                            greater_is_better=True)
    trainer.compute_metrics = _scores(1.0, 0.0)
    with inject(Fault("write", hook=hold, path="*/checkpoint-4/data/*")):
        trainer.train()
    assert held and removed.is_set()
    assert trainer.state.best_model_checkpoint == str(out / "checkpoint-2")
    assert os.listdir(out) == ["checkpoint-2"]
    bcp_verify(str(out / "checkpoint-2"))
    from transformers import LlamaConfig, LlamaForCausalLM

    from hf_resume import MODEL
    fresh = LlamaForCausalLM(LlamaConfig(**MODEL, attn_implementation="eager"))
    bcp.load(out / "checkpoint-2", {"model": fresh})
    for k, v in fresh.state_dict().items():
        assert torch.equal(weights.step2[k], v), k


@pytest.mark.timeout(300)
def test_hf_callback_alone_saves_the_callbacks_state_and_refuses_load_best_model_at_end(tmp_path, monkeypatch):
    """A plain Trainer with BCPCallback: each checkpoint holds the stateful callbacks' state as of its
    save (as the Trainer's own checkpoints do), so BCPTrainer resuming it with
    restore_callback_states_from_checkpoint continues EarlyStoppingCallback's patience counter; and
    load_best_model_at_end, which only the mixin honours, raises naming BCPTrainer."""
    from transformers import EarlyStoppingCallback, Trainer

    from bcp_integrations.hf import BCPCallback, BCPTrainer

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = tmp_path / "out"
    evals = dict(eval_strategy="steps", eval_steps=1, metric_for_best_model="score", greater_is_better=True,
                 save_strategy="steps", save_steps=4)
    stopper = EarlyStoppingCallback(early_stopping_patience=10)
    trainer = _tiny_trainer(Trainer, out, [BCPCallback(), stopper], max_steps=4, **evals)
    trainer.compute_metrics = _scores(1.0, 0.0, 0.0, 0.0)
    trainer.train()
    assert stopper.early_stopping_patience_counter == 3
    # saved at the end of step 4, before that step's evaluation: evaluations 2 and 3 did not improve
    saved = json.loads((out / "checkpoint-4" / "trainer_state.json").read_text())
    assert saved["stateful_callbacks"]["EarlyStoppingCallback"]["attributes"] == {"early_stopping_patience_counter": 2}
    in_bcp = {"trainer_state": None}
    bcp.load(out / "checkpoint-4", in_bcp)
    assert json.loads(in_bcp["trainer_state"])["stateful_callbacks"] == saved["stateful_callbacks"]

    resumed = _tiny_trainer(BCPTrainer, out, [EarlyStoppingCallback(early_stopping_patience=10)], max_steps=5,
                            restore_callback_states_from_checkpoint=True, **evals)
    resumed.compute_metrics = _scores(0.0)
    resumed.train(resume_from_checkpoint=True)
    restored = [c for c in resumed.callback_handler.callbacks if isinstance(c, EarlyStoppingCallback)]
    assert [c.early_stopping_patience_counter for c in restored] == [3]  # 2 restored, + step 5's

    with pytest.raises(ValueError, match="load_best_model_at_end .*use BCPTrainer"):
        _tiny_trainer(Trainer, tmp_path / "best", [BCPCallback()], max_steps=2, load_best_model_at_end=True,
                      **{**evals, "save_steps": 1}).train()
    assert not (tmp_path / "best").exists() or not os.listdir(tmp_path / "best")
