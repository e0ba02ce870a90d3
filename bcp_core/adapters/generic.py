"""The generic adapter: plain modules, DDP, torch.compile, activation checkpointing, DTensor layouts.

Their state dicts already hold tensors whose boxes bcp can compute (a DTensor knows its
placements), so one adapter serves them all; `DDPAdapter` and `DTensorAdapter` only name what
auto-detection found. Optimizer state is keyed by parameter FQN (`state.<fqn>.<name>`), so it
survives re-wrapping and resharding.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..errors import BCPError
from ..flatten import LoadTarget, LoadTargets
from ..metadata import CheckpointMetadata, TensorMeta
from ..shards import is_dtensor

_WRAPPER_PARTS = ("_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module")


def unwrap(module: nn.Module) -> nn.Module:
    """The user's module under DDP / torch.compile wrappers."""
    while True:
        if isinstance(module, nn.parallel.DistributedDataParallel):
            module = module.module
        elif hasattr(module, "_orig_mod") and isinstance(module._orig_mod, nn.Module):
            module = module._orig_mod
        else:
            return module


def clean_fqn(name: str) -> str:
    return ".".join(p for p in name.split(".") if p not in _WRAPPER_PARTS)


class ModuleAdapter:
    """How one framework's modules and optimizers become FQN-keyed state, and back (what
    `bcp_core.flatten.StateAdapter` asks), its name, and which modules it recognises.

    This base class serves plain modules, DDP, torch.compile, activation checkpointing and every
    DTensor layout (FSDP2, TP, HSDP): their state dicts already hold tensors whose boxes bcp can
    compute. A framework with other shards (FSDP1's flat parameters) subclasses it and returns
    `ShardedView`s instead, then registers with `bcp_core.adapters.register_adapter`.
    """

    name = "plain"
    # Every rank of the group loads a state of this layout together (a finisher may communicate):
    # its loads are collective unless the caller says otherwise (share_reads=False).
    loads_together = False

    def matches(self, module: nn.Module) -> bool:
        return True

    def state_to_save(self, state: dict) -> dict:
        return state

    def module_state(self, module: nn.Module) -> dict[str, Any]:
        sd = unwrap(module).state_dict()
        return {clean_fqn(k): v for k, v in sd.items()}

    def load_module_values(self, module: nn.Module, values: dict[str, Any]) -> None:
        unwrap(module).load_state_dict(values, strict=False)

    def after_module_load(self, module: nn.Module) -> None:
        return None

    def root(self, module: nn.Module) -> nn.Module:
        """The user's module under this framework's wrappers (its `config` says what model it is)."""
        return unwrap(module)

    def companions(self, module: nn.Module) -> dict[str, Any]:
        """Stateful objects the framework keeps beside `module` that a run's state holds too, by
        name (a DeepSpeed engine's counters: "engine"); see bcp_core.integration.run_state."""
        return {}

    def is_optimizer(self, obj: Any) -> bool:
        return isinstance(obj, torch.optim.Optimizer)

    def param_fqns(self, module: nn.Module) -> dict[int, str]:
        out: dict[int, str] = {}
        for name, p in unwrap(module).named_parameters():
            out.setdefault(id(p), clean_fqn(name))
        return out

    def optimizer_state(self, opt: torch.optim.Optimizer, key: str, fqn_of: dict[int, str]) -> dict[str, Any]:
        return optimizer_leaves(opt, key, fqn_of)

    def optimizer_targets(self, opt, key: str, fqn_of: dict[int, str], md: CheckpointMetadata,
                          out: LoadTargets) -> None:
        optimizer_targets(opt, key, fqn_of, md, out)


class DDPAdapter(ModuleAdapter):
    name = "ddp"

    def matches(self, module):
        return isinstance(module, nn.parallel.DistributedDataParallel)


class DTensorAdapter(ModuleAdapter):
    """Any DTensor layout: FSDP2 (`fully_shard`), TP, HSDP, 2-D."""

    name = "dtensor"

    def matches(self, module):
        return any(is_dtensor(p) for p in module.parameters())


# ----------------------------------------------------------------------------- optimizers

def _optimizer_params(opt: torch.optim.Optimizer) -> list[nn.Parameter]:
    return [p for g in opt.param_groups for p in g["params"]]


def _optimizer_fqns(opt, key: str, fqn_of: dict[int, str]) -> list[str]:
    fqns = []
    params = _optimizer_params(opt)
    for i, p in enumerate(params):
        if id(p) not in fqn_of:
            raise BCPError(f"optimizer {key!r}: parameter #{i} (shape {tuple(p.shape)}) belongs to no "
                           "nn.Module in the state; put the model in the same state dict")
        fqns.append(fqn_of[id(p)])
    check_distinct_fqns(key, [(f, tuple(p.shape)) for f, p in zip(fqns, params)])
    return fqns


def check_distinct_fqns(key: str, named: list[tuple[str, tuple[int, ...]]]) -> None:
    """Raise if two parameters of optimizer `key` ((FQN, shape) each) have one FQN: its state is keyed
    by FQN, so one's state would silently replace the other's. FQNs are relative to each module of
    the state: two modules under different keys both have a `weight`."""
    first: dict[str, tuple[int, ...]] = {}
    for fqn, shape in named:
        if fqn in first:
            raise BCPError(f"optimizer {key!r}: two of its parameters (shapes {first[fqn]} and {shape}) are both "
                           f"named {fqn!r} (relative to their modules in the state); optimizer state is keyed by "
                           "parameter name, so put the modules under one nn.Module (e.g. an nn.ModuleDict) or "
                           "give each its own optimizer")
        first[fqn] = shape


def optimizer_leaves(opt, key: str, fqn_of: dict[int, str]) -> dict[str, Any]:
    fqns = _optimizer_fqns(opt, key, fqn_of)
    osd = opt.state_dict()
    out: dict[str, Any] = {}
    for idx, st in osd["state"].items():
        for name, v in st.items():
            out[f"state.{fqns[idx]}.{name}"] = v
    groups = []
    for g in osd["param_groups"]:
        g = dict(g)
        g["params"] = [fqns[i] for i in g["params"]]
        groups.append(g)
    out["param_groups"] = groups
    return out


def optimizer_targets(opt, key: str, fqn_of: dict[int, str], md: CheckpointMetadata,
                      out: LoadTargets) -> None:
    params = _optimizer_params(opt)
    fqns = _optimizer_fqns(opt, key, fqn_of)
    index_of = {f: i for i, f in enumerate(fqns)}
    osd = opt.state_dict()
    new_state: dict[int, dict[str, Any]] = {}
    prefix = f"{key}.state."
    saved = sorted(k for k in md.keys() if k.startswith(prefix))  # same order on every rank
    for k in saved:
        rest = k[len(prefix):]
        fqn, _, name = rest.rpartition(".")
        if fqn not in index_of:
            continue  # reported as unexpected by the strict check
        i = index_of[fqn]
        slot = new_state.setdefault(i, {})
        existing = osd["state"].get(i, {}).get(name)
        tm = md.tensors.get(k)
        if isinstance(existing, torch.Tensor):
            target = existing
        elif tm is not None:
            target = _new_state_tensor(params[i], tm, k, out)
        else:
            target = None
        fresh = target is not None and target is not existing  # the optimizer gets it in the finisher

        def setter(v, slot=slot, name=name):
            slot[name] = v

        if target is not None:
            slot[name] = target
        out.targets[k] = LoadTarget(k, False, tensor=target, set_value=setter, fresh=fresh)
    groups_key = f"{key}.param_groups"

    def optimizer_groups(groups) -> list[dict]:
        """The checkpoint's param groups with the optimizer's parameter indices; raises if they do
        not hold the same parameters (checked before the load changes anything)."""
        out_groups = []
        cur = opt.param_groups
        if len(groups) != len(cur):
            raise BCPError(f"optimizer {key!r}: checkpoint has {len(groups)} param groups, optimizer has "
                           f"{len(cur)}")
        for gi, (g, c) in enumerate(zip(groups, cur)):
            want = [fqns[i] for i in range(len(params)) if any(params[i] is p for p in c["params"])]
            if sorted(g["params"]) != sorted(want):
                raise BCPError(f"optimizer {key!r}: param group {gi} holds {len(want)} parameters, the "
                               f"checkpoint's holds {len(g['params'])}; groups must hold the same FQNs")
            g = dict(g)
            g["params"] = [index_of[f] for f in want]
            out_groups.append(g)
        return out_groups

    holder: dict[str, Any] = {}
    out.targets[groups_key] = LoadTarget(groups_key, False, check=optimizer_groups,
                                         set_value=lambda groups: holder.update(groups=optimizer_groups(groups)))

    def finish():
        groups = holder.get("groups")
        if groups is None:  # not in checkpoint (strict=False): keep current hyperparameters
            groups = [{**{k: v for k, v in g.items() if k != "params"},
                       "params": [index_of[fqn_of[id(p)]] for p in g["params"]]} for g in opt.param_groups]
        opt.load_state_dict({"state": dict(sorted(new_state.items())), "param_groups": groups})

    out.finishers.append(finish)
    out.checkpoint_defined.append(prefix)


def _new_state_tensor(param: torch.Tensor, tm: TensorMeta, fqn: str, out: LoadTargets) -> torch.Tensor:
    """Destination for optimizer state that does not exist yet (never by stepping the optimizer).
    Left uninitialised: a saved tensor's pieces tile it exactly (metadata.py), so the load writes
    every byte, and zeroing first would be one more pass over fresh memory."""
    if tuple(tm.shape) == tuple(param.shape):
        return torch.empty_like(param, dtype=tm.dtype)  # keeps DTensor placements
    out.check_files(fqn, tm)  # the shape is the metadata's claim until the files back it
    return torch.empty(tm.shape, dtype=tm.dtype)  # scalars such as Adam's step live on CPU


