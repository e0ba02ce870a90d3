"""FSDP1 (FullyShardedDataParallel) checkpoints: decomposed flat shards, any layout in and out.

Each FSDP1 configuration (sharding strategy, use_orig_params, nesting, frozen and tied parameters,
several param groups, parameters outside the optimizer, an optimizer with no state yet) trains on
2 ranks and saves with bcp. Every checkpoint is then loaded into FSDP1 on 3 ranks with another
strategy, into FSDP2 on 2 ranks, into a plain model on 1 process and back into the same FSDP1
layout; model and Adam state must equal, bit for bit, what PyTorch's own full state dict of the
saving model holds, and training continued after the load must give the uninterrupted run's
losses (exactly when the layout is the same). DDP and FSDP2 checkpoints load into FSDP1 the same
way. A counter wrapped around torch.distributed shows that an FSDP1 save issues no tensor
collective on model or optimizer data, while FSDP1's own state_dict() does.

Process spawns are shared: one 2-rank spawn saves everything, one spawn per target world size
loads everything.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dist import run_ranks
from layouts import DIM, VOCAB, Net, assert_same, batch

TRAIN_STEPS, MORE_STEPS = 2, 3


class TiedNet(Net):
    """Net with the output head tied to the embedding, plus a persistent and a transient buffer."""

    def __init__(self):
        super().__init__()
        self.head.weight = self.emb.weight
        self.register_buffer("scale", torch.linspace(0.5, 1.5, DIM))
        self.register_buffer("scratch", torch.zeros(3), persistent=False)

    def forward(self, x):
        return super().forward(x) * self.scale.sum() / DIM


@dataclass(frozen=True)
class Case:
    """An FSDP1 configuration saved on `ranks` ranks, and the FSDP1 layout it is loaded into on 3."""

    strategy: str = "FULL_SHARD"
    orig_params: bool = False
    nested: tuple[str, ...] = ("w1",)           # submodules wrapped as their own FSDP units
    tied: bool = False
    frozen: tuple[str, ...] = ()                # parameters with requires_grad=False
    groups: tuple[tuple[str, float], ...] = ()  # (FQN prefix, lr) for groups after the default one
    excluded: tuple[str, ...] = ()              # FQN prefixes left out of the optimizer
    train_steps: int = TRAIN_STEPS
    to3: tuple[str, bool] = ("FULL_SHARD", False)  # strategy, use_orig_params on 3 ranks
    targets: tuple[str, ...] = ("fsdp1_3", "fsdp2", "plain")
    mesh: tuple[int, ...] = field(default=())   # HYBRID_SHARD: (replicate, shard)
    ranks: int = 2                              # world size of the saving run


CASES = {
    # use_orig_params=False: the optimizer holds FlatParameters; one group per FSDP unit
    "full": Case(groups=(("w1.", 5e-3),), to3=("SHARD_GRAD_OP", True)),
    # use_orig_params=True: frozen parameters, parameters outside the optimizer, two groups. (A whole
    # unit is left out: PyTorch's get_state_dict, which makes the reference, refuses a unit whose
    # trainable parameters are only partly in the optimizer.)
    "orig": Case(orig_params=True, nested=("w1", "w2"), frozen=("w1.bias", "norm.weight"),
                 groups=(("head.", 5e-3),), excluded=("w2.",), to3=("FULL_SHARD", True)),
    "grad_op": Case(strategy="SHARD_GRAD_OP", nested=(), to3=("FULL_SHARD", False)),
    # 2-D on 4 ranks: two replicas of a 2-way sharding; the replicas' identical boxes are written once
    "hybrid": Case(strategy="HYBRID_SHARD", orig_params=True, mesh=(2, 2), ranks=4, to3=("FULL_SHARD", False)),
    "tied": Case(tied=True, nested=("w2",), to3=("FULL_SHARD", True)),
    # unsharded: original parameters (and their state) keep their shapes
    "no_shard": Case(strategy="NO_SHARD", orig_params=True, to3=("FULL_SHARD", False), targets=("fsdp1_3",)),
    # the optimizer has never stepped: no state is saved and none may be created by saving
    "fresh": Case(orig_params=True, train_steps=0, to3=("SHARD_GRAD_OP", False)),
}
# DDP and FSDP2 checkpoints loaded into FSDP1: (source layout, FSDP1 strategy, use_orig_params, ranks)
REVERSE = {"ddp": [("FULL_SHARD", False, 2), ("SHARD_GRAD_OP", True, 3)],
           "fsdp2": [("FULL_SHARD", True, 2), ("FULL_SHARD", False, 3)]}
PLAIN_CASE = Case()


# ----------------------------------------------------------------------------- building

def _strategy(name):
    from torch.distributed.fsdp import ShardingStrategy
    return getattr(ShardingStrategy, name)


def build(case: Case, layout: str, seed: int = 0, strategy: str | None = None, orig: bool | None = None):
    """The case's model in `layout` (fsdp1 / fsdp2 / ddp / plain) and its Adam optimizer."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = TiedNet() if case.tied else Net()
    for name in case.frozen:
        model.get_parameter(name).requires_grad_(False)
    ws = dist.get_world_size() if dist.is_initialized() else 1
    if layout.startswith("fsdp1"):
        strategy = strategy or case.strategy
        orig = case.orig_params if orig is None else orig
        kw = dict(device_id=torch.device("cpu"), use_orig_params=orig, sharding_strategy=_strategy(strategy))
        if strategy == "HYBRID_SHARD":
            kw["device_mesh"] = init_device_mesh("cpu", case.mesh, mesh_dim_names=("replicate", "shard"))
        for sub in case.nested:
            setattr(model, sub, FSDP(getattr(model, sub), **kw))
        model = FSDP(model, **kw)
    elif layout == "fsdp2":
        mesh = init_device_mesh("cpu", (ws,))
        for sub in case.nested:
            fully_shard(getattr(model, sub), mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif layout == "ddp":
        model = nn.parallel.DistributedDataParallel(model)
    groups: list[list] = [[] for _ in range(len(case.groups) + 1)]
    for name, p in model.named_parameters():
        name = name.replace("_fsdp_wrapped_module.", "")
        if layout == "ddp":
            name = name.removeprefix("module.")
        if name.startswith(case.excluded):
            continue
        gi = next((i + 1 for i, (prefix, _) in enumerate(case.groups) if name.startswith(prefix)), 0)
        groups[gi].append(p)
    param_groups = [{"params": groups[0]}] + [{"params": g, "lr": lr} for g, (_, lr) in zip(groups[1:], case.groups)]
    optim = torch.optim.Adam(param_groups, lr=1e-2, foreach=False)
    return model, optim


def train(model, optim, steps) -> list[float]:
    losses = []
    for s in steps:
        x = batch(s)
        loss = F.cross_entropy(model(x[:, :-1]).reshape(-1, VOCAB), x[:, 1:].reshape(-1))
        optim.zero_grad()
        loss.backward()
        optim.step()
        losses.append(loss.item())
    return losses


def full_state(model, optim) -> dict:
    """Unsharded, FQN-keyed model and optimizer state through PyTorch's own get_state_dict.

    cpu_offload stays off: with it, FSDP1's full state dict fails on CPU-only torch.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
    msd, osd = get_state_dict(model, optim, options=StateDictOptions(full_state_dict=True, cpu_offload=False))
    msd = {k: v.detach().clone() for k, v in msd.items()}
    groups = [{**g, "params": sorted(g["params"])} for g in osd["param_groups"]]  # order is layout-specific
    return {"model": msd, "optim": {"state": osd["state"], "param_groups": groups}}


def set_full_state(model, optim, state) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"],
                   options=StateDictOptions(full_state_dict=True))


def _snapshot(model, optim) -> tuple:
    params = [p.detach().clone() for p in model.parameters()]
    states = {i: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in st.items()}
              for i, st in enumerate(optim.state.values())}
    return params, states


# ----------------------------------------------------------------------------- collective counter

_COLLECTIVES = ("all_gather", "all_gather_into_tensor", "_all_gather_base", "reduce_scatter", "reduce_scatter_tensor",
                "_reduce_scatter_base", "broadcast", "all_reduce", "all_to_all", "all_to_all_single", "gather",
                "scatter", "reduce")


class CollectiveCounter:
    """Records torch.distributed tensor collectives made inside the block (test-only wrapping).

    A collective moving floating-point tensors moves model or optimizer data; integer ones (bcp's
    planning messages, if it sends them as collectives at all) are counted apart.
    """

    def __init__(self):
        self.planning = 0
        self.data: list[str] = []

    def __enter__(self):
        import torch.distributed as dist
        self._saved = {name: getattr(dist, name) for name in _COLLECTIVES if hasattr(dist, name)}

        def tensors(values):
            for v in values:
                if isinstance(v, torch.Tensor):
                    yield v
                elif isinstance(v, (list, tuple)):
                    yield from tensors(v)

        def wrap(name, fn):
            def counted(*args, **kwargs):
                if any(t.is_floating_point() for t in tensors([*args, *kwargs.values()])):
                    self.data.append(name)
                else:
                    self.planning += 1
                return fn(*args, **kwargs)
            return counted

        for name, fn in self._saved.items():
            setattr(dist, name, wrap(name, fn))
        return self

    def __exit__(self, *exc):
        import torch.distributed as dist
        for name, fn in self._saved.items():
            setattr(dist, name, fn)


# ----------------------------------------------------------------------------- workers

def _save_worker(rank, world_size, root, names):
    import bcp_core as bcp
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import StateDictType
    from layouts import build as build_layout
    from layouts import train as train_layout
    out: dict = {"losses": {}, "counts": {}}
    for name in names:
        case = CASES[name]
        model, optim = build(case, "fsdp1")
        train(model, optim, range(case.train_steps))
        before = _snapshot(model, optim)
        with CollectiveCounter() as counter:
            bcp.save(os.path.join(root, name), {"model": model, "optimizer": optim,
                                                "extra_state": {"step": case.train_steps}}).wait()
        after = _snapshot(model, optim)
        assert_same(before, after, f"{name}: saving changed the model or optimizer")
        if case.train_steps == 0:
            assert len(optim.state) == 0, f"{name}: saving created optimizer state"
        out["counts"][name] = counter.data
        ref = full_state(model, optim)
        if rank == 0:
            torch.save(ref, os.path.join(root, f"{name}.ref.pt"))
        out["losses"][name] = train(model, optim, range(case.train_steps, case.train_steps + MORE_STEPS))
        if world_size == 4:  # no 4-rank load spawn: resume the saving layout here
            out.setdefault("resumed", {})[name] = _check_load(rank, root, name, case, "fsdp1", out["losses"])
        if name == "full":
            # Control for the counter: FSDP1's own full state dict all-gathers the flat parameters.
            with CollectiveCounter() as control, FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT):
                model.state_dict()
            out["control"] = control.data
    if world_size != 2:
        return out
    # Sources for the reverse direction: DDP and FSDP2 checkpoints.
    for layout in REVERSE:
        model, optim = build_layout(layout)
        train_layout(model, optim, range(TRAIN_STEPS))
        bcp.save(os.path.join(root, layout), {"model": model, "optimizer": optim,
                                              "extra_state": {"step": TRAIN_STEPS}}).wait()
        ref = full_state(model, optim)
        if rank == 0:
            torch.save(ref, os.path.join(root, f"{layout}.ref.pt"))
        out["losses"][layout] = train_layout(model, optim, range(TRAIN_STEPS, TRAIN_STEPS + MORE_STEPS))
    # One optimizer over two FSDP1 modules of the state whose parameters have the same names: refused
    # (optimizer state is keyed by parameter name; one's state would be saved over the other's).
    out["same_names_errors"] = []
    for orig in (False, True):
        kw = dict(device_id=torch.device("cpu"), use_orig_params=orig)
        a, b = FSDP(nn.Linear(4, 4), **kw), FSDP(nn.Linear(4, 4), **kw)
        opt = torch.optim.Adam([*a.parameters(), *b.parameters()])
        b(a(torch.ones(2, 4))).sum().backward()
        opt.step()
        try:
            bcp.save(os.path.join(root, f"same_names_{orig}"), {"a": a, "b": b, "optimizer": opt})
            out["same_names_errors"].append(None)
        except bcp.BCPError as e:
            out["same_names_errors"].append(str(e))
    # Refused while parameters are unsharded: the flat shard is then not what training uses.
    model, optim = build(CASES["full"], "fsdp1")
    with FSDP.summon_full_params(model, writeback=False):
        try:
            bcp.save(os.path.join(root, "unsharded"), {"model": model})
            out["unsharded_error"] = None
        except bcp.BCPError as e:
            out["unsharded_error"] = str(e)
    return out


def _check_load(rank, root, name, case, layout, losses, **build_kw):
    """Load checkpoint `name` into a fresh `layout`, compare with the saver's state, continue training."""
    import bcp_core as bcp
    ref = torch.load(os.path.join(root, f"{name}.ref.pt"), weights_only=True)
    model, optim = build(case, layout, seed=123, **build_kw)
    extra: dict = {}
    bcp.load(os.path.join(root, name), {"model": model, "optimizer": optim, "extra_state": extra})
    assert extra["step"] == case.train_steps
    loaded = full_state(model, optim)
    if rank == 0:
        assert_same(ref, loaded, f"{name}->{layout}")
    steps = range(case.train_steps, case.train_steps + MORE_STEPS)
    resumed = train(model, optim, steps)
    return resumed, losses[name]


def _load_worker(rank, world_size, root, losses):
    results = {}
    if world_size == 2:
        for name, case in CASES.items():
            if "fsdp2" in case.targets:
                results[(name, "fsdp2")] = _check_load(rank, root, name, case, "fsdp2", losses)
            if case.ranks == 2:  # the saving layout itself: training resumes exactly
                results[(name, "fsdp1_2")] = _check_load(rank, root, name, case, "fsdp1", losses)
    if world_size == 3:
        for name, case in CASES.items():
            if "fsdp1_3" not in case.targets:
                continue
            strategy, orig = case.to3
            results[(name, "fsdp1_3")] = _check_load(rank, root, name, case, "fsdp1", losses,
                                                     strategy=strategy, orig=orig)
    if world_size == 1:
        for name, case in CASES.items():
            results[(name, "plain")] = _check_load(rank, root, name, case, "plain", losses)
    for src, targets in REVERSE.items():
        for strategy, orig, ws in targets:
            if ws == world_size:
                results[(src, f"fsdp1_{strategy}_{orig}")] = _check_load(rank, root, src, PLAIN_CASE, "fsdp1",
                                                                         losses, strategy=strategy, orig=orig)
    return results


# ----------------------------------------------------------------------------- tests

@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("fsdp1"))
    outs = run_ranks(2, _save_worker, root, [n for n, c in CASES.items() if c.ranks == 2])
    outs += run_ranks(4, _save_worker, root, [n for n, c in CASES.items() if c.ranks == 4])
    losses = {k: v for out in outs for k, v in out["losses"].items()}  # rank 0 of each run first
    return root, outs, losses


def test_save_issues_no_tensor_collective(saved):
    _, outs, _ = saved
    assert all(out["control"] for out in outs[:2]), "the counter saw no collective in FSDP1's full state_dict()"
    for i, out in enumerate(outs):
        for name, data in out["counts"].items():
            assert data == [], f"run rank {i} {name}: bcp's FSDP1 save issued collectives {data}"


def test_save_refuses_unsharded_parameters(saved):
    _, outs, _ = saved
    for out in outs[:2]:
        assert out["unsharded_error"] and "unsharded" in out["unsharded_error"], out["unsharded_error"]


def test_one_optimizer_over_modules_with_the_same_parameter_names_is_refused(saved):
    _, outs, _ = saved
    for out in outs[:2]:
        assert len(out["same_names_errors"]) == 2
        for error in out["same_names_errors"]:
            assert error and "both named 'weight'" in error, error


def test_checkpoint_is_decomposed_per_original_parameter(saved):
    """Keys are the plain model's; pieces are boxes of the original shapes, with no padding."""
    import bcp_core as bcp
    root, _, _ = saved
    md = bcp.inspect(os.path.join(root, "full"))
    plain = Net()
    for fqn, p in plain.state_dict().items():
        tm = md.tensors[f"model.{fqn}"]
        assert tuple(tm.shape) == tuple(p.shape)
        assert sum(torch.Size(pc.lengths).numel() for pc in tm.pieces) == p.numel(), fqn
    # The root unit's flat parameter holds emb.weight (512), w2.weight (640), ... (1712 elements),
    # 856 per rank: rank 1's share begins inside w2.weight, mid-row, so w2.weight is held as boxes
    # on both ranks, one of them a partial row.
    pieces = md.tensors["model.w2.weight"].pieces
    assert len(pieces) > 2 and {pc.rank for pc in pieces} == {0, 1}
    assert any(pc.lengths[0] == 1 and pc.lengths[1] < 40 for pc in pieces), pieces
    hybrid = bcp.inspect(os.path.join(root, "hybrid"))
    # two replicas hold identical boxes; each is written once, by one of them, and the writes are
    # spread over all four ranks
    for fqn, tm in hybrid.tensors.items():
        assert sum(torch.Size(pc.lengths).numel() for pc in tm.pieces) == torch.Size(tm.shape).numel(), fqn
    assert {pc.rank for tm in hybrid.tensors.values() for pc in tm.pieces} == {0, 1, 2, 3}
    fresh = bcp.inspect(os.path.join(root, "fresh"))
    assert not [k for k in fresh.keys() if k.startswith("optimizer.state.")]


def test_hybrid_resumes_exactly(saved):
    _, outs, _ = saved
    for out in outs[2:]:
        for name, (resumed, uninterrupted) in out["resumed"].items():
            assert resumed == uninterrupted, f"{name}: {resumed} != {uninterrupted}"


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_load_into_other_layouts(saved, world_size):
    root, _, losses = saved
    results = run_ranks(world_size, _load_worker, root, losses)[0]
    assert results
    for (name, layout), (resumed, uninterrupted) in results.items():
        if layout == "fsdp1_2":
            assert resumed == uninterrupted, f"{name}->{layout}: {resumed} != {uninterrupted}"
        else:
            assert resumed == pytest.approx(uninterrupted, rel=1e-4), f"{name}->{layout}"


# ----------------------------------------------------------------------------- single-process

def test_range_boxes_cover_exactly_the_range_as_contiguous_runs():
    """Every run [start, stop) of a row-major tensor splits into <= 2*ndim-1 contiguous boxes."""
    from bcp_core.shards import range_boxes
    g = torch.Generator().manual_seed(0)
    shapes = [(7,), (5, 3), (4, 1, 6), (3, 4, 5), (2, 3, 2, 4), (1, 9), (6, 1)]
    for shape in shapes:
        numel = torch.Size(shape).numel()
        ref = torch.arange(numel).reshape(shape)
        for _ in range(60):
            start, stop = sorted(torch.randint(0, numel + 1, (2,), generator=g).tolist())
            boxes = range_boxes(shape, start, stop)
            assert len(boxes) <= 2 * len(shape) - 1, (shape, start, stop, boxes)
            seen = []
            for offs, lens, first in boxes:
                part = ref
                for d, (o, n) in enumerate(zip(offs, lens)):
                    part = part.narrow(d, o, n)
                flat = part.reshape(-1).tolist()
                assert flat == list(range(first, first + len(flat))), (shape, offs, lens, first)
                seen += flat
            assert sorted(seen) == list(range(start, stop)), (shape, start, stop, boxes)
    assert range_boxes((), 0, 1) == [((), (), 0)]
    assert range_boxes((4, 4), 3, 3) == []


def test_unsupported_torch_version_is_refused_clearly(monkeypatch):
    from bcp_core.errors import BCPError
    from bcp_core.adapters.fsdp1 import check_torch_version
    monkeypatch.delenv("BCP_FSDP1_ANY_TORCH", raising=False)
    for version in ("2.3.1", "2.99.0", "3.0.0"):
        with pytest.raises(BCPError, match=f"torch {version}.*FSDP2"):
            check_torch_version(version)
    check_torch_version("2.13.0")
    monkeypatch.setenv("BCP_FSDP1_ANY_TORCH", "1")
    check_torch_version("2.99.0")
