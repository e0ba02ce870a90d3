"""Durability through HF Transformers: the checkpoints the Trainer saves through bcp (asynchronous,
the default) are committed before the process ends, and `BCPCallback(preemption=True)` turns
SIGTERM into a final checkpoint that `BCPTrainer.train(resume_from_checkpoint=True)` resumes from
exactly.

Every test runs tests/jobs/hf_train.py on 2 ranks under torchrun (`use_cpu=True`: DDP on gloo; a
tiny Llama with attention dropout), with `BCPTrainer` or with `BCPCallback` alone on a plain
`Trainer`, and ends it as real jobs end: the script falling off its end, sys.exit or an uncaught
exception right after `train()` saved at its last step; SIGTERM to torchrun mid-run; a save
failing on one rank (faults injected with BCP_TEST_FAULT, tests/faults.py). Afterwards
`bcp verify` passes and the checkpoint holds, bit for bit, what the job had when it saved.
"""

from __future__ import annotations

import glob
import json
import os
import re
import signal

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import torch  # noqa: E402

import bcp_core as bcp  # noqa: E402
from dist import Job, bcp_verify  # noqa: E402
from faults import CommittedWatch  # noqa: E402

STEPS = 16
JOB = "hf_train.py"
ENV = {"HF_HUB_OFFLINE": "1"}


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = v
    return out


def load_job_state(path: str) -> dict:
    """The job's checkpoint at `path`, loaded in this process as plain values (optimizer state by
    parameter name)."""
    state = {"model": {}, "optimizer": {}, "scheduler": {}, "extra_state": {}, "trainer_state": None}
    bcp.load(path, state)
    return {"model": _flat(state["model"]), "optimizer": _flat(state["optimizer"]["state"]),
            "param_groups": state["optimizer"]["param_groups"], "scheduler": state["scheduler"],
            "rng": state["extra_state"]["rng"]["torch"],  # rank 0's
            "global_step": json.loads(state["trainer_state"])["global_step"]}


def assert_holds(path: str, reference: str, step: int) -> None:
    """Checkpoint `path` passes `bcp verify` and holds, bit for bit, the job's values in `reference`."""
    bcp_verify(path)
    got = load_job_state(path)
    ref = torch.load(reference, weights_only=True)
    assert got["global_step"] == step
    assert got["model"].keys() == ref["model"].keys()
    for k, v in ref["model"].items():
        assert torch.equal(v, got["model"][k]), k
    want = _flat(ref["optimizer"])
    assert got["optimizer"].keys() == want.keys() and want
    for k, v in want.items():
        assert torch.equal(v, got["optimizer"][k]), k
    assert got["param_groups"] == ref["param_groups"]
    assert got["scheduler"] == ref["scheduler"]
    assert torch.equal(got["rng"], ref["rng"])  # rank 0's RNG state at the save


def _run(root, *args, env: dict | None = None) -> tuple[int, str]:
    job = Job(JOB, 2, "--root", str(root), *args, env={**ENV, **(env or {})})
    return job.finish(timeout=180), job.output


def _checkpoints(root: str) -> list[str]:
    return sorted((n for n in os.listdir(root) if n.startswith("checkpoint-")), key=lambda n: int(n.split("-")[1]))


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> str:
    """BCPTrainer run to the end with no signal; its script falls off the end after train()."""
    root = tmp_path_factory.mktemp("finished")
    rc, out = _run(root, "--steps", str(STEPS))
    assert rc == 0, out[-4000:]
    return str(root)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("trainer,end", [("bcp", "script"), ("callback", "script"), ("bcp", "sys_exit"),
                                         ("callback", "exception")])
def test_save_at_the_last_step_is_committed(tmp_path, finished, trainer, end):
    """save_steps=4: the Trainer's last save is at the last step, then train() returns and the
    script ends at once."""
    if (trainer, end) == ("bcp", "script"):
        root = finished
    else:
        rc, out = _run(tmp_path, "--steps", str(STEPS), "--trainer", trainer, "--end", end)
        assert rc == (1 if end == "exception" else 0), out[-4000:]
        if end == "exception":
            assert "the training script failed after its last save" in out
        root = str(tmp_path)
    assert _checkpoints(root) == [f"checkpoint-{s}" for s in (4, 8, 12, 16)]
    assert not os.path.exists(os.path.join(root, f"checkpoint-{STEPS}", "model.safetensors"))  # bcp's, not HF's
    assert_holds(os.path.join(root, f"checkpoint-{STEPS}"), os.path.join(root, f"reference_{STEPS}.pt"), STEPS)


def _progress(root, rank) -> tuple[int, int]:
    step, pid = open(os.path.join(root, f"progress_rank{rank}")).read().split()
    return int(step), int(pid)


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("trainer,target", [("bcp", "torchrun"), ("callback", "torchrun"), ("bcp", "one_worker")])
def test_preemption_checkpoints_at_the_step_reached_and_resumes_exactly(tmp_path, finished, trainer, target):
    """SIGTERM mid-run, to torchrun (which forwards it to every worker) or to rank 1 only: both
    ranks stop after one agreed step and save checkpoint-<step> there (holding exactly the
    uninterrupted run's state at that step, RNG included), the workers exit 143;
    `BCPTrainer.train(resume_from_checkpoint=True)` in a relaunch reaches the uninterrupted run's
    final state bit for bit (dropout and the position in the data included)."""
    root = str(tmp_path)
    job = Job(JOB, 2, "--root", root, "--steps", str(STEPS), "--trainer", trainer, "--preemption",
              "--pause-at", "3", env=ENV)
    job.wait_for(os.path.join(root, "progress_rank1"), lambda text: int(text.split()[0]) == 3)
    job.signal_paused(root, 3, signal.SIGTERM, None if target == "torchrun" else _progress(root, 1)[1],
                      receivers=2 if target == "torchrun" else 1)
    rc = job.finish()
    out = job.output
    reached = [_progress(root, r)[0] for r in (0, 1)]
    assert reached[0] == reached[1] and 3 <= reached[0] < STEPS, (reached, out[-4000:])
    step = reached[0]
    assert rc != 0, out[-4000:]  # torchrun fails when signalled itself, or when a worker exits 143
    final = os.path.join(root, f"checkpoint-{step}")
    for rank in (0, 1):
        assert f"bcp: rank {rank}: preempted at step {step}: final checkpoint {final}" in out, out[-4000:]
    # the rank that got no signal leaves "after the preemption request"
    assert out.count("bcp: every save committed; exiting with status 143 after") == 2, out[-4000:]
    assert _checkpoints(root)[-1] == f"checkpoint-{step}"
    assert_holds(final, os.path.join(finished, f"reference_{step}.pt"), step)

    rc, out = _run(root, "--steps", str(STEPS), "--resume")
    assert rc == 0, out[-4000:]
    assert_holds(os.path.join(root, f"checkpoint-{STEPS}"), os.path.join(finished, f"reference_{STEPS}.pt"), STEPS)


@pytest.mark.slow  # the default tier stays under 6 minutes; CI runs both
@pytest.mark.timeout(300)
def test_save_total_limit_rotates_after_the_commit_and_a_failed_save_leaves_the_previous_checkpoint(tmp_path):
    """BCPTrainer, save_steps=4, save_total_limit=1, asynchronous saves.

    1. The last save (checkpoint-16) fails on rank 1 (ENOSPC); the save of checkpoint-12 is slow
       on rank 0, and rank 0 learns of its commit late, after rank 1 has begun checkpoint-16 (its
       directory exists when rank 0 rotates). Throughout, a committed checkpoint exists:
       checkpoint-8 goes only once checkpoint-12 is committed, and checkpoint-12 is not taken for
       an older one. train() raises, naming the save; checkpoint-12 passes `bcp verify` and holds
       step 12's values.
    2. Relaunched with `train(resume_from_checkpoint=True)`: it resumes from checkpoint-12 (the
       failed checkpoint-16 is skipped), trains steps 13 to 16 only, reaching the first run's
       step-16 state bit for bit; in the end only checkpoint-16 is left.
    """
    root = str(tmp_path)
    first = tmp_path / "first_run"  # its reference files: the relaunch writes its own
    args = ("--steps", str(STEPS), "--save-total-limit", "1")

    def watch() -> CommittedWatch:
        return CommittedWatch({"checkpoint-*": lambda: [os.path.join(root, n) for n in _checkpoints(root)]})

    with watch() as watching:
        rc, out = _run(root, *args, env={"BCP_TEST_FAULT": "slow:rank=0:save=3:seconds=1,"
                                                           "slow-commit:rank=0:save=3:seconds=1,write:rank=1:save=4"})
    assert rc != 0, out[-4000:]
    # (torchrun ends the other worker once one has failed: it may not get to print its error)
    assert re.search(rf"\[rank[01]\]: .*SaveError: save to {re.escape(root)}/checkpoint-16 failed and was not "
                     r"committed: .*rank 1.*No space left on device", out), out[-4000:]
    assert watching.violations == []
    assert _checkpoints(root) == ["checkpoint-12", "checkpoint-16"]
    assert not os.path.exists(os.path.join(root, "checkpoint-16", "bcp_metadata.json"))
    assert_holds(os.path.join(root, "checkpoint-12"), os.path.join(root, "reference_12.pt"), 12)
    first.mkdir()
    for path in glob.glob(os.path.join(root, "reference_*.pt")):
        os.rename(path, first / os.path.basename(path))

    with watch() as watching:
        rc, out = _run(root, *args, "--resume", env={"BCP_TEST_FAULT": "slow:rank=0:save=1:seconds=1"})
    assert rc == 0, out[-4000:]
    assert watching.violations == []
    assert sorted(n for n in os.listdir(root) if n.startswith("reference_")) == \
        sorted(f"reference_{s}.pt" for s in range(13, STEPS + 1))  # trained steps 13 to 16 only
    assert _checkpoints(root) == [f"checkpoint-{STEPS}"]
    assert_holds(os.path.join(root, f"checkpoint-{STEPS}"), str(first / f"reference_{STEPS}.pt"), STEPS)
