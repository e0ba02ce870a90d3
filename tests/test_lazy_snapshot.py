"""Lazy snapshots: an async save holds the values of its call, whatever training does right after.

For DDP, FSDP2, TP and FSDP1 states on 2 gloo ranks, each case takes a synchronous save (the
reference: it writes the live state as of the call), then an asynchronous one, then at once
changes the state the way training does: an optimizer step, an in-place edit inside
`bcp.mutating()`, gradient accumulation with `zero_grad(set_to_none=True)`, a second save, a step
given a closure (as Lightning calls it). The two checkpoints must be bit-identical.

The races are forced, not left to timing: the save's background threads wait at gates that a
probe optimizer pre-hook (registered before bcp's guard) opens. So one step arrives while nothing
has been copied or written yet, another while the writer is writing a piece straight from a live
tensor; only bcp's guard stands between them and the saved values. A save during which no step
comes copies nothing: the writer takes the stepped tensors from the state itself.
"""

from __future__ import annotations

import contextlib
import threading

import torch
import torch.nn.functional as F
from torch import nn

import bcp_core as bcp
from dist import run_ranks
from layouts import VOCAB, batch, build, train

LAYOUTS = ["ddp", "fsdp2", "tp", "fsdp1"]


def _build(layout: str):
    if layout != "fsdp1":
        return build(layout)
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    from layouts import Net
    torch.manual_seed(0)
    model = FSDP(Net(), device_id=torch.device("cpu"), use_orig_params=False)
    return model, torch.optim.Adam(model.parameters(), lr=1e-2, foreach=False)


def _loss(model, step: int):
    x = batch(step)
    return F.cross_entropy(model(x[:, :-1]).reshape(-1, VOCAB), x[:, 1:].reshape(-1))


def _checkpoint_tensors(path: str) -> dict:
    """Every tensor of a checkpoint, read as plain tensors in this process."""
    from bcp_core.tools import read_tensor
    st = bcp.resolve(path)
    md = bcp.inspect(path)
    return {fqn: read_tensor(st, md, fqn) for fqn in md.tensors}


def _same_checkpoints(a: str, b: str) -> list[str]:
    ta, tb = _checkpoint_tensors(a), _checkpoint_tensors(b)
    assert ta.keys() == tb.keys(), (sorted(ta), sorted(tb))
    return [k for k in ta if not torch.equal(ta[k], tb[k])]


class Gates:
    """Hold the save's background threads at chosen points; the main thread (the step guard,
    `mutating()`) is never held. `copy`: the copy thread; `hold`: the writer before it asks for a
    piece; `live`: the writer while it writes a piece from a live source (`live_entered` is set
    then). A probe optimizer pre-hook, registered before bcp's guard, opens all of them."""

    def __init__(self, staging):
        self.copy, self.hold, self.live, self.live_entered = (threading.Event() for _ in range(4))
        for g in (self.copy, self.hold, self.live):
            g.set()
        copy_all, hold = staging.LazyCopy._copy_all, staging.LazyCopy.hold
        gates = self

        def gated_copy_all(lazy, *args):
            gates.wait(gates.copy)
            copy_all(lazy, *args)

        @contextlib.contextmanager
        def gated_hold(lazy, buf):
            gates.wait(gates.hold)
            with hold(lazy, buf) as t:
                if t is not buf:  # a live source: the step must wait until this write ends
                    gates.live_entered.set()
                    gates.wait(gates.live)
                yield t
        staging.LazyCopy._copy_all, staging.LazyCopy.hold = gated_copy_all, gated_hold

    @staticmethod
    def wait(gate: threading.Event) -> None:
        if threading.current_thread() is not threading.main_thread():
            assert gate.wait(60), "a gate was never opened"

    def open(self) -> None:
        for g in (self.copy, self.hold, self.live):
            g.set()


def _copied_bytes(h) -> int:
    """Bytes the save copied into staging after its call (its "snapshot" phase)."""
    return sum(r["bytes"] for r in h.metrics if r.get("phase") == "snapshot")


def _cases(rank, world_size, root):
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    from bcp_core import staging
    gates = Gates(staging)
    in_flight: list[bool] = []

    def probe(*_):
        in_flight.append(bool(staging._IN_FLIGHT))
        gates.open()
    # registered before bcp's guard (bcp registers it at its first lazy save), so it runs first
    register_optimizer_step_pre_hook(probe)
    out = {}
    for layout in LAYOUTS:
        model, optim = _build(layout)
        # a second module and optimizer of some bulk, stepped alongside
        big = nn.Linear(1024, 1024)
        big_optim = torch.optim.Adam(big.parameters(), lr=1e-3)
        train(model, optim, range(1))
        big(torch.randn(4, 1024)).sum().backward()
        big_optim.step()
        state = {"model": model, "optimizer": optim, "big": big, "big_optimizer": big_optim}
        base = f"{root}/{layout}"
        differ = {}
        handles = {}

        def pair(name, then):
            """Reference (sync) save, async save, `then()` at once; the checkpoints must be equal."""
            bcp.save(f"{base}/{name}_ref", state).wait()
            h = handles[name] = bcp.save(f"{base}/{name}", state, async_save=True)
            then()
            h.wait()
            differ[name] = _same_checkpoints(f"{base}/{name}", f"{base}/{name}_ref")

        # 0. no step during the save: the writer takes every stepped tensor from the live state,
        #    nothing is copied (fresh staging memory stays untouched)
        pair("no_step", lambda: None)
        out[f"{layout}_copied_without_step"] = _copied_bytes(handles["no_step"])

        # 1. the optimizer steps right after the call (gradients are there from the last step),
        #    while nothing has been copied or written: the guard copies everything first
        steps_before = len(in_flight)
        gates.copy.clear()
        gates.hold.clear()
        pair("step", lambda: (big_optim.step(), optim.step()))
        out[f"{layout}_in_flight_at_step"] = in_flight[steps_before]
        out[f"{layout}_copied_at_step"] = _copied_bytes(handles["step"])

        # 1b. the step arrives while the writer is writing a piece straight from a live tensor:
        #     the step waits for that write, the guard copies the rest
        def step_during_live_write():
            assert gates.live_entered.wait(60), "the writer never wrote from a live tensor"
            big_optim.step()
            optim.step()
        gates.copy.clear()
        gates.live.clear()
        gates.live_entered.clear()
        steps_before = len(in_flight)
        pair("live", step_during_live_write)
        out[f"{layout}_in_flight_at_live_step"] = in_flight[steps_before]

        # 2. in-place edits outside a step, inside bcp.mutating()
        def edit():
            with bcp.mutating(), torch.no_grad():
                for p in list(model.parameters()) + list(big.parameters()):
                    p.mul_(0.5)
        pair("mutating", edit)

        # 3. gradient accumulation over two micro-batches, zero_grad(set_to_none), then a step
        def accumulate():
            optim.zero_grad(set_to_none=True)
            for s in (3, 4):
                _loss(model, s).backward()
            optim.step()
        pair("accumulate", accumulate)

        # 4. a second save while the first copies, then a step; then a save right after a step
        bcp.save(f"{base}/second_ref", state).wait()
        h1 = bcp.save(f"{base}/second_a", state, async_save=True)
        h2 = bcp.save(f"{base}/second_b", state, async_save=True)
        train(model, optim, range(5, 6))
        h3 = bcp.save(f"{base}/third", state, async_save=True)
        bcp.save(f"{base}/third_ref", state).wait()  # after the queued saves: the state as of h3's call
        train(model, optim, range(6, 7))
        for h in (h1, h2, h3):
            h.wait()
        differ["second_a"] = _same_checkpoints(f"{base}/second_a", f"{base}/second_ref")
        differ["second_b"] = _same_checkpoints(f"{base}/second_b", f"{base}/second_ref")
        differ["third"] = _same_checkpoints(f"{base}/third", f"{base}/third_ref")

        # 5. a step given a closure that runs forward and backward (Lightning's way)
        def closure_step():
            def closure():
                optim.zero_grad()
                loss = _loss(model, 7)
                loss.backward()
                return loss
            optim.step(closure)
        pair("closure", closure_step)
        out[f"{layout}_differ"] = {k: v for k, v in differ.items() if v}
    return out


def test_async_saves_hold_the_values_of_their_call_whatever_training_does_next(tmp_path):
    results = run_ranks(2, _cases, str(tmp_path), timeout=400)
    for r in results:
        for layout in LAYOUTS:
            assert r[f"{layout}_differ"] == {}, (layout, r[f"{layout}_differ"])
        for layout in LAYOUTS:
            # the races the guard is for did happen: the step began with the copies still to
            # make, or with a write from a live tensor in progress
            assert r[f"{layout}_in_flight_at_step"] and r[f"{layout}_in_flight_at_live_step"], r
            assert r[f"{layout}_copied_without_step"] == 0, r  # written straight from the state
            assert r[f"{layout}_copied_at_step"] > 0, r
