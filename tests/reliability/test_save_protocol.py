"""One save, one identity: faults on one rank only never make ranks pair one save's messages with
another's, never commit a checkpoint mixed from two steps, and never report success for a save that
was not committed (issue 22, items 1, 2 and 10).

Every scenario runs in one 2-rank launch. Rank 0 holds tensor "a", rank 1 tensor "b" (a layout
where each rank writes its own tensor, as with Megatron's per-rank state): a checkpoint mixed from
two saves shows as "a" and "b" holding the values of different steps. After each scenario every
committed step of the root is loaded and must hold one step's values.
"""

from __future__ import annotations

import errno
import os
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import bcp_core as bcp
from dist import mark, run_ranks, wait_for_file


def _state(rank: int, step: int, extra: bool = False) -> dict:
    """What each rank saves at `step`: its own tensor, valued after the step."""
    state = {"a": torch.full((4,), float(step))} if rank == 0 else {"b": torch.full((3,), float(step))}
    if extra:
        state["c"] = torch.full((2,), float(step))  # a structure change on this rank only
    return state


def _committed_steps(root: str) -> list[int]:
    return sorted(int(n[5:]) for n in os.listdir(root)
                  if n.startswith("step_") and os.path.exists(os.path.join(root, n, "bcp_metadata.json")))


def _assert_each_step_whole(root: str) -> list[int]:
    """Every committed step loads, and both ranks' tensors hold that step's values."""
    steps = _committed_steps(root)
    for step in steps:
        target = {"a": torch.zeros(4), "b": torch.zeros(3)}
        bcp.load(os.path.join(root, f"step_{step:08d}"), target, strict=False)
        assert torch.equal(target["a"], torch.full((4,), float(step))), (root, step, target)
        assert torch.equal(target["b"], torch.full((3,), float(step))), (root, step, target)
    if steps:  # and the root's latest is the newest committed step
        target = {"a": torch.zeros(4), "b": torch.zeros(3)}
        bcp.load(root, target, strict=False)
        assert torch.equal(target["a"], torch.full((4,), float(steps[-1])))
    return steps


def _patched(obj, name, replacement):
    """Context manager: obj.name = replacement(original) for the block."""
    import contextlib

    @contextlib.contextmanager
    def cm():
        original = getattr(obj, name)
        setattr(obj, name, replacement(original))
        try:
            yield
        finally:
            setattr(obj, name, original)
    return cm()


def _scenarios(rank, world_size, base):
    from bcp_core import checkpointer, save_planner, save_rounds
    from bcp_core.storage.faults import Fault, inject
    out = {}

    # 1. Saves with different timeouts, asynchronous and back to back: each commits its own step.
    #    (When a Comm was kept per timeout, the third save under the second timeout met the second
    #    save's stale report under a reused key and committed rank 1's step 2 as step 5.)
    root = os.path.join(base, "timeouts")
    for step in range(1, 6):
        h = bcp.save(root, _state(rank, step), step=step, async_save=True, role="timeouts",
                     timeout=timedelta(seconds=120 + (step > 2)))
    h.wait()
    out["timeouts"] = _assert_each_step_whole(root)

    # 2. A background write error on rank 1 only, the handle waited for on rank 0 only: the save
    #    fails on both ranks, later saves commit their own steps.
    root = os.path.join(base, "write_error")
    bcp.save(root, _state(rank, 1), step=1, async_save=True, role="write-error").wait()

    if rank == 1:
        with inject(Fault("write", error=OSError(errno.ENOSPC, "No space left on device"), path="*/step_00000002/*")):
            h2 = bcp.save(root, _state(rank, 2), step=2, async_save=True, role="write-error")
            while not h2.done():
                time.sleep(0.01)
    else:
        h2 = bcp.save(root, _state(rank, 2), step=2, async_save=True, role="write-error")
        with pytest.raises(bcp.SaveError, match=r"rank 1: .*No space left on device"):
            h2.wait()
    # rank 1 never waited: its next save raises the failure once under way; rank 0's does not
    if rank == 1:
        with pytest.raises(bcp.PreviousSaveError, match="step_00000002") as info:
            bcp.save(root, _state(rank, 3), step=3, async_save=True, role="write-error")
        h3 = info.value.handle
    else:
        h3 = bcp.save(root, _state(rank, 3), step=3, async_save=True, role="write-error")
    h3.wait()
    bcp.save(root, _state(rank, 4), step=4, role="write-error")
    out["write_error"] = _assert_each_step_whole(root)

    # 3. on_commit raises on rank 1 only: the checkpoint is committed on both ranks, rank 1's
    #    wait() says so, and no later save raises it again or drifts.
    root = os.path.join(base, "on_commit")

    def on_commit(path):
        if rank == 1:
            raise RuntimeError("evaluation launcher down")
    h = bcp.save(root, _state(rank, 1), step=1, async_save=True, role="on-commit", on_commit=on_commit)
    if rank == 1:
        with pytest.raises(bcp.CommitCallbackError, match="was committed, but on_commit raised on rank 1"):
            h.wait()
    else:
        h.wait()
    for step in (2, 3):
        h = bcp.save(root, _state(rank, step), step=step, async_save=True, role="on-commit")
    h.wait()
    out["on_commit"] = _assert_each_step_whole(root)

    # 4. An error inside the save call on rank 1 only (EIO creating the step directory): the save
    #    fails on both ranks, naming rank 1 (rank 1 does not report success), the previous step
    #    stays latest; the next save commits.
    for mode in ("sync", "async"):
        root = os.path.join(base, f"call_error_{mode}")
        bcp.save(root, _state(rank, 1), step=1, role=f"call-error-{mode}")

        eio = Fault("makedirs", error=OSError(errno.EIO, "Input/output error"), path="*/step_00000002*")
        with inject(eio) if rank == 1 else _nothing():
            with pytest.raises(bcp.SaveError, match=r"rank 1: OSError: \[Errno 5\] Input/output error"):
                h = bcp.save(root, _state(rank, 2), step=2, async_save=mode == "async", role=f"call-error-{mode}")
                h.wait()
        assert open(os.path.join(root, "latest")).read() == "step_00000001"
        bcp.save(root, _state(rank, 3), step=3, async_save=mode == "async", role=f"call-error-{mode}").wait()
        out[f"call_error_{mode}"] = _assert_each_step_whole(root)

    # 5. The structure changes on rank 1 only (a key appears), between asynchronous saves that
    #    reuse a cached plan on rank 0: the ranks agree to plan again, within what rank 0 staged.
    root = os.path.join(base, "structure")
    for step in (1, 2):
        bcp.save(root, _state(rank, step), step=step, async_save=True, role="structure").wait()
    h = bcp.save(root, _state(rank, 3, extra=rank == 1), step=3, async_save=True, role="structure")
    h.wait()
    bcp.save(root, _state(rank, 4, extra=rank == 1), step=4, async_save=True, role="structure").wait()
    out["structure"] = _assert_each_step_whole(root)
    target = {"c": torch.zeros(2)}
    bcp.load(os.path.join(root, "step_00000004"), target)
    out["structure_c"] = target["c"].tolist()
    # ... and when the rank that keeps its structure writes nothing under the cached plan (its one
    # tensor is replicated, and rank 0 writes it): it staged nothing, so the new plan leaves that
    # tensor to rank 0, though rank 1 writes fewer bytes.
    root = os.path.join(base, "nothing-staged")
    for step in (1, 2, 3):
        state = {"r": torch.full((4,), float(step))}
        if rank == 0 and step == 3:
            state["c"] = torch.ones(2)
        bcp.save(root, state, step=step, async_save=True, role="nothing-staged").wait()
    target = {"r": torch.zeros(4), "c": torch.zeros(2)}
    bcp.load(os.path.join(root, "step_00000003"), target)
    out["nothing_staged"] = (_committed_steps(root), target["r"].tolist(), target["c"].tolist())

    # 6. A second asynchronous save issued before the first one's planning ended: rank 1 does not
    #    hold the plan yet when it stages, rank 0 does. Both commit. The coordinator's planning waits
    #    until rank 1 has made its second call, so the race happens however fast each rank runs.
    root = os.path.join(base, "early")
    called = os.path.join(base, "early_second_call_made")

    def plan_after_second_call(original):
        def plan(*args, **kwargs):
            wait_for_file(called)
            return original(*args, **kwargs)
        return plan
    with _patched(save_planner, "global_save_plan", plan_after_second_call), \
            _patched(save_rounds, "global_save_plan", plan_after_second_call):
        h1 = bcp.save(root, _state(rank, 1), step=1, async_save=True, role="early")
        if rank == 0:
            h1.wait()  # the coordinator holds the plan when it calls the second save
        h2 = bcp.save(root, _state(rank, 2), step=2, async_save=True, role="early")
        out["early_cached"] = checkpointer.get_checkpointer("early").stats["cache_hits"]
        if rank == 1:
            mark(called)
        h2.wait()
        out["early_plans"] = checkpointer.get_checkpointer("early").stats["plans"]
    out["early"] = _assert_each_step_whole(root)

    # 7. Ranks asked to save different steps (a bug in the caller's loop): refused on both ranks,
    #    naming both identities; nothing is committed.
    root = os.path.join(base, "steps")
    with pytest.raises(bcp.SaveError, match=r"rank 1 is at save #1 \(step 8\).* rank 0 is at save #1 \(step 7\)"):
        bcp.save(root, _state(rank, 7), step=7 + rank, role="steps")
    out["steps"] = _committed_steps(root)

    # 8. keep=2 rotates only after the newer checkpoint committed: a failed save deletes nothing.
    root = os.path.join(base, "keep")
    for step in (1, 2, 3):
        bcp.save(root, _state(rank, step), step=step, role="keep", keep=2)
    dist.barrier()  # rank 0 rotates after the commit: the other rank may return before it did
    out["keep_rotated"] = _committed_steps(root)
    with inject(Fault("write", error=OSError(errno.EIO, "Input/output error"))) if rank == 1 else _nothing():
        with pytest.raises(bcp.SaveError, match="rank 1"):
            bcp.save(root, _state(rank, 4), step=4, role="keep", keep=2)
    out["keep"] = _assert_each_step_whole(root)
    return out


def _nothing():
    import contextlib
    return contextlib.nullcontext()


def test_faults_on_one_rank_never_mix_or_lose_saves(tmp_path):
    results = run_ranks(2, _scenarios, str(tmp_path), timeout=240)
    for r in results:
        assert r["timeouts"] == [1, 2, 3, 4, 5]
        assert r["write_error"] == [1, 3, 4]
        assert r["on_commit"] == [1, 2, 3]
        assert r["call_error_sync"] == [1, 3] and r["call_error_async"] == [1, 3]
        assert r["structure"] == [1, 2, 3, 4] and r["structure_c"] == [4.0, 4.0]
        assert r["nothing_staged"] == ([1, 2, 3], [3.0] * 4, [1.0, 1.0])
        assert r["early"] == [1, 2]
        assert r["steps"] == []
        assert r["keep_rotated"] == [2, 3] and r["keep"] == [2, 3]
    assert results[0]["early_cached"] == 1 and results[1]["early_cached"] == 0  # the race really happened
    assert [r["early_plans"] for r in results] == [1, 1]  # rank 1 got the one plan again: not a second plan
