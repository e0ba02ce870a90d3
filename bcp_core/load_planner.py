"""Load planning: from the checkpoint's metadata and the live targets to the reads that fill them.

Each rank intersects the boxes it holds with the saved pieces and reads only the overlapping
byte ranges (`read_items`); values are decoded, sharded objects handed over (whole, or as a
`ShardReader` the owner picks from), per-rank values chosen for this rank. `plan_load` decides all
of it without reading a tensor byte and without changing anything of the caller's (keys, shapes and
dtypes are checked here); the load driver (bcp_core.loader) executes the plan.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from . import codec, metrics
from .errors import BCPError, ShapeMismatchError
from .flatten import LoadTarget, LoadTargets
from .metadata import CheckpointMetadata, ObjectValue, TensorMeta
from .plan_records import LoadPlan, ReadItem, ValueLoad
from .shards import Box, intersect, local_tensor


def plan_load(md: CheckpointMetadata, lt: LoadTargets, rank: int, allow_pickle: bool,
              shard_reader: Callable[[str], Any],
              check_files: Callable[[str, TensorMeta], None] = lambda fqn, tm: None,
              reads: Callable[[str, TensorMeta, Any, bool], list[ReadItem]] | None = None) -> LoadPlan:
    """The plan that fills `lt` from the checkpoint `md` on `rank`. `shard_reader(fqn)` opens a
    sharded object's shards for reading. `check_files(fqn, tm)` raises unless the data files hold
    the bytes of `tm`'s pieces: called before a tensor is allocated from the metadata's shape.
    `reads(fqn, tm, target, fresh)` gives the reads that fill a target tensor (default `read_items`;
    a mapped load's come from other keys' pieces, bcp_core.mapping)."""
    reads = reads or read_items
    items: list[ReadItem] = []
    values: list[ValueLoad] = []
    late: list[tuple[LoadTarget, torch.Tensor]] = []
    saved = md.keys()
    # keys the checkpoint has below a plain dict the dict lacks
    targets = {**lt.targets, **{t.fqn: t for t in fill_containers(lt, saved)}}
    missing = sorted(k for k, t in targets.items() if k not in saved and not t.optional)
    covered = tuple(f"{p}." for p in lt.structured)
    unexpected = sorted(k for k in saved if k.startswith(covered) and k not in targets)

    for fqn, target in targets.items():
        if fqn not in saved:
            continue
        if fqn in md.objects:
            values.append(_decoded(target, md.objects[fqn].encoded, allow_pickle))
        elif fqn in md.sharded_objects:
            values.append(_shard_handover(target, fqn, shard_reader))
        elif fqn in md.per_rank:
            v = md.per_rank[fqn].variant_for(rank)
            if isinstance(v, ObjectValue):
                values.append(_decoded(target, v.encoded, allow_pickle))
            elif target.tensor is not None and tuple(target.tensor.shape) == v.shape and target.tensor.dtype == v.dtype:
                items.extend(box_read_items(fqn, v, Box((0,) * len(v.shape), v.shape, target.tensor), target.fresh))
            else:
                items.extend(_new_tensor(late, target, v, check_files, read_items))
        else:
            tm = md.tensors[fqn]
            if target.tensor is None:
                if target.set_value is None:
                    raise ShapeMismatchError(f"{fqn!r} is a tensor in the checkpoint but not in the target")
                items.extend(_new_tensor(late, target, tm, check_files, reads))
            else:
                items.extend(reads(fqn, tm, target.tensor, target.fresh))
    return LoadPlan(tuple(items), tuple(values), tuple(late), tuple(missing), tuple(unexpected))


def _new_tensor(late: list[tuple[LoadTarget, torch.Tensor]], target: LoadTarget, tm: TensorMeta,
                check_files: Callable[[str, TensorMeta], None], reads) -> list[ReadItem]:
    """Read `tm` whole into a new tensor that goes to the target (added to `late`) once the load succeeded."""
    if target.set_value is None:
        raise BCPError(f"cannot set {target.fqn!r}: it takes no new tensor of shape {tuple(tm.shape)}")
    check_files(target.fqn, tm)  # the shape is a claim of the metadata until the files back it
    t = torch.empty(tm.shape, dtype=tm.dtype)
    late.append((target, t))
    return reads(target.fqn, tm, t, True)


def set_target(target: LoadTarget, value: Any) -> None:
    if target.set_value is None:
        raise BCPError(f"cannot set {target.fqn!r}")
    target.set_value(value)


def _decoded(target: LoadTarget, raw: Any, allow_pickle: bool) -> ValueLoad:
    if target.set_value is None:
        raise BCPError(f"cannot set {target.fqn!r}: the checkpoint holds a value there, the target a tensor")

    def fetch() -> Any:
        value = codec.decode(raw, target.fqn, allow_pickle)
        if target.check is not None:
            target.check(value)
        return value
    return ValueLoad(target.fqn, fetch, target.set_value)


def _shard_handover(target: LoadTarget, fqn: str, shard_reader: Callable[[str], Any]) -> ValueLoad:
    """A sharded object goes to its target whole (a reader), as a reader the owner reshards from
    (index None), or as the one shard the target's index names (read when fetched)."""
    shard = target.shard
    if shard is None and target.set_value is None:
        raise BCPError(f"cannot set {fqn!r}: the checkpoint holds a sharded object there, the target a tensor")

    def fetch() -> Any:
        reader = shard_reader(fqn)
        if shard is None or shard.index is None:
            return reader
        if shard.grid and tuple(shard.grid) != tuple(reader.grid):
            raise ShapeMismatchError(
                f"sharded object {fqn!r}: the checkpoint's grid is {tuple(reader.grid)}, the target asks "
                f"for index {tuple(shard.index)} of grid {tuple(shard.grid)}; read it with index=None and reshard")
        return reader[shard.index]

    def hand_over(value: Any) -> None:
        if shard is None:
            set_target(target, value)
        elif shard.index is None:
            shard.value, shard.grid = value, value.grid
        else:
            shard.value = value
    return ValueLoad(fqn, fetch, hand_over)


def fill_containers(lt: LoadTargets, saved: set[str]) -> list[LoadTarget]:
    """Targets for saved keys below plain dicts of the state that the dicts do not have yet. The
    dicts are left as they are until a value is handed over: its setter makes the nested dicts on
    the way (replacing what is not a dict there, as the checkpoint's keys say)."""
    out = []
    containers = sorted(lt.containers, key=lambda c: -len(c[0]))
    for k in sorted(saved - set(lt.targets)):
        for prefix, d in containers:
            if k.startswith(prefix + "."):
                parts = k[len(prefix) + 1:].split(".")

                def setter(v, d=d, parts=parts):
                    node = d
                    for p in parts[:-1]:
                        if not isinstance(node.get(p), dict):
                            node[p] = {}
                        node = node[p]
                    node[parts[-1]] = v
                out.append(LoadTarget(k, False, set_value=setter))
                break
    return out


def read_items(fqn: str, tm: TensorMeta, target: torch.Tensor, fresh: bool = False) -> list[ReadItem]:
    """What to read from the saved `tm` to fill the local part of `target`."""
    if tuple(target.shape) != tuple(tm.shape):
        raise ShapeMismatchError(f"tensor {fqn!r}: checkpoint has global shape {tuple(tm.shape)}, "
                                 f"target has {tuple(target.shape)}")
    if target.dtype != tm.dtype:
        raise ShapeMismatchError(f"tensor {fqn!r}: checkpoint has dtype {tm.dtype}, target has "
                                 f"{target.dtype}; cast the target or the checkpoint")
    items: list[ReadItem] = []
    for box in local_tensor(target).boxes:
        items.extend(box_read_items(fqn, tm, box, fresh))
    return items


@metrics.timed("plan")
def box_read_items(fqn: str, tm: TensorMeta, box: Box, fresh: bool = False) -> list[ReadItem]:
    items = []
    for piece in tm.pieces:
        inter = intersect(box.offsets, box.lengths, piece.offsets, piece.lengths)
        if inter is None:
            continue
        off, ln = inter
        dest = box.view
        for d, (o, n) in enumerate(zip(off, ln)):
            dest = dest.narrow(d, o - box.offsets[d], n)
        items.append(ReadItem(fqn, piece, off, ln, dest, fresh))
    return items
