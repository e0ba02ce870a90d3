"""Durability through Megatron-core: an async `dist_checkpointing.save(..., sharded_strategy=("bcp", 1))`
scheduled on Megatron's AsyncCallsQueue right before the process ends is committed, and SIGTERM
becomes a final checkpoint that a relaunch resumes from exactly.

Every test runs tests/jobs/megatron_train.py (ColumnParallelLinear + RowParallelLinear at TP=2, a
torch Adam saved with Megatron's `optim_state_to_sharding_state`) on 2 ranks under torchrun and
ends it as real jobs end: Megatron-LM's end of training (the queue finalized and closed), or
without finalizing the queue: the script falling off its end, sys.exit, an uncaught exception;
SIGTERM to torchrun. Afterwards `bcp verify` passes and the checkpoint holds, bit for bit, each
rank's shards as they were when the save was called. Finalizing is Megatron's step that writes
`metadata.json` (and, in Megatron-LM, the tracker file); bcp's part commits either way.
"""

from __future__ import annotations

import json
import os
import signal

import pytest
import torch

import bcp_core as bcp
import megatron_releases
from dist import Job, bcp_verify

megatron_releases.skip_without_megatron_core()

STEPS = 8
JOB = "megatron_train.py"
TRACKER = "latest_checkpointed_iteration.txt"


def _path(root, iteration: int) -> str:
    return os.path.join(str(root), f"iter_{iteration:07d}")


def load_checkpoint(path: str) -> dict:
    """Every tensor of the checkpoint, whole, by Megatron key (read without Megatron), and Megatron's
    common state (common.pt up to megatron-core 0.18, a bcp object from 0.19 on)."""
    from bcp_integrations.megatron.strategy import read_common_state
    md = bcp.inspect(path)
    tensors = {key: torch.full(tm.shape, float("nan"), dtype=tm.dtype) for key, tm in md.tensors.items()}
    bcp.load(path, tensors)
    if os.path.exists(os.path.join(path, "common.pt")):
        common = torch.load(os.path.join(path, "common.pt"), weights_only=True)
    else:
        common = read_common_state(path)
    return {"tensors": tensors, "adam_step": common["adam_step"], "iteration": common["iteration"]}


def assert_holds_reference(root, iteration: int) -> dict:
    """The checkpoint of `iteration` passes `bcp verify` and holds each rank's shards as staged."""
    path = _path(root, iteration)
    bcp_verify(path)
    got = load_checkpoint(path)
    assert got["iteration"] == iteration
    covered = set()
    for rank in (0, 1):
        ref = torch.load(os.path.join(str(root), f"reference_{iteration}_rank{rank}.pt"), weights_only=True)
        assert ref.pop("adam_step") == got["adam_step"] == float(iteration)
        for key, (offset, local) in ref.items():
            box = tuple(slice(o, o + n) for o, n in zip(offset, local.shape))
            assert torch.equal(got["tensors"][key][box], local), (rank, key, offset)
            covered.add(key)
    # model and both Adam moments of each parameter, fc1 split on rows and fc2 on columns over TP
    assert covered == set(got["tensors"]) and len(covered) == 12, sorted(got["tensors"])
    return got


def _run(root, *args, release: str = megatron_releases.INSTALLED) -> tuple[int, str]:
    job = Job(JOB, 2, "--root", str(root), *args, env=megatron_releases.env(release))
    return job.finish(timeout=240), job.output


@pytest.mark.timeout(300)
@pytest.mark.parametrize("release", megatron_releases.params())
@pytest.mark.parametrize("end", ["finalize", *(pytest.param(e, marks=pytest.mark.slow)
                                             for e in ("script", "sys_exit", "exception"))])
def test_async_save_on_the_queue_right_before_the_end_is_committed(tmp_path, end, release):
    rc, out = _run(tmp_path, "--steps", str(STEPS), "--end", end, release=release)
    assert rc == (1 if end == "exception" else 0), out[-4000:]
    if end == "exception":
        assert "the training script failed after its last save" in out
    assert_holds_reference(tmp_path, STEPS)
    megatron_metadata = os.path.join(_path(tmp_path, STEPS), "metadata.json")
    if end == "finalize":
        with open(megatron_metadata) as f:
            assert json.load(f)["sharded_backend"] == "bcp"
        assert open(tmp_path / TRACKER).read() == str(STEPS)
    else:
        # Megatron writes metadata.json (and Megatron-LM its tracker) only when the queue is
        # finalized; bcp's checkpoint is committed and complete without them.
        assert not os.path.exists(megatron_metadata)
        assert not os.path.exists(tmp_path / TRACKER)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict:
    """The final state of the job run to the end with no signal."""
    root = tmp_path_factory.mktemp("uninterrupted")
    rc, out = _run(root, "--steps", str(2 * STEPS), "--save-interval", "3")
    assert rc == 0, out[-4000:]
    return load_checkpoint(_path(root, 2 * STEPS))


def _progress(root, rank) -> tuple[int, int]:
    step, pid = open(os.path.join(root, f"progress_rank{rank}")).read().split()
    return int(step), int(pid)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_preemption_checkpoints_at_the_iteration_reached_and_resumes_exactly(tmp_path, uninterrupted):
    """SIGTERM to torchrun mid-run (saves every 3 iterations, one may be in flight): both ranks
    stop at one agreed iteration, that checkpoint is saved unless the interval save just took it,
    the queue is finalized (bcp commit, metadata.json, tracker) and the job exits 143; a relaunch
    loads it with `dist_checkpointing.load` and reaches the uninterrupted run's final weights and
    Adam state bit for bit."""
    root = str(tmp_path)
    job = Job(JOB, 2, "--root", root, "--steps", str(2 * STEPS), "--save-interval", "3", "--preemption",
              "--pause-at", "4")
    job.wait_for(os.path.join(root, "progress_rank1"), lambda text: int(text.split()[0]) == 4)
    job.signal_paused(root, 4, signal.SIGTERM)
    rc = job.finish()
    reached = [_progress(root, r)[0] for r in (0, 1)]
    assert reached[0] == reached[1] and 4 <= reached[0] < 2 * STEPS, (reached, job.output[-4000:])
    assert rc != 0  # torchrun, signalled itself, fails whatever its workers' status (143 here)
    assert open(os.path.join(root, TRACKER)).read() == str(reached[0])
    assert os.path.exists(os.path.join(_path(root, reached[0]), "metadata.json"))
    assert_holds_reference(root, reached[0])
    for it in range(3, reached[0], 3):  # the interval saves before it, committed and finalized
        bcp_verify(_path(root, it))
        assert os.path.exists(os.path.join(_path(root, it), "metadata.json"))

    rc, out = _run(root, "--steps", str(2 * STEPS), "--save-interval", "3", "--resume")
    assert rc == 0, out[-4000:]
    final = load_checkpoint(_path(root, 2 * STEPS))
    assert final["adam_step"] == uninterrupted["adam_step"] == float(2 * STEPS)
    assert final["tensors"].keys() == uninterrupted["tensors"].keys()
    for key, want in uninterrupted["tensors"].items():
        assert torch.equal(want, final["tensors"][key]), key
