"""bcp as a Megatron-core dist_checkpointing backend: `("bcp", 1)`.

    from bcp_integrations.megatron import register_strategies
    register_strategies()
    dist_checkpointing.save(sharded_sd, ckpt_dir, sharded_strategy=("bcp", 1))
    dist_checkpointing.load(sharded_sd, ckpt_dir)          # picks bcp from metadata.json

Megatron writes `common.pt` and `metadata.json` in `ckpt_dir`; bcp writes `bcp_metadata.json` and
`data/`. Megatron writes `metadata.json` after the strategy returns (after the async request's
finalize functions, for async saves), so a directory without it was never completed.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch
from torch.distributed.checkpoint import CheckpointException as TorchCheckpointException
from megatron.core.dist_checkpointing.core import CheckpointingException
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest
from megatron.core.dist_checkpointing.strategies.base import (AsyncSaveShardedStrategy, LoadShardedStrategy,
                                                              StrategyAction, register_default_strategy)

import bcp_core as bcp
from bcp_core.comm import DEFAULT_TIMEOUT
from bcp_core.errors import BCPError, PickleNotAllowedError
from bcp_core.utils import this_rank

from .adapter import load, save

BACKEND, VERSION = "bcp", 1


class BcpCheckpointingException(CheckpointingException, TorchCheckpointException):
    """A bcp save or load failure, as Megatron's callers expect one from a dist_checkpointing backend.

    It is Megatron's `CheckpointingException` and also `torch.distributed.checkpoint.CheckpointException`
    (what the default torch_dist backend raises), so code that catches either keeps working with
    ("bcp", 1). `__cause__` is bcp's own error (`KeyMismatchError`, `ShapeMismatchError`, `SaveError`...);
    `failures` maps this rank to it, as torch's exception does.
    """

    def __init__(self, message: str, failures: dict):
        TorchCheckpointException.__init__(self, message, failures)

    def __str__(self) -> str:
        return self.args[0]


def _translated(action: str, checkpoint_dir, fn: Callable, *args, **kwargs):
    """fn(*args, **kwargs), a bcp error raised as BcpCheckpointingException naming `action` and the rank."""
    try:
        return fn(*args, **kwargs)
    except BCPError as e:
        rank = this_rank()
        hint = ""
        if isinstance(e, PickleNotAllowedError) or "UnsupportedValueError" in str(e):  # a SaveError carries text
            hint = (" (through dist_checkpointing: save with BcpSaveShardedStrategy(allow_pickle=True), load with "
                    "BcpLoadShardedStrategy(allow_pickle=True))")
        raise BcpCheckpointingException(f"bcp {action} of {checkpoint_dir} failed on rank {rank}: "
                                        f"{type(e).__name__}: {e}{hint}",
                                        {rank: (e, traceback.extract_tb(e.__traceback__))}) from e


class BcpSaveShardedStrategy(AsyncSaveShardedStrategy):
    """Writes Megatron's sharded state (ShardedTensors and ShardedObjects) as a bcp checkpoint.

    Replicated boxes are written once, by the least-loaded rank holding them, so wrapping this in
    `FullyParallelSaveStrategyWrapper` is unnecessary (harmless: it only renumbers replica ids).
    """

    def __init__(self, backend: str = BACKEND, version: int = VERSION, *, allow_pickle: bool = False,
                 num_threads: int | None = None, process_group=None, timeout: timedelta = DEFAULT_TIMEOUT):
        super().__init__(backend, version)
        self.allow_pickle = allow_pickle
        self.num_threads = num_threads
        self.process_group = process_group
        self.timeout = timeout

    @property
    def can_handle_sharded_objects(self) -> bool:
        return True

    def _save(self, sharded_state_dict, checkpoint_dir, async_save: bool) -> bcp.SaveHandle:
        return save(sharded_state_dict, checkpoint_dir, async_save=async_save, process_group=self.process_group,
                    allow_pickle=self.allow_pickle, num_threads=self.num_threads, timeout=self.timeout)

    def save(self, sharded_state_dict, checkpoint_dir) -> None:
        _translated("save", checkpoint_dir, lambda: self._save(sharded_state_dict, checkpoint_dir, False).wait())

    def async_save(self, sharded_state_dict, checkpoint_dir) -> AsyncRequest:
        """Stage now (the only training stall) and write in bcp's background thread.

        Megatron runs `async_fn` in a forked or spawned process, which cannot see bcp's writer
        thread or join its planning collectives; so the request has no `async_fn`, and its
        finalize function — run by Megatron on every rank once the request is done — waits for
        the bcp commit before Megatron writes `metadata.json`.
        """
        handle = _translated("save", checkpoint_dir, self._save, sharded_state_dict, checkpoint_dir, True)
        return AsyncRequest(async_fn=None, async_fn_args=(),
                            finalize_fns=[lambda: _translated("save", checkpoint_dir, handle.wait)])


class BcpLoadShardedStrategy(LoadShardedStrategy):
    """Loads a bcp checkpoint into any Megatron layout (TP/PP/DP/EP may all differ from the save)."""

    def __init__(self, *, allow_pickle: bool = False, verify_checksums: bool = True, num_threads: int = 4,
                 mapping=None):
        super().__init__()
        self.allow_pickle = allow_pickle
        self.verify_checksums = verify_checksums
        self.num_threads = num_threads
        self.mapping = mapping  # a bcp_core.mapping.Mapping: load another framework's checkpoint (adapter.load)

    @property
    def can_handle_sharded_objects(self) -> bool:
        return True

    def check_backend_compatibility(self, loaded_backend) -> None:
        if loaded_backend != BACKEND:
            raise CheckpointingException(f"the bcp load strategy cannot read a {loaded_backend!r} checkpoint")

    def check_version_compatibility(self, loaded_version) -> None:
        if loaded_version > VERSION:
            raise CheckpointingException(f"bcp Megatron backend version {loaded_version} is newer than this "
                                         f"bcp's ({VERSION}); upgrade bcp")

    def load(self, sharded_state_dict, checkpoint_dir):
        """Errors are `BcpCheckpointingException`s: a requested key the checkpoint lacks (what Megatron
        calls an unexpected key, left to the backend under its default `StrictHandling.ASSUME_OK_UNEXPECTED`),
        a shape that differs without `allow_shape_mismatch`, a damaged checkpoint."""
        return _translated("load", checkpoint_dir, load, sharded_state_dict, checkpoint_dir, strict=True,
                           allow_pickle=self.allow_pickle, verify_checksums=self.verify_checksums,
                           num_threads=self.num_threads, mapping=self.mapping)

    def load_tensors_metadata(self, checkpoint_dir: str | Path):
        """key -> data-less ShardedTensor with the saved global shape and dtype (one shard)."""
        return _tensors_metadata(_translated("metadata read", checkpoint_dir, bcp.inspect, str(checkpoint_dir)))

    def load_sharded_metadata(self, checkpoint_dir: str | Path):
        """Tensors as in `load_tensors_metadata`, plus one data-less ShardedObject per saved shard."""
        md = _translated("metadata read", checkpoint_dir, bcp.inspect, str(checkpoint_dir))
        out = {}
        for unique_key in md.sharded_objects:  # saved under Megatron's unique keys
            out[unique_key] = ShardedObject.empty_from_unique_key(unique_key)
        out.update(_tensors_metadata(md))
        return out


def _tensors_metadata(md) -> dict:
    return {key: ShardedTensor.from_rank_offsets(key, torch.empty(tm.shape, dtype=tm.dtype,
                                                                  device="meta")).without_data()
            for key, tm in md.tensors.items()}


def register_strategies() -> None:
    """Register `("bcp", 1)` for saving and loading sharded state. Idempotent."""
    register_default_strategy(StrategyAction.SAVE_SHARDED, BACKEND, VERSION, BcpSaveShardedStrategy())
    register_default_strategy(StrategyAction.LOAD_SHARDED, BACKEND, VERSION, BcpLoadShardedStrategy())
