"""Framework adapters: which one serves a state, by name or by detection.

An adapter (`ModuleAdapter`) turns a framework's live modules and optimizers into FQN-keyed
tensors and back. Built in: `plain`, `ddp`, `dtensor` (FSDP2, TP, HSDP: any DTensor layout) and
`fsdp1` (FullyShardedDataParallel, imported on first use). Integrations register their own
(`bcp_integrations.megatron` registers `megatron`). The older names `fsdp` (= `fsdp1`) and
`fsdp2` (= `dtensor`) are accepted everywhere.

Adapters of other frameworks are known by name before they are imported (`_LAZY`, as fsspec knows
its filesystems by protocol): `framework="deepspeed"` imports bcp's DeepSpeed adapter, and so does
`"auto"` once the process has imported the `deepspeed` package (to ask whether DeepSpeed trains a
module of the state). bcp itself never imports a training framework.
"""

from __future__ import annotations

import importlib
import sys

from torch import nn

from ..errors import BCPError, UnsupportedValueError
from .generic import DDPAdapter, DTensorAdapter, ModuleAdapter, check_distinct_fqns, clean_fqn, unwrap

ALIASES = {"fsdp": "fsdp1", "fsdp2": "dtensor"}

_ADAPTERS: dict[str, ModuleAdapter] = {}
# Adapters in modules of their own, imported on first use (FSDP1's reads torch internals).
_LAZY = {"fsdp1": "bcp_core.adapters.fsdp1", "deepspeed": "bcp_integrations.deepspeed.adapter"}
# Adapters "auto" looks for first, by the top-level package of the classes in the state: an object
# of that framework in the state imports its adapter (the framework is imported already then).
_BY_PACKAGE = {"deepspeed": "deepspeed"}
# Layouts only their own adapter can read or write (flat shards): naming another is an error.
_EXCLUSIVE = {"fsdp1", "deepspeed"}


def register_adapter(adapter: ModuleAdapter) -> ModuleAdapter:
    """Make `adapter` available as `framework=adapter.name`."""
    _ADAPTERS[adapter.name] = adapter
    return adapter


for _a in (ModuleAdapter(), DDPAdapter(), DTensorAdapter()):
    register_adapter(_a)


def canonical_name(framework: str) -> str:
    return ALIASES.get(framework, framework)


def known_frameworks() -> list[str]:
    return sorted({"auto", *_ADAPTERS, *_LAZY, *ALIASES})


def get_adapter(name: str) -> ModuleAdapter:
    name = canonical_name(name)
    if name not in _ADAPTERS and name in _LAZY:
        importlib.import_module(_LAZY[name])
    if name not in _ADAPTERS:
        raise BCPError(f"unknown framework {name!r}; expected one of {', '.join(known_frameworks())}")
    return _ADAPTERS[name]


def _from_package(obj, package: str) -> bool:
    return any(c.__module__.split(".", 1)[0] == package for c in type(obj).__mro__)


def detect_framework(state: dict) -> str:
    """The most specific layout among the state's modules: deepspeed > fsdp1 > dtensor > ddp > plain."""
    modules = [v for v in state.values() if isinstance(v, nn.Module)]
    for package, name in _BY_PACKAGE.items():
        if package not in sys.modules:
            continue  # nothing in the state can be of it
        # Its objects in the state, or a module of the user's that it trains: DeepSpeed's ZeRO trains
        # copies of the parameters it marks, and a load into the module alone would be lost.
        ours = any(_from_package(v, package) for v in state.values())
        try:
            adapter = get_adapter(name)
        except (BCPError, ImportError):
            if ours:
                raise
            continue  # a version bcp does not support, and nothing of it in the state
        if any(adapter.matches(m) for m in modules):
            return name
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1
    if any(isinstance(s, FSDP1) for m in modules for s in m.modules()):
        return "fsdp1"
    for name in ("dtensor", "ddp"):
        if any(_ADAPTERS[name].matches(m) for m in modules):
            return name
    return "plain"


def resolve_framework(state: dict, framework: str) -> ModuleAdapter:
    """The adapter for `state`: `framework` checked against the layout found, or detected ("auto")."""
    if not isinstance(state, dict):
        raise UnsupportedValueError(f"state must be a dict (e.g. {{'model': model, 'optimizer': optim}}), "
                                    f"got {type(state).__name__}")
    if framework != "auto" and canonical_name(framework) not in (*_ADAPTERS, *_LAZY):
        raise BCPError(f"unknown framework {framework!r}; expected one of {', '.join(known_frameworks())}")
    found = detect_framework(state)
    name = found if framework == "auto" else canonical_name(framework)
    if name != found and (name in _EXCLUSIVE or found in _EXCLUSIVE):
        raise BCPError(f"framework={framework!r} but the model's layout is {found!r}; pass "
                       f"framework={found!r} or 'auto'")
    if name in ("plain", "ddp") and found == "dtensor":
        raise BCPError(f"framework={framework!r} but the model holds DTensor parameters (FSDP2/TP); "
                       "pass framework='dtensor' or 'auto'")
    return get_adapter(name)


__all__ = ["ModuleAdapter", "DDPAdapter", "DTensorAdapter", "register_adapter", "get_adapter", "detect_framework",
           "resolve_framework", "canonical_name", "known_frameworks", "unwrap", "clean_fqn", "check_distinct_fqns",
           "ALIASES"]
