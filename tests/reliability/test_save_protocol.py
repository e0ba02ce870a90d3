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
import json
import os
import threading
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

    # 9. A save into a directory holding a committed checkpoint (the same step saved again, a path
    #    saved twice) leaves it whole and loadable until its own commit replaces it: a save failing
    #    on one rank, sync or async, leaves it as it was. One that commits replaces it, and the
    #    replaced checkpoint's files go (written by another role here: another token).
    root = os.path.join(base, "again")
    bcp.save(root, _state(rank, 1), step=1, role="again-first")
    plain = os.path.join(base, "again-plain")
    bcp.save(plain, _state(rank, 1), role="again-first")
    first_files = sorted(os.listdir(os.path.join(root, "step_00000001", "data")))
    for path, step in ((root, 1), (plain, None)):
        for faulty, async_save in ((1, False), (0, True)):
            with inject(Fault("write", error=OSError(errno.EIO, "Input/output error"))) if rank == faulty \
                    else _nothing():
                with pytest.raises(bcp.SaveError, match=f"rank {faulty}"):
                    bcp.save(path, _state(rank, 9), step=step, role="again", async_save=async_save).wait()
    out["again_failed"] = _assert_each_step_whole(root)
    target = {"a": torch.zeros(4), "b": torch.zeros(3)}
    bcp.load(plain, target, strict=False)
    out["again_plain_failed"] = [target["a"][0].item(), target["b"][0].item()]
    bcp.save(root, _state(rank, 9), step=1, role="again")
    target = {"a": torch.zeros(4), "b": torch.zeros(3)}
    bcp.load(root, target, strict=False)
    out["again_replaced"] = [target["a"][0].item(), target["b"][0].item()]
    dist.barrier()  # the coordinator removes the replaced files after the commit
    data = sorted(os.listdir(os.path.join(root, "step_00000001", "data")))
    listed = sorted(f.split("/", 1)[1] for f in bcp.inspect(os.path.join(root, "step_00000001")).files)
    out["again_files"] = (data == listed, set(first_files) & set(data))
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
        assert r["again_failed"] == [1] and r["again_plain_failed"] == [1.0, 1.0]
        assert r["again_replaced"] == [9.0, 9.0] and r["again_files"] == (True, set())
    assert results[0]["early_cached"] == 1 and results[1]["early_cached"] == 0  # the race really happened
    assert [r["early_plans"] for r in results] == [1, 1]  # rank 1 got the one plan again: not a second plan


# ----------------------------------------------------------------------------- one process

def test_a_staging_slot_is_freed_only_by_the_save_that_took_it(tmp_path, monkeypatch):
    """Async saves of two structures by one role, on slow storage: the end of an earlier save never
    frees the staging slot a later save still writes from, so each step holds its own call's values
    (the later save used to copy into that slot, silently: the checksums matched its bytes)."""
    from bcp_core import checkpointer, staging
    gates = {1: threading.Event(), 3: threading.Event()}  # saves 1 and 3 write slowly
    write = checkpointer.Checkpointer._write

    def slow_write(self, comm, request, progress):
        gate = gates.get(request.save.number)
        if gate is not None:
            assert gate.wait(60)
        return write(self, comm, request, progress)
    acquire = staging.StagingPool.acquire
    asked = []

    def acquire_then_end_save_1(pool, key, sources):
        got = acquire(pool, key, sources)
        asked.append(key)
        if len(asked) == 3:  # save 1 ends once save 3 has asked for a slot
            gates[1].set()
        return got
    monkeypatch.setattr(checkpointer.Checkpointer, "_write", slow_write)
    monkeypatch.setattr(staging.StagingPool, "acquire", acquire_then_end_save_1)
    full, small = {"w": torch.zeros(1024)}, {"v": torch.zeros(8)}  # e.g. a training and an evaluation save

    def save(state, step):
        for t in state.values():
            t.fill_(step)
        return bcp.save(tmp_path, state, step=step, async_save=True, snapshot="copy", role="slots")
    h1, h2, h3 = save(full, 1), save(small, 2), save(full, 3)
    h1.wait(60), h2.wait(60)
    h4 = save(full, 4)  # save 3 still writes
    pool = checkpointer.get_checkpointer("slots").snapshots.pool
    assert pool.nbytes() <= 2 * full["w"].nbytes  # two sets of buffers at most, whatever the structures
    gates[3].set()
    h3.wait(60), h4.wait(60)
    for step, state in ((1, full), (2, small), (3, full), (4, full)):
        target = {k: torch.empty_like(v) for k, v in state.items()}
        bcp.load(tmp_path / f"step_{step:08d}", target)
        assert all(torch.equal(t, torch.full_like(t, step)) for t in target.values()), (step, target)


def test_staging_slots_in_use_stay_theirs_whatever_the_key():
    """A slot in use is never handed out again, and never forgotten, when another key comes (a save
    or `prepare_save` of another structure) or when a release comes late; the pool holds two slots at most."""
    from bcp_core.staging import StagingPool
    pool = StagingPool()
    one, other = ("one", ((0, 0),)), ("other", ((0, 0),))
    first_lease, first = pool.acquire(one, [torch.ones(4)])
    pool.warm_up(other, [torch.ones(8)])  # buffers for another structure, meanwhile
    second_lease, second = pool.acquire(one, [torch.ones(4)])
    assert second[0] is not first[0]
    assert pool.acquire(other, [torch.ones(8)]) is None  # two slots in use: a third save waits
    pool.release(one, first_lease)
    pool.release(one, first_lease)  # a second release of the same acquisition changes nothing
    third_lease, third = pool.acquire(one, [torch.ones(4)])
    assert third[0] is not second[0]  # the second save still writes from its slot
    assert pool.acquire(one, [torch.ones(4)]) is None
    pool.release(one, second_lease)
    pool.release(one, third_lease)
    assert pool.nbytes() <= 2 * 16


def test_user_metadata_is_taken_at_the_call(tmp_path, monkeypatch):
    """An async save commits `user_metadata` as it was at the call, though the caller changes nested
    values afterwards; a value the metadata (JSON) cannot hold fails the save naming its key."""
    from bcp_core import checkpointer
    gate = threading.Event()
    write = checkpointer.Checkpointer._write

    def slow_write(*args):
        assert gate.wait(60)  # training goes on before the background write
        return write(*args)
    monkeypatch.setattr(checkpointer.Checkpointer, "_write", slow_write)
    losses = [1.0]
    handle = bcp.save(tmp_path, {"w": torch.ones(4)}, step=1, async_save=True, role="user-metadata",
                      user_metadata={"losses": losses, "run": {"seed": 3}})
    losses.append(2.0)  # the next training step
    gate.set()
    handle.wait(60)
    with open(tmp_path / "step_00000001" / "bcp_metadata.json") as f:
        assert json.load(f)["user"] == {"losses": [1.0], "run": {"seed": 3}}
    with pytest.raises(bcp.SaveError, match=r"user_metadata\['lr'\] cannot be saved"):
        bcp.save(tmp_path, {"w": torch.ones(4)}, step=2, role="user-metadata",
                 user_metadata={"run": {"seed": 3}, "lr": torch.tensor(0.1)})
    assert not (tmp_path / "step_00000002" / "bcp_metadata.json").exists()


def _commit_waits(rank, world_size, base):
    """Rank 1 gives up waiting for the commit answer while rank 0 is still writing (1), or while it is
    committing (2). Only rank 1, the rank that gives up, has a short timeout, and it starts its
    clocks once rank 0 is in the exchange (docs/reliability.md, "Injecting faults")."""
    from bcp_core import checkpointer, save_rounds
    from bcp_core.comm import Comm
    events = os.path.join(base, "{}_{}")  # what happened, and to which save

    def save(step, timeout=timedelta(seconds=120)):
        dist.barrier()
        committed = []

        def on_commit(path):
            committed.append(path)
            mark(events.format("committed", step))
        handle = bcp.save(base, _state(rank, step), step=step, async_save=True, role="commit-wait", timeout=timeout,
                          on_commit=on_commit)
        if rank == 1:  # tell rank 0 once this rank gave up, or its save ended (without the fix, it never says)
            while not handle.done() and not os.path.exists(events.format("gave_up", step)):
                time.sleep(0.01)
            mark(events.format("gave_up", step))
        try:
            handle.wait(120)
            return "committed" if committed else "no on_commit"
        except bcp.BCPError as e:
            return f"{type(e).__name__}: {e}"

    agree = save_rounds.SaveRounds.agree

    def agree_together(self, comm, request, progress, op, **kwargs):
        if comm.rank == 0:
            mark(events.format("planning", request.save.number))
        else:
            wait_for_file(events.format("planning", request.save.number))
        return agree(self, comm, request, progress, op, **kwargs)
    settle = Comm.settle

    def settle_and_say(self, op, outcome):
        held = settle(self, op, outcome)
        number = op.split("/")[0][1:]
        if self.rank == 1:
            mark(events.format("gave_up", number))
            if held.startswith(save_rounds.COMMIT):  # its answer comes: here once rank 0 sent it
                wait_for_file(events.format("committed", number))
        return held
    write = checkpointer.Checkpointer._write

    def write_after_rank_1_gave_up(self, comm, request, progress):
        if comm.rank == 0:
            wait_for_file(events.format("gave_up", request.save.number))
        return write(self, comm, request, progress)
    committed_metadata = save_rounds._committed_metadata  # the commit's first step after settling

    def commit_after_rank_1_gave_up(ckpt):
        wait_for_file(events.format("gave_up", 2))
        return committed_metadata(ckpt)

    out = {}
    short = timedelta(seconds=2 if rank == 1 else 120)  # rank 1 waits twice this for the answer
    with _patched(save_rounds.SaveRounds, "agree", lambda _: agree_together), \
            _patched(Comm, "settle", lambda _: settle_and_say):
        # 1. Rank 0 writes its pieces after rank 1 gave up: the save fails on both ranks, nothing is
        #    committed (rank 0 used to commit it, while rank 1 raised).
        with _patched(checkpointer.Checkpointer, "_write", lambda _: write_after_rank_1_gave_up):
            out["gave_up_first"] = save(1, short)
        dist.barrier()
        out["committed_after_1"] = _committed_steps(base)
        # 2. Rank 0 began committing before rank 1 gave up: rank 1 waits for the answer, and the
        #    save is committed on both ranks (rank 1 used to raise).
        with _patched(save_rounds, "_committed_metadata", lambda _: commit_after_rank_1_gave_up):
            out["commit_first"] = save(2, short)
    out["last"] = save(3)  # the next save is undisturbed
    dist.barrier()
    out["committed"] = _assert_each_step_whole(base)
    return out


def test_a_rank_giving_up_on_the_commit_and_the_commit_exclude_each_other(tmp_path):
    results = run_ranks(2, _commit_waits, str(tmp_path), timeout=120)
    for r in results:
        assert r["gave_up_first"].startswith("SaveError: ") and "was not committed" in r["gave_up_first"], r
        assert r["committed_after_1"] == []
        assert r["commit_first"] == "committed" and r["last"] == "committed", r
        assert r["committed"] == [2, 3]
    assert "rank 1 gave up waiting for the commit" in results[0]["gave_up_first"]
