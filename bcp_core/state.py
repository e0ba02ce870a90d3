"""From the user's `state` dict to flat FQN-keyed leaves, and back.

Saving turns modules, optimizers, stateful objects and nested dicts into
`SaveLeaf`s. Loading turns the same kinds of objects into `LoadTarget`s: a
tensor to fill in place or a setter for a new value, plus finishers that hand
the filled state back to optimizers and stateful objects.

Framework specifics live in the module adapters (`ModuleAdapter`): how to
unwrap a module, name its parameters and produce its state tensors. DDP,
torch.compile, activation checkpointing and DTensor-based layouts (FSDP2, TP,
HSDP) need nothing more than the generic adapter.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .errors import BCPError, UnsupportedValueError
from .metadata import CheckpointMetadata, TensorMeta
from .shards import is_dtensor

PER_RANK_KEY = "extra_state"
FRAMEWORKS = ("auto", "plain", "ddp", "fsdp2", "fsdp", "megatron")
_WRAPPER_PARTS = ("_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module", "module")


@dataclass
class SaveLeaf:
    fqn: str
    value: Any          # torch.Tensor / DTensor, or a plain value
    per_rank: bool      # differs per rank (extra_state): stored per rank, deduplicated


@dataclass
class LoadTarget:
    fqn: str
    per_rank: bool
    tensor: torch.Tensor | None = None          # filled in place when not None
    set_value: Callable[[Any], None] | None = None  # receives decoded objects / new tensors
    optional: bool = False                      # absence is not a missing key (strict)


@dataclass
class LoadTargets:
    targets: dict[str, LoadTarget] = field(default_factory=dict)
    finishers: list[Callable[[], None]] = field(default_factory=list)
    # prefixes whose entries the checkpoint defines (optimizer state): never "unexpected" by absence
    checkpoint_defined: list[str] = field(default_factory=list)
    # plain dicts: checkpoint keys below them that the dict lacks are added to it
    containers: list[tuple[str, dict]] = field(default_factory=list)
    # modules / optimizers: checkpoint keys below them without a target are "unexpected"
    structured: list[str] = field(default_factory=list)


# ----------------------------------------------------------------------------- modules

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
    return ".".join(p for p in name.split(".") if p not in _WRAPPER_PARTS[:3])


def module_state(module: nn.Module) -> dict[str, Any]:
    """The module's state dict with wrapper prefixes removed; tensors alias the live parameters."""
    sd = unwrap(module).state_dict()
    return {clean_fqn(k): v for k, v in sd.items()}


def param_fqns(modules: list[nn.Module]) -> dict[int, str]:
    """id(param) -> FQN for every parameter of the given modules (tied params: first name)."""
    out: dict[int, str] = {}
    for m in modules:
        for name, p in unwrap(m).named_parameters():
            out.setdefault(id(p), clean_fqn(name))
    return out


def detect_framework(state: dict) -> str:
    modules = [v for v in state.values() if isinstance(v, nn.Module)]
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1
    for m in modules:
        if any(isinstance(s, FSDP1) for s in m.modules()):
            return "fsdp"
    for m in modules:
        if any(is_dtensor(p) for p in m.parameters()):
            return "fsdp2"
    if any(isinstance(m, nn.parallel.DistributedDataParallel) for m in modules):
        return "ddp"
    return "plain"


def resolve_framework(state: dict, framework: str) -> str:
    if framework not in FRAMEWORKS:
        raise BCPError(f"unknown framework {framework!r}; expected one of {', '.join(FRAMEWORKS)}")
    found = detect_framework(state)
    if framework == "auto":
        framework = found
    elif framework in ("plain", "ddp") and found in ("fsdp", "fsdp2"):
        raise BCPError(f"framework={framework!r} but the model is sharded ({found}); "
                       f"pass framework={found!r} or 'auto'")
    if framework in ("fsdp", "megatron"):
        raise BCPError(f"framework {framework!r} is not supported by this bcp version; supported: "
                       "plain, ddp, fsdp2 (DTensor: FSDP2, TP, HSDP)")
    return framework


# ----------------------------------------------------------------------------- optimizers

def _optimizer_params(opt: torch.optim.Optimizer) -> list[nn.Parameter]:
    return [p for g in opt.param_groups for p in g["params"]]


def _optimizer_fqns(opt, key: str, fqn_of: dict[int, str]) -> list[str]:
    fqns = []
    for i, p in enumerate(_optimizer_params(opt)):
        if id(p) not in fqn_of:
            raise BCPError(f"optimizer {key!r}: parameter #{i} (shape {tuple(p.shape)}) belongs to no "
                           "nn.Module in the state; put the model in the same state dict")
        fqns.append(fqn_of[id(p)])
    return fqns


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


def _optimizer_targets(opt, key: str, fqn_of: dict[int, str], md: CheckpointMetadata,
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
            target = _new_state_tensor(params[i], tm)
        else:
            target = None

        def setter(v, slot=slot, name=name):
            slot[name] = v

        if target is not None:
            slot[name] = target
        out.targets[k] = LoadTarget(k, False, tensor=target, set_value=setter)
    groups_key = f"{key}.param_groups"

    def set_groups(groups):
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
        holder["groups"] = out_groups

    holder: dict[str, Any] = {}
    out.targets[groups_key] = LoadTarget(groups_key, False, set_value=set_groups)

    def finish():
        groups = holder.get("groups")
        if groups is None:  # not in checkpoint (strict=False): keep current hyperparameters
            groups = [{**{k: v for k, v in g.items() if k != "params"},
                       "params": [index_of[fqn_of[id(p)]] for p in g["params"]]} for g in opt.param_groups]
        opt.load_state_dict({"state": dict(sorted(new_state.items())), "param_groups": groups})

    out.finishers.append(finish)
    out.checkpoint_defined.append(prefix)


def _new_state_tensor(param: torch.Tensor, tm: TensorMeta) -> torch.Tensor:
    """Destination for optimizer state that does not exist yet (never by stepping the optimizer)."""
    if tuple(tm.shape) == tuple(param.shape):
        return torch.zeros_like(param, dtype=tm.dtype)  # keeps DTensor placements
    return torch.zeros(tm.shape, dtype=tm.dtype)  # scalars such as Adam's step live on CPU


# ----------------------------------------------------------------------------- flattening

def _is_stateful(v: Any) -> bool:
    return callable(getattr(v, "state_dict", None)) and callable(getattr(v, "load_state_dict", None))


def save_leaves(state: dict) -> list[SaveLeaf]:
    if not isinstance(state, dict):
        raise UnsupportedValueError(f"state must be a dict, got {type(state).__name__}")
    fqn_of = param_fqns([v for v in state.values() if isinstance(v, nn.Module)])
    leaves: list[SaveLeaf] = []

    def add_dict(prefix: str, d: dict, per_rank: bool) -> None:
        for k, v in d.items():
            if not isinstance(k, str):
                raise UnsupportedValueError(f"key {k!r} under {prefix or 'state'!r} is not a string")
            fqn = f"{prefix}.{k}" if prefix else k
            add(fqn, v, per_rank)

    def add(fqn: str, v: Any, per_rank: bool) -> None:
        if isinstance(v, nn.Module):
            add_dict(fqn, module_state(v), per_rank)
        elif isinstance(v, torch.optim.Optimizer):
            add_dict(fqn, optimizer_leaves(v, fqn, fqn_of), per_rank)
        elif isinstance(v, dict):
            add_dict(fqn, v, per_rank)
        elif isinstance(v, torch.Tensor):
            leaves.append(SaveLeaf(fqn, v, per_rank))
        elif _is_stateful(v):
            add_dict(fqn, v.state_dict(), per_rank)
        else:
            leaves.append(SaveLeaf(fqn, v, per_rank))

    for k, v in state.items():
        add(k, v, k == PER_RANK_KEY)
    seen: set[str] = set()
    for leaf in leaves:
        if leaf.fqn in seen:
            raise UnsupportedValueError(f"key {leaf.fqn!r} appears twice after flattening the state")
        seen.add(leaf.fqn)
    return leaves


def load_targets(state: dict, md: CheckpointMetadata) -> LoadTargets:
    if not isinstance(state, dict):
        raise UnsupportedValueError(f"state must be a dict, got {type(state).__name__}")
    fqn_of = param_fqns([v for v in state.values() if isinstance(v, nn.Module)])
    out = LoadTargets()

    def add_dict(prefix: str, d: dict, per_rank: bool, into: dict | None) -> None:
        for k, v in list(d.items()):
            fqn = f"{prefix}.{k}" if prefix else k

            def setter(new, d=into, k=k):
                if d is not None:
                    d[k] = new
            add(fqn, v, per_rank, setter)

    def add(fqn: str, v: Any, per_rank: bool, setter) -> None:
        if isinstance(v, nn.Module):
            out.structured.append(fqn)
            sd = module_state(v)
            non_tensor = {k: x for k, x in sd.items() if not isinstance(x, torch.Tensor)}
            add_dict(fqn, sd, per_rank, sd)
            if non_tensor:  # e.g. get_extra_state(): hand the new values back through load_state_dict
                keys = list(non_tensor)
                out.finishers.append(lambda m=v, sd=sd, keys=keys: unwrap(m).load_state_dict(
                    {k: sd[k] for k in keys}, strict=False))
        elif isinstance(v, torch.optim.Optimizer):
            out.structured.append(fqn)
            _optimizer_targets(v, fqn, fqn_of, md, out)
        elif isinstance(v, dict):
            out.containers.append((fqn, v))
            add_dict(fqn, v, per_rank, v)
        elif isinstance(v, torch.Tensor):
            out.targets[fqn] = LoadTarget(fqn, per_rank, tensor=v, set_value=setter)
        elif _is_stateful(v):
            sd = v.state_dict()
            out.containers.append((fqn, sd))
            add_dict(fqn, sd, per_rank, sd)
            out.finishers.append(lambda obj=v, sd=sd: obj.load_state_dict(sd))
        else:
            out.targets[fqn] = LoadTarget(fqn, per_rank, set_value=setter)

    for k, v in state.items():
        def top_setter(new, k=k):
            state[k] = new
        add(k, v, k == PER_RANK_KEY, top_setter)
    return out
