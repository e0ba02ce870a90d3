"""bcp as a Megatron-core dist_checkpointing backend: `("bcp", 1)`, megatron-core 0.16 to 0.19.

    import bcp_integrations.megatron        # routes dist_checkpointing's entry points (routing.py)
    dist_checkpointing.save(sharded_sd, ckpt_dir, sharded_strategy=("bcp", 1))
    dist_checkpointing.load(sharded_sd, ckpt_dir)          # picks bcp from metadata.json

Megatron writes `metadata.json` in `ckpt_dir` after the strategy returns (after the async request's
finalize functions, for async saves), so a directory without it was never completed; bcp writes
`bcp_metadata.json` and `data/`. Megatron's non-sharded values are the bcp object `common_state`
(`read_common_state`), inside bcp's commit, on every release: 0.19 hands them to the strategy as
that object; up to 0.18 Megatron's save would write them to `common.pt` before the sharded part,
outside any commit, so the routing hands them here instead (`saving_common_state`). torch.save
bytes, enum members pickled by value (`common_state_bytes`). Checkpoints of earlier bcp releases
keep them in `common.pt`, which the routed loads still read.

The strategies subclass Megatron's torch_dist ones: from 0.17 on, `dist_checkpointing.save` replaces
any strategy that is not a `TorchDistSaveShardedStrategy` by a new torch_dist one, and 0.19 has no
other base class left. Every method Megatron calls is overridden; nothing of torch_dist runs.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import enum
import io
import pickle
import traceback
import types
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch
from megatron.core.dist_checkpointing import serialization
from megatron.core.dist_checkpointing.core import CheckpointingException
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, is_main_replica
from megatron.core.dist_checkpointing.strategies import async_utils, common as megatron_common
from megatron.core.dist_checkpointing.strategies import torch as megatron_torch
from torch.distributed.checkpoint import CheckpointException as TorchCheckpointException

import bcp_core as bcp
from bcp_core.comm import DEFAULT_TIMEOUT
from bcp_core.errors import BCPError, PickleNotAllowedError
from bcp_core.utils import this_rank

from .adapter import load, save

BACKEND, VERSION = "bcp", 1

# 0.19 hands Megatron's non-sharded values to the strategy as this ShardedObject; for earlier
# releases, which write them to common.pt themselves, bcp stores them as the same object.
COMMON_STATE_KEY = "common_state"
# up to 0.18 (0.16: TorchCommonSaveStrategy; 0.17, 0.18: serialization.save_common)
MEGATRON_WRITES_COMMON_PT = hasattr(serialization, "save_common") or hasattr(megatron_common,
                                                                              "TorchCommonSaveStrategy")
# Megatron's non-sharded values of the dist_checkpointing.save running in this context (up to 0.18)
_common_state_of_save: contextvars.ContextVar[dict | None] = contextvars.ContextVar("bcp_megatron_common_state",
                                                                                      default=None)


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


class _EnumsByValue(pickle.Pickler):
    """Pickles enum members as `Class(value)`, whichever Python runs. Some releases (Debian 12's
    Python 3.11.2; not 3.11.7) pickle them as `getattr(Class, name)`, and torch.load(weights_only=True)
    refuses `getattr` whatever classes are allowed: Megatron's own common.pt written there cannot be
    loaded again, with any backend, by Megatron's own load."""

    def reducer_override(self, obj):
        if isinstance(obj, enum.Enum):
            return type(obj), (obj._value_,)
        return NotImplemented


# what torch.save asks of its `pickle_module`
_PICKLE_ENUMS_BY_VALUE = types.SimpleNamespace(Pickler=_EnumsByValue, Unpickler=pickle.Unpickler, load=pickle.load,
                                               dump=pickle.dump, __name__="pickle")


def common_state_bytes(common_state) -> bytes:
    """Megatron's non-sharded values (its `args` Namespace, enums, configs) as the bytes of a
    torch.save file, as common.pt holds them, that torch.load(weights_only=True) reads back under
    Megatron's safe globals on any Python: enum members pickled by value (`_EnumsByValue`)."""
    buffer = io.BytesIO()
    torch.save(common_state, buffer, pickle_module=_PICKLE_ENUMS_BY_VALUE)
    return buffer.getvalue()


def _common_state_as_bytes(sharded_state_dict: dict) -> None:
    """0.19's `common_state` ShardedObject holds Megatron's non-sharded values: stored as
    `common_state_bytes` (what common.pt held), which `read_common_state` reads back with
    torch.load(weights_only=True) under Megatron's safe globals, as torch_dist does. Only the main
    replica is written."""
    common = sharded_state_dict.get(COMMON_STATE_KEY)
    if isinstance(common, ShardedObject) and is_main_replica(common.replica_id) \
            and not isinstance(common.data, bytes):
        sharded_state_dict[COMMON_STATE_KEY] = dataclasses.replace(common, data=common_state_bytes(common.data))


@contextlib.contextmanager
def saving_common_state():
    """Around a `dist_checkpointing.save` with a bcp strategy (routing.py): Megatron's non-sharded
    values, given to `keep_common_state` by the routed writer of common.pt, go into this save's
    checkpoint as the object COMMON_STATE_KEY, committed with the sharded part."""
    token = _common_state_of_save.set({})
    try:
        yield
    finally:
        _common_state_of_save.reset(token)


def keep_common_state(common_state) -> bool:
    """Megatron's non-sharded values for the bcp save running in this context; False outside one."""
    pending = _common_state_of_save.get()
    if pending is None:
        return False
    pending["data"] = common_state_bytes(common_state)
    return True


def _with_common_state(sharded_state_dict: dict) -> dict:
    """The sharded state dict of a save, with the non-sharded values kept for it (up to 0.18, rank 0)."""
    pending = _common_state_of_save.get()
    if pending is None or not MEGATRON_WRITES_COMMON_PT:
        return sharded_state_dict
    # refused on every rank, not only on rank 0, which holds the values: the others would wait for
    # rank 0 in the save's exchanges until the timeout
    if COMMON_STATE_KEY in sharded_state_dict:
        raise CheckpointingException(f"the sharded state dict has a key {COMMON_STATE_KEY!r}, which bcp keeps for "
                                     "Megatron's non-sharded values")
    data = pending.get("data")
    if data is None:
        return sharded_state_dict
    return {**sharded_state_dict, COMMON_STATE_KEY: ShardedObject(COMMON_STATE_KEY, data, (1,), (0,), replica_id=0)}


def read_common_state(checkpoint_dir) -> dict:
    """Megatron's non-sharded values kept in a bcp checkpoint as its object COMMON_STATE_KEY. Reads
    on this rank alone: Megatron-LM asks on rank 0 only."""
    target = ShardedObject(COMMON_STATE_KEY, None, (1,), (0,), replica_id=0)
    loaded = _translated("load", checkpoint_dir, load, {COMMON_STATE_KEY: target}, checkpoint_dir, strict=True,
                         share_reads=False)[COMMON_STATE_KEY]
    if not isinstance(loaded, bytes):
        raise CheckpointingException(f"{checkpoint_dir}: its {COMMON_STATE_KEY!r} object is not Megatron's "
                                     f"common state (a {type(loaded).__name__})")
    return torch.load(io.BytesIO(loaded), weights_only=True)


class CommitWait:
    """The finalize function of a bcp save's async request: waits for bcp's commit of `handle`, a
    failure raised as BcpCheckpointingException naming `where`. `CommitCaller` tells Megatron's
    queue when it has nothing left to wait for."""

    def __init__(self, handle: bcp.SaveHandle, where):
        self.handle, self.where = handle, where

    def __call__(self) -> None:
        _translated("save", self.where, self.handle.wait)


class CommitCaller(async_utils.TemporalAsyncCaller):
    """What Megatron's `AsyncCallsQueue` asks whether a bcp request is done (routing puts it in place
    of the caller the queue made): once bcp has committed or failed the save on every rank, agreed
    by Megatron's own all-reduce. A request carries no process for the queue to watch (bcp writes in
    its own thread), so without this the queue took it as done at once, and its next non-blocking
    `maybe_finalize_async_calls` (Megatron-LM makes one every iteration) waited in the finalize
    function for the whole write: the save was asynchronous for the call only."""

    def __init__(self, handle: bcp.SaveHandle):
        super().__init__()
        self.handle = handle

    def is_current_async_call_done(self, blocking: bool = False, no_dist: bool = False) -> bool:
        if blocking:
            return True  # the finalize function waits for the commit (bounded by the save's timeout)
        pending = int(not self.handle.done())
        return not pending if no_dist else bool(self.sync_all_async_calls(pending))


def _async_request(commit: CommitWait, async_strategy: str | None):
    """A request with no `async_fn`, of the class the caller's queue takes (Megatron's own, or
    NVIDIA Resiliency Extension's for `async_strategy="nvrx"` where it is installed), finalized by
    `commit`."""
    get_async_strategy = getattr(megatron_torch, "get_async_strategy", None)  # 0.17+
    if get_async_strategy is not None and async_strategy is not None:
        try:
            request_cls = get_async_strategy(async_strategy)[1]["AsyncRequest"]
        except ModuleNotFoundError:  # "nvrx" without the package: bcp needs no worker, Megatron's queue serves
            request_cls = async_utils.AsyncRequest
    else:
        request_cls = async_utils.AsyncRequest
    return request_cls(None, (), [commit])


class BcpSaveShardedStrategy(megatron_torch.TorchDistSaveShardedStrategy):
    """Writes Megatron's sharded state (ShardedTensors and ShardedObjects) as a bcp checkpoint.

    Replicated boxes are written once, by the least-loaded rank holding them, so wrapping this in
    `FullyParallelSaveStrategyWrapper` is unnecessary (the routing unwraps it: from 0.17 on the
    wrapper would record `torch_dist` in metadata.json).
    """

    def __init__(self, backend: str = BACKEND, version: int = VERSION, *, allow_pickle: bool = False,
                 num_threads: int | None = None, process_group=None, timeout: timedelta = DEFAULT_TIMEOUT):
        if backend != BACKEND or version > VERSION:
            raise CheckpointingException(f"BcpSaveShardedStrategy writes ({BACKEND!r}, {VERSION}), "
                                         f"not ({backend!r}, {version})")
        super().__init__(backend=BACKEND, version=VERSION)
        self.allow_pickle = allow_pickle
        self.num_threads = num_threads
        self.process_group = process_group
        self.timeout = timeout

    @property
    def can_handle_sharded_objects(self) -> bool:
        return True

    def _save(self, sharded_state_dict, checkpoint_dir, async_save: bool) -> bcp.SaveHandle:
        sharded_state_dict = _with_common_state(sharded_state_dict)
        _common_state_as_bytes(sharded_state_dict)
        return save(sharded_state_dict, checkpoint_dir, async_save=async_save, process_group=self.process_group,
                    allow_pickle=self.allow_pickle, num_threads=self.num_threads, timeout=self.timeout)

    def save(self, sharded_state_dict, checkpoint_dir) -> None:
        _translated("save", checkpoint_dir, lambda: self._save(sharded_state_dict, checkpoint_dir, False).wait())

    def async_save(self, sharded_state_dict, checkpoint_dir, async_strategy: str | None = None):
        """Stage now (the only training stall) and write in bcp's background thread.

        Megatron runs `async_fn` in a forked or spawned process, which cannot see bcp's writer
        thread or join its planning collectives; so the request has no `async_fn`, and its
        finalize function — run by Megatron on every rank once the request is done — waits for
        the bcp commit before Megatron writes `metadata.json`. Megatron's `AsyncCallsQueue` takes
        the request as done once bcp's commit is (`CommitCaller`). `async_strategy` ("mcore",
        "nvrx") only chooses the request's class.
        """
        handle = _translated("save", checkpoint_dir, self._save, sharded_state_dict, checkpoint_dir, True)
        return _async_request(CommitWait(handle, checkpoint_dir), async_strategy)

    def __str__(self) -> str:
        return f"{type(self).__name__}({BACKEND}, {VERSION})"


class BcpLoadShardedStrategy(megatron_torch.TorchDistLoadShardedStrategy):
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

    def load(self, sharded_state_dict, checkpoint_dir, async_strategy: str | None = None):
        """Errors are `BcpCheckpointingException`s: a requested key the checkpoint lacks (what Megatron
        calls an unexpected key, left to the backend under its default `StrictHandling.ASSUME_OK_UNEXPECTED`),
        a shape that differs without `allow_shape_mismatch`, a damaged checkpoint. `async_strategy`
        (how the checkpoint's saver ran, passed by 0.17+) does not matter to bcp."""
        return _translated("load", checkpoint_dir, load, sharded_state_dict, checkpoint_dir, strict=True,
                           allow_pickle=self.allow_pickle, verify_checksums=self.verify_checksums,
                           num_threads=self.num_threads, mapping=self.mapping)

    def load_tensors_metadata(self, checkpoint_dir: str | Path, metadata=None):
        """key -> data-less ShardedTensor with the saved global shape and dtype (one shard)."""
        return _tensors_metadata(_translated("metadata read", checkpoint_dir, bcp.inspect, str(checkpoint_dir)))

    def load_sharded_metadata(self, checkpoint_dir: str | Path):
        """Tensors as in `load_tensors_metadata`, plus one data-less ShardedObject per saved shard.
        Up to 0.18 without Megatron's non-sharded values (its strict checks would take the object
        for a key the caller forgot; 0.19 leaves it out of them itself)."""
        md = _translated("metadata read", checkpoint_dir, bcp.inspect, str(checkpoint_dir))
        out = {}
        for unique_key in md.sharded_objects:  # saved under Megatron's unique keys
            if not (MEGATRON_WRITES_COMMON_PT and unique_key.split("/")[0] == COMMON_STATE_KEY):
                out[unique_key] = ShardedObject.empty_from_unique_key(unique_key)
        out.update(_tensors_metadata(md))
        return out

    def remove_sharded_tensors(self, checkpoint_dir, key_prefix: str):
        raise CheckpointingException(f"{checkpoint_dir} is a bcp checkpoint: bcp does not edit committed "
                                     f"checkpoints in place (to drop {key_prefix!r}*, load what you keep and save "
                                     "it anew)")

    def __str__(self) -> str:
        return f"{type(self).__name__}({BACKEND}, {VERSION})"


def _tensors_metadata(md) -> dict:
    return {key: ShardedTensor.from_rank_offsets(key, torch.empty(tm.shape, dtype=tm.dtype,
                                                                  device="meta")).without_data()
            for key, tm in md.tensors.items()}
