"""SIGKILL a rank at points of a save: the previous checkpoint stays intact and current.

Kill points: while staging (async), while writing data, before fsync, after the metadata was
written but before the tracker, and while the tracker is written; sync and async saves. After
each kill the root still loads, bit-exact, the last checkpoint whose save returned, and the
killed save is recognisable as incomplete.
"""

from __future__ import annotations

import os
import re
import signal
from datetime import timedelta

import pytest
import torch

import bcp_core as bcp
from dist import run_ranks

POINTS = ["stage", "write", "fsync", "metadata", "tracker"]


def _state(rank, step):
    torch.manual_seed(step)
    # every rank writes something: its own per-rank tensor
    return {"w": torch.randn(64, 8), "extra_state": {"step": step, "rank": rank, "t": torch.full((4,), rank + step)}}


def _save_then_die(rank, world_size, root, point, async_save, victim):
    from bcp_core import staging
    from bcp_core.storage.faults import Fault, inject

    bcp.save(root, _state(rank, 1), step=1).wait()

    def die(*a, **k):
        os.kill(os.getpid(), signal.SIGKILL)

    if rank == victim:
        if point == "stage":
            staging.StagingPool.acquire = die
        else:
            inject({"write": Fault("write", hook=die),       # while writing a data file
                    "fsync": Fault("close", hook=die),       # before a data file is made durable
                    # while the metadata is being committed
                    "metadata": Fault("write_atomic", hook=die, path="*/bcp_metadata.json"),
                    # metadata committed, tracker not yet written
                    "tracker": Fault("write_atomic", hook=die, path="*/latest")}[point])
    # The survivor waits for the dead rank until the test's launcher kills it: a timeout of its own
    # could end the save before a slow victim reached its point of death.
    h = bcp.save(root, _state(rank, 2), step=2, async_save=async_save, timeout=timedelta(seconds=60))
    h.wait()
    return "survived"


CASES = [(point, async_save) for point in POINTS for async_save in (False, True) if async_save or point != "stage"]


@pytest.fixture(scope="module")
def killed_jobs(tmp_path_factory) -> dict:
    """Every case's job, all at once (each mostly waits for its dead rank): case -> (root, error)."""
    from concurrent.futures import ThreadPoolExecutor

    base = tmp_path_factory.mktemp("crash")

    def run(case):
        point, async_save = case
        root = str(base / f"{point}_{'async' if async_save else 'sync'}")
        os.makedirs(root)
        victim = 0 if point in ("metadata", "tracker") else 1  # only the coordinator commits
        try:
            run_ranks(2, _save_then_die, root, point, async_save, victim, timeout=120)
        except (RuntimeError, AssertionError) as e:
            return root, e
        return root, None
    with ThreadPoolExecutor(len(CASES)) as pool:
        return dict(zip(CASES, pool.map(run, CASES)))


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("point", POINTS)
def test_kill_during_save_leaves_previous_checkpoint_current(killed_jobs, point, async_save):
    if point == "stage" and not async_save:
        pytest.skip("synchronous saves do not stage")
    root, error = killed_jobs[(point, async_save)]
    assert error is not None and re.search("died|SaveError", str(error)), error
    out = {"w": torch.empty(64, 8), "extra_state": {}}
    result = bcp.load(root, out)
    if point == "tracker":
        # step 2 committed its metadata but the tracker still names step 1: the tracker is the
        # commit point of "latest", so step 1 stays current and step 2 is complete but unreferenced
        assert result.path.endswith("step_00000001")
        assert bcp.inspect(os.path.join(root, "step_00000002")).world_size == 2
    else:
        assert result.path.endswith("step_00000001")
        with pytest.raises(bcp.IncompleteCheckpointError):
            bcp.load(os.path.join(root, "step_00000002"), {"w": torch.empty(64, 8)})
    assert torch.equal(out["w"], _state(0, 1)["w"])
    assert out["extra_state"]["step"] == 1 and torch.equal(out["extra_state"]["t"], torch.full((4,), 1))
    assert open(os.path.join(root, "latest")).read() == "step_00000001"
