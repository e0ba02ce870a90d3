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
from .shards import ObjectShard, is_dtensor, is_tensor_like

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
    tensor: Any = None                          # tensor or ShardedView, filled in place when not None
    set_value: Callable[[Any], None] | None = None  # receives decoded objects / new tensors
    optional: bool = False                      # absence is not a missing key (strict)
    shard: ObjectShard | None = None            # receives a sharded object's shard (or a ShardReader)


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


# ----------------------------------------------------------------------------- adapters

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


class ModuleAdapter:
    """How one framework's modules and optimizers become FQN-keyed state, and back.

    This base class serves plain modules, DDP, torch.compile, activation checkpointing and every
    DTensor layout (FSDP2, TP, HSDP): their state dicts already hold tensors whose boxes bcp can
    compute. A framework with other shards (FSDP1's flat parameters) subclasses it and returns
    `ShardedView`s instead, then registers with `register_adapter`.
    """

    name = "plain"

    def matches(self, module: nn.Module) -> bool:
        return True

    def module_state(self, module: nn.Module) -> dict[str, Any]:
        """FQN -> tensor-like aliasing the live storage (saved from; loaded into in place)."""
        sd = unwrap(module).state_dict()
        return {clean_fqn(k): v for k, v in sd.items()}

    def param_fqns(self, module: nn.Module) -> dict[int, str]:
        """id(param) -> FQN of every parameter an optimizer may hold (tied params: first name)."""
        out: dict[int, str] = {}
        for name, p in unwrap(module).named_parameters():
            out.setdefault(id(p), clean_fqn(name))
        return out

    def optimizer_state(self, opt: torch.optim.Optimizer, key: str, fqn_of: dict[int, str]) -> dict[str, Any]:
        """Relative keys `state.<param fqn>.<name>` and `param_groups` for saving."""
        return optimizer_leaves(opt, key, fqn_of)

    def optimizer_targets(self, opt, key: str, fqn_of: dict[int, str], md: CheckpointMetadata,
                          out: LoadTargets) -> None:
        """Add load targets (and a finisher handing the state to the optimizer) to `out`."""
        optimizer_targets(opt, key, fqn_of, md, out)


class DDPAdapter(ModuleAdapter):
    name = "ddp"

    def matches(self, module):
        return isinstance(module, nn.parallel.DistributedDataParallel)


class DTensorAdapter(ModuleAdapter):
    name = "fsdp2"

    def matches(self, module):
        return any(is_dtensor(p) for p in module.parameters())


_ADAPTERS: dict[str, ModuleAdapter] = {}
# Adapters that live in their own module, imported on first use.
_LAZY_ADAPTERS = {"fsdp": "bcp_core.fsdp"}


def register_adapter(adapter: ModuleAdapter) -> ModuleAdapter:
    _ADAPTERS[adapter.name] = adapter
    return adapter


for _a in (ModuleAdapter(), DDPAdapter(), DTensorAdapter()):
    register_adapter(_a)


def get_adapter(name: str) -> ModuleAdapter:
    if name not in _ADAPTERS and name in _LAZY_ADAPTERS:
        import importlib
        importlib.import_module(_LAZY_ADAPTERS[name])
    if name not in _ADAPTERS:
        raise BCPError(f"framework {name!r} is not supported by this bcp installation")
    return _ADAPTERS[name]


def detect_framework(state: dict) -> str:
    """The most specific framework among the state's modules: fsdp > fsdp2 > ddp > plain."""
    modules = [v for v in state.values() if isinstance(v, nn.Module)]
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1
    if any(isinstance(s, FSDP1) for m in modules for s in m.modules()):
        return "fsdp"
    for name in ("fsdp2", "ddp"):
        if any(_ADAPTERS[name].matches(m) for m in modules):
            return name
    return "plain"


def resolve_framework(state: dict, framework: str) -> ModuleAdapter:
    if not isinstance(state, dict):
        raise UnsupportedValueError(f"state must be a dict (e.g. {{'model': model, 'optimizer': optim}}), "
                                    f"got {type(state).__name__}")
    if framework not in FRAMEWORKS:
        raise BCPError(f"unknown framework {framework!r}; expected one of {', '.join(FRAMEWORKS)}")
    found = detect_framework(state)
    if framework == "auto":
        framework = found
    elif found == "fsdp" and framework != "fsdp" or framework == "fsdp" and found != "fsdp":
        raise BCPError(f"framework={framework!r} but the model's layout is {found!r}; pass "
                       f"framework={found!r} or 'auto'")
    elif framework in ("plain", "ddp") and found == "fsdp2":
        raise BCPError(f"framework={framework!r} but the model holds DTensor parameters (FSDP2/TP); "
                       "pass framework='fsdp2' or 'auto'")
    if framework == "megatron":  # Megatron state arrives as ShardedViews; the generic adapter serves it
        return _ADAPTERS["plain"]
    return get_adapter(framework)


# ----------------------------------------------------------------------------- optimizers (generic)

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


def _fqn_map(adapter: ModuleAdapter, state: dict) -> dict[int, str]:
    out: dict[int, str] = {}
    for v in state.values():
        if isinstance(v, nn.Module):
            for k, name in adapter.param_fqns(v).items():
                out.setdefault(k, name)
    return out


def save_leaves(state: dict, adapter: ModuleAdapter) -> list[SaveLeaf]:
    if not isinstance(state, dict):
        raise UnsupportedValueError(f"state must be a dict, got {type(state).__name__}")
    fqn_of = _fqn_map(adapter, state)
    leaves: list[SaveLeaf] = []

    def add_dict(prefix: str, d: dict, per_rank: bool) -> None:
        for k, v in d.items():
            if not isinstance(k, str):
                raise UnsupportedValueError(f"key {k!r} under {prefix or 'state'!r} is not a string")
            fqn = f"{prefix}.{k}" if prefix else k
            add(fqn, v, per_rank)

    def add(fqn: str, v: Any, per_rank: bool) -> None:
        if isinstance(v, nn.Module):
            add_dict(fqn, adapter.module_state(v), per_rank)
        elif isinstance(v, torch.optim.Optimizer):
            add_dict(fqn, adapter.optimizer_state(v, fqn, fqn_of), per_rank)
        elif isinstance(v, dict):
            add_dict(fqn, v, per_rank)
        elif is_tensor_like(v):
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


def load_targets(state: dict, md: CheckpointMetadata, adapter: ModuleAdapter) -> LoadTargets:
    if not isinstance(state, dict):
        raise UnsupportedValueError(f"state must be a dict, got {type(state).__name__}")
    fqn_of = _fqn_map(adapter, state)
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
            sd = adapter.module_state(v)
            non_tensor = {k: x for k, x in sd.items() if not is_tensor_like(x)}
            add_dict(fqn, sd, per_rank, sd)
            if non_tensor:  # e.g. get_extra_state(): hand the new values back through load_state_dict
                keys = list(non_tensor)
                out.finishers.append(lambda m=v, sd=sd, keys=keys: unwrap(m).load_state_dict(
                    {k: sd[k] for k in keys}, strict=False))
        elif isinstance(v, torch.optim.Optimizer):
            out.structured.append(fqn)
            adapter.optimizer_targets(v, fqn, fqn_of, md, out)
        elif isinstance(v, dict):
            out.containers.append((fqn, v))
            add_dict(fqn, v, per_rank, v)
        elif is_tensor_like(v):
            out.targets[fqn] = LoadTarget(fqn, per_rank, tensor=v, set_value=setter)
        elif isinstance(v, ObjectShard):
            out.targets[fqn] = LoadTarget(fqn, per_rank, set_value=setter, shard=v)
        elif _is_stateful(v):
            # An object whose saved layout may differ from its own (a dataloader saved at another
            # DP degree) names what to load in `bcp_load_template()`; the checkpoint's other keys
            # below it are filled in as for any container, then the dict goes to load_state_dict.
            template = getattr(v, "bcp_load_template", None)
            sd = template() if callable(template) else v.state_dict()
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
