"""A save that was asked for is committed before the process ends, or the process fails naming it.

Every test runs a real 2-rank job under torchrun (tests/jobs/plain_train.py) that ends the way
jobs end: falling off the end of the script right after an asynchronous save, sys.exit, an
uncaught exception, destroying the process group first, a rank vanishing, a storage fault in the
background write, SIGTERM (preemption) to torchrun or to one worker. Afterwards `bcp verify`
passes and the checkpoint loads bit-identically, or the exit status is non-zero and the output
names the checkpoint and the rank.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import threading

import pytest
import torch
from torch import nn

import bcp_core as bcp
from dist import Job, bcp_verify

STEPS = 8


def _fresh():
    torch.manual_seed(123)  # different from the job's values: a load that does nothing shows
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    model(torch.zeros(1, 32)).sum().backward()
    optim.step()  # creates the optimizer state the checkpoint's values go into
    return model, optim


def load_job_state(path: str) -> dict:
    """The job's checkpoint at `path` loaded into a fresh single-process model and optimizer."""
    model, optim = _fresh()
    state = {"model": model, "optimizer": optim, "extra_state": {}, "bulk": {}}
    bcp.load(path, state)
    return {"model": model.state_dict(), "optimizer": optim.state_dict()["state"], "step": state["extra_state"]["step"],
            "bulk": state["bulk"]["t"]}


def assert_holds_reference(root: str, step: int) -> None:
    """The checkpoint of `step` passes `bcp verify` and holds, bit for bit, what the job had then."""
    path = os.path.join(root, f"step_{step:08d}")
    bcp_verify(path)
    got = load_job_state(path)
    ref = torch.load(os.path.join(root, f"reference_{step}.pt"), weights_only=True)
    assert got["step"] == step
    assert ref["model"].keys() == got["model"].keys()
    for k, v in ref["model"].items():
        assert torch.equal(v, got["model"][k]), k
    for i, s in ref["optimizer"]["state"].items():
        for name, v in s.items():
            assert torch.equal(v, got["optimizer"][i][name]), (i, name)
    mib = got["bulk"].numel() * 4 // 2**20
    assert torch.equal(got["bulk"], torch.arange(mib * 2**18, dtype=torch.float32).reshape(-1, 1024))


def _run(root, *args, env=None) -> tuple[int, str]:
    job = Job("plain_train.py", 2, "--root", str(root), "--steps", str(STEPS), *args, env=env)
    return job.finish(), job.output


@pytest.mark.parametrize("end", ["script", pytest.param("sys_exit", marks=pytest.mark.slow), "exception",
                                 pytest.param("destroy", marks=pytest.mark.slow)])
def test_async_save_right_before_the_end_is_committed(tmp_path, end, request):
    if end == "script":  # the uninterrupted job: its script falls off the end after its last save
        root, steps = request.getfixturevalue("uninterrupted")["root"], 2 * STEPS
    else:
        rc, out = _run(tmp_path, "--end", end)
        assert rc == (1 if end == "exception" else 0), out[-4000:]
        if end == "exception":
            assert "the training script failed after its last save" in out
        root, steps = str(tmp_path), STEPS
    assert open(os.path.join(root, "latest")).read() == f"step_{steps:08d}"
    assert_holds_reference(root, steps)


def test_write_failing_at_exit_makes_the_job_fail_naming_the_checkpoint(tmp_path):
    rc, out = _run(tmp_path, "--fail-write")
    assert rc != 0, out[-4000:]
    path = os.path.join(str(tmp_path), f"step_{STEPS:08d}")
    for rank in (0, 1):
        assert re.search(rf"bcp: rank {rank} exits with status 1: the asynchronous save to {re.escape(path)} "
                         r"was not committed: .*No space left on device", out), out[-4000:]
    assert not os.path.exists(os.path.join(path, "bcp_metadata.json"))
    assert not os.path.exists(tmp_path / "latest")
    with pytest.raises(bcp.IncompleteCheckpointError):
        bcp.inspect(path)


def test_rank_vanishing_after_the_save_call_fails_the_others_naming_it(tmp_path):
    rc, out = _run(tmp_path, "--die-rank", "1", "--timeout", "3")
    assert rc != 0, out[-4000:]
    path = os.path.join(str(tmp_path), f"step_{STEPS:08d}")
    assert re.search(rf"bcp: rank 0 exits with status 1: the asynchronous save to {re.escape(path)} was not "
                     r"committed: .*waited 0:00:03 for rank\(s\) \[1\] that never arrived", out), out[-4000:]
    assert not os.path.exists(os.path.join(path, "bcp_metadata.json"))


def _final_state(root: str) -> dict:
    return load_job_state(os.path.join(root, f"step_{2 * STEPS:08d}"))


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict:
    """The final state of the job run to the end with no signal."""
    root = tmp_path_factory.mktemp("uninterrupted")
    rc, out = _run(root, "--steps", str(2 * STEPS))
    assert rc == 0, out[-4000:]
    return {**_final_state(str(root)), "root": str(root)}


def _progress(root, rank) -> tuple[int, int]:
    step, pid = open(os.path.join(root, f"progress_rank{rank}")).read().split()
    return int(step), int(pid)


@pytest.mark.parametrize("target", ["torchrun", pytest.param("one_worker", marks=pytest.mark.slow)])
def test_preemption_checkpoints_at_the_step_reached_and_resumes_exactly(tmp_path, uninterrupted, target):
    """SIGTERM mid-run (to torchrun, which forwards it to every worker, or to rank 1 only): every
    rank stops at one agreed step, that checkpoint commits, the workers exit 143, and a relaunch
    from it reaches the same final weights as the uninterrupted run."""
    root = str(tmp_path)
    job = Job("plain_train.py", 2, "--root", root, "--steps", str(2 * STEPS), "--preemption", "--pause-at", "3")
    job.wait_for(os.path.join(root, "progress_rank1"), lambda text: int(text.split()[0]) == 3)
    job.signal_paused(root, 3, signal.SIGTERM, None if target == "torchrun" else _progress(root, 1)[1],
                      receivers=2 if target == "torchrun" else 1)
    rc = job.finish()
    reached = [_progress(root, r)[0] for r in (0, 1)]
    assert reached[0] == reached[1] and 3 <= reached[0] < 2 * STEPS, (reached, job.output[-4000:])
    assert open(os.path.join(root, "latest")).read() == f"step_{reached[0]:08d}"
    assert_holds_reference(root, reached[0])
    if target == "one_worker":  # torchrun reports a worker's exit code when it was not signalled itself
        assert rc != 0
        assert "exitcode  : 143" in job.output, job.output[-4000:]

    rc, out = _run(root, "--steps", str(2 * STEPS), "--resume")
    assert rc == 0, out[-4000:]
    final = _final_state(root)
    for k, v in uninterrupted["model"].items():
        assert torch.equal(v, final["model"][k]), k
    for i, s in uninterrupted["optimizer"].items():
        for name, v in s.items():
            assert torch.equal(v, final["optimizer"][i][name]), (i, name)


class _PlainLockHandler(logging.Handler):
    """A logging handler serialised by a plain (non-reentrant) lock, as a QueueHandler's queue.Queue
    is; it receives SIGTERM while it holds the lock, as a process may at any moment."""

    def __init__(self):
        super().__init__()
        self.plain, self.stuck, self.messages = threading.Lock(), False, []

    def emit(self, record):
        if not self.plain.acquire(timeout=2):  # a QueueHandler would wait here for ever
            self.stuck = True
            return
        try:
            self.messages.append(record.getMessage())
            if record.getMessage() == "about to be preempted":
                os.kill(os.getpid(), signal.SIGTERM)
                sum(range(1000))  # Python runs the signal handler between these bytecodes
        finally:
            self.plain.release()


def test_the_preemption_handler_takes_no_lock_the_interrupted_code_may_hold():
    """The SIGTERM handler records the signal and writes a line to the standard error's descriptor;
    the loop's next stop_requested() logs it. Before, the handler logged: a signal arriving while the
    main thread held a logging handler's lock deadlocked (here: the handler's emit found its own lock
    taken)."""
    log, handler = logging.getLogger("bcp"), _PlainLockHandler()
    log.addHandler(handler)
    level = log.level
    log.setLevel(logging.INFO)
    preemption = bcp.handle_preemption()
    try:
        log.warning("about to be preempted")
        assert preemption.signum == signal.SIGTERM and not handler.stuck
        assert handler.messages == ["about to be preempted"]
        assert preemption.stop_requested()
        assert any("this rank received SIGTERM" in m for m in handler.messages[1:]), handler.messages
    finally:
        preemption.close()
        log.removeHandler(handler)
        log.setLevel(level)
