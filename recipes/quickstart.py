"""bcp quickstart: save from FSDP2, load into TP and into a single process, keep training.

    torchrun --nproc_per_node 2 recipes/quickstart.py [--out DIR]

1. Trains a small transformer with FSDP2 on 2 CPU ranks and saves model + Adam + extra state.
2. Loads that checkpoint into tensor parallelism (a different sharding) and checks every tensor
   is bit-identical, then trains on and compares losses with the uninterrupted run.
3. Loads it on rank 0 alone into an unsharded model (world size 1, no collectives).
4. Loads it into a fresh FSDP2 model and checks the losses are exactly those of the
   uninterrupted run.
"""

from __future__ import annotations

import argparse
import copy
import os
import tempfile

from _launch import exit_without_teardown  # recipes/_launch.py

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import bcp_core as bcp

VOCAB, DIM, HEADS, SEQ = 64, 32, 4, 16


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.q, self.k, self.v, self.o = (nn.Linear(DIM, DIM) for _ in range(4))
        self.up, self.down = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)

    def forward(self, x):
        b, t, _ = x.shape
        h = self.norm1(x)
        # -1 heads: under tensor parallelism each rank holds HEADS / tp of them
        q, k, v = (m(h).view(b, t, -1, DIM // HEADS).transpose(1, 2) for m in (self.q, self.k, self.v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, -1)
        x = x + self.o(a)
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class TinyGPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, x):
        h = self.emb(x)
        for blk in self.blocks:
            h = blk(h)
        return self.head(self.norm(h))


def build(layout: str, seed: int):
    torch.manual_seed(seed)
    model = TinyGPT()
    if layout == "fsdp2":
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for blk in model.blocks:
            fully_shard(blk, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif layout == "tp":
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for blk in model.blocks:
            parallelize_module(blk, mesh, {"q": ColwiseParallel(), "k": ColwiseParallel(),
                                           "v": ColwiseParallel(), "o": RowwiseParallel(),
                                           "up": ColwiseParallel(), "down": RowwiseParallel()})
    return model, torch.optim.AdamW(model.parameters(), lr=3e-3, foreach=False)


def train(model, optim, steps) -> list[float]:
    losses = []
    for step in steps:
        x = torch.randint(0, VOCAB, (8, SEQ + 1), generator=torch.Generator().manual_seed(step))
        loss = F.cross_entropy(model(x[:, :-1]).reshape(-1, VOCAB), x[:, 1:].reshape(-1))
        optim.zero_grad()
        loss.backward()
        optim.step()
        losses.append(loss.item())
    return losses


def full(model, optim) -> dict:
    """Every tensor of model and optimizer, unsharded, via PyTorch's own state_dict helpers."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
    m, o = get_state_dict(model, optim, options=StateDictOptions(full_state_dict=True))
    return {"model": m, "optim": o["state"]}


def same(a: dict, b: dict) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "bcp_quickstart"))
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    say = print if rank == 0 else (lambda *a, **k: None)

    # 1. FSDP2 training, an asynchronous save at step 3, then on to step 6 (the uninterrupted run).
    model, optim = build("fsdp2", seed=0)
    train(model, optim, range(3))
    handle = bcp.save(args.out, {"model": model, "optimizer": optim, "extra_state": {"step": 3}},
                      step=3, async_save=True)
    # A private copy for checking (Adam bumps its step tensors in place as training goes on).
    saved = copy.deepcopy(full(model, optim))
    uninterrupted = train(model, optim, range(3, 6))  # training goes on while the save writes
    path = handle.wait()
    md = bcp.inspect(args.out)
    say(f"[1] FSDP2 x{world}: saved {len(md.tensors)} tensors to {path} "
        f"({sum(t.nbytes for t in md.tensors.values()) / 2**20:.2f} MiB, {len(md.files)} data files)")
    say(f"    uninterrupted losses, steps 3-5: {[f'{x:.6f}' for x in uninterrupted]}")

    # 2. Into tensor parallelism: different sharding of every attention/MLP weight.
    model, optim = build("tp", seed=1)
    extra: dict = {}
    bcp.load(args.out, {"model": model, "optimizer": optim, "extra_state": extra})
    ok = same(saved, full(model, optim))
    resumed = train(model, optim, range(3, 6))
    diff = max(abs(a - b) for a, b in zip(resumed, uninterrupted))
    say(f"[2] TP x{world}: state bit-identical: {ok}; resumed at step {extra['step']}, losses "
        f"{[f'{x:.6f}' for x in resumed]} (max diff vs the uninterrupted FSDP2 run: {diff:.1e})")
    assert ok and diff < 1e-4

    # 3. World size 1: rank 0 alone, into a plain model, no process group involved.
    if rank == 0:
        torch.manual_seed(2)
        plain = TinyGPT()
        bcp.load(args.out, {"model": plain})
        ok = same(saved["model"], plain.state_dict())
        say(f"[3] plain x1 (rank 0 alone): model bit-identical: {ok}")
        assert ok
    dist.barrier()

    # 4. Back into FSDP2: training continues exactly as if never interrupted.
    model, optim = build("fsdp2", seed=3)
    bcp.load(args.out, {"model": model, "optimizer": optim})
    resumed = train(model, optim, range(3, 6))
    say(f"[4] FSDP2 x{world} resumed: losses identical to the uninterrupted run: {resumed == uninterrupted}")
    assert resumed == uninterrupted
    say("quickstart: all checks passed")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_without_teardown()
