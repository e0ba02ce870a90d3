"""A tiny transformer-like model in the parallel layouts the tests save from and load into."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

VOCAB, DIM, HIDDEN = 32, 16, 40  # HIDDEN is not divisible by 3: uneven shards


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.w1 = nn.Linear(DIM, HIDDEN)
        self.w2 = nn.Linear(HIDDEN, DIM)
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, x):
        h = self.emb(x)
        h = h + self.w2(F.relu(self.w1(h)))
        return self.head(self.norm(h))


# name -> world size
LAYOUTS = {"plain": 1, "ddp": 2, "fsdp2": 2, "tp": 2, "fsdp2_tp": 4, "fsdp2_3": 3, "fsdp2_4": 4}


def build(layout: str, seed: int = 0):
    """The model in `layout` (all ranks of the default group take part) and an Adam optimizer."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(seed)
    model = Net()
    ws = dist.get_world_size() if dist.is_initialized() else 1
    assert ws == LAYOUTS[layout], (layout, ws)
    if layout == "ddp":
        model = nn.parallel.DistributedDataParallel(model)
    elif layout in ("fsdp2", "fsdp2_3", "fsdp2_4"):
        mesh = init_device_mesh("cpu", (ws,))
        fully_shard(model.w1, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif layout == "tp":
        mesh = init_device_mesh("cpu", (ws,))
        parallelize_module(model, mesh, {"w1": ColwiseParallel(), "w2": RowwiseParallel()})
    elif layout == "fsdp2_tp":
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh["tp"], {"w1": ColwiseParallel(), "w2": RowwiseParallel()})
        fully_shard(model.w1, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    optim = torch.optim.Adam(model.parameters(), lr=1e-2, foreach=False)
    return model, optim


def batch(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, VOCAB, (4, 9), generator=g)


def train(model, optim, steps: range) -> list[float]:
    losses = []
    for s in steps:
        x = batch(s)
        logits = model(x[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), x[:, 1:].reshape(-1))
        optim.zero_grad()
        loss.backward()
        optim.step()
        losses.append(loss.item())
    return losses


def full_state(model, optim) -> dict:
    """Unsharded model + FQN-keyed optimizer state through PyTorch's own state_dict helpers."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    msd, osd = get_state_dict(model, optim, options=StateDictOptions(full_state_dict=True, cpu_offload=True,
                                                                     broadcast_from_rank0=False))
    return {"model": msd, "optim": osd}


def set_full_state(model, optim, state: dict) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"],
                   options=StateDictOptions(full_state_dict=True))


def assert_same(a, b, where="state"):
    """Bit-exact equality of nested dicts/lists of tensors and values."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), f"{where}: keys {sorted(a)} != {sorted(b)}"
        for k in a:
            assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{where}: length {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), f"{where}: tensor vs {type(b)}"
        assert a.dtype == b.dtype and a.shape == b.shape, \
            f"{where}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
        assert torch.equal(a, b), f"{where}: values differ (max abs diff {(a.double() - b.double()).abs().max()})"
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"
