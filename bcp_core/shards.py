"""What one rank holds of a global tensor, as n-D boxes (the paper's ShardMeta).

A local tensor maps to one or more boxes of the global tensor; each box has a
view into the local data. Plain tensors are one box covering the whole tensor;
a DTensor yields the boxes its placements give this rank (several for strided
sharding, none for an empty uneven shard). Adapters for flat layouts (FSDP1,
Megatron's distributed optimizer) produce several boxes per shard.
"""

from __future__ import annotations

import itertools
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .errors import BCPError


@dataclass(frozen=True)
class Box:
    offsets: tuple[int, ...]
    lengths: tuple[int, ...]
    view: torch.Tensor  # the local data of this box, shape == lengths

    @property
    def numel(self) -> int:
        return math.prod(self.lengths)


@dataclass(frozen=True)
class LocalTensor:
    """The boxes of global tensor `fqn` that this rank holds."""

    global_shape: tuple[int, ...]
    dtype: torch.dtype
    boxes: tuple[Box, ...]


class ShardedView:
    """A tensor this rank holds only parts of, given as boxes of its global shape.

    The common currency of adapters whose shards are not one box: FSDP1 flat-parameter slices,
    Megatron ShardedTensors and distributed-optimizer buckets. The boxes' views alias the live
    storage, so saving reads from it and loading writes into it in place.
    """

    def __init__(self, global_shape: tuple[int, ...], dtype: torch.dtype, boxes: list[Box] | tuple[Box, ...],
                 stepped: bool = False):
        self.shape = tuple(global_shape)
        self.dtype = dtype
        self.boxes = tuple(boxes)
        # the data changes in place only in an optimizer step (parameters, optimizer state): an async
        # save may copy it after the call, until the next step (bcp_core.staging)
        self.stepped = stepped

    def __bcp_local_tensor__(self) -> LocalTensor:
        return LocalTensor(self.shape, self.dtype, self.boxes)

    def __repr__(self) -> str:
        return f"ShardedView(shape={self.shape}, dtype={self.dtype}, boxes={len(self.boxes)})"


@dataclass
class ObjectShard:
    """One shard of a non-tensor value sharded over a grid.

    A DP rank's dataloader buffer is `ObjectShard(buf, index=(dp_rank, worker), grid=(dp, workers))`;
    a Megatron ShardedObject maps the same way. Ranks holding the same index hold the same value:
    it is written once. On load, a target with an `index` receives that shard's value; a target with
    `index=None` receives a `ShardReader` so the owner can pick the shards it needs (resharding).
    """

    value: Any
    index: tuple[int, ...] | None
    grid: tuple[int, ...] = ()


def is_tensor_like(v) -> bool:
    """Values saved and loaded as tensors: torch tensors (plain or DTensor) and ShardedViews."""
    return isinstance(v, (torch.Tensor, ShardedView))


def is_dtensor(t) -> bool:
    # A DTensor exists only once its module is imported; importing it here would cost every process
    # half a second (torch.distributed.tensor brings in sympy)
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


def global_shape_of(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(t.shape)  # DTensor.shape is already the global shape


def local_tensor(t) -> LocalTensor:
    """Boxes of a plain tensor, DTensor or ShardedView."""
    if isinstance(t, ShardedView):
        return t.__bcp_local_tensor__()
    if is_dtensor(t):
        return _dtensor_boxes(t)
    t = t.detach()
    return LocalTensor(tuple(t.shape), t.dtype, (Box((0,) * t.dim(), tuple(t.shape), t),))


def _dim_runs(indices: range | list[int]) -> list[tuple[int, int, int]]:
    """Split a dim's global indices (in local order) into runs (local_start, global_start, length)."""
    if isinstance(indices, range) and indices.step == 1:  # plain Shard: one run, no per-index loop
        return [(0, indices.start, len(indices))] if len(indices) else []
    runs: list[tuple[int, int, int]] = []
    for i, g in enumerate(indices):
        if runs and runs[-1][1] + runs[-1][2] == g and runs[-1][0] + runs[-1][2] == i:
            ls, gs, n = runs[-1]
            runs[-1] = (ls, gs, n + 1)
        else:
            runs.append((i, g, 1))
    return runs


def _dtensor_boxes(dt) -> LocalTensor:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import Partial

    shape = tuple(dt.shape)
    local = dt.to_local().detach()
    mesh, placements = dt.device_mesh, dt.placements
    coord = mesh.get_coordinate()
    if coord is None:  # this rank is not in the mesh
        return LocalTensor(shape, dt.dtype, ())
    # Follow DTensor's left-to-right sharding: per tensor dim, the global index of each local row.
    indices: dict[int, range | list[int]] = {}
    sizes = list(shape)
    for mesh_dim, p in enumerate(placements):
        if isinstance(p, Replicate):
            continue
        if isinstance(p, Partial):
            raise BCPError(f"DTensor with Partial placement {p} cannot be checkpointed; reduce it first")
        strided = type(p).__name__ == "_StridedShard"
        if not (isinstance(p, Shard) or strided):
            raise BCPError(f"unsupported DTensor placement {p!r}")
        d = p.dim
        prev = indices.get(d, range(shape[d]))
        n, c = mesh.size(mesh_dim), coord[mesh_dim]
        if not strided:
            size, off = Shard.local_shard_size_and_offset(sizes[d], n, c)
            indices[d] = prev[off:off + size]  # a range stays a range
            sizes[d] = len(indices[d])
            continue
        # _StridedShard (FSDP2 over TP on the same dim): positions are not contiguous
        try:
            from torch.distributed.tensor._utils import _StridedShardOffsetMode
            size, pos = p._local_shard_size_and_offset(sizes[d], n, c, offset_mode=_StridedShardOffsetMode.ALL)
        except (ImportError, TypeError, AttributeError) as e:
            raise BCPError(f"strided DTensor placement {p!r} is not supported on torch "
                           f"{torch.__version__}: {e}") from None
        pos = [int(x) for x in pos] if size else []
        indices[d] = [prev[i] for i in pos]
        sizes[d] = len(indices[d])
    if tuple(sizes) != tuple(local.shape):
        raise BCPError(f"DTensor local shape {tuple(local.shape)} does not match the {tuple(sizes)} its "
                       f"placements {placements} imply for global shape {shape}")
    per_dim = [(_dim_runs(indices[d]) if d in indices else [(0, 0, shape[d])]) for d in range(len(shape))]
    boxes = []
    for combo in itertools.product(*per_dim):
        lengths = tuple(r[2] for r in combo)
        if 0 in lengths and math.prod(shape) != 0:
            continue
        view = local
        for d, (ls, _, n) in enumerate(combo):
            view = view.narrow(d, ls, n)
        boxes.append(Box(tuple(r[1] for r in combo), lengths, view))
    return LocalTensor(shape, dt.dtype, tuple(boxes))


def range_boxes(shape: tuple[int, ...], start: int, stop: int) -> list[tuple[tuple, tuple, int]]:
    """Split the row-major elements [start, stop) of a tensor of `shape` into n-D boxes.

    Returns (offsets, lengths, first) per box, `first` being the flat index of its first element.
    Every box is a contiguous run of the flattened tensor, so its data is a slice of the flat
    shard viewed with shape `lengths`. At most 2 * ndim - 1 boxes.
    """
    if stop <= start:
        return []
    if len(shape) <= 1:
        return [((start,) if shape else (), (stop - start,) if shape else (), start)]
    inner = math.prod(shape[1:])
    rest = tuple(shape[1:])
    out: list[tuple[tuple, tuple, int]] = []
    if start % inner:  # a partial first row
        row = start // inner
        end = min(stop, (row + 1) * inner)
        for offs, lens, first in range_boxes(rest, start - row * inner, end - row * inner):
            out.append(((row, *offs), (1, *lens), row * inner + first))
        start = end
    rows = (stop - start) // inner
    if rows:  # whole rows
        out.append(((start // inner,) + (0,) * len(rest), (rows, *rest), start))
        start += rows * inner
    if start < stop:  # a partial last row
        row = start // inner
        for offs, lens, first in range_boxes(rest, 0, stop - start):
            out.append(((row, *offs), (1, *lens), start + first))
    return out


# ----------------------------------------------------------------------------- tiling

@dataclass(frozen=True)
class TilingFault:
    """Why boxes do not tile a shape. `at`: the indices (into the boxes checked) of the box that lies
    outside the shape or of the two boxes that overlap; empty when the boxes leave a gap. `problem`
    completes a sentence about them ("lies outside shape (4, 4)", "overlap", "cover 12 of ...")."""

    at: tuple[int, ...]
    problem: str


def tiling_fault(shape: Sequence[int], boxes: Sequence[tuple[Sequence[int], Sequence[int]]]) -> TilingFault | None:
    """Why `boxes` ((offsets, lengths) each) do not tile `shape` exactly, or None when they do.

    Boxes tile a shape when each lies inside it, no two share an element and no element is left
    out. Inside and disjoint, they leave nothing out exactly when their element counts add up to the
    shape's, which is what is checked last. A box without elements holds nothing and overlaps
    nothing; two identical boxes overlap (a caller that means them as replicas passes one).
    """
    shape = tuple(shape)
    total = math.prod(shape)
    if shape and len(boxes) >= _NUMPY_BOXES and total < 1 << 62:  # sums below stay within int64
        arrays = _box_arrays(boxes, len(shape))
        if arrays is not None:
            return _tiling_fault_np(shape, total, boxes, *arrays)
    for i, (off, ln) in enumerate(boxes):
        if not (len(off) == len(ln) == len(shape) and all(type(x) is int for x in (*off, *ln))):
            return TilingFault((i,), f"is not a box of {len(shape)} integer offsets and lengths")
        if not all(0 <= o and 0 <= n and o + n <= s for o, n, s in zip(off, ln, shape)):
            return TilingFault((i,), f"lies outside shape {shape}")
    overlap = _first_overlap(boxes)
    if overlap is not None:
        return TilingFault(overlap, "overlap")
    return _gap(shape, total, sum(math.prod(ln) for _, ln in boxes))


def _gap(shape: tuple[int, ...], total: int, covered: int) -> TilingFault | None:
    return None if covered == total else TilingFault((), f"cover {covered} elements but shape {shape} has {total}")


# Boxes of one tensor are checked with numpy from this many on: at 8,960 ranks with every parameter
# split over DP, the pure-Python sweep was three quarters of the global plan's time; from 16 boxes
# on, numpy is the faster of the two (bench/plan_scale.py's 405B layouts).
_NUMPY_BOXES = 16
_PAIRS_PER_CHUNK = 1 << 22  # candidate pairs tested at once: bounds the memory of the numpy check


def _first_overlap(boxes: Sequence[tuple[Sequence[int], Sequence[int]]]) -> tuple[int, int] | None:
    """The indices of two boxes that overlap, or None. Sweep along dim 0: boxes rarely share many
    dim-0 ranges."""
    active: list[int] = []
    for i in sorted(range(len(boxes)), key=lambda i: tuple(boxes[i][0])):
        off, ln = boxes[i]
        if off:
            active = [a for a in active if boxes[a][0][0] + boxes[a][1][0] > off[0]]
        for a in active:
            if intersect(boxes[a][0], boxes[a][1], off, ln) is not None:
                return a, i
        active.append(i)
    return None


def _box_arrays(boxes, dims: int):
    """The boxes' offsets and lengths as (n, dims) int64 arrays, or None when they do not fit one
    (ragged, not integers, beyond int64): the exact Python check then says what is wrong."""
    import numpy as np
    try:
        off = np.array([b[0] for b in boxes], dtype=np.int64)
        ln = np.array([b[1] for b in boxes], dtype=np.int64)
    except (ValueError, TypeError, OverflowError):
        return None
    return (off, ln) if off.shape == ln.shape == (len(boxes), dims) else None


def _tiling_fault_np(shape, total, boxes, off, ln) -> TilingFault | None:
    """`tiling_fault` for many boxes, vectorised."""
    import numpy as np
    limit = np.array(shape, dtype=np.int64)
    inside = ((off >= 0) & (ln >= 0) & (off <= limit - ln)).all(axis=1)  # no sum that could overflow
    if not inside.all():
        return TilingFault((int(np.argmin(inside)),), f"lies outside shape {shape}")
    overlap = _first_overlap_np(off, off + ln)
    if overlap is not None:
        return TilingFault(overlap, "overlap")
    return _gap(shape, total, int(np.prod(ln, axis=1).sum()))


def _first_overlap_np(off, end) -> tuple[int, int] | None:
    """`_first_overlap` on (n, dims) arrays of starts and ends: the same candidate pairs (after
    sorting by offsets, box j > i is a candidate while it starts in dim 0 before box i ends), tested
    at once."""
    import numpy as np
    order = np.lexsort(off.T[::-1])
    off, end = off[order], end[order]
    k = len(off)
    stop = np.searchsorted(off[:, 0], end[:, 0], side="left")  # first j whose dim-0 start is past i's end
    counts = np.maximum(stop - np.arange(k) - 1, 0)
    bounds = np.cumsum(counts)
    i0 = 0
    while i0 < k:  # chunks of about _PAIRS_PER_CHUNK pairs bound the memory
        i1 = max(i0 + 1, int(np.searchsorted(bounds, bounds[i0] - counts[i0] + _PAIRS_PER_CHUNK, side="right")))
        c = counts[i0:i1]
        n = int(c.sum())
        if n:
            first = np.repeat(np.arange(i0, i1), c)
            second = first + 1 + np.arange(n) - np.repeat(np.cumsum(c) - c, c)
            # boxes overlap where, in every dim, the larger start lies before the smaller end
            hit = np.all(np.maximum(off[first], off[second]) < np.minimum(end[first], end[second]), axis=1)
            if hit.any():
                p = int(np.argmax(hit))
                return int(order[first[p]]), int(order[second[p]])
        i0 = i1
    return None


def intersect(a_off, a_len, b_off, b_len):
    """Intersection of two boxes as (offsets, lengths), or None if empty."""
    off, ln = [], []
    for ao, al, bo, bl in zip(a_off, a_len, b_off, b_len):
        lo, hi = max(ao, bo), min(ao + al, bo + bl)
        if hi <= lo:
            return None
        off.append(lo)
        ln.append(hi - lo)
    return tuple(off), tuple(ln)
