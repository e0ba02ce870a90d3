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

from datetime import timedelta
from pathlib import Path

import torch
from megatron.core.dist_checkpointing.core import CheckpointingException
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest
from megatron.core.dist_checkpointing.strategies.base import (AsyncSaveShardedStrategy, LoadShardedStrategy,
                                                              StrategyAction, register_default_strategy)

import bcp_core as bcp
from bcp_core.comm import DEFAULT_TIMEOUT

from .adapter import load, save

BACKEND, VERSION = "bcp", 1


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
        self._save(sharded_state_dict, checkpoint_dir, async_save=False).wait()

    def async_save(self, sharded_state_dict, checkpoint_dir) -> AsyncRequest:
        """Stage now (the only training stall) and write in bcp's background thread.

        Megatron runs `async_fn` in a forked or spawned process, which cannot see bcp's writer
        thread or join its planning collectives; so the request has no `async_fn`, and its
        finalize function — run by Megatron on every rank once the request is done — waits for
        the bcp commit before Megatron writes `metadata.json`.
        """
        handle = self._save(sharded_state_dict, checkpoint_dir, async_save=True)
        return AsyncRequest(async_fn=None, async_fn_args=(), finalize_fns=[handle.wait])


class BcpLoadShardedStrategy(LoadShardedStrategy):
    """Loads a bcp checkpoint into any Megatron layout (TP/PP/DP/EP may all differ from the save)."""

    def __init__(self, *, allow_pickle: bool = False, verify_checksums: bool = True, num_threads: int = 4):
        super().__init__()
        self.allow_pickle = allow_pickle
        self.verify_checksums = verify_checksums
        self.num_threads = num_threads

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
        return load(sharded_state_dict, checkpoint_dir, strict=True, allow_pickle=self.allow_pickle,
                    verify_checksums=self.verify_checksums, num_threads=self.num_threads)

    def load_tensors_metadata(self, checkpoint_dir: str | Path):
        """key -> data-less ShardedTensor with the saved global shape and dtype (one shard)."""
        md = bcp.inspect(str(checkpoint_dir))
        return {key: ShardedTensor.from_rank_offsets(key, torch.empty(tm.shape, dtype=tm.dtype,
                                                                      device="meta")).without_data()
                for key, tm in md.tensors.items()}

    def load_sharded_metadata(self, checkpoint_dir: str | Path):
        """Tensors as in `load_tensors_metadata`, plus one data-less ShardedObject per saved shard."""
        md = bcp.inspect(str(checkpoint_dir))
        out = {}
        for unique_key in md.sharded_objects:  # saved under Megatron's unique keys
            out[unique_key] = ShardedObject.empty_from_unique_key(unique_key)
        out.update(self.load_tensors_metadata(checkpoint_dir))
        return out


def register_strategies() -> None:
    """Register `("bcp", 1)` for saving and loading sharded state. Idempotent."""
    register_default_strategy(StrategyAction.SAVE_SHARDED, BACKEND, VERSION, BcpSaveShardedStrategy())
    register_default_strategy(StrategyAction.LOAD_SHARDED, BACKEND, VERSION, BcpLoadShardedStrategy())
