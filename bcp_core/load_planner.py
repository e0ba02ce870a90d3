"""Load planning: from the checkpoint's metadata and the live targets to the reads that fill them.

Each rank intersects the boxes it holds with the saved pieces and reads only the overlapping
byte ranges (`read_items`); values are decoded, sharded objects handed over (whole, or as a
`ShardReader` the owner picks from), per-rank values chosen for this rank. `plan_load` decides all
of it without reading a tensor byte; the load driver (bcp_core.loader) executes the plan.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from . import codec, metrics
from .errors import BCPError, ShapeMismatchError
from .flatten import LoadTarget, LoadTargets
from .metadata import CheckpointMetadata, ObjectValue, Piece, TensorMeta
from .shards import Box, intersect, local_tensor


@dataclass(frozen=True)
class ReadItem:
    """Copy the part `offsets/lengths` (global coordinates) of `piece` into `dest`."""

    fqn: str
    piece: Piece
    offsets: tuple[int, ...]
    lengths: tuple[int, ...]
    dest: torch.Tensor


@dataclass
class LoadPlan:
    """What one rank does to load: set values, read byte ranges, hand over new tensors."""

    items: list[ReadItem] = field(default_factory=list)
    assign: list[Callable[[], None]] = field(default_factory=list)  # values set before any read
    late: list[tuple[LoadTarget, torch.Tensor]] = field(default_factory=list)  # set after reading
    missing: list[str] = field(default_factory=list)     # requested but not in the checkpoint
    unexpected: list[str] = field(default_factory=list)  # in the checkpoint under a requested module/optimizer


def plan_load(md: CheckpointMetadata, lt: LoadTargets, rank: int, allow_pickle: bool,
              shard_reader: Callable[[str], Any]) -> LoadPlan:
    """The plan that fills `lt` from the checkpoint `md` on `rank`. `shard_reader(fqn)` opens a
    sharded object's shards for reading."""
    plan = LoadPlan()
    saved = md.keys()
    for t in fill_containers(lt, saved):  # keys the checkpoint has below a plain dict the dict lacks
        lt.targets[t.fqn] = t
    plan.missing = sorted(k for k, t in lt.targets.items() if k not in saved and not t.optional)
    covered = tuple(f"{p}." for p in lt.structured)
    plan.unexpected = sorted(k for k in saved if k.startswith(covered) and k not in lt.targets)

    for fqn, target in lt.targets.items():
        if fqn not in saved:
            continue
        if fqn in md.objects:
            plan.assign.append(_setter(target, lambda raw=md.objects[fqn].encoded, fqn=fqn:
                                       codec.decode(raw, fqn, allow_pickle)))
        elif fqn in md.sharded_objects:
            plan.assign.append(_shard_handover(target, fqn, shard_reader))
        elif fqn in md.per_rank:
            v = md.per_rank[fqn].variant_for(rank)
            if isinstance(v, ObjectValue):
                plan.assign.append(_setter(target, lambda raw=v.encoded, fqn=fqn: codec.decode(raw, fqn, allow_pickle)))
            else:
                t = target.tensor
                if t is None or tuple(t.shape) != v.shape or t.dtype != v.dtype:
                    t = torch.empty(v.shape, dtype=v.dtype)
                    plan.late.append((target, t))
                plan.items.extend(box_read_items(fqn, v, Box((0,) * len(v.shape), v.shape, t)))
        else:
            tm = md.tensors[fqn]
            if target.tensor is None:
                if target.set_value is None:
                    raise ShapeMismatchError(f"{fqn!r} is a tensor in the checkpoint but not in the target")
                t = torch.empty(tm.shape, dtype=tm.dtype)
                plan.late.append((target, t))
                plan.items.extend(box_read_items(fqn, tm, Box((0,) * len(tm.shape), tm.shape, t)))
            else:
                plan.items.extend(read_items(fqn, tm, target.tensor))
    return plan


def set_target(target: LoadTarget, value: Any) -> None:
    if target.set_value is None:
        raise BCPError(f"cannot set {target.fqn!r}")
    target.set_value(value)


def _setter(target: LoadTarget, value: Callable[[], Any]) -> Callable[[], None]:
    return lambda: set_target(target, value())


def _shard_handover(target: LoadTarget, fqn: str, shard_reader: Callable[[str], Any]) -> Callable[[], None]:
    """A sharded object goes to its target whole (a reader), as a reader the owner reshards from
    (index None), or as the one shard the target's index names."""
    def assign() -> None:
        reader = shard_reader(fqn)
        if target.shard is None:
            set_target(target, reader)
        elif target.shard.index is None:
            target.shard.value, target.shard.grid = reader, reader.grid
        else:
            if target.shard.grid and tuple(target.shard.grid) != tuple(reader.grid):
                raise ShapeMismatchError(
                    f"sharded object {fqn!r}: the checkpoint's grid is {tuple(reader.grid)}, the target asks "
                    f"for index {tuple(target.shard.index)} of grid {tuple(target.shard.grid)}; read it "
                    "with index=None and reshard")
            target.shard.value = reader[target.shard.index]
    return assign


def fill_containers(lt: LoadTargets, saved: set[str]) -> list[LoadTarget]:
    """Targets for saved keys below plain dicts of the state that the dicts do not have yet."""
    out = []
    containers = sorted(lt.containers, key=lambda c: -len(c[0]))
    for k in sorted(saved - set(lt.targets)):
        for prefix, d in containers:
            if k.startswith(prefix + "."):
                parts = k[len(prefix) + 1:].split(".")
                node = d
                for p in parts[:-1]:
                    nxt = node.get(p)
                    if not isinstance(nxt, dict):
                        nxt = node[p] = {}
                    node = nxt

                def setter(v, node=node, key=parts[-1]):
                    node[key] = v
                out.append(LoadTarget(k, False, set_value=setter))
                break
    return out


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
