"""Lazy snapshots: an async save holds the values of its call, whatever training does right after.

For DDP, FSDP2, TP and FSDP1 states on 2 gloo ranks, each case takes a synchronous save (the
reference: it writes the live state as of the call), then an asynchronous one, then at once
changes the state the way training does: an optimizer step, an in-place edit inside
`bcp.mutating()`, gradient accumulation with `zero_grad(set_to_none=True)`, a second save, a step
given a closure (as Lightning calls it). The two checkpoints must be bit-identical.

For the first case the race is forced, not left to timing: the background copy threads wait at a
gate that a probe optimizer pre-hook (registered before bcp's guard) opens, so the step always
arrives while nothing has been copied yet, and only bcp's guard stands between it and the saved
values.
"""

from __future__ import annotations

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


def _gate_background_copies(staging) -> threading.Event:
    """Copies made off the main thread (the copy thread, the writer) wait until the gate opens;
    the main thread's finishers (the step guard, `mutating()`) copy at once."""
    gate = threading.Event()
    gate.set()
    copy_all = staging.LazyCopy._copy_all

    def gated(self):
        if threading.current_thread() is not threading.main_thread():
            assert gate.wait(60), "the copy gate was never opened"
        copy_all(self)
    staging.LazyCopy._copy_all = gated
    return gate


def _cases(rank, world_size, root):
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    from bcp_core import staging
    gate = _gate_background_copies(staging)
    in_flight: list[bool] = []

    def probe(*_):
        in_flight.append(bool(staging._IN_FLIGHT))
        gate.set()
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

        def pair(name, then):
            """Reference (sync) save, async save, `then()` at once; the checkpoints must be equal."""
            bcp.save(f"{base}/{name}_ref", state).wait()
            h = bcp.save(f"{base}/{name}", state, async_save=True)
            then()
            h.wait()
            differ[name] = _same_checkpoints(f"{base}/{name}", f"{base}/{name}_ref")

        # 1. the optimizer steps right after the call (gradients are there from the last step),
        #    while no copy has been made: the background copies wait for the step to begin
        steps_before = len(in_flight)
        gate.clear()
        pair("step", lambda: (big_optim.step(), optim.step()))
        out[f"{layout}_in_flight_at_step"] = in_flight[steps_before]

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
        # the race the guard is for did happen: the step began with the copies still to make
        assert all(r[f"{layout}_in_flight_at_step"] for layout in LAYOUTS), r
