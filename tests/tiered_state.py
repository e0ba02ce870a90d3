"""The state of the tiered-checkpoint jobs (tests/jobs/tiered_train.py), known exactly at every step.

Each element of "w" and "exp_avg" changes at step s by a formula of s and its global index only, so
the state at any step is the same whatever the world size and sharding: `expected(step)` gives it
in full, for tests to compare what a job loaded or ended with, bit for bit.
"""

from __future__ import annotations

import torch

ROWS, COLS = 12, 1024


def _index() -> torch.Tensor:
    return torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS) % 97


def _step(w: torch.Tensor, m: torch.Tensor, bias: torch.Tensor, index: torch.Tensor, step: int) -> None:
    w.mul_(0.5).add_(index).add_(step)
    m.mul_(0.25).add_(w)
    bias.add_(step * 0.5)


def expected(step: int) -> dict:
    """The whole state after `step` steps."""
    index = _index()
    w, m, bias = torch.zeros(ROWS, COLS), torch.zeros(ROWS, COLS), torch.zeros(4)
    for s in range(1, step + 1):
        _step(w, m, bias, index, s)
    return {"w": w, "exp_avg": m, "bias": bias, "step": step}


def initial(mesh) -> dict:
    """The state at step 0 on this rank: rows of w and exp_avg sharded over the mesh."""
    from torch.distributed.tensor import Shard, distribute_tensor
    return {"w": distribute_tensor(torch.zeros(ROWS, COLS), mesh, [Shard(0)]),
            "exp_avg": distribute_tensor(torch.zeros(ROWS, COLS), mesh, [Shard(0)]),
            "bias": torch.zeros(4), "step": 0}


def advance(state: dict, step: int) -> None:
    """One training step, in place: each rank changes its own rows."""
    w, m = state["w"].to_local(), state["exp_avg"].to_local()
    rows = w.shape[0]
    first = state["w"].device_mesh.get_local_rank() * rows
    _step(w, m, state["bias"], _index()[first:first + rows], step)
    state["step"] = step


def flip_last_byte(path):
    """A bit flipped in a data file's last piece, as RAM flips one after the write checked it; the path."""
    data = bytearray(path.read_bytes())
    data[-10] ^= 0xFF
    path.write_bytes(bytes(data))
    return path
