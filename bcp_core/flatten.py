"""From the user's `state` dict to flat FQN-keyed leaves, and back.

Saving turns modules, optimizers, stateful objects and nested dicts into `SaveLeaf`s. Loading
turns the same kinds of objects into `LoadTarget`s: a tensor to fill in place or a setter for a
new value, plus finishers that hand the filled state back to optimizers and stateful objects.
Building the targets changes nothing of the state: tensors are filled, setters and finishers run
only once the whole load has been read and verified (bcp_core.loader).
How a module or optimizer becomes FQN-keyed state is the adapter's business: `StateAdapter` says
what is asked of one (bcp_core.adapters.ModuleAdapter and its subclasses answer it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

from .errors import UnsupportedValueError
from .metadata import CheckpointMetadata
from .shards import ObjectShard, ShardedView, is_dtensor, is_tensor_like

PER_RANK_KEY = "extra_state"


@dataclass(frozen=True)
class SaveLeaf:
    fqn: str
    value: Any          # torch.Tensor / DTensor, or a plain value
    per_rank: bool      # differs per rank (extra_state): stored per rank, deduplicated
    stepped: bool = False  # a parameter or optimizer state: changes in place only in an optimizer step


@dataclass(frozen=True)
class LoadTarget:
    fqn: str
    per_rank: bool
    tensor: Any = None                          # tensor or ShardedView, filled in place when not None
    set_value: Callable[[Any], None] | None = None  # receives decoded objects / new tensors
    optional: bool = False                      # absence is not a missing key (strict)
    shard: ObjectShard | None = None            # receives a sharded object's shard (or a ShardReader)
    check: Callable[[Any], None] | None = None  # raises if a decoded value cannot be set (run before any change)
    fresh: bool = False                         # `tensor` was made for this load, not the caller's yet


@dataclass
class LoadTargets:
    """What a state asks of a load, collected by `load_targets` and the adapters it calls; read, not
    changed, once collected."""

    targets: dict[str, LoadTarget] = field(default_factory=dict)
    finishers: list[Callable[[], None]] = field(default_factory=list)
    # run once every read is verified, before anything changes: they may look at fresh tensors only
    checks: list[Callable[[], None]] = field(default_factory=list)
    # prefixes whose entries the checkpoint defines (optimizer state): never "unexpected" by absence
    checkpoint_defined: list[str] = field(default_factory=list)
    # plain dicts: checkpoint keys below them that the dict lacks are added to it
    containers: list[tuple[str, dict]] = field(default_factory=list)
    # modules / optimizers: checkpoint keys below them without a target are "unexpected"
    structured: list[str] = field(default_factory=list)
    # objects whose values go into dicts of the load's own (their `bcp_load_template()`) and whose
    # `bcp_read_state` reads what else they need from the checkpoint before anything changes
    read_first: list[str] = field(default_factory=list)
    # run once the values below `read_first` are in their dicts, before any read of a tensor
    reads: list[Callable[[], None]] = field(default_factory=list)
    # (fqn, saved tensor): raises unless the data files back its pieces; an adapter calls it before
    # it allocates a tensor of the saved shape (the metadata's claim) rather than a live tensor's
    check_files: Callable[[str, Any], None] = lambda fqn, tm: None


class StateAdapter(Protocol):
    """What flattening asks of a framework adapter about the state's modules and optimizers."""

    def state_to_save(self, state: dict) -> dict:
        """The state to flatten for a save, from the one the caller passed: itself, but for a
        framework whose state is of its own kind (Megatron's sharded state dict). Runs inside the
        save's exchange of errors, so that an error here on one rank fails the save on every rank
        at once."""

    def is_optimizer(self, obj: Any) -> bool:
        """Whether `obj` is an optimizer this adapter saves by parameter FQN (a torch optimizer, or a
        framework's own, such as DeepSpeed's ZeRO optimizers)."""

    def module_state(self, module: nn.Module) -> dict[str, Any]:
        """FQN -> tensor-like aliasing the live storage (saved from; loaded into in place)."""

    def load_module_values(self, module: nn.Module, values: dict[str, Any]) -> None:
        """Hand loaded non-tensor entries of `module_state` (get_extra_state) back to the module."""

    def after_module_load(self, module: nn.Module) -> None:
        """Run once the module's tensors hold the loaded values (a framework's copies derived from
        them: DeepSpeed's low-precision parameters from the fp32 master weights)."""

    def param_fqns(self, module: nn.Module) -> dict[int, str]:
        """id(param) -> FQN of every parameter an optimizer may hold (tied params: first name)."""

    def optimizer_state(self, opt: torch.optim.Optimizer, key: str, fqn_of: dict[int, str]) -> dict[str, Any]:
        """Relative keys `state.<param fqn>.<name>` and `param_groups` for saving."""

    def optimizer_targets(self, opt: torch.optim.Optimizer, key: str, fqn_of: dict[int, str],
                          md: CheckpointMetadata, out: LoadTargets) -> None:
        """Add load targets (and a finisher handing the state to the optimizer) to `out`."""


# ----------------------------------------------------------------------------- flattening

def _is_stateful(v: Any) -> bool:
    return callable(getattr(v, "state_dict", None)) and callable(getattr(v, "load_state_dict", None))


def _fqn_map(adapter: StateAdapter, state: dict) -> dict[int, str]:
    out: dict[int, str] = {}
    for v in state.values():
        if isinstance(v, nn.Module):
            for k, name in adapter.param_fqns(v).items():
                out.setdefault(k, name)
    return out


def storage_of(t: Any) -> int:
    """The address of the storage `t` (a tensor, DTensor or ShardedView) lives in; 0 if none."""
    if is_dtensor(t):
        t = t._local_tensor
    elif isinstance(t, ShardedView):
        if not t.boxes:
            return 0
        t = t.boxes[0].view
    return t.untyped_storage().data_ptr() if t.numel() else 0


def _parameter_storages(state: dict, adapter: StateAdapter) -> set[int]:
    """Storages of the parameters of the state's modules and optimizers (lazily snapshot, see
    bcp_core.staging): an optimizer step is the only training code that writes them in place."""
    out: set[int] = set()
    for v in state.values():
        params = v.parameters() if isinstance(v, nn.Module) else \
            (p for g in v.param_groups for p in g["params"]) if adapter.is_optimizer(v) else ()
        out.update(storage_of(p) for p in params)
    out.discard(0)
    return out


def save_leaves(state: dict, adapter: StateAdapter) -> list[SaveLeaf]:
    if not isinstance(state, dict):
        raise UnsupportedValueError(f"state must be a dict, got {type(state).__name__}")
    state = adapter.state_to_save(state)
    fqn_of = _fqn_map(adapter, state)
    params = _parameter_storages(state, adapter)
    leaves: list[SaveLeaf] = []

    def add_dict(prefix: str, d: dict, per_rank: bool, in_optimizer: bool = False) -> None:
        for k, v in d.items():
            if not isinstance(k, str):
                raise UnsupportedValueError(f"key {k!r} under {prefix or 'state'!r} is not a string")
            fqn = f"{prefix}.{k}" if prefix else k
            add(fqn, v, per_rank, in_optimizer)

    def add(fqn: str, v: Any, per_rank: bool, in_optimizer: bool = False) -> None:
        if isinstance(v, nn.Module):
            add_dict(fqn, adapter.module_state(v), per_rank)
        elif adapter.is_optimizer(v):
            add_dict(fqn, adapter.optimizer_state(v, fqn, fqn_of), per_rank, in_optimizer=True)
        elif isinstance(v, dict):
            add_dict(fqn, v, per_rank, in_optimizer)
        elif is_tensor_like(v):
            stepped = not per_rank and (in_optimizer or storage_of(v) in params or getattr(v, "stepped", False))
            leaves.append(SaveLeaf(fqn, v, per_rank, stepped))
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


def load_targets(state: dict, md: CheckpointMetadata, adapter: StateAdapter,
                 check_files: Callable[[str, Any], None] = lambda fqn, tm: None) -> LoadTargets:
    if not isinstance(state, dict):
        raise UnsupportedValueError(f"state must be a dict, got {type(state).__name__}")
    fqn_of = _fqn_map(adapter, state)
    out = LoadTargets(check_files=check_files)

    def add_dict(prefix: str, d: dict, per_rank: bool, into: dict | None, in_place: bool = False) -> None:
        """`in_place`: `d` is a module's state; its tensors are loaded into as they are, never replaced
        (a value or a tensor of another shape in the checkpoint is refused, not set into `d`)."""
        for k, v in list(d.items()):
            fqn = f"{prefix}.{k}" if prefix else k

            def setter(new, d=into, k=k):
                if d is not None:
                    d[k] = new
            add(fqn, v, per_rank, None if in_place and is_tensor_like(v) else setter)

    def add(fqn: str, v: Any, per_rank: bool, setter) -> None:
        if isinstance(v, nn.Module):
            out.structured.append(fqn)
            sd = adapter.module_state(v)
            non_tensor = {k: x for k, x in sd.items() if not is_tensor_like(x)}
            add_dict(fqn, sd, per_rank, sd, in_place=True)
            if non_tensor:  # e.g. get_extra_state(): hand the new values back through load_state_dict
                keys = list(non_tensor)
                out.finishers.append(lambda m=v, sd=sd, keys=keys: adapter.load_module_values(
                    m, {k: sd[k] for k in keys}))
            out.finishers.append(lambda m=v: adapter.after_module_load(m))
        elif adapter.is_optimizer(v):
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
            read_state = getattr(v, "bcp_read_state", None)
            if callable(template) and callable(read_state):
                # A dataloader's shards are read (and verified) with everything else, before the
                # state changes; it adopts them with the rest (`bcp_read_state` returns how).
                adopt: list[Callable[[], None]] = []
                out.read_first.append(fqn)
                out.reads.append(lambda read_state=read_state, sd=sd, adopt=adopt: adopt.append(read_state(sd)))
                out.finishers.append(lambda adopt=adopt: adopt[0]())
            else:
                out.finishers.append(lambda obj=v, sd=sd: obj.load_state_dict(sd))
        else:
            out.targets[fqn] = LoadTarget(fqn, per_rank, set_value=setter)

    for k, v in state.items():
        def top_setter(new, k=k):
            state[k] = new
        add(k, v, k == PER_RANK_KEY, top_setter)
    return out
