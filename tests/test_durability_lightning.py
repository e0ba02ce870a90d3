"""Durability through Lightning: every save BCPCheckpointIO was asked for (asynchronous, its default)
is committed before the process ends, and `BCPCheckpointIO(preemption=True)` turns SIGTERM into a
final checkpoint that `fit(ckpt_path="hpc")` resumes from exactly.

Every test runs tests/jobs/lightning_train.py on 2 ranks under torchrun (DDP on gloo, a
PackedTokenLoader, dropout) and ends it as real jobs end: the script falling off its end, sys.exit
or an uncaught exception right after `trainer.save_checkpoint` following `fit`; SIGTERM to one
worker while the job starts up and to torchrun while it trains; a save failing on one rank
(faults injected with BCP_TEST_FAULT, tests/faults.py). Afterwards `bcp verify` passes and each
checkpoint holds, bit for bit, what the job had when it saved.
"""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import signal

import pytest

pytest.importorskip("lightning")

import torch  # noqa: E402

import bcp_core as bcp  # noqa: E402
from dist import Job, bcp_verify  # noqa: E402
from faults import CommittedWatch  # noqa: E402
from jobs.lightning_train import TokenRegressor  # noqa: E402

STEPS = 16
JOB = "lightning_train.py"


def load_job_state(path: str) -> dict:
    """The job's checkpoint at `path` loaded into a fresh single-process model and optimizer."""
    torch.manual_seed(123)  # other values than the job's: a load that does nothing shows
    module = TokenRegressor()
    (opt,), _ = module.configure_optimizers()
    module(torch.zeros(1, 4, dtype=torch.long)).sum().backward()
    opt.step()  # creates the optimizer state the checkpoint's values go into
    state = {"model": module, "optimizer_0": opt, "extra_state": {}, "lightning": None}
    bcp.load(path, state, strict=False)  # the loader's state is Lightning's to restore
    lightning = json.loads(state["lightning"])
    return {"model": module.state_dict(), "optimizer": opt.state_dict(), "lightning": lightning,
            "rng": state["extra_state"]["rng"]["torch"]}


def _assert_same_training_state(want: dict, got: dict) -> None:
    assert want["model"].keys() == got["model"].keys()
    for k, v in want["model"].items():
        assert torch.equal(v, got["model"][k]), k
    assert want["optimizer"]["state"].keys() == got["optimizer"]["state"].keys()
    for i, s in want["optimizer"]["state"].items():
        for name, v in s.items():
            assert torch.equal(v, got["optimizer"]["state"][i][name]), (i, name)
    assert want["optimizer"]["param_groups"] == got["optimizer"]["param_groups"]


def assert_holds_reference(root: str, name: str, step: int, reference: str | None = None) -> dict:
    """Checkpoint `name` passes `bcp verify` and holds, bit for bit, what the job had at its save
    (or the values in `reference`)."""
    path = os.path.join(root, name)
    bcp_verify(path)
    got = load_job_state(path)
    ref = torch.load(reference or os.path.join(root, f"reference_{step}.pt"), weights_only=True)
    assert ref["global_step"] == step and got["lightning"]["global_step"] == step
    _assert_same_training_state(ref, got)
    assert got["lightning"]["lr_schedulers"] == [json.loads(json.dumps(ref["scheduler"]))]
    assert torch.equal(ref["rng"], got["rng"])  # rank 0's RNG state at the save
    return got


def _run(root, *args, env: dict | None = None) -> tuple[int, str]:
    job = Job(JOB, 2, "--root", str(root), *args, env=env)
    return job.finish(timeout=180), job.output


def _assert_saves_inside_fit_committed(root: str) -> None:
    """ModelCheckpoint's saves (the last one at the last step, in flight when fit's loop ends) and
    save_checkpoint at the last step inside fit."""
    assert sorted(os.listdir(os.path.join(root, "mc"))) == sorted(f"step={s}.ckpt" for s in (4, 8, 12, 16))
    assert_holds_reference(root, os.path.join("mc", f"step={STEPS}.ckpt"), STEPS)
    assert_holds_reference(root, "in_fit.ckpt", STEPS)


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> str:
    """The job run to the end with no signal, its script falling off the end after its last save."""
    root = tmp_path_factory.mktemp("finished")
    rc, out = _run(root, "--steps", str(STEPS))
    assert rc == 0, out[-4000:]
    return str(root)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("end", ["script", "sys_exit", "exception"])
def test_save_right_before_the_end_is_committed(tmp_path, finished, end):
    """`trainer.save_checkpoint` after fit returns, then the script ends at once."""
    if end == "script":
        root = finished
        _assert_saves_inside_fit_committed(root)
    else:
        rc, out = _run(tmp_path, "--steps", str(STEPS), "--end", end)
        assert rc == (1 if end == "exception" else 0), out[-4000:]
        if end == "exception":
            assert "the training script failed after its last save" in out
        root = str(tmp_path)
    assert_holds_reference(root, "after_fit.ckpt", STEPS)


def _progress(root, rank) -> tuple[int, int]:
    step, pid = open(os.path.join(root, f"progress_rank{rank}")).read().split()
    return int(step), int(pid)


def _preempted(root: str, *args: str, pause_at: int, target: str) -> int:
    """Run the job with the preemption option; once it is paused at step `pause_at`, SIGTERM to
    torchrun (which forwards it to every worker) or to rank 1 only. The step both ranks stopped at."""
    job = Job(JOB, 2, "--root", root, "--steps", str(STEPS), "--preemption", "--pause-at", str(pause_at), *args)
    job.wait_for(os.path.join(root, "progress_rank1"), lambda text: int(text.split()[0]) == pause_at)
    job.signal_paused(root, pause_at, signal.SIGTERM, None if target == "torchrun" else _progress(root, 1)[1],
                      receivers=2 if target == "torchrun" else 1)
    rc = job.finish()
    out = job.output
    reached = [_progress(root, r)[0] for r in (0, 1)]
    assert reached[0] == reached[1] and 0 < reached[0] < STEPS, (reached, out[-4000:])
    assert rc != 0, out[-4000:]  # torchrun fails when signalled itself, or when a worker exits 143
    for rank in (0, 1):
        assert f"bcp: rank {rank}: preempted at step {reached[0]} (the step boundary the ranks agreed on)" in out, \
            out[-4000:]
    # a rank that got no signal leaves "after the preemption request"
    assert out.count("bcp: every save committed; exiting with status 143 after") == 2, out[-4000:]
    return reached[0]


@pytest.mark.slow
@pytest.mark.timeout(500)
def test_preemption_checkpoints_at_the_step_reached_and_resumes_exactly(tmp_path, finished):
    """SIGTERM twice, then a relaunch to the end, each time `fit(ckpt_path="hpc")`:

    1. to rank 1 only, while the job starts up (before fit installs Lightning's handlers): the
       ranks agree through the store to stop at the second step boundary;
    2. to torchrun, mid-run: the ranks stop at the boundary after the step in progress.

    Lightning's own SIGTERM notifier is not called (it broadcasts inside the signal handler, see
    bcp_integrations.lightning); bcp's handler, which Lightning's composed handler calls, is. Each
    time hpc_ckpt_<n>.ckpt holds exactly the job's state at its save and both workers exit 143; the
    run resumed to the end reaches the uninterrupted run's weights, optimizer, scheduler and RNG
    states bit for bit (dropout, mid-epoch data position included)."""
    root = str(tmp_path)
    first = _preempted(root, pause_at=0, target="one_worker")
    assert first == 2
    assert sorted(n for n in os.listdir(root) if n.startswith("hpc_")) == ["hpc_ckpt_1.ckpt"]
    assert_holds_reference(root, "hpc_ckpt_1.ckpt", first)

    second = _preempted(root, "--resume", pause_at=first + 3, target="torchrun")
    assert second > first + 2
    assert sorted(n for n in os.listdir(root) if n.startswith("hpc_")) == ["hpc_ckpt_1.ckpt", "hpc_ckpt_2.ckpt"]
    assert_holds_reference(root, "hpc_ckpt_2.ckpt", second)

    rc, out = _run(root, "--steps", str(STEPS), "--resume")
    assert rc == 0, out[-4000:]
    want = load_job_state(os.path.join(finished, "after_fit.ckpt"))
    got = load_job_state(os.path.join(root, "after_fit.ckpt"))
    _assert_same_training_state(want, got)
    assert want["lightning"]["lr_schedulers"] == got["lightning"]["lr_schedulers"]
    assert torch.equal(want["rng"], got["rng"])


def _watch_mc(mc: str) -> CommittedWatch:
    """ModelCheckpoint's directory: its top-k checkpoints, and last.ckpt, each always hold a committed one."""
    def top_k() -> list[str]:
        found = glob.glob(os.path.join(mc, "step=*.ckpt"))
        return sorted(found, key=lambda p: int(re.search(r"step=(\d+)", p).group(1)))
    return CommittedWatch({"step=*.ckpt": top_k, "last.ckpt": lambda: [os.path.join(mc, "last.ckpt")]})


@pytest.mark.timeout(400)
def test_rotation_waits_for_the_commit_and_a_failed_save_leaves_the_previous_checkpoint(tmp_path):
    """ModelCheckpoint(save_top_k=1, save_last=True) every 4 steps, asynchronous BCPCheckpointIO.

    1. The job's save of step=16.ckpt fails on rank 1 (ENOSPC); its saves at step 8 are slow on
       rank 0. Throughout, the top-k checkpoints and last.ckpt each hold a committed checkpoint:
       the older top-k one and the previous last.ckpt go only once their successor is committed.
       The job fails naming the save; step=12.ckpt and last.ckpt pass `bcp verify` and hold
       step 12's values; the failed step=16.ckpt left nothing behind.
    2. Relaunched with `fit(ckpt_path="last")` (its saves at step 16 slow on rank 0, and the
       on_commit of step=16.ckpt raising on rank 1: that checkpoint is committed, rank 1 logs the
       error and goes on with rank 0): it resumes from last.ckpt and reaches the first run's
       step-16 state bit for bit; in the end only step=16.ckpt and last.ckpt are left.
    """
    root, mc = str(tmp_path), str(tmp_path / "mc")
    args = ("--steps", str(STEPS), "--top-k", "1", "--save-last")
    # saves 1-8: step=4.ckpt, last.ckpt, step=8.ckpt, last.ckpt, step=12.ckpt, last.ckpt, in_fit.ckpt, step=16.ckpt
    with _watch_mc(mc) as watch:
        rc, out = _run(root, *args, env={"BCP_TEST_FAULT": "slow:rank=0:save=3:seconds=1,"
                                                           "slow:rank=0:save=4:seconds=1,write:rank=1:save=8"})
    assert rc != 0, out[-4000:]
    # (torchrun ends the other worker once one has failed: it may not get to print its error)
    assert re.search(rf"\[rank[01]\]: .*SaveError: save to {re.escape(mc)}/step=16.ckpt\S* failed and was not "
                     r"committed: .*rank 1.*No space left on device", out), out[-4000:]
    assert watch.violations == []
    assert sorted(os.listdir(mc)) == ["last.ckpt", "step=12.ckpt"]
    for name in ("step=12.ckpt", "last.ckpt"):
        assert_holds_reference(root, os.path.join("mc", name), 12)
    uninterrupted = str(tmp_path / "uninterrupted_16.pt")  # the relaunch writes reference_16.pt again
    shutil.copy(os.path.join(root, "reference_16.pt"), uninterrupted)

    # saves 1-3 at step 16: in_fit.ckpt, step=16.ckpt, last.ckpt
    with _watch_mc(mc) as watch:
        rc, out = _run(root, *args, "--resume", "last", env={
            "BCP_TEST_FAULT": "slow:rank=0:save=2:seconds=1,slow:rank=0:save=3:seconds=1,commit:rank=1:save=2"})
    assert rc == 0, out[-4000:]
    assert re.search(rf"bcp: {re.escape(mc)}/step=16.ckpt\S* was committed, but on_commit raised on rank 1", out)
    assert f"Restoring states from the checkpoint path at {mc}/last.ckpt" in out
    assert watch.violations == []
    assert sorted(os.listdir(mc)) == ["last.ckpt", "step=16.ckpt"]
    for name in ("step=16.ckpt", "last.ckpt"):
        assert_holds_reference(root, os.path.join("mc", name), STEPS, reference=uninterrupted)
