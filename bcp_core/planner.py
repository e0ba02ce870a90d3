"""Save and load planning.

Save: every rank describes what it holds (`local_save_plan`); the coordinator
checks the descriptions agree, writes each distinct box once, giving
replicated boxes to the least-loaded holder (worst-fit on bytes, paper §4.1),
and dedups per-rank values (`global_save_plan`). Plans are plain JSON so they
travel over `Comm`.

Load: each rank intersects the boxes it needs with the saved pieces
(`read_items`) and reads only the overlapping bytes.
"""

from __future__ import annotations

import functools
import gc
import hashlib
import json
import math
from dataclasses import dataclass

import torch

from . import codec, metrics
from .errors import PlanError, ShapeMismatchError
from .metadata import Piece, TensorMeta, dtype_from_name, dtype_name, element_size
from .shards import Box, LocalTensor, ObjectShard, intersect, is_tensor_like, local_tensor
from .state import SaveLeaf


# ----------------------------------------------------------------------------- save

@dataclass
class LocalSavePlan:
    """This rank's side of a save.

    `structure` is what the coordinator plans from: keys, shapes, boxes, grid indices. It is the
    same from save to save while the model's layout does not change, so its hash `key` indexes the
    plan cache. `values` are what changes every save (non-tensor values, per-rank values, shard
    digests); they travel with the write report instead of the plan.
    """

    structure: dict
    key: str
    tensors: list[tuple[str, LocalTensor]]      # index matches structure["tensors"]
    per_rank_tensors: list[tuple[str, torch.Tensor]]
    object_shards: list[bytes]                  # index matches structure["sharded_objects"]
    values: dict


def gc_paused(fn):
    """Run `fn` with the cyclic garbage collector paused.

    Planning a large job builds millions of small lists and dicts (decoded plans, boxes, pieces);
    each allocation burst triggers a collection that walks the whole growing heap, which made
    decoding 8,960 plans 18x slower (bench/plan_scale.py). None of these objects form cycles, so
    collection is only deferred, never skipped: it runs as usual once `fn` returns.
    """
    @functools.wraps(fn)
    def inner(*args, **kwargs):
        was_enabled = gc.isenabled()
        gc.disable()
        try:
            return fn(*args, **kwargs)
        finally:
            if was_enabled:
                gc.enable()
    return inner


def digest(data) -> str:
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def local_save_plan(leaves: list[SaveLeaf], rank: int, allow_pickle: bool) -> LocalSavePlan:
    tensors: list[tuple[str, LocalTensor]] = []
    st_tensors, st_objects, st_per_rank, st_shards = [], [], [], []
    per_rank_tensors, object_shards = [], []
    objects, per_rank, shard_digests, object_digests = {}, {}, [], {}
    for leaf in leaves:
        v = leaf.value
        if isinstance(v, ObjectShard):
            if v.index is None or len(v.index) != len(v.grid) or any(
                    not 0 <= i < g for i, g in zip(v.index, v.grid)):
                raise PlanError(f"{leaf.fqn}: object shard index {v.index} does not lie in grid {v.grid}")
            data = json.dumps(codec.encode(v.value, leaf.fqn, allow_pickle), separators=(",", ":")).encode()
            st_shards.append([leaf.fqn, list(v.grid), list(v.index)])
            object_shards.append(data)
            shard_digests.append(digest(data))
        elif leaf.per_rank:
            if isinstance(v, torch.Tensor):
                if v.__class__ is not torch.Tensor and not isinstance(v, torch.nn.Parameter):
                    raise PlanError(f"{leaf.fqn}: per-rank (extra_state) tensors must be plain tensors, "
                                    f"got {type(v).__name__}")
                st_per_rank.append([leaf.fqn, dtype_name(v.dtype), list(v.shape)])
                per_rank_tensors.append((leaf.fqn, v.detach()))
            else:
                st_per_rank.append([leaf.fqn, None, None])
                per_rank[leaf.fqn] = codec.encode(v, leaf.fqn, allow_pickle)
        elif is_tensor_like(v):
            lt = local_tensor(v)
            tensors.append((leaf.fqn, lt))
            st_tensors.append([leaf.fqn, dtype_name(lt.dtype), list(lt.global_shape),
                               [[list(b.offsets), list(b.lengths)] for b in lt.boxes]])
        else:
            # replicated values: the coordinator's copy is saved; the others send a digest so a value
            # that differs between ranks (and would be lost) is reported
            st_objects.append(leaf.fqn)
            encoded = codec.encode(v, leaf.fqn, allow_pickle)
            if rank == 0:
                objects[leaf.fqn] = encoded
            object_digests[leaf.fqn] = digest(json.dumps(encoded, sort_keys=True).encode())
    structure = {"tensors": st_tensors, "objects": st_objects, "per_rank": st_per_rank,
                 "sharded_objects": st_shards}
    key = digest(json.dumps(structure, separators=(",", ":")).encode())
    values = {"objects": objects, "per_rank": per_rank, "shard_digests": shard_digests,
              "object_digests": object_digests}
    return LocalSavePlan(structure, key, tensors, per_rank_tensors, object_shards, values)


@dataclass
class GlobalSavePlan:
    """The coordinator's plan: what each rank writes, and the layout the metadata will describe."""

    assignments: list[dict]                        # per rank: {"write": [[ti, bi]...], "shards": [i...]}
    tensor_info: dict[str, tuple[str, list[int]]]  # fqn -> (dtype name, global shape)
    object_keys: list[str]
    per_rank: dict[str, str]                       # fqn -> "tensor" or "object"
    sharded_grids: dict[str, list[int]]            # fqn -> grid of each sharded object
    shard_holders: dict[tuple, list[tuple[int, int]]]  # (fqn, index) -> [(rank, local shard i)]
    bytes_per_rank: list[int]


@metrics.timed("plan")
@gc_paused
def global_save_plan(structures: list[dict]) -> GlobalSavePlan:
    world = len(structures)
    tensor_info: dict[str, tuple[str, list[int], int]] = {}   # fqn -> dtype, shape, first rank
    holders: dict[tuple, list[tuple[int, int, int]]] = {}   # (fqn, offs, lens) -> [(rank, ti, bi)]
    for r, plan in enumerate(structures):
        for ti, (fqn, dt, shape, boxes) in enumerate(plan["tensors"]):
            seen = tensor_info.setdefault(fqn, (dt, shape, r))
            if (seen[0], seen[1]) != (dt, shape):
                raise PlanError(f"tensor {fqn!r}: rank {seen[2]} has dtype {seen[0]} shape {tuple(seen[1])} "
                                f"but rank {r} has dtype {dt} shape {tuple(shape)}")
            for bi, (offs, lens) in enumerate(boxes):
                holders.setdefault((fqn, tuple(offs), tuple(lens)), []).append((r, ti, bi))
    _check_coverage(tensor_info, holders)

    # Worst-fit: boxes held by one rank are fixed; replicated boxes go, largest first, to the
    # holder with the fewest bytes so far (ties: lowest rank).
    load = [0] * world
    assignments: list[dict] = [{"write": [], "shards": []} for _ in range(world)]
    replicated = []
    esize = {dt: element_size(dtype_from_name(dt)) for dt in {v[0] for v in tensor_info.values()}}
    for key, hs in holders.items():
        nbytes = math.prod(key[2]) * esize[tensor_info[key[0]][0]]
        if len(hs) == 1:
            r, ti, bi = hs[0]
            load[r] += nbytes
            assignments[r]["write"].append([ti, bi])
        else:
            replicated.append((nbytes, key, hs))
    replicated.sort(key=lambda x: (-x[0], x[1]))
    for nbytes, _, hs in replicated:
        r, ti, bi = min(hs, key=lambda h: (load[h[0]], h[0]))
        load[r] += nbytes
        assignments[r]["write"].append([ti, bi])

    grids: dict[str, list[int]] = {}
    shard_holders: dict[tuple, list[tuple[int, int]]] = {}
    for r, plan in enumerate(structures):
        for i, (fqn, grid, index) in enumerate(plan["sharded_objects"]):
            if grids.setdefault(fqn, grid) != grid:
                raise PlanError(f"sharded object {fqn!r}: ranks disagree on its grid ({grids[fqn]} vs {grid} "
                                f"on rank {r})")
            shard_holders.setdefault((fqn, tuple(index)), []).append((r, i))
    for hs in shard_holders.values():  # shards are small: spread them by count
        r, i = min(hs, key=lambda h: (len(assignments[h[0]]["shards"]), h[0]))
        assignments[r]["shards"].append(i)

    object_keys = list(structures[0]["objects"])
    for r, plan in enumerate(structures[1:], start=1):
        extra = set(plan["objects"]) - set(object_keys)
        if extra:
            raise PlanError(f"non-tensor value {min(extra)!r} exists on rank {r} but not on rank 0; "
                            "values that differ per rank belong under 'extra_state'")
    per_rank: dict[str, str] = {}
    for r, plan in enumerate(structures):
        for fqn, dt, _ in plan["per_rank"]:
            kind = "object" if dt is None else "tensor"
            if per_rank.setdefault(fqn, kind) != kind:
                raise PlanError(f"per-rank value {fqn!r} is a {kind} on rank {r} but a {per_rank[fqn]} on "
                                "another rank")
    info = {k: (v[0], v[1]) for k, v in tensor_info.items()}
    return GlobalSavePlan(assignments, info, object_keys, per_rank, grids, shard_holders, load)


def _check_coverage(tensor_info, holders) -> None:
    boxes_of: dict[str, list[tuple[tuple, tuple]]] = {}
    for fqn, offs, lens in holders:
        boxes_of.setdefault(fqn, []).append((offs, lens))
    for fqn, (_, shape, _) in tensor_info.items():
        boxes = boxes_of.get(fqn, [])
        total = math.prod(shape)
        covered = sum(math.prod(lens) for _, lens in boxes)
        if total == 0:
            continue
        overlap = (_first_overlap_np if len(shape) and len(boxes) >= _NUMPY_BOXES else _first_overlap)(boxes)
        if overlap is not None:
            (a_off, a_len), (b_off, b_len) = overlap
            raise PlanError(f"tensor {fqn!r}: saved boxes overlap without being identical: "
                            f"offsets {a_off} lengths {a_len} and offsets {b_off} lengths {b_len}; "
                            "ranks disagree about the sharding")
        if covered != total:
            raise PlanError(f"tensor {fqn!r} of shape {tuple(shape)}: the ranks' shards cover {covered} of "
                            f"{total} elements; some part of the tensor is held by no rank")


# A tensor with this many distinct boxes is checked with numpy: at 8,960 ranks with every
# parameter split over DP, the pure-Python sweep was three quarters of the global plan's time.
_NUMPY_BOXES = 64
_PAIRS_PER_CHUNK = 1 << 22


def _first_overlap(boxes: list[tuple[tuple, tuple]]):
    """Two boxes that overlap, or None. Sweep along dim 0: boxes rarely share many dim-0 ranges."""
    active: list[tuple[tuple, tuple]] = []
    for off, ln in sorted(boxes, key=lambda b: b[0]):
        if off:
            active = [a for a in active if a[0][0] + a[1][0] > off[0]]
        for a in active:
            if intersect(a[0], a[1], off, ln) is not None:
                return a, (off, ln)
        active.append((off, ln))
    return None


def _first_overlap_np(boxes: list[tuple[tuple, tuple]]):
    """`_first_overlap` for many boxes, vectorised: the same candidate pairs (after sorting by
    offsets, box j > i is a candidate while it starts in dim 0 before box i ends), tested at once."""
    import numpy as np
    off = np.array([b[0] for b in boxes], dtype=np.int64)
    end = off + np.array([b[1] for b in boxes], dtype=np.int64)
    order = np.lexsort(off.T[::-1])
    off, end = off[order], end[order]
    k = len(boxes)
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
                return boxes[order[first[p]]], boxes[order[second[p]]]
        i0 = i1
    return None


# ----------------------------------------------------------------------------- load

@dataclass(frozen=True)
class ReadItem:
    """Copy the part `offsets/lengths` (global coordinates) of `piece` into `dest`."""

    fqn: str
    piece: Piece
    offsets: tuple[int, ...]
    lengths: tuple[int, ...]
    dest: torch.Tensor


def read_items(fqn: str, tm: TensorMeta, target: torch.Tensor) -> list[ReadItem]:
    """What to read from the saved `tm` to fill the local part of `target`."""
    if tuple(target.shape) != tuple(tm.shape):
        raise ShapeMismatchError(f"tensor {fqn!r}: checkpoint has global shape {tuple(tm.shape)}, "
                                 f"target has {tuple(target.shape)}")
    if target.dtype != tm.dtype:
        raise ShapeMismatchError(f"tensor {fqn!r}: checkpoint has dtype {tm.dtype}, target has "
                                 f"{target.dtype}; cast the target or the checkpoint")
    items: list[ReadItem] = []
    for box in local_tensor(target).boxes:
        items.extend(box_read_items(fqn, tm, box))
    return items


@metrics.timed("plan")
def box_read_items(fqn: str, tm: TensorMeta, box: Box) -> list[ReadItem]:
    items = []
    for piece in tm.pieces:
        inter = intersect(box.offsets, box.lengths, piece.offsets, piece.lengths)
        if inter is None:
            continue
        off, ln = inter
        dest = box.view
        for d, (o, n) in enumerate(zip(off, ln)):
            dest = dest.narrow(d, o - box.offsets[d], n)
        items.append(ReadItem(fqn, piece, off, ln, dest))
    return items
