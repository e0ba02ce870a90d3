"""DeepSpeed ZeRO 1/2/3 through bcp's plain API: real engines under torchrun (DS_ACCELERATOR=cpu, gloo).

tests/jobs/deepspeed_train.py does the multi-rank work (see its doc): bcp checkpoints of each stage
loaded into each stage, into FSDP2, a 1-process checkpoint into ZeRO-3, DeepSpeed's own checkpoints
read by bcp, a checkpoint of another shape refused, all compared bit for bit with DeepSpeed's own
full values. Here: the job is launched as a cluster launches it, and its checkpoints are loaded into
a plain LlamaForCausalLM + AdamW in this one process, continued as ZeRO-2 on one rank, and
DeepSpeed's own checkpoint is exported to safetensors that `from_pretrained` loads.
"""

from __future__ import annotations

import os

import pytest

pytest.importorskip("deepspeed")
pytest.importorskip("transformers")
import torch  # noqa: E402

import bcp_core as bcp  # noqa: E402
from dist import JOBS, Job  # noqa: E402

ENV = {"DS_ACCELERATOR": "cpu", "HF_HUB_OFFLINE": "1"}


def _job_module():
    import importlib.util
    spec = importlib.util.spec_from_file_location("deepspeed_train", os.path.join(JOBS, "deepspeed_train.py"))
    module = importlib.util.module_from_spec(spec)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    spec.loader.exec_module(module)
    return module


def _plain_checkpoint(job, root) -> None:
    """A run on one process with a plain model and torch's AdamW: 2 steps on the whole batch."""
    model = job.build_model(seed=3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    for step in (0, 1):
        ids = job.tokens(step, 0, 1)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    bcp.save(os.path.join(root, "plain"), {"model": model, "optimizer": opt})
    ref = {f"model.{n}": p.detach().clone() for n, p in model.named_parameters()}
    for n, p in model.named_parameters():
        for k in ("exp_avg", "exp_avg_sq"):
            ref[f"optimizer.state.{n}.{k}"] = opt.state[p][k].clone()
    ref["step"] = float(opt.state[next(iter(model.parameters()))]["step"])
    torch.save(ref, os.path.join(root, "ref_plain.pt"))


def _plain_state_equals(job, path, ref: dict) -> None:
    model = job.build_model(seed=9)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    bcp.load(path, {"model": model, "optimizer": opt})
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), ref[f"model.{n}"]), n
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(opt.state[p][k], ref[f"optimizer.state.{n}.{k}"]), (n, k)
        assert float(opt.state[p]["step"]) == ref["step"]
    assert opt.param_groups[0]["lr"] == 1e-2 and opt.param_groups[0]["weight_decay"] == 0.01


def _damaged_deepspeed_file_is_refused(job, tmp_path) -> None:
    """A byte flipped inside a tensor record of DeepSpeed's file: the load fails naming the file (the zip's
    CRC of that record), and the model it was to fill is unchanged."""
    import shutil
    import zipfile
    bad = tmp_path / "ds2_damaged"
    shutil.copytree(tmp_path / "ds2", bad)
    step = (bad / "latest").read_text().strip()
    target = bad / step / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    with zipfile.ZipFile(target) as zf:
        info = max((i for i in zf.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
        offset = info.header_offset + 30 + len(info.filename.encode()) + len(info.extra) + info.file_size // 2
    data = bytearray(target.read_bytes())
    data[offset] ^= 0xFF
    target.write_bytes(bytes(data))
    model = job.build_model(seed=9)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(bcp.BCPError, match="zero_pp_rank_1_mp_rank_00_optim_states.pt"):
        bcp.load(bad, {"model": model})
    assert all(torch.equal(p.detach(), before[n]) for n, p in model.named_parameters())


@pytest.mark.timeout(300)
def test_zero3_saved_while_training_loads_into_zero2_and_a_plain_model(tmp_path):
    """The default tier's DeepSpeed case (7 s; the matrix below and the HF Trainer's resumes are slow)."""
    job = _job_module()
    run = Job("deepspeed_train.py", 2, "--phase", "reshard", "--root", str(tmp_path), env=ENV)
    assert run.finish(timeout=240) == 0, run.output[-6000:]
    assert all((tmp_path / f"reshard_ok_rank{r}").exists() for r in (0, 1))
    ref = torch.load(tmp_path / "ref_zero3.pt")
    _plain_state_equals(job, tmp_path / "zero3", ref)
    after = torch.load(tmp_path / "after_zero3.pt")  # the state as of the save's call, not the step after
    assert not torch.equal(after["values"]["model.lm_head.weight"], ref["model.lm_head.weight"])


@pytest.mark.slow  # 70 s
@pytest.mark.timeout(900)
def test_zero_checkpoints_reshard_across_stages_world_sizes_and_frameworks(tmp_path):
    job = _job_module()
    _plain_checkpoint(job, tmp_path)
    run = Job("deepspeed_train.py", 2, "--phase", "matrix", "--root", str(tmp_path), env=ENV)
    assert run.finish(timeout=600) == 0, run.output[-6000:]
    assert all((tmp_path / f"matrix_ok_rank{r}").exists() for r in (0, 1))

    # ZeRO-3 (2 ranks, saved asynchronously while the next step ran) -> a plain model in one process
    refs = {s: torch.load(tmp_path / f"ref_zero{s}.pt") for s in (1, 2, 3)}
    for s in (1, 2, 3):
        md = bcp.inspect(tmp_path / f"zero{s}")
        assert md.framework == "deepspeed" and md.world_size == 2
        _plain_state_equals(job, tmp_path / f"zero{s}", refs[s])
    # the state as of the asynchronous save's call, not the step that ran meanwhile
    after = torch.load(tmp_path / "after_zero3.pt")
    assert not torch.equal(after["values"]["model.lm_head.weight"], refs[3]["model.lm_head.weight"])

    # DeepSpeed's own checkpoint (its global_stepN/, through its `latest`) -> a plain model
    _plain_state_equals(job, tmp_path / "ds2", refs[2])
    md = bcp.inspect(tmp_path / "ds2")
    assert md.user["converted_from"] == "deepspeed" and md.world_size == 2
    assert md.objects["engine.global_steps"].encoded == 2
    from dist import bcp_verify
    assert "0 fault(s)" in bcp_verify(str(tmp_path / "ds2"))
    _damaged_deepspeed_file_is_refused(job, tmp_path)

    # ... and exported to safetensors that Hugging Face loads
    from transformers import LlamaForCausalLM

    from bcp_core.tools.cli import main as bcp_cli
    job.build_model().config.save_pretrained(tmp_path / "config")
    assert bcp_cli(["export", str(tmp_path / "ds2"), str(tmp_path / "hf"), "--to", "hf",
                    "--config", str(tmp_path / "config")]) == 0
    hf = LlamaForCausalLM.from_pretrained(tmp_path / "hf")
    for n, p in hf.named_parameters():
        assert torch.equal(p.detach(), refs[2][f"model.{n}"]), n

    # ZeRO-3 on 2 ranks -> ZeRO-2 on 1 rank, which takes the step the 2-rank run took after its save
    run = Job("deepspeed_train.py", 1, "--phase", "continue", "--root", str(tmp_path), env=ENV)
    assert run.finish(timeout=300) == 0, run.output[-6000:]
    one = torch.load(tmp_path / "continued.pt")
    for k, v in after["values"].items():
        if isinstance(v, torch.Tensor):
            torch.testing.assert_close(one["values"][k], v, rtol=1e-5, atol=1e-7, msg=k)
    assert one["values"]["global_steps"] == after["values"]["global_steps"] == 3


def _hf(root, *args: str) -> None:
    defaults = () if "--steps" in args else ("--steps", "4", "--save-steps", "2")
    run = Job("hf_train.py", 2, "--root", str(root), *defaults, *args, env=ENV)
    assert run.finish(timeout=400) == 0, run.output[-6000:]


def _losses(root) -> dict:
    import json
    with open(os.path.join(root, "losses_rank0.json")) as f:
        return {step: loss for step, loss in json.load(f)}


def _same_reference(a: dict, b: dict) -> None:
    assert a["global_steps"] == b["global_steps"] and a["step"] == b["step"]
    for n, v in a["model"].items():
        assert torch.equal(v, b["model"][n]), n
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(a["optimizer"][n][k], b["optimizer"][n][k]), (n, k)
    assert a["scheduler"] == b["scheduler"]


def _hf_stop_and_resume(tmp_path, stage: int) -> None:
    full, part = tmp_path / "full", tmp_path / "part"
    _hf(full, "--zero", str(stage))
    _hf(part, "--zero", str(stage), "--stop-at", "2")  # the job ends after its step-2 checkpoint
    assert sorted(p.name for p in part.iterdir() if p.name.startswith("checkpoint-")) == ["checkpoint-2"]
    ckpt = part / "checkpoint-2"
    assert sorted(os.listdir(ckpt)) == ["bcp_metadata.json", "bcp_metrics.jsonl", "config.json", "data",
                                        "trainer_state.json"]  # bcp's files only: no global_step*, no .pt
    assert bcp.inspect(ckpt).framework == "deepspeed"
    _hf(part, "--zero", str(stage), "--resume")
    assert _losses(part) == _losses(full) and sorted(_losses(full)) == [1, 2, 3, 4]
    _same_reference(torch.load(part / "reference_4.pt"), torch.load(full / "reference_4.pt"))


@pytest.mark.slow  # 70 s
@pytest.mark.timeout(900)
def test_hf_trainer_zero3_stops_and_resumes_bit_identical(tmp_path):
    _hf_stop_and_resume(tmp_path, 3)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_hf_trainer_zero2_stops_and_resumes_bit_identical(tmp_path):
    _hf_stop_and_resume(tmp_path, 2)


def _same_values(a: dict, b: dict) -> None:
    for n, v in a["model"].items():
        assert torch.equal(v, b["model"][n]), n
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(a["optimizer"][n][k], b["optimizer"][n][k]), (n, k)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_accelerate_deepspeed_plugin_resumes_at_another_stage_and_world_size(tmp_path):
    """`register(accelerator)` with a DeepSpeedPlugin: ZeRO-3 on 2 processes saves with save_state; ZeRO-3
    on 2 resumes bit-identically; ZeRO-2 on 1 process loads the same values and trains on."""
    def run(nproc: int, root, *args: str) -> None:
        job = Job("accelerate_train.py", nproc, "--root", str(root), *args, env=ENV)
        assert job.finish(timeout=400) == 0, job.output[-6000:]

    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    for d in (a, b, c):
        d.mkdir()
    run(2, a, "--zero", "3", "--steps", "6", "--save-every", "3")
    assert bcp.inspect(a / "step_00000003").framework == "deepspeed"
    run(2, b, "--zero", "3", "--steps", "6", "--resume", str(a / "step_00000003"))
    ref3, ref6 = torch.load(a / "reference_3.pt"), torch.load(a / "reference_6.pt")
    _same_values(torch.load(b / "resumed.pt"), ref3)
    end = torch.load(b / "reference_6.pt")
    _same_values(end, ref6)
    assert end["global_steps"] == ref6["global_steps"] == 6 and end["scheduler"] == ref6["scheduler"]
    run(1, c, "--zero", "2", "--steps", "6", "--resume", str(a / "step_00000003"))
    resumed = torch.load(c / "resumed.pt")
    _same_values(resumed, ref3)
    assert resumed["global_steps"] == 3 and resumed["scheduler"] == ref3["scheduler"]


def _holds(path, reference_file) -> None:
    """Checkpoint `path` (of the HF job under DeepSpeed) holds, bit for bit, DeepSpeed's full values in
    `reference_file`: loaded into a plain model and torch's AdamW in this process."""
    from dist import bcp_verify
    bcp_verify(str(path))
    ref = torch.load(reference_file, map_location="cpu")  # a GPU run's reference too
    job = _job_module()
    model = job.build_model(seed=9)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    state = {"model": model, "optimizer": opt, "engine": {}}
    bcp.load(path, state)
    assert state["engine"]["global_steps"] == ref["global_steps"]
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), ref["model"][n]), n
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(opt.state[p][k], ref["optimizer"][n][k]), (n, k)
        assert [float(opt.state[p]["step"])] == ref["step"]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_hf_zero3_failed_write_on_one_rank_commits_nothing_and_sigterm_commits_and_resumes(tmp_path):
    import re
    import signal

    # a write fails on rank 1 only, in the save of checkpoint-4: every rank fails that save, none commits it
    failed = tmp_path / "failed"
    run = Job("hf_train.py", 2, "--root", str(failed), "--steps", "4", "--save-steps", "2", "--zero", "3",
              env={**ENV, "BCP_TEST_FAULT": "write:rank=1:save=2"})
    assert run.finish(timeout=400) != 0
    assert re.search(rf"SaveError: save to {re.escape(str(failed))}/checkpoint-4 failed and was not committed: "
                     r".*rank 1.*No space left on device", run.output), run.output[-4000:]
    assert not (failed / "checkpoint-4" / "bcp_metadata.json").exists()
    _holds(failed / "checkpoint-2", failed / "reference_2.pt")

    # SIGTERM mid-run: both ranks stop at one agreed step, save there, exit 143; the relaunch resumes exactly
    full, part = tmp_path / "full", tmp_path / "part"
    _hf(full, "--zero", "3", "--steps", "8", "--save-steps", "4")
    job = Job("hf_train.py", 2, "--root", str(part), "--steps", "8", "--save-steps", "4", "--zero", "3",
              "--preemption", "--pause-at", "3", env=ENV)
    job.wait_for(str(part / "progress_rank1"), lambda text: int(text.split()[0]) == 3)
    job.signal_paused(str(part), 3, signal.SIGTERM)
    assert job.finish(timeout=300) != 0
    steps = sorted(int(p.name.split("-")[1]) for p in part.iterdir() if p.name.startswith("checkpoint-"))
    stop = steps[-1]
    assert 3 <= stop < 8 and "exiting with status 143" in job.output, job.output[-4000:]
    _holds(part / f"checkpoint-{stop}", full / f"reference_{stop}.pt")
    _hf(part, "--zero", "3", "--steps", "8", "--save-steps", "4", "--resume")
    _holds(part / "checkpoint-8", full / "reference_8.pt")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_megatron_checkpoint_loads_into_zero3_through_the_mapping(tmp_path):
    """Megatron-core (TP=2, DistributedOptimizer; recipes/megatron_to_hf.py) -> a Hugging Face Llama under
    ZeRO-3 on 2 ranks with `mapping="auto"`: weights, both moments and step as a plain model in one process
    loads them (which tests/test_mapping_megatron.py compares with Megatron itself)."""
    pytest.importorskip("megatron.core")
    from dist import run_recipe
    run_recipe("megatron_to_hf.py", 2, "--phase", "megatron", "--out", str(tmp_path / "megatron"), timeout=400)
    path = tmp_path / "megatron" / "iter_0000003"
    model = _job_module().megatron_llama()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    bcp.load(path, {"model": model, "optimizer": opt}, mapping="auto")
    ref = {f"model.{n}": p.detach().clone() for n, p in model.named_parameters()}
    for n, p in model.named_parameters():
        for k in ("exp_avg", "exp_avg_sq"):
            ref[f"optimizer.state.{n}.{k}"] = opt.state[p][k].clone()
    ref["step"] = float(next(iter(opt.state.values()))["step"])
    torch.save(ref, tmp_path / "ref_megatron.pt")
    run = Job("deepspeed_train.py", 2, "--phase", "megatron", "--root", str(tmp_path), env=ENV)
    assert run.finish(timeout=400) == 0, run.output[-6000:]
    assert all((tmp_path / f"megatron_ok_rank{r}").exists() for r in (0, 1))


def _hf_resume_job(nproc: int, root, *args: str, env: dict | None = None) -> None:
    os.makedirs(root, exist_ok=True)
    run = Job("hf_deepspeed_resume.py", nproc, "--root", str(root), *args, env={**ENV, **(env or {})})
    assert run.finish(timeout=400) == 0, run.output[-6000:]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_plain_hf_trainer_resumes_deepspeeds_own_zero3_checkpoint_with_bcp_imported(tmp_path):
    """bcp reads DeepSpeed's own checkpoints, but they are not bcp's: a plain Trainer under ZeRO-3 in a
    process that imported bcp_integrations.hf saves DeepSpeed's checkpoint-2 (no model.safetensors)
    and resumes it through DeepSpeed as without bcp, at step 2's values (it was refused as "a bcp
    checkpoint ... use BCPTrainer")."""
    _hf_resume_job(1, tmp_path, "--native", "--zero", "3", "--steps", "2")
    ckpt = tmp_path / "checkpoint-2"
    assert "global_step2" in os.listdir(ckpt) and not (ckpt / "model.safetensors").exists()
    assert not (ckpt / "bcp_metadata.json").exists()
    _hf_resume_job(1, tmp_path, "--native", "--zero", "3", "--steps", "4", "--resume")
    _same_reference(torch.load(tmp_path / "resumed" / "reference_2.pt"), torch.load(tmp_path / "reference_2.pt"))
    assert "global_step4" in os.listdir(tmp_path / "checkpoint-4")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_bcp_trainer_zero2_resumes_from_tiers_bit_identical(tmp_path):
    """BCPTrainer under DeepSpeed ZeRO-2 on 2 ranks, each a simulated node (BCP_LOCAL_WORLD_SIZE=1),
    saving to tiers (BCPCallback(tiers=...)): stopped after step 2, `train(resume_from_checkpoint=tiers)`
    starts from step 2's weights, Adam moments, scheduler and engine counters, bit for bit, and reaches
    the uninterrupted run's step-4 state and losses (the Trainer handed DeepSpeed's loader the folder
    holding only the trainer state: "Can't find a valid checkpoint")."""
    env = {"BCP_LOCAL_WORLD_SIZE": "1"}
    full, part, resumed = tmp_path / "full", tmp_path / "part", tmp_path / "resumed"
    _hf_resume_job(2, full, "--zero", "2", "--tiers", str(tmp_path / "full_tiers"), env=env)
    _hf_resume_job(2, part, "--zero", "2", "--stop-at", "2", "--tiers", str(tmp_path / "tiers"), env=env)
    _hf_resume_job(2, resumed, "--zero", "2", "--resume", "--tiers", str(tmp_path / "tiers"), env=env)
    _same_reference(torch.load(resumed / "resumed" / "reference_2.pt"), torch.load(part / "reference_2.pt"))
    _same_reference(torch.load(resumed / "reference_4.pt"), torch.load(full / "reference_4.pt"))
    assert {**_losses(part), **_losses(resumed)} == _losses(full) and sorted(_losses(resumed)) == [3, 4]
