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



# ----------------------------------------------------------------------------- a chain of optimizers

_GROUP_KEYS = ("wd_mult", "lr_mult", "is_decoupled_lr")  # Megatron's identifiers of a param group, but for EP


def chained_optimizer_state(optimizer, loaded: dict) -> dict:
    """The optimizer state `dist_checkpointing.load` returned for `optimizer.sharded_state_dict(...)`,
    made into what `optimizer.load_state_dict` takes, whatever chain of optimizers saved it.

    Megatron builds a second DistributedOptimizer for the experts when expert parallelism is on (EP>1)
    and none at EP=1, so a checkpoint saved at EP=2 holds the param groups of two optimizers in its
    common state (`{0: {"optimizer": {"param_groups": ...}}, 1: ...}`) and one at EP=1 those of one.
    Loading either into the other chain, dist_checkpointing merges the saved common state with the
    requested tensor state as they come, which neither `ChainedOptimizer.load_state_dict` (entry count)
    nor `DistributedOptimizer.load_state_dict` (`KeyError: 'optimizer'`, or a group it cannot find:
    the saved groups differ in `is_expert_parallel`) takes. Here each optimizer of the chain gets its
    own loaded tensor state (`param_state`) and, for each of its param groups, the saved group with
    the same `wd_mult`, `lr_mult` and `is_decoupled_lr` (the one of the same `is_expert_parallel` if
    there are two; hyperparameters and step as saved). Use it in place of the loaded dict:

        state = dist_checkpointing.load(sharded, ckpt_dir)
        opt.load_state_dict(chained_optimizer_state(opt, state["optimizer"]))

    A chain that saved and loads alike comes back as loaded. Raises `BCPError` naming the param
    group the checkpoint has no counterpart for.
    """
    members = list(getattr(optimizer, "chained_optimizers", [optimizer]))
    chained = len(members) > 1
    numbered = {k: v for k, v in loaded.items() if isinstance(k, int) and isinstance(v, dict)}
    saved = [v for _, v in sorted(numbered.items()) if "optimizer" in v]  # a saved chain's common state
    if not saved and "optimizer" in loaded:
        saved = [loaded]
    if not saved:
        raise BCPError("the loaded optimizer state holds no param groups (no 'optimizer' entry): it is not what "
                       "dist_checkpointing.load returns for a Megatron optimizer's sharded state dict")
    groups = [g for s in saved for g in s["optimizer"].get("param_groups", [])]
    out = {}
    for i, member in enumerate(members):
        own = numbered.get(i, {}) if chained else {k: v for k, v in loaded.items() if not isinstance(k, int)}
        state = {k: v for k, v in own.items() if k not in ("optimizer", "param_state_sharding_type", "grad_scaler")}
        for k in ("param_state_sharding_type", "grad_scaler"):
            found = [s[k] for s in saved if k in s]
            if found:
                state[k] = found[0]
        inner = getattr(member, "optimizer", None)
        if inner is None or not hasattr(inner, "param_groups"):
            raise BCPError(f"optimizer {i} of the chain ({type(member).__name__}) has no inner torch optimizer")
        state["optimizer"] = {**{k: v for k, v in saved[0]["optimizer"].items() if k != "param_groups"},
                              "param_groups": [_saved_group(g, groups, i) for g in inner.param_groups]}
        out[i] = state
    return out if chained else out[0]


def _saved_group(group: dict, saved: list[dict], member: int) -> dict:
    """The saved param group for the live `group`, marked with the live group's `is_expert_parallel`."""
    ident = tuple(group.get(k) for k in _GROUP_KEYS)
    same = [g for g in saved if tuple(g.get(k) for k in _GROUP_KEYS) == ident]
    exact = [g for g in same if g.get("is_expert_parallel") == group.get("is_expert_parallel")]
    found = exact or same
    if not found:
        have = sorted({tuple(g.get(k) for k in _GROUP_KEYS) for g in saved}, key=str)
        raise BCPError(f"optimizer {member}: the checkpoint has no param group with "
                       f"{dict(zip(_GROUP_KEYS, ident))} (it has {[dict(zip(_GROUP_KEYS, h)) for h in have]})")
    values = [{k: v for k, v in g.items() if k != "is_expert_parallel"} for g in found]
    if any(v != values[0] for v in values[1:]):
        raise BCPError(f"optimizer {member}: the checkpoint has param groups with {dict(zip(_GROUP_KEYS, ident))} "
                       f"that differ ({values}); which one this group continues is not known")
    return {**found[0], "is_expert_parallel": group.get("is_expert_parallel", False)}
