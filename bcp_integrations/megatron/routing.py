"""dist_checkpointing's entry points, routed to bcp by what the checkpoint is and what was asked.

Megatron-core 0.16 chose a backend through a registry: `("bcp", 1)` named one, and a load found
its strategy from the checkpoint's `metadata.json`. 0.17 removed the registry: `save` replaces any
strategy that is not torch_dist's by a new torch_dist one (a `("bcp", 1)` save would silently write
torch_dist), and `load`, `load_tensors_metadata` and `load_sharded_metadata` read with torch_dist
whatever `metadata.json` says. `install()` wraps those four functions and `load_common_state_dict`
(in `dist_checkpointing` and in its `serialization` module, where Megatron's own code calls them)
so that on every release:

- `save` writes bcp for `("bcp", 1)`, a `BcpSaveShardedStrategy`, and — in a Megatron-LM run with
  `--ckpt-format bcp` — for the torch_dist strategy Megatron-LM builds. A bcp strategy inside
  `FullyParallelSaveStrategyWrapper` is unwrapped (bcp balances replicated writes itself; from
  0.17 on the wrapper records `torch_dist` in `metadata.json`). Once `metadata.json` is written,
  rank 0 checks that it names bcp: a Megatron that swapped the strategy anyway fails loudly.
- the three loads read a checkpoint whose `metadata.json` names bcp with bcp, whatever strategy
  was passed (none, torch_dist's, or its fully parallel wrapper, whose exchange bcp does not need:
  bcp reads each byte range once across the job by itself), and give a torch_dist checkpoint to
  Megatron's default strategy when a bcp one was passed.
- Megatron's non-sharded values (its `args`, iteration...) of a bcp save are kept in the checkpoint
  itself, committed with the sharded part, on every release: up to 0.18 Megatron's writer of
  common.pt, called before the sharded save, hands them to that save instead
  (`strategy.saving_common_state`); 0.19 passes them to the strategy. `load_common_state_dict`,
  and up to 0.18 Megatron's reader of common.pt, read them from there (0.19 would read them with
  torch DCP; a checkpoint of an earlier bcp that left them in common.pt is read as before).
  torch_dist saves are left alone.

Megatron's `AsyncCallsQueue` watches a bcp save's async request by bcp's commit (`strategy.CommitCaller`):
it has no writer process for the queue to watch.

Any other strategy passes through untouched. `check_api()` fails at import, naming what is missing,
when a Megatron release lacks what this relies on.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import os

import torch
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing import serialization
from megatron.core.dist_checkpointing.core import CheckpointingException, maybe_load_config
from megatron.core.dist_checkpointing.strategies import async_utils
from megatron.core.dist_checkpointing.strategies import common as megatron_common
from megatron.core.dist_checkpointing.strategies import fully_parallel
from megatron.core.dist_checkpointing.strategies import torch as megatron_torch

from bcp_core.errors import KeyMismatchError, UnsupportedFrameworkError

from . import megatron_lm
from .strategy import (BACKEND, VERSION, BcpLoadShardedStrategy, BcpSaveShardedStrategy,
                       BcpCheckpointingException, CommitCaller, CommitWait, keep_common_state, read_common_state,
                       saving_common_state)

SUPPORTED = "megatron-core 0.16 to 0.19"
_LOADS = ("load", "load_tensors_metadata", "load_sharded_metadata")
_ROUTED = "__bcp_routed__"
COMMON_FILE = "common.pt"  # Megatron's COMMON_STATE_FNAME, where an earlier bcp left the values up to 0.18


def check_api() -> None:
    """Raise UnsupportedFrameworkError naming every interface of megatron-core the routing needs
    and this release lacks."""
    missing = [f"dist_checkpointing.serialization.{name}(..., sharded_strategy)" for name in ("save", *_LOADS)
               if "sharded_strategy" not in _parameters(getattr(serialization, name, None))]
    for cls, methods in ((megatron_torch, ("TorchDistSaveShardedStrategy", "save", "async_save")),
                         (megatron_torch, ("TorchDistLoadShardedStrategy", "load", "load_sharded_metadata")),
                         (fully_parallel, ("FullyParallelSaveStrategyWrapper",)),
                         (fully_parallel, ("FullyParallelLoadStrategyWrapper",))):
        name, *attrs = methods
        found = getattr(cls, name, None)
        if found is None:
            missing.append(f"{cls.__name__}.{name}")
        missing += [f"{cls.__name__}.{name}.{a}" for a in attrs if found is not None and not hasattr(found, a)]
    if missing:
        version = getattr(importlib.import_module("megatron.core.package_info"), "__version__", "?")
        raise UnsupportedFrameworkError(
            f"bcp_integrations.megatron supports {SUPPORTED}; this megatron-core ({version}) lacks "
            f"{', '.join(missing)}. Upgrade bcp-checkpoint, or install a supported megatron-core.")


def _parameters(fn) -> tuple:
    try:
        return tuple(inspect.signature(fn).parameters) if fn is not None else ()
    except (TypeError, ValueError):
        return ()


def _bcp_inside(strategy):
    """The bcp strategy `strategy` is or wraps (Megatron's fully parallel wrappers), else None."""
    inner = getattr(strategy, "base_strategy", strategy)
    return inner if isinstance(inner, (BcpSaveShardedStrategy, BcpLoadShardedStrategy)) else None


def _is_torch_dist(strategy, cls) -> bool:
    """Megatron's own torch_dist strategy (`cls`), alone or in its fully parallel wrapper, or its tuple."""
    if isinstance(strategy, (tuple, list)):
        return len(strategy) > 0 and strategy[0] == "torch_dist"
    return type(getattr(strategy, "base_strategy", strategy)) is cls


def save_strategy_for(strategy):
    """The strategy `save` should be given for `strategy`, as the module docstring says."""
    if isinstance(strategy, (tuple, list)) and len(strategy) > 0 and strategy[0] == BACKEND:
        version = strategy[1] if len(strategy) > 1 else VERSION
        if version > VERSION:
            raise CheckpointingException(f"({BACKEND!r}, {version}) is newer than this bcp's ({BACKEND!r}, "
                                         f"{VERSION}); upgrade bcp-checkpoint")
        return BcpSaveShardedStrategy()
    inner = _bcp_inside(strategy)
    if isinstance(inner, BcpSaveShardedStrategy):
        return inner
    if megatron_lm.bcp_selected() and (strategy is None or _is_torch_dist(
            strategy, megatron_torch.TorchDistSaveShardedStrategy)):
        return BcpSaveShardedStrategy()
    return strategy


def load_strategy_for(checkpoint_dir, strategy):
    """The strategy a load of `checkpoint_dir` should be given for `strategy`."""
    if isinstance(strategy, (tuple, list)) and len(strategy) > 0 and strategy[0] == BACKEND:
        # ("bcp", 1), as saves name it: 0.16 looked it up in its registry, 0.17+ would call .load on the tuple
        strategy = BcpLoadShardedStrategy()
    config = maybe_load_config(str(checkpoint_dir))
    if config is None:
        return strategy  # not a dist checkpoint: Megatron's own error names it
    if config.sharded_backend == BACKEND:
        inner = _bcp_inside(strategy)
        if isinstance(inner, BcpLoadShardedStrategy):
            return inner
        if strategy is None or _is_torch_dist(strategy, megatron_torch.TorchDistLoadShardedStrategy):
            return BcpLoadShardedStrategy()
        return strategy
    if _bcp_inside(strategy) is not None:
        return None  # a torch_dist (or other) checkpoint: Megatron's default strategy for it
    return strategy


def _check_metadata_names_bcp(checkpoint_dir) -> None:
    """After a bcp save's `metadata.json` is written: it must name bcp (rank 0 reads it)."""
    if torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
        return
    config = maybe_load_config(str(checkpoint_dir))
    backend = None if config is None else config.sharded_backend
    if backend != BACKEND:
        raise CheckpointingException(
            f"{checkpoint_dir}: saved with a bcp strategy, but its metadata.json names {backend!r}: this "
            f"megatron-core replaced the strategy ({SUPPORTED} are supported); the directory is not a bcp "
            "checkpoint")


def _routed_save(original):
    signature = inspect.signature(original)

    @functools.wraps(original)
    def save(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        strategy = save_strategy_for(bound.arguments.get("sharded_strategy"))
        bound.arguments["sharded_strategy"] = strategy
        bcp_save = isinstance(strategy, BcpSaveShardedStrategy)
        with saving_common_state() if bcp_save else contextlib.nullcontext():
            request = original(*bound.args, **bound.kwargs)
        if bcp_save:
            checkpoint_dir = bound.arguments["checkpoint_dir"]
            if request is None:
                _check_metadata_names_bcp(checkpoint_dir)
            else:  # after Megatron's metadata.json finalize, before any the caller adds
                request.finalize_fns.append(lambda: _check_metadata_names_bcp(checkpoint_dir))
        return request
    return save


def _routed_load(original):
    signature = inspect.signature(original)

    @functools.wraps(original)
    def load(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.arguments["sharded_strategy"] = load_strategy_for(bound.arguments["checkpoint_dir"],
                                                                bound.arguments.get("sharded_strategy"))
        return original(*bound.args, **bound.kwargs)
    return load


def register_strategies() -> None:
    """Route dist_checkpointing's save and loads (module docstring); on releases with a strategy
    registry (0.16) also register `("bcp", 1)` there, for code that looks strategies up by name.
    Idempotent; importing `bcp_integrations.megatron` calls it."""
    install()
    base = _registry()
    if base is not None:
        base.register_default_strategy(base.StrategyAction.SAVE_SHARDED, BACKEND, VERSION, BcpSaveShardedStrategy())
        base.register_default_strategy(base.StrategyAction.LOAD_SHARDED, BACKEND, VERSION, BcpLoadShardedStrategy())


def _registry():
    """megatron-core's strategy registry module (0.16), or None (0.17 removed it, 0.19 the module)."""
    try:
        base = importlib.import_module("megatron.core.dist_checkpointing.strategies.base")
    except ImportError:
        return None
    return base if hasattr(base, "register_default_strategy") else None


def _routed_common_state(original):
    """`load_common_state_dict`, and up to 0.18 Megatron's reader of common.pt (0.16:
    `TorchCommonLoadStrategy.load_common`; 0.17, 0.18: `serialization.load_common`): a bcp
    checkpoint's own object, or where it has none (an earlier bcp's save up to 0.18), common.pt."""
    parameters = list(inspect.signature(original).parameters)
    method = parameters[:1] == ["self"]

    @functools.wraps(original)
    def load_common(*args, **kwargs):
        checkpoint_dir = kwargs.get("checkpoint_dir", args[1 if method else 0] if len(args) > method else None)
        config = None if checkpoint_dir is None else maybe_load_config(str(checkpoint_dir))
        if config is None or config.sharded_backend != BACKEND:
            return original(*args, **kwargs)
        try:
            return read_common_state(checkpoint_dir)
        except BcpCheckpointingException as e:
            if isinstance(e.__cause__, KeyMismatchError) and \
                    os.path.exists(os.path.join(str(checkpoint_dir), COMMON_FILE)):
                return original(*args, **kwargs)
            raise
    return load_common


def _routed_common_save(original):
    """Megatron's writer of common.pt (0.16: `TorchCommonSaveStrategy.save_common`; 0.17, 0.18:
    `serialization.save_common`): during a bcp save, rank 0 hands the values to that save
    (`strategy.keep_common_state`), and no common.pt is written."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def save_common(*args, **kwargs):
        common_state = signature.bind(*args, **kwargs).arguments["common_state_dict"]
        if torch.distributed.get_rank() == 0 and keep_common_state(common_state):
            return None
        return original(*args, **kwargs)  # writes on rank 0 only
    return save_common


def _routed_schedule(original):
    """`AsyncCallsQueue.schedule_async_request`: a bcp save's request is watched by a `CommitCaller`
    (done once bcp's commit is), in place of the caller the queue made for it, which watches a
    process the request does not have."""
    @functools.wraps(original)
    def schedule_async_request(self, async_request):
        call_idx = original(self, async_request)
        commit = next((fn for fn in async_request.finalize_fns if isinstance(fn, CommitWait)), None)
        if commit is not None and self.async_calls and self.async_calls[-1].idx == call_idx:
            self.async_calls[-1] = self.async_calls[-1]._replace(async_caller=CommitCaller(commit.handle))
        return call_idx
    return schedule_async_request


def _wrap(owner, name: str, wrap) -> None:
    original = getattr(owner, name)
    if getattr(original, _ROUTED, False):
        return
    routed = wrap(original)
    setattr(routed, _ROUTED, True)
    setattr(owner, name, routed)
    if owner is serialization and getattr(dist_checkpointing, name, None) is original:
        setattr(dist_checkpointing, name, routed)


def install() -> None:
    """Route dist_checkpointing's save and loads (module docstring). Idempotent."""
    check_api()
    for name, wrap in (("save", _routed_save), *((n, _routed_load) for n in _LOADS),
                       ("load_common_state_dict", _routed_common_state)):
        _wrap(serialization, name, wrap)
    _wrap(async_utils.AsyncCallsQueue, "schedule_async_request", _routed_schedule)
    if hasattr(serialization, "save_common"):  # 0.17, 0.18 (0.19 writes no common.pt)
        _wrap(serialization, "save_common", _routed_common_save)
        _wrap(serialization, "load_common", _routed_common_state)
    elif hasattr(megatron_common, "TorchCommonSaveStrategy"):  # 0.16
        _wrap(megatron_common.TorchCommonSaveStrategy, "save_common", _routed_common_save)
        _wrap(megatron_common.TorchCommonLoadStrategy, "load_common", _routed_common_state)
