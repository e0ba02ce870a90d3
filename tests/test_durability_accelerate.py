"""Durability through Accelerate: `accelerator.save_state` (asynchronous through bcp) right before the
process ends is committed, and `register(accelerator, preemption=True)` turns SIGTERM into a final
checkpoint that a relaunch resumes from exactly.

Every test runs tests/jobs/accelerate_train.py on 2 processes under torchrun (Accelerate's
MULTI_CPU: DDP on gloo) and ends it as real jobs end: the script falling off its end with or
without `accelerator.end_training()`, sys.exit, an uncaught exception, SIGTERM to torchrun; a save
failing on one process (faults injected with BCP_TEST_FAULT, tests/faults.py). Afterwards
`bcp verify` passes and the checkpoint holds, bit for bit, what the job had when it called
save_state.
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import signal

import pytest

pytest.importorskip("accelerate")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import bcp_core as bcp  # noqa: E402
from dist import Job, bcp_verify  # noqa: E402
from faults import CommittedWatch  # noqa: E402
from jobs.accelerate_train import batch, build  # noqa: E402

STEPS = 8
JOB = "accelerate_train.py"


def load_job_state(path: str) -> dict:
    """The job's checkpoint at `path` loaded into fresh single-process objects."""
    model, opt, sched, progress, bulk = build(seed=123)  # other values: a load that does nothing shows
    x, y = batch(0, 0)
    F.mse_loss(model(x), y).backward()
    opt.step()  # creates the optimizer state the checkpoint's values go into
    state = {"model": model, "optimizer": opt, "scheduler": sched, "custom": progress, "custom_1": bulk,
             "extra_state": {}}
    bcp.load(path, state)
    return {"model": model.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
            "step": progress.step, "bulk": bulk.t, "rng": state["extra_state"]["rng"]["torch"]}


def _assert_same_training_state(want: dict, got: dict) -> None:
    assert want["model"].keys() == got["model"].keys()
    for k, v in want["model"].items():
        assert torch.equal(v, got["model"][k]), k
    assert want["optimizer"]["state"].keys() == got["optimizer"]["state"].keys()
    for i, s in want["optimizer"]["state"].items():
        for name, v in s.items():
            assert torch.equal(v, got["optimizer"]["state"][i][name]), (i, name)
    assert want["optimizer"]["param_groups"] == got["optimizer"]["param_groups"]
    assert want["scheduler"] == got["scheduler"]
    assert want["step"] == got["step"]


def assert_holds_reference(root: str, step: int, path: str | None = None, reference: str | None = None) -> dict:
    """The checkpoint of `step` (DIR/step_<step>, or `path`) passes `bcp verify` and holds, bit for
    bit, what the job had then (or the values in `reference`)."""
    path = path or os.path.join(root, f"step_{step:08d}")
    bcp_verify(path)
    got = load_job_state(path)
    ref = torch.load(reference or os.path.join(root, f"reference_{step}.pt"), weights_only=True)
    _assert_same_training_state(ref, got)
    assert torch.equal(ref["rng"], got["rng"])  # process 0's RNG state at the save
    _, _, _, _, bulk = build()
    assert torch.equal(got["bulk"], bulk.t)
    return got


def _run(root, *args, env: dict | None = None) -> tuple[int, str]:
    job = Job(JOB, 2, "--root", str(root), *args, env=env)
    return job.finish(timeout=180), job.output


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("end", ["script", "end_training", "sys_exit", "exception"])
def test_save_state_right_before_the_end_is_committed(tmp_path, end):
    rc, out = _run(tmp_path, "--steps", str(STEPS), "--end", end)
    assert rc == (1 if end == "exception" else 0), out[-4000:]
    if end == "exception":
        assert "the training script failed after its last save_state" in out
    assert assert_holds_reference(str(tmp_path), STEPS)["step"] == STEPS


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict:
    """The final state of the job run to the end with no signal."""
    root = tmp_path_factory.mktemp("uninterrupted")
    rc, out = _run(root, "--steps", str(2 * STEPS))
    assert rc == 0, out[-4000:]
    return load_job_state(os.path.join(str(root), f"step_{2 * STEPS:08d}"))


def _progress(root, rank) -> tuple[int, int]:
    step, pid = open(os.path.join(root, f"progress_rank{rank}")).read().split()
    return int(step), int(pid)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_preemption_saves_at_the_step_reached_and_resumes_exactly(tmp_path, uninterrupted):
    """SIGTERM to torchrun mid-run: both processes stop at one agreed step, save_state there
    commits, the job exits 143; `load_state` of that checkpoint in a relaunch reaches the same
    final weights, optimizer and scheduler state as the uninterrupted run (dropout included)."""
    root = str(tmp_path)
    job = Job(JOB, 2, "--root", root, "--steps", str(2 * STEPS), "--preemption", "--pause-at", "3")
    job.wait_for(os.path.join(root, "progress_rank1"), lambda text: int(text.split()[0]) == 3)
    job.signal_paused(root, 3, signal.SIGTERM)
    rc = job.finish()
    reached = [_progress(root, r)[0] for r in (0, 1)]
    assert reached[0] == reached[1] and 3 <= reached[0] < 2 * STEPS, (reached, job.output[-4000:])
    assert rc != 0  # torchrun, signalled itself, fails whatever its workers' status (143 here)
    assert sorted(n for n in os.listdir(root) if n.startswith("step_")) == [f"step_{reached[0]:08d}"]
    assert_holds_reference(root, reached[0])

    rc, out = _run(root, "--steps", str(2 * STEPS), "--resume", os.path.join(root, f"step_{reached[0]:08d}"))
    assert rc == 0, out[-4000:]
    _assert_same_training_state(uninterrupted, load_job_state(os.path.join(root, f"step_{2 * STEPS:08d}")))


def _watch_checkpoints(ckpts: str) -> CommittedWatch:
    """Accelerate's automatic checkpoint folders always hold a committed checkpoint."""
    def folders() -> list[str]:
        return sorted(glob.glob(os.path.join(ckpts, "checkpoint_*")), key=lambda p: int(p.rsplit("_", 1)[1]))
    return CommittedWatch({"checkpoint_*": folders})


@pytest.mark.timeout(300)
def test_total_limit_rotates_after_the_commit_and_a_failed_save_leaves_the_previous_checkpoint(tmp_path):
    """ProjectConfiguration(automatic_checkpoint_naming=True, total_limit=1), `save_state()` every
    2 steps, asynchronous.

    1. The last save (checkpoint_3, step 8) fails on process 1 (ENOSPC); the saves of steps 4 and 6
       are slow on process 0. Throughout, a committed checkpoint exists: the older folder goes
       only once the newer one is committed (Accelerate deletes it before saving). Both processes
       exit 1 naming the save; checkpoint_2 passes `bcp verify` and holds step 6's values.
    2. Relaunched with `load_state()` (the newest committed checkpoint, not the failed
       checkpoint_3): it resumes with exactly checkpoint_2's values, reaches the first run's step-8
       state bit for bit, and in the end only its new checkpoint is left (the failed folder went
       with the rotation).
    """
    root, ckpts = str(tmp_path), str(tmp_path / "checkpoints")
    args = ("--steps", str(STEPS), "--save-every", "2", "--total-limit", "1")
    with _watch_checkpoints(ckpts) as watch:
        rc, out = _run(root, *args, env={"BCP_TEST_FAULT": "slow:rank=0:save=2:seconds=1,"
                                                           "slow:rank=0:save=3:seconds=1,write:rank=1:save=4"})
    assert rc != 0, out[-4000:]
    for rank in (0, 1):
        assert re.search(rf"bcp: rank {rank} exits with status 1: the asynchronous save to {re.escape(ckpts)}/"
                         r"checkpoint_3 was not committed: .*rank 1.*No space left on device", out), out[-4000:]
    assert watch.violations == []
    assert sorted(os.listdir(ckpts)) == ["checkpoint_2", "checkpoint_3"]
    assert not os.path.exists(os.path.join(ckpts, "checkpoint_3", "bcp_metadata.json"))
    assert assert_holds_reference(root, 6, path=os.path.join(ckpts, "checkpoint_2"))["step"] == 6
    uninterrupted = str(tmp_path / "uninterrupted_8.pt")  # the relaunch writes reference_8.pt again
    shutil.copy(os.path.join(root, f"reference_{STEPS}.pt"), uninterrupted)

    with _watch_checkpoints(ckpts) as watch:
        rc, out = _run(root, *args, "--resume-newest", env={"BCP_TEST_FAULT": "slow:rank=0:save=1:seconds=1"})
    assert rc == 0, out[-4000:]
    assert watch.violations == []
    resumed, saved = (torch.load(os.path.join(root, n), weights_only=True) for n in ("resumed.pt", "reference_6.pt"))
    _assert_same_training_state(saved, resumed)
    assert torch.equal(saved["rng"], resumed["rng"])
    assert os.listdir(ckpts) == ["checkpoint_4"]
    assert assert_holds_reference(root, STEPS, path=os.path.join(ckpts, "checkpoint_4"),
                                  reference=uninterrupted)["step"] == STEPS
