"""Megatron-LM's local (non-persistent) checkpoints served by bcp's tiers, under `--ckpt-format bcp`.

    --ckpt-format bcp --non-persistent-ckpt-type local --non-persistent-local-ckpt-dir /dev/shm/ckpt
    --non-persistent-save-interval 10 [--replication --replication-factor 2 --replication-jump 1]

Megatron-LM hands local checkpoints to NVIDIA Resiliency Extension's `LocalCheckpointManager`, whose
checkpoints reload only into the same parallel layout. In a run that chose bcp they go to
`bcp.Tiers(memory=<local ckpt dir>, replicas=<replication factor - 1 with --replication, else 0>)`:
every node writes its pieces into its own directory, replicas travel to other nodes, and a
restart loads the newest step whose pieces survive, resharded to the new layout, fetching from the
nodes that hold them (docs/tiers.md). Megatron's persistent checkpoints (`--save`, `--save-interval`)
stay as they are; Megatron loads whichever of the two is newer.

Megatron's own code for local checkpoints runs unchanged; three hook points make bcp serve it
(`enable`, called by `enable_megatron_lm`):

1. the parsed arguments: `--non-persistent-ckpt-type local` (and `--replication`) are recorded and
   parsed as unset, so that Megatron's checks and its manager's creation, which import the
   extension, are skipped;
2. `training.setup_model_and_optimizer`, which `pretrain` calls with its checkpointing context
   before the first load: bcp's manager (`TieredLocalCheckpoints`) goes into that context and the
   type back to "local", so Megatron's save and load take their local branches;
3. `MCoreTensorAwareStateDict.from_state_dict`, which those branches call: with bcp's manager it
   hands Megatron's state dict through unchanged.

The state is saved as a checkpoint of dist_checkpointing does it: the sharded part by bcp's Megatron
adapter, the common part (args, iteration...) as the bytes of a `torch.save` in one object, as
megatron-core 0.19 keeps it (`strategy.COMMON_STATE_KEY`).
"""

from __future__ import annotations

import argparse
import functools
import io
from collections.abc import Callable

import torch
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.dist_checkpointing.state_dict_utils import load_preprocess, save_preprocess
from megatron.core.dist_checkpointing.utils import extract_sharded_base

import bcp_core as bcp
from bcp_core.errors import IncompleteCheckpointError, NotACheckpointError
from bcp_core.tiers import locate
from bcp_core.utils import this_rank

from .adapter import PreparedLoad
from .strategy import COMMON_STATE_KEY, CommitWait, _async_request, _translated, common_state_bytes

_state: dict = {"tiers": None, "enabled": False}


def requested() -> bcp.Tiers | None:
    """The tiers this run's local checkpoints go to, if it asked for them under `--ckpt-format bcp`."""
    return _state["tiers"]


# ----------------------------------------------------------------------------- 1. the arguments

def hook_parser(parser: argparse.ArgumentParser, bcp_selected: Callable[[], bool]) -> argparse.ArgumentParser:
    """After `parser` parses (Megatron-LM's own parser): the local checkpoint type of a run that
    `bcp_selected()` (`--ckpt-format bcp`) is taken over (module doc). Idempotent."""
    if getattr(parser.parse_known_args, "_bcp_local", False):
        return parser
    original = parser.parse_known_args

    @functools.wraps(original)
    def parse_known_args(*args, **kwargs):
        namespace, rest = original(*args, **kwargs)
        if bcp_selected():
            _take_over(namespace)
        return namespace, rest

    parse_known_args._bcp_local = True
    parser.parse_known_args = parse_known_args
    return parser


def _take_over(ns: argparse.Namespace) -> None:
    if getattr(ns, "non_persistent_ckpt_type", None) != "local":
        return
    directory = getattr(ns, "non_persistent_local_ckpt_dir", None)
    if not directory:
        raise ValueError("--non-persistent-ckpt-type local needs --non-persistent-local-ckpt-dir (each node's "
                         "own directory for its local checkpoints: a RAM disk or a local SSD)")
    replicas = (int(getattr(ns, "replication_factor", 2)) - 1) if getattr(ns, "replication", False) else 0
    _state["tiers"] = bcp.Tiers(directory, replicas=replicas)
    ns.non_persistent_ckpt_type = None
    ns.replication = False  # bcp places the replicas (tiers/placement.py)
    ns.replication_jump = None


# ----------------------------------------------------------------------------- 2. and 3.

def enable() -> None:
    """Install hook points 2 and 3 (module doc). Idempotent; `enable_megatron_lm` calls it."""
    if _state["enabled"]:
        return
    from megatron.core.dist_checkpointing.tensor_aware_state_dict import MCoreTensorAwareStateDict
    from megatron.training import training

    setup = training.setup_model_and_optimizer

    @functools.wraps(setup)
    def setup_model_and_optimizer(*args, **kwargs):
        tiers = requested()
        context = kwargs.get("checkpointing_context")
        if tiers is not None and context is not None:
            from megatron.training import get_args
            context["local_checkpoint_manager"] = TieredLocalCheckpoints(tiers)
            get_args().non_persistent_ckpt_type = "local"
        return setup(*args, **kwargs)

    training.setup_model_and_optimizer = setup_model_and_optimizer
    from_state_dict = MCoreTensorAwareStateDict.from_state_dict.__func__

    @functools.wraps(from_state_dict)
    def passed_through(cls, sharded_state_dict, *args, **kwargs):
        if requested() is not None:
            return TieredStateDict(sharded_state_dict), None
        return from_state_dict(cls, sharded_state_dict, *args, **kwargs)

    MCoreTensorAwareStateDict.from_state_dict = classmethod(passed_through)
    _state["enabled"] = True


class TieredStateDict:
    """What Megatron's local branches hold between the manager and the model: on save, Megatron's
    sharded state dict; on load, the step found (`to_state_dict` loads it)."""

    def __init__(self, state_dict=None, located=None):
        self.state_dict, self.located = state_dict, located

    def to_state_dict(self, sharded_state_dict=None, algo=None, parallelization_group=None, **_):
        """The loaded state dict, as `dist_checkpointing.load` returns it; only the common part when
        Megatron asks without a sharded state dict (its first, arguments-only read)."""
        if sharded_state_dict is None:
            target = {COMMON_STATE_KEY: _common_target()}
            loaded = _load(target, self.located)
            return _common_of(loaded)
        sharded, nonpersistent, factories = load_preprocess(sharded_state_dict)
        sharded, _ = extract_sharded_base(sharded)  # the rest is the common state, loaded with it
        sharded[COMMON_STATE_KEY] = _common_target()
        loaded = _load(sharded, self.located)
        common = _common_of(loaded)
        from megatron.core.dist_checkpointing.dict_utils import merge
        from megatron.core.dist_checkpointing.mapping import apply_factory_merges
        merge(common, loaded)
        merge(common, nonpersistent)
        return apply_factory_merges(common, factories)


class TieredLocalCheckpoints:
    """bcp's stand-in for the extension's `LocalCheckpointManager`: the interface Megatron-LM's
    local branches call (`local_ckpt_dir`, `save`, `find_latest`, `load`), over `tiers`."""

    def __init__(self, tiers: bcp.Tiers):
        self.tiers = tiers
        self.local_ckpt_dir = tiers.memory
        self._located = None

    def save(self, state: TieredStateDict, iteration: int, is_async: bool = False):
        """Save `iteration` to the tiers; for an async save, the request Megatron's queue finalizes
        (its finalize function waits for the commit with the replicas)."""
        sharded, common = save_preprocess(state.state_dict)
        # enum members by value, so that torch.load(weights_only=True) reads it back on any Python
        sharded[COMMON_STATE_KEY] = ShardedObject(COMMON_STATE_KEY, common_state_bytes(common), (1,), (0,),
                                                  replica_id=this_rank())
        where = f"{self.tiers.memory} (iteration {iteration})"
        handle = _translated("save", where, bcp.save, self.tiers, sharded, framework="megatron",
                             step=int(iteration), async_save=is_async)
        if not is_async:
            _translated("save", where, handle.wait)
            return None
        return _async_request(CommitWait(handle, where), None)

    def find_latest(self) -> int:
        """The newest iteration whose every piece survives (collective), or -1."""
        try:
            self._located = _translated("load", self.tiers.memory, locate, self.tiers)
        except Exception as e:  # noqa: BLE001 - nothing to resume from is no error: Megatron goes on
            cause = e.__cause__ if e.__cause__ is not None else e
            if not isinstance(cause, (NotACheckpointError, IncompleteCheckpointError)):
                raise
            self._located = None
            return -1
        return self._located.step

    def load(self):
        if self._located is None:
            raise RuntimeError("bcp local checkpoints: load() without a step found by find_latest()")
        located, self._located = self._located, None
        return TieredStateDict(located=located), located.path


def _common_target() -> ShardedObject:
    return ShardedObject(COMMON_STATE_KEY, None, (1,), (0,), replica_id=0)


def _common_of(loaded: dict) -> dict:
    """Megatron's common state, from the bytes a save stored (read as `strategy.read_common_state` does)."""
    data = loaded.pop(COMMON_STATE_KEY)
    return torch.load(io.BytesIO(data), weights_only=True)


def _load(sharded_state_dict: dict, located) -> dict:
    """Load the located step into a Megatron sharded state dict (`adapter.load`, from a tiered step).
    A planning error on this rank is raised by the load on every rank, not here alone (the others
    would wait for this one in the collective load)."""
    failure, prepared = None, None
    try:
        prepared = PreparedLoad.of(sharded_state_dict, located.metadata)
    except Exception as e:  # noqa: BLE001 - raised on every rank by the load below
        failure = e
    _translated("load", located.path, located.load, prepared.state if prepared else {}, framework="megatron",
                failure=failure)
    return prepared.result()
