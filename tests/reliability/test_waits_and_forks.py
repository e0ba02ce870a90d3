"""Every wait is bounded, and forked children inherit nothing (issue 22, items 11 and 12).

A stalled storage (an NFS server gone away) must fail the save within its timeout instead of
blocking training or the end of the process; a process forked while a save is in flight (a
DataLoader worker, a multiprocessing.Process) must neither wait for the parent's saves at its
exit nor see its lazy copies or preemption handler.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import subprocess
import sys
import textwrap
import threading
from datetime import timedelta

import pytest
import torch

import bcp_core as bcp
from bcp_core.storage import faults

SHORT = timedelta(seconds=1)


class StalledWrites:
    """Writes of tensor bytes (not the small file headers) block until released: a storage that
    stopped answering while the writer holds a piece."""

    def __init__(self, min_bytes: int = 1024):
        self.min_bytes = min_bytes
        self.release = threading.Event()
        self.entered = threading.Event()
        self._injection = None

    def _stall(self, call: faults.Call) -> None:
        if call.nbytes >= self.min_bytes:
            self.entered.set()
            self.release.wait(60)

    def __enter__(self):
        self._injection = faults.inject(faults.Fault("write", hook=self._stall))
        return self

    def __exit__(self, *exc):
        self.release.set()
        self._injection.remove()


def _model():
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(2, 64)).sum().backward()
    return model, opt


def test_a_stalled_live_write_does_not_block_the_optimizer_step(tmp_path):
    model, opt = _model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with StalledWrites() as stall:
        handle = bcp.save(tmp_path / "ck", {"model": model, "optimizer": opt}, async_save=True,
                          role="stall-step", timeout=SHORT)
        assert stall.entered.wait(30)  # the writer holds a parameter straight from the live state
        opt.step()                      # waits at most the timeout, then goes on
        assert not torch.equal(model.weight, before["weight"])
    with pytest.raises(bcp.SaveError, match="bcp step pre-hook: rank 0 waited 1 s"):
        handle.wait(60)
    assert not (tmp_path / "ck" / "bcp_metadata.json").exists()
    # the next save is clean and holds the values of its call
    bcp.save(tmp_path / "ck2", {"model": model}, role="stall-step").wait()
    fresh = torch.nn.Linear(64, 64)
    bcp.load(tmp_path / "ck2", {"model": fresh})
    assert torch.equal(fresh.weight, model.weight)


def test_a_stalled_fork_snapshot_is_killed_within_the_timeout(tmp_path):
    state = {"w": torch.arange(1 << 16, dtype=torch.float32)}
    with StalledWrites():  # inherited by the forked child: it never finishes writing
        handle = bcp.save(tmp_path / "ck", state, async_save=True, snapshot="fork", role="stall-fork",
                          timeout=SHORT)
        with pytest.raises(bcp.SaveError, match="bcp fork snapshot: rank 0 waited 1 s .* killed it"):
            handle.wait(60)
    assert not (tmp_path / "ck" / "bcp_metadata.json").exists()


def test_waiting_for_staging_buffers_is_bounded(tmp_path):
    state = {"w": torch.ones(1024)}
    with StalledWrites():
        first = [bcp.save(tmp_path / f"ck{i}", state, async_save=True, snapshot="copy", role="stall-slots",
                          timeout=SHORT) for i in range(2)]  # both staging slots held by stalled writes
        third = bcp.save(tmp_path / "ck2", state, async_save=True, snapshot="copy", role="stall-slots",
                         timeout=SHORT)  # its staging gave up after the timeout; it fails once its turn comes
    with pytest.raises(bcp.SaveError, match="bcp staging: rank 0 waited 0:00:01"):
        third.wait(60)
    for h in first:
        h.wait(60)  # released: they commit


def test_a_save_stalled_at_exit_ends_the_process_naming_it(tmp_path):
    script = textwrap.dedent(f"""
        import sys, time, torch
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        import bcp_core as bcp
        from datetime import timedelta
        from test_waits_and_forks import StalledWrites
        StalledWrites().__enter__()
        bcp.save({str(tmp_path / "ck")!r}, {{"w": torch.ones(4096)}}, async_save=True, timeout=timedelta(seconds=1))
        print("script ends", flush=True)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, (proc.stdout, proc.stderr)
    assert "script ends" in proc.stdout
    assert "bcp exit: rank 0 waited 0:00:03" in proc.stderr and "still writing" in proc.stderr, proc.stderr


def _child_exits(code: int = 0) -> None:
    sys.exit(code)


def _child_steps(model, opt) -> None:
    opt.step()  # the parent's lazy copy is not this process's: no wait
    sys.exit(0)


def _child_handler() -> None:
    # the handler that was there before bcp's (the default one) is back: SIGTERM ends the child
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    os.kill(os.getpid(), signal.SIGTERM)


def test_forked_children_inherit_no_saves_waits_or_handlers(tmp_path):
    fork = mp.get_context("fork")
    model, opt = _model()
    preemption = bcp.handle_preemption()
    try:
        with StalledWrites() as stall:
            handle = bcp.save(tmp_path / "ck", {"model": model, "optimizer": opt}, async_save=True,
                              role="fork-safety")
            assert stall.entered.wait(30)
            # a plain forked process ends at once: it does not wait for the parent's save at its exit
            children = [fork.Process(target=_child_exits), fork.Process(target=_child_steps, args=(model, opt)),
                        fork.Process(target=_child_handler)]
            for p in children:
                p.start()
            for p in children:
                p.join(30)
            codes = [p.exitcode for p in children]
            for p in children:
                if p.is_alive():
                    p.kill()
            assert codes == [0, 0, -signal.SIGTERM], codes
            # DataLoader workers (forked) shut down by themselves, none terminated by the loader
            loader = torch.utils.data.DataLoader(list(range(8)), batch_size=2, num_workers=2,
                                                 multiprocessing_context=fork)
            it = iter(loader)
            workers = list(it._workers)
            assert sum(len(b) for b in it) == 8
            del it
            for w in workers:
                w.join(30)
            assert [w.exitcode for w in workers] == [0, 0]
        handle.wait(60)  # the parent's save itself is untouched: it commits
        fresh = torch.nn.Linear(64, 64)
        bcp.load(tmp_path / "ck", {"model": fresh})
    finally:
        preemption.close()
