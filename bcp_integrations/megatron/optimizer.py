"""Megatron's distributed optimizer, saved in model space without gathering.

Megatron-core 0.16 offers two reshardable layouts for `DistributedOptimizer.sharded_state_dict`:

* `dp_reshardable`: 1-D bucket tensors (padding included), keyed per DP group. No communication,
  but the bucket layout depends on TP/PP, so only the DP degree may change. bcp saves and loads it
  as it is (plain 1-D ShardedTensors).
* `fully_reshardable`: model-space tensors `optimizer.state.<name>.<param key>` shaped like the
  parameters, so TP, PP and DP may all change — but saving gathers every DP rank's slices on DP
  rank 0 first (an all-gather of the whole optimizer state).

`fully_reshardable_param_state` writes the `fully_reshardable` layout without the gather: each DP
rank's flat slice of a (TP-local) parameter is decomposed into row-major boxes of the parameter's
global tensor (`flat_range_sharded_tensors`), whose data are views of the optimizer's own state
tensors. The checkpoint has exactly the keys and global shapes of Megatron's `fully_reshardable`,
so a resuming job loads it through Megatron's own `fully_reshardable` path, at any TP/PP/DP.

A parameter saved through a `ShardedTensorFactory` (SwiGLU's `linear_fc1`: the TP-local tensor is
[gate_r; up_r], saved as two boxes of the global [gate; up]) is handled the same way: the factory
is built over the model parameter itself (views, nothing copied) to learn which contiguous part of
the local tensor goes to which box, and the rank's flat slice is cut at those parts.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

from bcp_core.errors import BCPError

from .adapter import flat_range_sharded_tensors, iter_leaves

STATE_PREFIX = "optimizer.state"  # the prefix Megatron's fully_reshardable layout uses


def fully_reshardable_param_state(optimizer, model_sharded_state_dict: dict) -> dict[int, dict[str, Any]]:
    """`param_state` for a DistributedOptimizer sharded state dict, in fully_reshardable keys, gather-free.

    `model_sharded_state_dict` must come from `model.sharded_state_dict()` built over the same
    parameter tensors the optimizer holds (Megatron builds it with keep_vars for this). Use it in
    place of the `param_state` of `optimizer.sharded_state_dict(..., metadata=
    {"distrib_optim_sharding_type": "fully_reshardable"})` when saving; load with Megatron's own
    fully_reshardable sharded state dict.

    Returns {param index: {state name: [ShardedTensor, ...]}}, the nesting Megatron uses, with the
    lists holding the boxes of this rank's slice (empty slices are left out).
    """
    by_param: dict[int, ShardedTensor] = {}
    for _, sh in iter_leaves(model_sharded_state_dict):
        if isinstance(sh, ShardedTensorFactory):
            by_param[id(sh.data)] = sh
        elif isinstance(sh, ShardedTensor) and sh.data is not None:
            by_param[id(sh.data)] = sh
    out: dict[int, dict[str, Any]] = {}
    index = 0
    for gbuf_idx, gbuf_range_maps in enumerate(optimizer.gbuf_ranges):
        for dtype, bucket_maps in gbuf_range_maps.items():
            for bucket_idx, bucket_map in enumerate(bucket_maps):
                for model_param, ranges in bucket_map["param_map"].items():
                    sh = by_param.get(id(model_param))
                    where = f"buffer {gbuf_idx} ({dtype}) bucket {bucket_idx}, shape {tuple(model_param.shape)}"
                    if sh is None:
                        raise BCPError(f"distributed optimizer parameter in {where} is not in the model's "
                                       "sharded state dict; build it with keep_vars=True")
                    out[index] = _param_entry(optimizer, model_param, sh, ranges["param"], where)
                    index += 1
    return out


def _param_entry(optimizer, model_param, sh, param_range, where: str) -> dict[str, list[ShardedTensor]]:
    entry: dict[str, list[ShardedTensor]] = {}
    for name, t in optimizer._get_main_param_and_optimizer_states(model_param).items():
        # Scalars (Adam's `step`) live in the param groups, saved with the common state.
        if not isinstance(t, torch.Tensor) or t.dim() != 1:
            continue
        if t.numel() != param_range.size:
            raise BCPError(f"optimizer state {name!r} of {sh.key!r} has {t.numel()} elements, its slice "
                           f"[{param_range.start}, {param_range.end}) of the parameter has {param_range.size}")
        key = f"{STATE_PREFIX}.{name}.{sh.key}"
        entry[name] = []
        for part, first in _parts(sh, key, model_param, where):
            # the rank's slice [start, end) of the local tensor, cut to this part [first, first + numel)
            lo = max(param_range.start, first)
            hi = min(param_range.end, first + part.data.numel())
            if lo < hi:
                flat = t.detach()[lo - param_range.start:hi - param_range.start]
                entry[name] += flat_range_sharded_tensors(part.key, flat, part, lo - first)
    return entry


def _parts(sh, key: str, model_param: torch.Tensor, where: str) -> list[tuple[ShardedTensor, int]]:
    """The ShardedTensors (named `key`, Megatron's fully_reshardable naming) that save the TP-local
    parameter, each with the flat offset in the local tensor where its (contiguous) part starts."""
    if isinstance(sh, ShardedTensor):
        return [(replace(sh, key=key), 0)]
    local = model_param.detach()
    built = sh.build_fn(key, local, sh.replica_id, None)
    parts = [v for _, v in iter_leaves(built)]
    out, size = [], local.element_size()
    for part in parts:
        data = part.data if isinstance(part, ShardedTensor) else None
        if data is None or not data.is_contiguous() or data.untyped_storage().data_ptr() != \
                local.untyped_storage().data_ptr():
            raise BCPError(f"parameter {sh.key!r} ({where}): its ShardedTensorFactory builds a part that is not a "
                           "contiguous view of the local tensor; use Megatron's fully_reshardable layout")
        out.append((part, (data.data_ptr() - local.data_ptr()) // size))
    covered = sorted((first, first + p.data.numel()) for p, first in out)
    if [a for a, _ in covered] != [0] + [b for _, b in covered[:-1]] or covered[-1][1] != local.numel():
        raise BCPError(f"parameter {sh.key!r} ({where}): the parts its ShardedTensorFactory builds do not tile "
                       f"the local tensor ({covered} of {local.numel()} elements)")
    return out

