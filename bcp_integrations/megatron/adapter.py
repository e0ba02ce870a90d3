"""Megatron sharded state dicts <-> bcp state.

Megatron describes each rank's share of the training state as a nested dict (and lists) whose
leaves are `ShardedTensor`s, `ShardedObject`s, `ShardedTensorFactory`s, `LocalNonpersistentObject`s
and plain values. bcp wants a flat dict keyed by FQN whose tensor values know their boxes in the
global tensor. The mapping:

* `ShardedTensor` -> one box of the bcp tensor named by its `key`. The global shape already holds
  the prepended axes (`prepend_axis_num`, e.g. the layer axis of stacked transformer layers); the
  box has length 1 on those axes, so the local data is viewed with them unsqueezed. Several
  ShardedTensors with one key on one rank (Megatron emits that for distributed-optimizer buckets,
  and `flat_range_sharded_tensors` does for flat slices) become one `ShardedView` with several boxes.
  Replicas (`replica_id` not all zero) are boxes identical to the main replica's, so the planner
  writes each box once, from the least-loaded holder.
* `ShardedObject` -> an `ObjectShard` at index `global_offset` of grid `global_shape`, named by
  Megatron's `unique_key` (`<key>/shard_<offset>_<shape>`): one rank often holds several shards
  of one key (a `_extra_state` per stacked layer), and bcp names one shard per rank and name.
  Only the main replica is saved.
* `ShardedTensorFactory` -> built before saving and merged after loading.
* `LocalNonpersistentObject` -> not saved; unwrapped on load.

Plain values never reach a strategy (Megatron puts them in `common.pt`); when the helpers here are
used directly, they are saved as bcp values.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass, field
from typing import Any

import torch
from megatron.core.dist_checkpointing.mapping import (LocalNonpersistentObject, ShardedObject,
                                                      ShardedTensor, ShardedTensorFactory, is_main_replica)

import bcp_core as bcp
from bcp_core.adapters import ModuleAdapter, register_adapter
from bcp_core.errors import BCPError, ShapeMismatchError
from bcp_core.loader import load_checkpoint
from bcp_core.shards import Box, ObjectShard, ShardedView, range_boxes
from bcp_core.storage import storage_for
from bcp_core.utils import load_threads, this_rank

from .layouts import saved_dtypes, saved_tensors, to_saved_layout

# io.BytesIO (Transformer Engine's `_extra_state`) has no place in bcp's safe codec; it travels as
# bytes inside this one-key dict and is turned back into a BytesIO on load.
_BYTESIO_TAG = "__megatron_bytesio__"

Path = tuple  # the keys / list indices leading to a leaf of a nested sharded state dict


def iter_leaves(tree: Any, path: Path = ()):
    """(path, leaf) for every non-container leaf of nested dicts and lists, in a stable order."""
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from iter_leaves(v, (*path, k))
    elif isinstance(tree, list):
        for i, v in enumerate(tree):
            yield from iter_leaves(v, (*path, i))
    else:
        yield path, tree


def map_leaves(tree: Any, fn):
    """A copy of nested dicts and lists with every leaf replaced by fn(path, leaf)."""
    def walk(node, path):
        if isinstance(node, dict):
            return {k: walk(v, (*path, k)) for k, v in node.items()}
        if isinstance(node, list):
            return [walk(v, (*path, i)) for i, v in enumerate(node)]
        return fn(path, node)
    return walk(tree, ())


def _where(path: Path) -> str:
    return "/".join(map(str, path)) or "<root>"


def box_of(sh: ShardedTensor, data: torch.Tensor) -> Box:
    """The box of the global tensor that `sh` describes, viewing `data` (local shape) in it."""
    p = sh.prepend_axis_num
    lengths = (1,) * p + tuple(sh.local_shape)
    if tuple(data.shape) != tuple(sh.local_shape):
        raise ShapeMismatchError(f"ShardedTensor {sh.key!r} on rank {this_rank()}: data has shape "
                                 f"{tuple(data.shape)}, local_shape is {tuple(sh.local_shape)}")
    if len(lengths) != len(sh.global_shape) or len(sh.global_offset) != len(sh.global_shape):
        raise ShapeMismatchError(f"ShardedTensor {sh.key!r} on rank {this_rank()}: global shape "
                                 f"{tuple(sh.global_shape)}, offset {tuple(sh.global_offset)}, local shape "
                                 f"{tuple(sh.local_shape)} with {p} prepended axes do not agree")
    for d, (o, n, g) in enumerate(zip(sh.global_offset, lengths, sh.global_shape)):
        if o < 0 or o + n > g:
            raise ShapeMismatchError(f"ShardedTensor {sh.key!r} on rank {this_rank()}: axis {d} covers "
                                     f"[{o}, {o + n}) outside the global size {g}")
    view = data
    for _ in range(p):  # a view, never a copy: loading writes through it into `data`
        view = view.unsqueeze(0)
    return Box(tuple(sh.global_offset), lengths, view)


def _check_flat(sh: ShardedTensor) -> None:
    if sh.flattened_range is not None:
        raise BCPError(f"ShardedTensor {sh.key!r} has a flattened_range, which Megatron-core 0.16 "
                       "removed; describe flat slices with bcp_integrations.megatron."
                       "flat_range_sharded_tensors instead")


def _encode_object(value: Any) -> Any:
    if isinstance(value, io.BytesIO):
        return {_BYTESIO_TAG: value.getvalue()}
    return value


def _decode_object(value: Any) -> Any:
    if isinstance(value, dict) and set(value) == {_BYTESIO_TAG}:
        return io.BytesIO(value[_BYTESIO_TAG])
    return value


def build_factories(sharded_state_dict: dict) -> tuple[dict, dict]:
    """(state with factories built, the factories by path) — merge them back with `merge_factories`."""
    factories = {p: v for p, v in iter_leaves(sharded_state_dict) if isinstance(v, ShardedTensorFactory)}
    if not factories:
        return sharded_state_dict, {}
    return map_leaves(sharded_state_dict,
                      lambda p, v: v.build() if isinstance(v, ShardedTensorFactory) else v), factories


def merge_factories(loaded: dict, factories: dict) -> dict:
    """Replace each factory's loaded sub-tree by its merged tensor (inverse of `build_factories`)."""
    for path, fac in factories.items():
        node = loaded
        for k in path[:-1]:
            node = node[k]
        node[path[-1]] = fac.merge_fn(node[path[-1]])
    return loaded


# ----------------------------------------------------------------------------- the walk save and load share

def _leaves(sharded_state_dict: dict):
    """(path, leaf) of a sharded state dict whose factories are built, LocalNonpersistentObjects left out
    (never saved; a load hands back their local value)."""
    for path, v in iter_leaves(sharded_state_dict):
        if isinstance(v, ShardedTensorFactory):
            raise BCPError(f"{_where(path)}: ShardedTensorFactory {v.key!r} was not built; call "
                           "build_factories first")
        if isinstance(v, LocalNonpersistentObject):
            continue
        if isinstance(v, ShardedTensor):
            _check_flat(v)
        yield path, v


class _Keys:
    """The bcp keys one rank's leaves use: each must name one global thing (a tensor's shape and dtype, an
    object, a value), and a tensor key gathers the boxes of its leaves into one ShardedView."""

    def __init__(self):
        self.what: dict[str, tuple] = {}
        self.boxes: dict[str, list[Box]] = {}

    def claim(self, key: str, what: tuple, path: Path) -> None:
        prev = self.what.setdefault(key, what)
        if prev != what:
            raise BCPError(f"key {key!r} is used on rank {this_rank()} for different things: {prev} and {what} "
                           f"(second at {_where(path)})")

    def box(self, key: str, gshape: tuple, dtype: torch.dtype, box: Box, path: Path) -> None:
        self.claim(key, (gshape, dtype), path)
        self.boxes.setdefault(key, []).append(box)

    def views(self) -> dict[str, ShardedView]:
        """One ShardedView per tensor key; a box held twice (shared or tied weights listed twice) once.
        A second holder that is other memory is in `repeats`, with the box kept for it."""
        out = {}
        self.repeats: list[tuple[torch.Tensor, torch.Tensor]] = []  # (kept view, other view)
        for key, boxes in self.boxes.items():
            gshape, dtype = self.what[key]
            unique: dict[tuple, Box] = {}
            for b in boxes:
                kept = unique.setdefault((b.offsets, b.lengths), b)
                if kept is not b and not _same_memory(kept.view, b.view):
                    self.repeats.append((kept.view, b.view))
            out[key] = ShardedView(gshape, dtype, list(unique.values()))
        return out


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.stride() == b.stride() and a.dtype == b.dtype


# ----------------------------------------------------------------------------- save

def save_state(sharded_state_dict: dict) -> dict:
    """The bcp state (flat, FQN = Megatron key) for saving a sharded state dict (factories built)."""
    keys = _Keys()
    state: dict[str, Any] = {}
    for path, v in _leaves(sharded_state_dict):
        if isinstance(v, ShardedTensor):
            if v.data is None:
                raise BCPError(f"ShardedTensor {v.key!r} at {_where(path)} on rank {this_rank()} has no data")
            if v.data.dtype != v.dtype:
                raise ShapeMismatchError(f"ShardedTensor {v.key!r} on rank {this_rank()}: data dtype "
                                         f"{v.data.dtype} differs from its dtype {v.dtype}")
            keys.box(v.key, tuple(v.global_shape), v.dtype, box_of(v, v.data.detach()), path)
        elif isinstance(v, ShardedObject):
            if not is_main_replica(v.replica_id):
                # Unlike tensor replicas, object replicas may differ (e.g. per-TP-rank extra state);
                # Megatron keeps the main one, and so must we, or the planner sees a conflict.
                continue
            keys.claim(v.unique_key, ("object",), path)
            state[v.unique_key] = ObjectShard(_encode_object(v.data), tuple(v.global_offset),
                                              tuple(v.global_shape))
        else:
            key = ".".join(map(str, path))
            keys.claim(key, ("value",), path)
            state[key] = v
    return {**state, **keys.views()}


# ----------------------------------------------------------------------------- load

@dataclass
class LoadPlan:
    """The bcp state to load into, and how to rebuild Megatron's loaded state dict from it.

    What goes into the caller's tensors besides the load's own in-place reads (casts, zeros past a
    smaller saved shape, boxes requested twice) happens in `result`, once the load has succeeded:
    a failed load leaves them as they were."""

    state: dict
    tensors: dict[Path, torch.Tensor] = field(default_factory=dict)
    objects: dict[Path, tuple[str, ObjectShard]] = field(default_factory=dict)
    values: dict[Path, str] = field(default_factory=dict)   # plain values, by their bcp key
    casts: dict[Path, torch.Tensor] = field(default_factory=dict)  # read in the saved dtype, cast on result
    # allow_shape_mismatch: the local lengths read from the checkpoint (None: nothing); the rest is zeroed
    clipped: dict[Path, tuple[int, ...] | None] = field(default_factory=dict)
    repeats: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # (read, copied into)

    def result(self, sharded_state_dict: dict) -> dict:
        """The sharded state dict with each leaf replaced by what was loaded for it."""
        for read, other in self.repeats:
            other.copy_(read)
        for path, buffer in self.casts.items():
            self.tensors[path].copy_(buffer)
        for path, lengths in self.clipped.items():
            data = self.tensors[path]
            if lengths is None:
                data.zero_()
                continue
            for d, n in enumerate(lengths):
                data.narrow(d, n, data.shape[d] - n).zero_()

        def fill(path, v):
            if isinstance(v, ShardedTensor):
                return self.tensors[path]
            if isinstance(v, ShardedObject):
                return _decode_object(self.objects[path][1].value)
            if isinstance(v, LocalNonpersistentObject):
                return v.unwrap()
            if path in self.values:
                return self.state[self.values[path]]
            return v
        return map_leaves(sharded_state_dict, fill)


def load_state(sharded_state_dict: dict, saved_shapes: dict[str, tuple] | None = None,
               saved_dtypes: dict[str, torch.dtype] | None = None) -> LoadPlan:
    """The bcp state for loading a sharded state dict (factories built) in place.

    ShardedTensors with data are loaded into it in place (what torch_dist does too); those without
    get a new tensor. `saved_shapes` (key -> saved global shape) serves `allow_shape_mismatch`
    tensors: only the part inside both shapes is read, the rest is zeroed. A tensor whose
    `saved_dtypes` entry differs from its own dtype is read in the saved dtype and cast into
    place by `LoadPlan.result` (torch_dist casts too: a bf16 model loads an fp32 checkpoint).
    """
    plan = LoadPlan({})
    keys = _Keys()
    for path, v in _leaves(sharded_state_dict):
        if isinstance(v, ShardedTensor):
            # detach: parameters require grad, and loading writes into their storage in place
            data = v.data.detach() if v.data is not None else torch.empty(v.local_shape, dtype=v.dtype)
            plan.tensors[path] = data
            gshape, dtype = tuple(v.global_shape), v.dtype
            saved_dtype = (saved_dtypes or {}).get(v.key, dtype)
            if saved_dtype != dtype:
                dtype = saved_dtype
                data = plan.casts[path] = torch.empty(v.local_shape, dtype=dtype)
            box = box_of(v, data)
            if v.allow_shape_mismatch:
                if saved_shapes is None or v.key not in saved_shapes:
                    raise BCPError(f"ShardedTensor {v.key!r} allows a shape mismatch but its saved shape "
                                   "is unknown")
                gshape, box = _clip(box, saved_shapes[v.key])
                plan.clipped[path] = box.lengths[v.prepend_axis_num:] if box is not None else None
                if box is None:
                    continue
            keys.box(v.key, gshape, dtype, box, path)
        elif isinstance(v, ShardedObject):
            keys.claim(v.unique_key, ("object",), path)
            # the same shard asked for twice on this rank is read once, for both. Its value is the
            # target's own until the load hands over the saved one (a load through a mapping reads
            # no objects: they keep their own)
            shard = plan.state.setdefault(v.unique_key, ObjectShard(v.data, tuple(v.global_offset),
                                                                    tuple(v.global_shape)))
            plan.objects[path] = (v.unique_key, shard)
        else:
            key = ".".join(map(str, path))
            plan.state[key] = v
            plan.values[path] = key
    plan.state.update(keys.views())
    plan.repeats = keys.repeats
    return plan


def _clip(box: Box, saved_shape: tuple):
    """For allow_shape_mismatch: the box restricted to the saved tensor (`LoadPlan.result` zeroes the
    rest of the data once the load has succeeded)."""
    if len(saved_shape) != len(box.offsets):
        raise ShapeMismatchError(f"saved tensor has {len(saved_shape)} dims, the target has "
                                 f"{len(box.offsets)}")
    offs, lens, view = [], [], box.view
    for d, (o, n, g) in enumerate(zip(box.offsets, box.lengths, saved_shape)):
        n = min(n, g - o)
        if n <= 0:
            return tuple(saved_shape), None
        view = view.narrow(d, 0, n)
        offs.append(o)
        lens.append(n)
    return tuple(saved_shape), Box(tuple(offs), tuple(lens), view)


# ----------------------------------------------------------------------------- flat slices


def flat_range_sharded_tensors(key: str, flat: torch.Tensor, param: ShardedTensor, start: int,
                               replica_id=0) -> list[ShardedTensor]:
    """ShardedTensors for a flat slice of a (TP-local) parameter, in the parameter's global space.

    `flat` holds elements [start, start + flat.numel()) of `param`'s local data flattened in row
    major order — what a distributed-optimizer rank owns of that parameter (its main weight or an
    Adam moment). Each row-major box of that range becomes a ShardedTensor named `key` whose data
    is a view of `flat`, placed in `param`'s global shape (prepended axes and TP offset included).
    `axis_fragmentations=None` marks the grid irregular, so Megatron leaves the coverage check to
    the backend. Saved with bcp, the state reshards across DP (other slices) and TP/PP (other
    parameter shards) alike; Megatron's own dp_reshardable format only allows DP changes.
    """
    _check_flat(param)
    local = tuple(param.local_shape)
    stop = start + flat.numel()
    if flat.dim() != 1 or start < 0 or stop > math.prod(local):
        raise ShapeMismatchError(f"{key!r}: flat slice [{start}, {stop}) (data shape {tuple(flat.shape)}) "
                                 f"does not lie in parameter {param.key!r} of local shape {local}")
    p = param.prepend_axis_num
    out = []
    for offs, lens, first in range_boxes(local, start, stop):
        data = flat[first - start:first - start + math.prod(lens)].view(lens)
        goff = tuple(param.global_offset[:p]) + tuple(o + g for o, g in zip(offs, param.global_offset[p:]))
        out.append(ShardedTensor(key, data, flat.dtype, lens, tuple(param.global_shape), goff,
                                 axis_fragmentations=None, replica_id=replica_id, prepend_axis_num=p))
    return out


# ----------------------------------------------------------------------------- entry points

def save(sharded_state_dict: dict, path: str, *, async_save: bool = False, **kwargs) -> bcp.SaveHandle:
    """Save a Megatron sharded state dict with bcp, with or without dist_checkpointing around it.

    The "megatron" adapter builds the factories (dist_checkpointing has built them already when it
    calls the strategy) and flattens the state inside the save, so that a bad state on one rank
    fails the save on every rank at once; plain values, which dist_checkpointing would put in
    common.pt, are saved as bcp values. `kwargs` go to `bcp_core.save`.
    """
    return bcp.save(str(path), sharded_state_dict, framework="megatron", async_save=async_save, **kwargs)


def load(sharded_state_dict: dict, path: str, *, mapping=None, **kwargs) -> dict:
    """Load into a Megatron sharded state dict of any layout; returns the loaded state dict.

    ShardedTensors with data are filled in place; factories are merged back. `kwargs` go to
    `bcp_core.load` (strict=True by default: a key missing from the checkpoint is an error).

    A checkpoint saved in another of Megatron's key layouts (stacked or per layer and expert,
    `singleton_local_shards`; chained optimizers' `chained_<n>.` prefixes) loads too (layouts.py).

    `mapping`: a checkpoint of another model family or framework, seen through a
    `bcp_core.mapping.Mapping` (e.g. `bcp.mapping.hf_to_megatron(hf_config)` for a Hugging Face
    Llama checkpoint saved by bcp). Only what the mapping makes is read: the weights, and the
    DistributedOptimizer's `fully_reshardable` state (moments; the fp32 master copy from the source's
    weights). Plain values and ShardedObjects of the state dict (the optimizer's param groups, extra
    state) keep the target's own, except the optimizer step: every param group's `step` is set to
    the source's (docs/mapping.md). `mapping="auto"` refuses: a Megatron state does not say which
    model family it is.
    """
    failure, prepared = None, None
    try:
        md, mapped = bcp.inspect(str(path)), None
        if mapping is not None:
            from bcp_core.mapping import resolve_mapping
            m = resolve_mapping(mapping, md, {}, _ADAPTER)
            if m is not None:
                mapped = m.bind(md, storage_for(str(path)))
                md = mapped.metadata
        prepared = PreparedLoad.of(sharded_state_dict, md, mapped)
    except Exception as e:  # noqa: BLE001 - raised on every rank of a collective load, not only here
        failure = e
    num_threads = kwargs.pop("num_threads", None) or load_threads()
    load_checkpoint(str(path), prepared.state if prepared else {}, "megatron", mapping=prepared.mapping if prepared
                    else None, num_threads=num_threads, failure=failure, **kwargs)
    result = prepared.result()
    if prepared.mapped is not None:
        step = prepared.mapped.source_step()
        if step is not None:
            _set_group_steps(result, step)
    return result


@dataclass
class PreparedLoad:
    """What a load into a sharded state dict reads into (`state`) and how its result is rebuilt
    (`result`), decided before the load reads anything."""

    built: dict
    factories: dict
    plan: LoadPlan
    state: dict
    mapped: Any = None

    @property
    def mapping(self):
        return self.mapped.mapping if self.mapped is not None else None

    @classmethod
    def of(cls, sharded_state_dict: dict, md, mapped=None) -> PreparedLoad:
        """`md`: the checkpoint's metadata (seen through `mapped`, a bound mapping, if given)."""
        built, factories = build_factories(sharded_state_dict)
        keys = {v.key for _, v in iter_leaves(built) if isinstance(v, ShardedTensor)}
        plan = load_state(built, {k: tm.shape for k, tm in saved_tensors(keys, md).items()}, saved_dtypes(keys, md))
        state = plan.state
        if mapped is not None:  # only tensors come through a mapping; the rest stays the target's
            state = {k: v for k, v in plan.state.items() if isinstance(v, ShardedView)}
        state = to_saved_layout(state, md)  # saved per layer / expert, or behind chained_<n>., asked otherwise
        return cls(built, factories, plan, state, mapped)

    def result(self) -> dict:
        """Megatron's loaded state dict, once the load has read into `state`."""
        return merge_factories(self.plan.result(self.built), self.factories)


def _set_group_steps(tree: Any, step: int) -> None:
    """`step` of every optimizer param group (a dict in a list under "param_groups") in `tree`."""
    if isinstance(tree, dict):
        groups = tree.get("param_groups")
        if isinstance(groups, list):
            for g in groups:
                if isinstance(g, dict):
                    g["step"] = step
        for v in tree.values():
            _set_group_steps(v, step)
    elif isinstance(tree, list):
        for v in tree:
            _set_group_steps(v, step)


class MegatronAdapter(ModuleAdapter):
    """`framework="megatron"`: a save gets Megatron's sharded state dict and flattens it here
    (`save_state`, inside the save's exchange of errors); a load gets it flattened by `load_state`
    (ShardedViews and ObjectShards), so the generic handling serves it; the name is recorded in
    the checkpoint's metadata."""

    name = "megatron"

    def state_to_save(self, state: dict) -> dict:
        built, _ = build_factories(state)
        return save_state(built)

    def matches(self, module) -> bool:
        return False  # never auto-detected: Megatron state is not a module


_ADAPTER = MegatronAdapter()
register_adapter(_ADAPTER)
