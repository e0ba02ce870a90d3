"""Asynchronous saves: values as of the call, plan cache, prepare_save, error propagation, flat memory, roles."""

from __future__ import annotations

import copy
import os
import time

import pytest
import torch

import bcp_core as bcp
from bcp_core import checkpointer as ckp
from bcp_core.comm import comm_for, save_tag
from dist import run_ranks
from layouts import assert_same, build, full_state, train


class Opaque:
    """A value bcp cannot save without pickle."""



def _saves_while_training(model, optim, path, role, wait_each=False, **save_kw):
    """Three async saves, training mutating the parameters in place right after each call.
    Returns the state as of each call and the handles."""
    snapshots, handles = [], []
    for k in range(3):
        snapshots.append(copy.deepcopy(full_state(model, optim)))
        handles.append(bcp.save(path, {"model": model, "optimizer": optim}, step=k, async_save=True, role=role,
                                **save_kw))
        train(model, optim, range(k + 1, k + 2))  # mutates in place while the save writes
        if wait_each:
            handles[-1].wait()
    return snapshots, handles


def _assert_each_holds_its_call(handles, snapshots, rank, what):
    """Each checkpoint holds the state as of its own save call (compared on rank 0, after every load:
    the loads are collective, and a rank that raised early would leave the other waiting in one)."""
    differ = []
    for k, h in enumerate(handles):
        h.wait()
        fresh, fresh_opt = build("fsdp2", seed=99)
        bcp.load(h.path, {"model": fresh, "optimizer": fresh_opt})
        loaded = full_state(fresh, fresh_opt)
        if rank == 0:
            try:
                assert_same(snapshots[k], loaded, f"{what} {k}")
            except AssertionError as e:
                differ.append(str(e))
    assert not differ, differ


def _async_scenarios(rank, world_size, root):
    out = {}
    model, optim = build("fsdp2")
    train(model, optim, range(1))
    cp = ckp.get_checkpointer("async-test")

    # 1. Three back-to-back async saves while training mutates the parameters right after each
    #    call: every checkpoint holds the values of its own call (ping-pong staging, FIFO commits).
    snapshots, handles = _saves_while_training(model, optim, os.path.join(root, "a"), "async-test")
    _assert_each_holds_its_call(handles, snapshots, rank, "async save")

    # 2. Plan cache: the first save planned, the next two reused its plan (no rank learned another).
    #    A call finds the plan in its cache (a hit: it stages only its own boxes) only if the previous
    #    save's planning, in the background, has ended by then: back to back, that is up to the
    #    scheduler (tests/reliability/test_save_protocol.py makes a call come first on purpose). Once
    #    the saves were waited for, the next call hits, and its save needs no planning collective.
    out["plans"] = cp.stats["plans"]
    out["hits_back_to_back"] = hits = cp.stats["cache_hits"]
    comm = comm_for(None, save_tag("async-test"))
    before = comm.collectives
    bcp.save(os.path.join(root, "a"), {"model": model, "optimizer": optim}, step=10, role="async-test").wait()
    out["collectives_cached_save"] = comm.collectives - before
    out["hits_after_wait"] = cp.stats["cache_hits"] - hits
    out["plans_cached_save"] = cp.stats["plans"]
    # a structural change (a new key) invalidates the cached plan
    bcp.save(os.path.join(root, "a"), {"model": model, "optimizer": optim, "extra": {"x": 1}}, step=11,
             role="async-test").wait()
    out["plans_after_change"] = cp.stats["plans"]

    # 3. A write failure on rank 1: wait() raises on every rank, nothing is committed, the next
    #    save goes through.
    from bcp_core.storage.faults import Fault, inject
    full_disk = inject(Fault("write", error=OSError(28, "No space left on device"))) if rank == 1 else None
    h = bcp.save(os.path.join(root, "b"), {"model": model}, step=1, async_save=True, role="async-test")
    with pytest.raises(bcp.SaveError, match=r"rank 1: .*\[Errno 28\] No space left on device"):
        h.wait()
    assert not os.path.exists(os.path.join(root, "b", "step_00000001", "bcp_metadata.json"))
    # not waited on: surfaces at the next save of the role
    h = bcp.save(os.path.join(root, "b"), {"model": model}, step=2, async_save=True, role="async-test")
    while not h.done():
        time.sleep(0.01)
    if full_disk is not None:
        full_disk.remove()
    # raised once the next save is under way (here a synchronous one, which commits): every rank
    # takes part in every save, so no rank skips one and pairs its messages with another's
    with pytest.raises(bcp.PreviousSaveError, match="an earlier asynchronous save .* failed"):
        bcp.save(os.path.join(root, "b"), {"model": model}, step=3, role="async-test")
    assert os.path.exists(os.path.join(root, "b", "step_00000003", "bcp_metadata.json"))
    committed = []
    bcp.save(os.path.join(root, "b"), {"model": model}, step=4, role="async-test",
             on_commit=committed.append).wait()
    assert committed == [os.path.join(root, "b", "step_00000004")]
    assert open(os.path.join(root, "b", "latest")).read() == "step_00000004"

    # 4. prepare_save: planned ahead, buffers touched in the background; the first save then
    #    performs no planning collective and copies into those buffers, with the values of its call.
    prep = ckp.get_checkpointer("prepare-test")
    state = {"model": model, "optimizer": optim}
    bcp.prepare_save(state, role="prepare-test").result()
    out["prepared_plans"] = prep.stats["plans"]
    warmed = [b.data_ptr() for b in prep.snapshots.pool._slots[0]]
    comm = comm_for(None, save_tag("prepare-test"))
    before = comm.collectives
    snapshots, handles = [copy.deepcopy(full_state(model, optim))], [
        bcp.save(os.path.join(root, "p"), state, step=0, async_save=True, role="prepare-test")]
    train(model, optim, range(5, 6))
    _assert_each_holds_its_call(handles, snapshots, rank, "prepared save")
    out["prepared_first_save"] = {"plans": prep.stats["plans"], "collectives": comm.collectives - before,
                                  "same_buffers": [b.data_ptr() for b in prep.snapshots.pool._slots[0]] == warmed}
    # a planning error on one rank fails prepare_save on every rank, naming it
    bad = {"x": Opaque()} if rank == 1 else {"x": [1, 2]}
    with pytest.raises(bcp.SaveError, match=r"prepare_save \(role 'prepare-test'\) planned nothing: rank 1: "
                                            r"UnsupportedValueError"):
        bcp.prepare_save(bad, role="prepare-test")
    return out


def test_async_saves_plan_cache_and_errors(tmp_path):
    results = run_ranks(2, _async_scenarios, str(tmp_path))
    for r in results:
        assert r["plans"] == 1 and r["hits_back_to_back"] <= 2  # 3 saves of one structure: 1 plan
        # a save called after the others ended hits; one agreement round (every rank names the cached
        # plan: "use it") + the commit round
        assert r["hits_after_wait"] == 1 and r["plans_cached_save"] == 1
        assert r["collectives_cached_save"] == 4
        assert r["plans_after_change"] == 2
        assert r["prepared_plans"] == 1
        assert r["prepared_first_save"] == {"plans": 1, "collectives": 4, "same_buffers": True}


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_host_memory_stays_flat_over_20_async_saves(tmp_path):
    """A leak of one copy per save would add 32 MiB each time; growth stays well below one copy."""
    state = {"w": torch.randn(8 << 20)}  # 32 MiB
    rss = []
    for k in range(20):
        state["w"].add_(1)
        bcp.save(str(tmp_path), state, step=k, async_save=True, role="mem").wait()
        rss.append(_rss_bytes())
    cp = ckp.get_checkpointer("mem")
    assert cp.snapshots.pool.nbytes() <= 2 * (32 << 20)
    assert rss[-1] - rss[3] < 16 << 20, [r >> 20 for r in rss]
    out = {"w": torch.empty(8 << 20)}
    bcp.load(str(tmp_path), out)
    assert torch.equal(out["w"], state["w"])


def test_roles_are_independent(tmp_path):
    actor = {"w": torch.ones(1000)}
    critic = {"w": torch.zeros(10), "v": torch.arange(3)}
    h1 = bcp.save(str(tmp_path / "actor"), actor, step=1, async_save=True, role="actor")
    h2 = bcp.save(str(tmp_path / "critic"), critic, step=1, async_save=True, role="critic")
    actor["w"].mul_(5)  # after the call: not in the checkpoint
    h1.wait(), h2.wait()
    a, c = ckp.get_checkpointer("actor"), ckp.get_checkpointer("critic")
    assert a is not c and a.rounds._plans.keys().isdisjoint(c.rounds._plans.keys())
    out = {"w": torch.empty(1000)}
    bcp.load(str(tmp_path / "actor"), out)
    assert torch.equal(out["w"], torch.ones(1000))
    with pytest.raises(bcp.BCPError, match="role must be a non-empty string"):
        bcp.save(str(tmp_path / "x"), actor, role="")


def _fork_scenarios(rank, world_size, root):
    out = {}
    model, optim = build("fsdp2")
    train(model, optim, range(1))
    cp = ckp.get_checkpointer("fork-test")
    # Saves of one structure: the first forks (cold staging buffers), the next ones copy into the
    # buffers the first one warmed in the background. Training mutates right after every call.
    # Waiting for each save lets the next one find the warmed buffers.
    snapshots, handles = _saves_while_training(model, optim, os.path.join(root, "f"), "fork-test", wait_each=True,
                                               snapshot="fork")
    out["forked"] = [any(r["phase"] == "snapshot" for r in h.metrics) for h in handles]
    _assert_each_holds_its_call(handles, snapshots, rank, "fork-snapshot save")
    phases = {r["phase"] for r in handles[0].metrics}
    out["child_phases"] = sorted(phases & {"write", "checksum", "fsync"})
    out["pool_bytes"] = cp.snapshots.pool.nbytes()

    # A snapshot process that dies: the save fails on every rank, nothing is committed, and the
    # next save goes through.
    import signal

    import bcp_core.fork_snapshot as mod
    real = mod._snapshot_child

    def dying(write, r_in, w_out):  # only the step-1 save forks while this is in place
        if rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        return real(write, r_in, w_out)
    mod._snapshot_child = dying
    try:
        h = bcp.save(os.path.join(root, "g"), {"model": model, "extra": {"n": 1}}, step=1, async_save=True,
                     role="fork-test", snapshot="fork")
        with pytest.raises(bcp.SaveError, match="rank 1: SaveError: the snapshot process ended without writing its "
                                                "pieces \\(killed by signal 9\\)"):
            h.wait()
    finally:
        mod._snapshot_child = real
    assert not os.path.exists(os.path.join(root, "g", "step_00000001", "bcp_metadata.json"))
    bcp.save(os.path.join(root, "g"), {"model": model, "extra": {"n": 2}}, step=2, async_save=True,
             role="fork-test", snapshot="fork").wait()
    return out


def test_fork_snapshot_holds_the_values_of_the_call(tmp_path):
    results = run_ranks(2, _fork_scenarios, str(tmp_path))
    for r in results:
        assert r["forked"] == [True, False, False]  # then the warmed staging buffers
        assert r["child_phases"] == ["checksum", "fsync", "write"]  # the child's phases are reported
        assert r["pool_bytes"] > 0
    with pytest.raises(ValueError, match="snapshot must be one of 'lazy', 'copy', 'fork'"):
        bcp.save(str(tmp_path / "x"), {"w": torch.ones(2)}, async_save=True, snapshot="cow")
