"""Save in every layout, load into every layout: model + Adam + extra state bit-identical.

Layouts: 1-process plain, 2-rank DDP, 2-rank FSDP2, 2-rank TP, 4-rank 2-D FSDP2 x TP, 3-rank
uneven FSDP2 (and 4-rank FSDP2 for the loss check). For the pairs in LOSS_PAIRS, training
continues after the load with exactly the losses of the same layout resumed from the saved
state through PyTorch's own state_dict path, and within float tolerance of the saving layout's
uninterrupted run.
"""

from __future__ import annotations

import os

import pytest
import torch

from dist import run_ranks
from layouts import LAYOUTS, assert_same, build, full_state, set_full_state, train

SAVE_LAYOUTS = ["plain", "ddp", "fsdp2", "tp", "fsdp2_tp", "fsdp2_3", "fsdp2_4"]
LOAD_LAYOUTS = ["plain", "ddp", "fsdp2", "tp", "fsdp2_tp", "fsdp2_3"]
LOSS_PAIRS = {("ddp", "fsdp2"), ("fsdp2_4", "plain"), ("tp", "fsdp2_3")}
TRAIN_STEPS, MORE_STEPS = 2, 3


def _save_worker(rank, world_size, root, layouts):
    import bcp_core as bcp
    out = {}
    for layout in layouts:
        model, optim = build(layout)
        train(model, optim, range(TRAIN_STEPS))
        extra = {"step": TRAIN_STEPS, "rank": rank, "rng": torch.get_rng_state()}
        bcp.save(os.path.join(root, layout), {"model": model, "optimizer": optim, "extra_state": extra}).wait()
        ref = full_state(model, optim)
        if rank == 0:
            torch.save(ref, os.path.join(root, f"{layout}.ref.pt"))
        out[layout] = train(model, optim, range(TRAIN_STEPS, TRAIN_STEPS + MORE_STEPS))
    return out


def _load_worker(rank, world_size, root, layouts, sources, uninterrupted):
    import bcp_core as bcp
    for layout in layouts:
        for src in sources:
            ref = torch.load(os.path.join(root, f"{src}.ref.pt"), weights_only=True)
            model, optim = build(layout, seed=123)  # different initial values
            extra: dict = {}
            bcp.load(os.path.join(root, src), {"model": model, "optimizer": optim, "extra_state": extra})
            loaded = full_state(model, optim)  # gathered from every rank onto rank 0 (cpu_offload)
            if rank == 0:
                assert_same(ref, loaded, f"{src}->{layout}")
            assert extra["step"] == TRAIN_STEPS
            assert extra["rank"] == (rank if rank < LAYOUTS[src] else 0), extra["rank"]
            if (src, layout) in LOSS_PAIRS:
                resumed = train(model, optim, range(TRAIN_STEPS, TRAIN_STEPS + MORE_STEPS))
                model2, optim2 = build(layout, seed=7)
                set_full_state(model2, optim2, ref)
                reference = train(model2, optim2, range(TRAIN_STEPS, TRAIN_STEPS + MORE_STEPS))
                assert resumed == reference, f"{src}->{layout}: {resumed} != {reference}"
                assert resumed == pytest.approx(uninterrupted[src], rel=1e-4), (resumed, uninterrupted[src])
    return True


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("matrix"))
    losses = {}
    by_ws: dict[int, list[str]] = {}
    for layout in SAVE_LAYOUTS:
        by_ws.setdefault(LAYOUTS[layout], []).append(layout)
    for ws, layouts in sorted(by_ws.items()):
        losses.update(run_ranks(ws, _save_worker, root, layouts)[0])
    return root, losses


@pytest.mark.parametrize("world_size", sorted({LAYOUTS[name] for name in LOAD_LAYOUTS}))
def test_load_every_layout(saved, world_size):
    root, losses = saved
    layouts = [name for name in LOAD_LAYOUTS if LAYOUTS[name] == world_size]
    run_ranks(world_size, _load_worker, root, layouts, SAVE_LAYOUTS, losses)


def test_single_process_load_without_process_group(saved):
    """A multi-rank checkpoint loads into a plain model with no process group at all."""
    import bcp_core as bcp
    from layouts import Net
    root, _ = saved
    ref = torch.load(os.path.join(root, "fsdp2_tp.ref.pt"), weights_only=True)
    model = Net()
    bcp.load(os.path.join(root, "fsdp2_tp"), {"model": model})
    assert_same(ref["model"], model.state_dict())


def test_one_optimizer_over_modules_with_the_same_parameter_names_is_refused(tmp_path):
    """Optimizer state is keyed by parameter FQN, relative to the parameter's module in the state: two
    modules with a `weight` each under one optimizer would have one's state saved over the other's,
    and loaded into the wrong one. Save and load refuse it, naming the FQN, and the load changes
    nothing."""
    import bcp_core as bcp
    from torch import nn

    def trained(opt_of_both: bool):
        torch.manual_seed(0)
        enc, dec = nn.Linear(3, 3), nn.Linear(3, 3)
        opt = torch.optim.Adam([*enc.parameters(), *dec.parameters()] if opt_of_both else enc.parameters())
        dec(enc(torch.ones(2, 3))).sum().backward()
        opt.step()
        return enc, dec, opt

    enc, dec, opt = trained(opt_of_both=True)
    with pytest.raises(bcp.BCPError, match="both named 'weight'"):
        bcp.save(tmp_path / "both", {"enc": enc, "dec": dec, "optimizer": opt})
    # a checkpoint whose optimizer held only enc's parameters, loaded where it holds both
    enc1, dec1, opt1 = trained(opt_of_both=False)
    bcp.save(tmp_path / "enc_only", {"enc": enc1, "dec": dec1, "optimizer": opt1})
    before = {id(p): {k: v.clone() for k, v in st.items()} for p, st in opt.state.items()}
    with pytest.raises(bcp.BCPError, match="both named 'weight'"):
        bcp.load(tmp_path / "enc_only", {"enc": enc, "dec": dec, "optimizer": opt})
    for p, st in opt.state.items():
        assert all(torch.equal(v, before[id(p)][k]) for k, v in st.items())
