"""What Megatron-core's dist_checkpointing promises its callers, held by bcp's ("bcp", 1) backend.

Megatron code written for the default torch_dist backend relies on more than bytes coming back:
errors are `CheckpointingException`s (torch's `CheckpointException` too, from torch_dist) naming
what is wrong; `strict=StrictHandling...` finds missing and unexpected keys from the backend's
`load_sharded_metadata`; `allow_shape_mismatch` pads; ShardedObjects hold ordinary Python values
(lists, sets, tuples); a write failure on one rank fails the save on every rank; metadata reads,
`load_plain_tensors` and `load_common_state_dict` answer from the checkpoint. docs/megatron.md
lists which of Megatron's own unit tests these cases stand for.

One 2-rank launch runs every distributed case (`_contract`) and reports what it saw; the tests
below assert on the reports. A case that raised reports its traceback instead.
"""

from __future__ import annotations

import enum
import logging
import os
import pickle
import traceback

import pytest

import torch

import megatron_releases
from dist import run_ranks

megatron_releases.skip_without_megatron_core()

WORLD = 2


# ----------------------------------------------------------------------------- rank side

def _base_state(rank: int, world: int) -> dict:
    """Tensors replicated, sharded and replicated with the main replica on the last rank; objects
    holding a list (one shard, rank 0's saved), a set per rank, and a tuple/frozenset per rank."""
    from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor
    return {
        "TenA": ShardedTensor.from_rank_offsets("TenA", torch.arange(2), replica_id=rank),
        "TenB": ShardedTensor.from_rank_offsets("TenB", torch.arange(3), (0, rank, world), replica_id=0),
        "TenC": ShardedTensor.from_rank_offsets("TenC", torch.arange(3), replica_id=world - rank - 1),
        "ObjA": ShardedObject("ObjA", list(range(10)), (1,), (0,), replica_id=rank),
        "ObjB": ShardedObject("ObjB", {rank + 7}, (1, world), (0, rank), replica_id=0),
        "ObjT": ShardedObject("ObjT", {"t": (rank, "x"), "f": frozenset({rank, -rank - 1})}, (world,), (rank,),
                              replica_id=0),
    }


class _Warnings(logging.Handler):
    """Every WARNING (or worse) logged anywhere while installed."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.records: list[str] = []

    def emit(self, record):
        self.records.append(f"{record.name}: {record.getMessage()}")

    def __enter__(self):
        logging.getLogger().addHandler(self)
        return self

    def __exit__(self, *exc):
        logging.getLogger().removeHandler(self)


def _error(fn) -> dict:
    """What fn() raised: its classes, message, and bcp's error behind it."""
    from megatron.core.dist_checkpointing.core import CheckpointingException
    from torch.distributed.checkpoint import CheckpointException
    try:
        fn()
    except BaseException as e:  # noqa: BLE001 - torch's CheckpointException is a BaseException
        return {"megatron": isinstance(e, CheckpointingException), "torch": isinstance(e, CheckpointException),
                "type": type(e).__name__, "message": str(e),
                "cause": type(e.__cause__).__name__ if e.__cause__ is not None else None}
    return {"raised": False}


def _dir(root: str, name: str) -> str:
    path = os.path.join(root, name)
    if torch.distributed.get_rank() == 0:
        os.makedirs(path)
    torch.distributed.barrier()
    return path


def _values(sd: dict) -> dict:
    return {k: (v.tolist() if isinstance(v, torch.Tensor) else v) for k, v in sd.items()}


def _strict_cases(rank, world, root) -> dict:
    from megatron.core import dist_checkpointing as dc
    from megatron.core.dist_checkpointing.serialization import load_sharded_metadata
    from megatron.core.dist_checkpointing.validation import StrictHandling as S
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
    ckpt = _dir(root, "strict")
    dc.save(_base_state(rank, world), ckpt, sharded_strategy=("bcp", 1))
    out: dict = {"exact": {}, "unexpected": {}, "missing": {}}

    for mode in (S.ASSUME_OK_UNEXPECTED, S.LOG_UNEXPECTED, S.LOG_ALL, S.RAISE_UNEXPECTED, S.RAISE_ALL,
                 S.IGNORE_ALL, S.RETURN_UNEXPECTED, S.RETURN_ALL):
        with _Warnings() as w:
            got = dc.load(_base_state(rank, world), ckpt, strict=mode)
        mismatch = None
        if isinstance(got, tuple):
            got, missing, unexpected = got
            mismatch = (sorted(missing), sorted(unexpected))
        out["exact"][mode.value] = {"values": _values(got), "warnings": w.records, "mismatch": mismatch}

    def with_unexpected():
        sd = _base_state(rank, world)
        sd["TenD"] = ShardedTensor.from_rank_offsets("UnexpectedTenD", torch.arange(3), replica_id=rank)
        sd["ObjD"] = ShardedObject("UnexpectedObjD", None, (1,), (0,), replica_id=rank)
        return sd
    u = out["unexpected"]
    u["assume_ok"] = _error(lambda: dc.load(with_unexpected(), ckpt, strict=S.ASSUME_OK_UNEXPECTED))
    u["raise"] = _error(lambda: dc.load(with_unexpected(), ckpt, strict=S.RAISE_UNEXPECTED))
    _, missing, unexpected = dc.load(with_unexpected(), ckpt, strict=S.RETURN_ALL)
    u["returned"] = (sorted(missing), sorted(unexpected))

    def without_some():
        sd = _base_state(rank, world)
        del sd["TenA"], sd["ObjB"]
        return sd
    m = out["missing"]
    with _Warnings() as w:
        m["raise_unexpected_keys"] = sorted(dc.load(without_some(), ckpt, strict=S.RAISE_UNEXPECTED))
    m["raise_unexpected_warnings"] = w.records
    m["raise_all"] = _error(lambda: dc.load(without_some(), ckpt, strict=S.RAISE_ALL))
    _, missing, unexpected = dc.load(without_some(), ckpt, strict=S.RETURN_ALL)
    m["returned"] = (sorted(missing), sorted(unexpected))

    md = load_sharded_metadata(ckpt)
    # 0.19 keeps its non-sharded values as the object "common_state" (torch_dist too); Megatron's
    # own load leaves it out of the key checks
    internal = sorted(k for k, v in md.items() if v.key == "common_state")
    md = {k: v for k, v in md.items() if v.key != "common_state"}
    loaded = dc.load(md, ckpt, validate_access_integrity=False)
    out["sharded_metadata"] = {"keys": sorted(md), "base_keys": sorted({v.key for v in md.values()}),
                               "values": _values(loaded), "internal": internal}
    return out


def _metadata_cases(rank, world, root) -> dict:
    from megatron.core import dist_checkpointing as dc
    from megatron.core.dist_checkpointing.serialization import load_plain_tensors

    from bcp_integrations.megatron import BcpLoadShardedStrategy
    ckpt = _dir(root, "metadata")
    sd = _base_state(rank, world)
    sd["TenF"] = dc.ShardedTensor.from_rank_offsets("TenF", torch.full((2, 3), float(rank), dtype=torch.bfloat16),
                                                     (1, rank, world), replica_id=0)
    sd["common"] = {"step": 7, "name": "run"}
    dc.save(sd, ckpt, sharded_strategy=("bcp", 1))
    tm = dc.load_tensors_metadata(ckpt)
    empty = _dir(root, "not_a_checkpoint")
    return {
        "tensors": {k: (tuple(v.global_shape), str(v.dtype)) for k, v in tm.items()},
        "plain": _values(load_plain_tensors(ckpt)),
        "common": dc.load_common_state_dict(ckpt),
        "not_a_checkpoint": _error(lambda: BcpLoadShardedStrategy().load_tensors_metadata(empty)),
    }


def _shape_cases(rank, world, root) -> dict:
    from megatron.core import dist_checkpointing as dc
    ckpt = _dir(root, "shapes")
    local = torch.arange(4).unsqueeze(0).expand(2, 4) + rank * 4   # global: arange(4 * world) in 2 rows
    dc.save({"rigid": dc.ShardedTensor.from_rank_offsets("keyA", local, (1, rank, world)),
             "flexible": dc.ShardedTensor.from_rank_offsets("keyB", local, (1, rank, world),
                                                            allow_shape_mismatch=True)}, ckpt,
            sharded_strategy=("bcp", 1))
    out = {}
    for name, n in (("smaller", 3), ("larger", 5)):
        out[f"rigid_{name}"] = _error(lambda: dc.load(
            {"rigid": dc.ShardedTensor.from_rank_offsets("keyA", torch.ones(2, n), (1, rank, world))}, ckpt))
        target = torch.ones(2, n)  # float32: the checkpoint holds int64
        got = dc.load({"flexible": dc.ShardedTensor.from_rank_offsets("keyB", target, (1, rank, world),
                                                                      allow_shape_mismatch=True)}, ckpt)
        out[f"flexible_{name}"] = {"values": got["flexible"].tolist(), "dtype": str(got["flexible"].dtype),
                                   "in_place": got["flexible"].data_ptr() == target.data_ptr()}
    return out


def _save_cases(rank, world, root) -> dict:
    import bcp_core as bcp
    from megatron.core import dist_checkpointing as dc
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper

    from bcp_integrations.megatron import BcpSaveShardedStrategy
    out = {}
    # a view of a big tensor: only the view's bytes are written
    big = torch.ones(1_000_000)
    ckpt = _dir(root, "view")
    dc.save({"v": dc.ShardedTensor.from_rank_offsets("v", big[:10], replica_id=rank)}, ckpt,
            sharded_strategy=("bcp", 1))
    data = os.path.join(ckpt, "data")
    out["view_bytes"] = sum(os.path.getsize(os.path.join(data, f)) for f in os.listdir(data))

    # one strategy saving the same structure again (its plan is cached) writes what a first save writes
    strategy = BcpSaveShardedStrategy()
    paths = [_dir(root, f"cached_{i}") for i in range(3)]
    for i, p in enumerate(paths):
        sd = {"w": dc.ShardedTensor.from_rank_offsets("w", torch.full((2, 3), float(i + rank)), (0, rank, world)),
              "r": dc.ShardedTensor.from_rank_offsets("r", torch.full((4,), float(i)), replica_id=rank)}
        dc.save(sd, p, sharded_strategy=strategy)
    tensors = [{k: (tuple(t.shape), [(p.offsets, p.lengths) for p in t.pieces])
                for k, t in bcp.inspect(p).tensors.items()} for p in paths]
    out["cached_same_metadata"] = all(t == tensors[0] for t in tensors)
    w = dc.ShardedTensor.from_rank_offsets("w", torch.zeros(2, 3), (0, rank, world))
    out["cached_last"] = dc.load({"w": w}, paths[-1])["w"].tolist()

    # ranks with different states: rank 0 only common values, rank 1 a tensor
    ckpt = _dir(root, "uneven")
    sd = {"common": "common-value"} if rank == 0 else \
        {"a": dc.ShardedTensor.from_rank_offsets("x", torch.ones(2) * rank, replica_id=0)}
    dc.save(sd, ckpt, sharded_strategy=("bcp", 1))
    got = dc.load(sd, ckpt)
    out["uneven"] = {k: (v.tolist() if isinstance(v, torch.Tensor) else v) for k, v in got.items()}

    # Megatron's fully parallel save wrapper around bcp
    ckpt = _dir(root, "fully_parallel")
    sd = {f"t{i}": dc.ShardedTensor.from_rank_offsets(f"t{i}", torch.full((3,), float(i)), replica_id=rank)
          for i in range(4)}
    dc.save(sd, ckpt, sharded_strategy=FullyParallelSaveStrategyWrapper(BcpSaveShardedStrategy()))
    target = {f"t{i}": dc.ShardedTensor.from_rank_offsets(f"t{i}", torch.zeros(3), replica_id=rank) for i in range(4)}
    out["fully_parallel"] = _values(dc.load(target, ckpt))
    out["fully_parallel_writers"] = sorted({p.rank for t in bcp.inspect(ckpt).tensors.values() for p in t.pieces})

    # a ShardedObject value the safe codec does not take: the error says how to opt in through Megatron
    ckpt = _dir(root, "unsupported_value")
    out["unsupported"] = _error(lambda: dc.save(
        {"o": dc.ShardedObject("cfg", _Config(), (world,), (rank,), replica_id=0)}, ckpt, sharded_strategy=("bcp", 1)))
    return out


class _Config:
    """A plain object in a ShardedObject: the safe codec refuses it."""


class PickledByGetattr(enum.Enum):
    """An enum whose members pickle as `getattr(Class, name)`, as every enum member does on some
    Python releases (Debian 12's 3.11.2): torch.load(weights_only=True) refuses that, allowed class
    or not. Megatron-LM's `args` hold enums, in the common state Megatron loads that way."""

    MODE = 1

    def __reduce_ex__(self, protocol):
        return getattr, (type(self), self.name)


def _common_state_cases(rank, world, root) -> dict:
    """Megatron's non-sharded values holding an enum member that pickles through getattr, saved with
    ("bcp", 1): Megatron's own loads of them (`load`, `load_common_state_dict`) get it back, as bcp
    writes them with enum members by value (up to 0.18 in common.pt, from 0.19 in the checkpoint)."""
    from megatron.core import dist_checkpointing as dc

    torch.serialization.add_safe_globals([PickledByGetattr])  # as Megatron-LM allows its own enums

    def state():
        return {"w": dc.ShardedTensor.from_rank_offsets("w", torch.full((2,), float(rank)), (0, rank, world)),
                "args": {"mode": PickledByGetattr.MODE, "layers": 2}}
    ckpt = _dir(root, "common_state_enum")
    dc.save(state(), ckpt, sharded_strategy=("bcp", 1))
    got = dc.load(state(), ckpt)
    common = dc.load_common_state_dict(ckpt)
    return {"args": got["args"], "w": got["w"].tolist(), "common_args": common["args"]}


def _async_queue_cases(rank, world, root) -> dict:
    """An async bcp save on Megatron's AsyncCallsQueue, temporal and persistent, is done for the queue
    once bcp has committed it: a non-blocking finalize made while its data are still being written
    (held here until the finalize returned) finalizes nothing and returns; it used to wait in the
    finalize function for the whole write, so Megatron-LM's finalize at every iteration made async
    saves synchronous. A later finalize writes metadata.json."""
    import threading

    from megatron.core import dist_checkpointing as dc
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

    from bcp_core.storage.faults import Fault, inject
    out = {}
    for persistent in (False, True):
        name = f"async_queue_{'persistent' if persistent else 'temporal'}"
        ckpt = _dir(root, name)
        written = threading.Event()
        held = inject(Fault("close", hook=lambda call: written.wait(10), path=f"*/{name}/data/*"))
        try:
            with megatron_releases.torch_dist_on_cpu():  # the queue's all-reduces go to the current device
                queue = AsyncCallsQueue(persistent=persistent)
                queue.schedule_async_request(dc.save(
                    {"w": dc.ShardedTensor.from_rank_offsets("w", torch.full((4,), float(rank)), (0, rank, world))},
                    ckpt, sharded_strategy=("bcp", 1), async_sharded_save=True))
                early = queue.maybe_finalize_async_calls(blocking=False)
                early_metadata_json = os.path.exists(os.path.join(ckpt, "metadata.json"))
                written.set()
                late = queue.maybe_finalize_async_calls(blocking=True)
                queue.close()
        finally:
            written.set()
            held.remove()
        out[name] = {"early": early, "early_metadata_json": early_metadata_json, "late": late,
                     "metadata_json": _written_format(ckpt)}
    return out


def _write_error_cases(rank, world, root) -> dict:
    """Last: from here on, rank 1's data writes fail (ENOSPC) in every save. Saves into new
    directories, and saves again into directories holding a committed checkpoint (with other
    non-sharded values: up to 0.18 Megatron writes those to common.pt before the sharded part)."""
    from megatron.core import dist_checkpointing as dc

    from faults import install_from_env

    def state(value):
        return {**{f"key{i}": dc.ShardedTensor.from_rank_offsets(f"key{i}_rank{rank}", torch.full((2, 4), value))
                   for i in range(4)}, "common": {"step": int(value)}}

    def save(ckpt, value, mode):
        request = dc.save(state(value), ckpt, sharded_strategy=("bcp", 1), async_sharded_save=mode == "async")
        if request is not None:
            request.execute_sync()
    replaced = {mode: _dir(root, f"write_error_replaced_{mode}") for mode in ("sync", "async")}
    for mode, ckpt in replaced.items():
        save(ckpt, 1.0, mode)
    os.environ["BCP_TEST_FAULT"] = "write:rank=1"
    install_from_env()
    out = {}
    for mode in ("sync", "async"):
        ckpt = _dir(root, f"write_error_{mode}")
        out[mode] = _error(lambda: save(ckpt, 2.0, mode))
        out[f"{mode}_metadata_json"] = os.path.exists(os.path.join(ckpt, "metadata.json"))
        ckpt = replaced[mode]
        out[f"{mode}_again"] = _error(lambda: save(ckpt, 2.0, mode))
        got = dc.load(state(-1.0), ckpt)
        out[f"{mode}_kept"] = {"common": dc.load_common_state_dict(ckpt), "loaded_common": got["common"],
                               "tensors": sorted({v for k, t in got.items() if k != "common"
                                                  for v in t.flatten().tolist()}),
                               "common_pt": os.path.exists(os.path.join(ckpt, "common.pt"))}
    return out


def _one_rank_error_cases(rank, world, root) -> dict:
    """A state that only rank 1 gets wrong, before bcp has read or written a byte: a save whose
    tensor's data has another dtype than it declares, a load asking for another global shape (a
    collective load: share_reads=True). Every rank raises at once, naming rank 1, rather than
    waiting out the timeout (30 s here) for rank 1."""
    from datetime import timedelta

    from megatron.core import dist_checkpointing as dc

    import bcp_integrations.megatron as bm
    timeout = timedelta(seconds=30)

    def state(length, dtype=torch.float32):
        t = dc.ShardedTensor.from_rank_offsets("w", torch.zeros(length), (0, rank, world))
        t.dtype = dtype
        return {"w": t}
    # bcp's own entry point: Megatron's save validates the sharding itself first, raising on rank 0
    out = {"save": _error(lambda: bm.save(state(2, torch.float16 if rank == 1 else torch.float32),
                                          _dir(root, "one_rank_error_save"), timeout=timeout))}
    ckpt = _dir(root, "one_rank_error_load")
    bm.save(state(2), ckpt, timeout=timeout)
    out["load"] = _error(lambda: bm.load(state(3 if rank == 1 else 2), ckpt, share_reads=True, timeout=timeout))
    # the adapter's own planning fails on rank 1 (its data is not of the local shape it declares):
    # rank 0 raises too, naming rank 1's error, and its tensor keeps its values
    target = state(2)
    target["w"].data.fill_(7.0)
    if rank == 1:
        target["w"].local_shape = (3,)
    out["load_planning"] = _error(lambda: bm.load(target, ckpt, share_reads=True, timeout=timeout))
    out["load_planning_kept"] = target["w"].data.tolist()
    # up to 0.18 the key "common_state" is bcp's, for Megatron's non-sharded values: a state dict
    # holding it is refused by every rank at once, not by rank 0 alone (which holds the values)
    from bcp_integrations.megatron.strategy import MEGATRON_WRITES_COMMON_PT, BcpSaveShardedStrategy
    if MEGATRON_WRITES_COMMON_PT:
        reserved = {**state(2), "common_state": dc.ShardedObject("common_state", rank, (1,), (0,), replica_id=rank)}
        out["reserved_key"] = _error(lambda: dc.save(reserved, _dir(root, "one_rank_error_reserved_key"),
                                                     sharded_strategy=BcpSaveShardedStrategy(timeout=timeout)))
    return out


def _local_checkpoint_cases(rank, world, root) -> dict:
    """Megatron-LM's local checkpoints served by bcp's tiers (`TieredLocalCheckpoints`, both ranks on
    one node): a step saved and found; then a load whose state only rank 1 cannot plan (a tensor's
    data not of its `local_shape`) fails on every rank at once, and changes no rank's tensor."""
    from megatron.core import dist_checkpointing as dc

    import bcp_core as bcp
    from bcp_integrations.megatron.local_checkpoints import TieredLocalCheckpoints, TieredStateDict

    def state(value):
        return {"w": dc.ShardedTensor.from_rank_offsets("w", torch.full((2,), value + rank), (0, rank, world)),
                "iteration": 3}
    manager = TieredLocalCheckpoints(bcp.Tiers(os.path.join(root, "local_checkpoints"), replicas=0))
    manager.save(TieredStateDict(state(1.0)), 3)
    out = {"found": manager.find_latest()}
    loaded, _ = manager.load()
    target = state(7.0)
    if rank == 1:
        target["w"].local_shape = (3,)
    out["load_planning"] = _error(lambda: loaded.to_state_dict(target))
    out["kept"] = target["w"].data.tolist()
    manager.find_latest()
    loaded, _ = manager.load()
    got = loaded.to_state_dict(state(7.0))
    out["loaded"] = {"w": got["w"].tolist(), "iteration": got["iteration"]}
    return out


def _older_common_pt_cases(rank, world, root) -> dict:
    """A checkpoint of an earlier bcp (up to 0.18): Megatron's non-sharded values in common.pt, no
    object in the checkpoint. Megatron's loads still read them there."""
    from megatron.core import dist_checkpointing as dc
    from megatron.core.dist_checkpointing.core import CheckpointingConfig, save_config

    from bcp_integrations.megatron import BcpSaveShardedStrategy

    def state(value):
        return {"w": dc.ShardedTensor.from_rank_offsets("w", torch.full((2,), value + rank), (0, rank, world))}
    ckpt = _dir(root, "older_common_pt")
    BcpSaveShardedStrategy().save(state(3.0), ckpt)  # the strategy alone: nothing but the sharded part
    if rank == 0:
        torch.save({"common": {"step": 3}}, os.path.join(ckpt, "common.pt"))
        save_config(CheckpointingConfig("bcp", 1), ckpt)
    torch.distributed.barrier()
    got = dc.load({**state(-1.0), "common": None}, ckpt)
    return {"common": dc.load_common_state_dict(ckpt), "loaded_common": got["common"], "w": got["w"].tolist()}


def _written_format(ckpt: str) -> dict:
    """What a save left in `ckpt`: the backend metadata.json names, and whose files are there."""
    import json
    with open(os.path.join(ckpt, "metadata.json")) as f:
        backend = json.load(f)["sharded_backend"]
    files = set(os.listdir(ckpt))
    return {"backend": backend, "bcp": "bcp_metadata.json" in files, "torch_dist": ".metadata" in files}


def _format_cases(rank, world, root) -> dict:
    """Every way of asking dist_checkpointing for bcp writes bcp (0.17+ would swap in torch_dist),
    and each backend's checkpoint loads whatever strategy the caller passes (0.17+ Megatron-LM
    passes torch_dist's, wrapped in the fully parallel wrapper with --ckpt-fully-parallel-load; a
    `("bcp", 1)` load failed on 0.17+, which call `.load` on it, and on 0.16 for torch_dist)."""
    from megatron.core import dist_checkpointing as dc
    from megatron.core.dist_checkpointing.strategies.fully_parallel import (FullyParallelLoadStrategyWrapper,
                                                                            FullyParallelSaveStrategyWrapper)
    from megatron.core.dist_checkpointing.strategies.torch import (TorchDistLoadShardedStrategy,
                                                                   TorchDistSaveShardedStrategy)

    from bcp_integrations.megatron import BcpLoadShardedStrategy, BcpSaveShardedStrategy

    def state(value):
        return {"w": dc.ShardedTensor.from_rank_offsets("w", torch.full((2, 3), value + rank), (0, rank, world)),
                "o": dc.ShardedObject("o", {"rank": rank}, (world,), (rank,), replica_id=0),
                "common": {"step": int(value)}}

    def saved(strategy, value, **kwargs):
        ckpt = _dir(root, f"format_{value}")
        request = dc.save(state(value), ckpt, sharded_strategy=strategy, **kwargs)
        if request is not None:
            request.execute_sync()
        return ckpt
    asks = {"tuple": ("bcp", 1), "object": BcpSaveShardedStrategy(),
            "fully_parallel": FullyParallelSaveStrategyWrapper(BcpSaveShardedStrategy())}
    out, ckpts = {}, {}
    for i, (name, strategy) in enumerate(asks.items()):
        ckpts[name] = saved(strategy, float(i))
        out[name] = _written_format(ckpts[name])
    ckpts["async"] = saved(("bcp", 1), 3.0, async_sharded_save=True)
    out["async"] = _written_format(ckpts["async"])
    with megatron_releases.torch_dist_on_cpu():
        ckpts["torch_dist"] = saved(TorchDistSaveShardedStrategy(backend="torch_dist", version=1), 4.0)
    out["torch_dist"] = _written_format(ckpts["torch_dist"])

    loads = {"none": lambda: None, "bcp": BcpLoadShardedStrategy, "bcp_tuple": lambda: ("bcp", 1),
             "torch_dist": TorchDistLoadShardedStrategy,
             "fully_parallel_torch_dist": lambda: FullyParallelLoadStrategyWrapper(TorchDistLoadShardedStrategy())}
    out["loads"] = {}
    for ckpt_name, value in (("object", 1.0), ("torch_dist", 4.0)):
        for load_name, make in loads.items():
            with megatron_releases.torch_dist_on_cpu():
                got = dc.load(state(-1.0), ckpts[ckpt_name], sharded_strategy=make())
            out["loads"][f"{ckpt_name}/{load_name}"] = (got["w"].tolist() == [[value + rank] * 3] * 2
                                                        and got["o"] == {"rank": rank}
                                                        and got["common"] == {"step": int(value)})
    return out


def _contract(rank: int, world: int, root: str, release: str) -> dict:
    megatron_releases.activate(release)
    import bcp_integrations.megatron  # noqa: F401 - routes dist_checkpointing's entry points
    megatron_releases.check_active(release)
    report = {}
    for name, case in (("strict", _strict_cases), ("metadata", _metadata_cases), ("shapes", _shape_cases),
                       ("saves", _save_cases), ("formats", _format_cases), ("common_state", _common_state_cases),
                       ("async_queue", _async_queue_cases), ("older_common_pt", _older_common_pt_cases),
                       ("one_rank_error", _one_rank_error_cases), ("local_checkpoints", _local_checkpoint_cases),
                       ("write_error", _write_error_cases)):
        try:
            report[name] = case(rank, world, root)
        except Exception:  # noqa: BLE001 - reported to the test that owns the case
            report[name] = {"error": traceback.format_exc()}
    return report


# ----------------------------------------------------------------------------- tests

@pytest.fixture(scope="module", params=megatron_releases.params())
def reports(request, tmp_path_factory):
    return run_ranks(WORLD, _contract, str(tmp_path_factory.mktemp("megatron_contract")), request.param,
                     timeout=150)


def _case(reports, name):
    out = []
    for rank, r in enumerate(reports):
        assert "error" not in r[name], f"rank {rank}:\n{r[name]['error']}"
        out.append(r[name])
    return out


def _saved_values():
    return {"TenA": [0, 1], "TenB": [0, 1, 2], "TenC": [0, 1, 2], "ObjA": list(range(10))}


def test_exact_load_returns_everything_and_logs_nothing_in_every_strict_mode(reports):
    for rank, r in enumerate(_case(reports, "strict")):
        for mode, got in r["exact"].items():
            assert got["warnings"] == [], (rank, mode)
            values = got["values"]
            assert {k: values[k] for k in _saved_values()} == _saved_values(), (rank, mode)
            assert values["ObjB"] == {rank + 7}, (rank, mode)  # a set comes back a set
            assert values["ObjT"] == {"t": (rank, "x"), "f": frozenset({rank, -rank - 1})}, (rank, mode)
            if mode in ("return_unexpected", "return_all"):
                assert got["mismatch"] == ([], []), (rank, mode)


def test_requested_key_missing_from_checkpoint_is_megatrons_and_torchs_checkpoint_exception(reports):
    for r in _case(reports, "strict"):
        e = r["unexpected"]["assume_ok"]  # left to the backend
        assert e["megatron"] and e["torch"], e
        assert e["cause"] == "KeyMismatchError" and "UnexpectedTenD" in e["message"], e
        e = r["unexpected"]["raise"]      # found by Megatron from bcp's load_sharded_metadata
        assert e["megatron"] and "Unexpected keys" in e["message"], e
        assert "UnexpectedTenD" in e["message"] and "UnexpectedObjD" in e["message"], e
        assert "Missing keys" not in e["message"], e
        assert r["unexpected"]["returned"] == ([], ["UnexpectedObjD", "UnexpectedTenD"])


def test_checkpoint_keys_left_out_are_missing_keys_for_megatron(reports):
    for r in _case(reports, "strict"):
        m = r["missing"]
        assert m["raise_unexpected_keys"] == ["ObjA", "ObjT", "TenB", "TenC"]
        assert m["raise_unexpected_warnings"] == []
        assert m["raise_all"]["megatron"] and "Missing keys" in m["raise_all"]["message"], m["raise_all"]
        assert "TenA" in m["raise_all"]["message"] and "ObjB" in m["raise_all"]["message"]
        assert m["returned"] == (["ObjB", "TenA"], [])


def test_sharded_metadata_names_every_tensor_and_object_shard_and_loads(reports):
    for r in _case(reports, "strict"):
        md = r["sharded_metadata"]
        assert md["internal"] in ([], ["common_state/shard_0_1"])
        assert md["base_keys"] == ["ObjA", "ObjB", "ObjT", "TenA", "TenB", "TenC"]
        assert md["keys"] == sorted(["TenA", "TenB", "TenC", "ObjA/shard_0_1", "ObjB/shard_0.0_1.2",
                                     "ObjB/shard_0.1_1.2", "ObjT/shard_0_2", "ObjT/shard_1_2"])
        v = md["values"]
        assert v["ObjA/shard_0_1"] == list(range(10))
        assert v["ObjB/shard_0.0_1.2"] == {7} and v["ObjB/shard_0.1_1.2"] == {8}
        assert v["ObjT/shard_1_2"] == {"t": (1, "x"), "f": frozenset({1, -2})}
        assert v["TenB"] == [0, 1, 2] * WORLD and v["TenC"] == [0, 1, 2]


def test_tensors_metadata_plain_tensors_and_common_state(reports):
    for r in _case(reports, "metadata"):
        assert r["tensors"] == {"TenA": ((2,), "torch.int64"), "TenB": ((3 * WORLD,), "torch.int64"),
                                "TenC": ((3,), "torch.int64"), "TenF": ((2, 3 * WORLD), "torch.bfloat16")}
        assert r["plain"]["TenB"] == [0, 1, 2] * WORLD
        assert r["plain"]["TenF"] == [[float(rank) for rank in range(WORLD) for _ in range(3)]] * 2
        assert r["common"] == {"common": {"step": 7, "name": "run"}}
        e = r["not_a_checkpoint"]
        assert e["megatron"] and e["cause"] == "NotACheckpointError" and "not_a_checkpoint" in e["message"], e


def test_shape_mismatch_raises_on_every_rank_unless_allowed_then_pads_and_casts(reports):
    for rank, r in enumerate(_case(reports, "shapes")):
        for name in ("rigid_smaller", "rigid_larger"):
            e = r[name]
            assert e["megatron"] and e["torch"] and e["cause"] == "ShapeMismatchError", (rank, e)
            assert "keyA" in e["message"] and "(2, 8)" in e["message"], e
        small = r["flexible_smaller"]
        assert small["dtype"] == "torch.float32" and small["in_place"]
        assert small["values"] == [[float(3 * rank + i) for i in range(3)]] * 2
        large = r["flexible_larger"]  # rank 1's box [5, 10) reaches past the saved 8: zeros
        want = [float(5 * rank + i) if 5 * rank + i < 4 * WORLD else 0.0 for i in range(5)]
        assert large["values"] == [want] * 2 and large["in_place"]


def test_views_cached_plans_uneven_ranks_and_fully_parallel_wrapper(reports):
    for rank, r in enumerate(_case(reports, "saves")):
        assert r["view_bytes"] < 10_000  # 10 floats of a 1M-element tensor, not the whole storage
        assert r["cached_same_metadata"]
        assert r["cached_last"] == [[float(2 + rank)] * 3] * 2
        assert r["uneven"] == ({"common": "common-value"} if rank == 0 else {"common": "common-value", "a": [1.0, 1.0]})
        assert r["fully_parallel"] == {f"t{i}": [float(i)] * 3 for i in range(4)}
        assert r["fully_parallel_writers"] == list(range(WORLD))  # the 4 replicated tensors spread over ranks
        e = r["unsupported"]
        assert e["megatron"] and e["cause"] == "SaveError", e
        assert f"cfg/shard_{rank}_{WORLD}" in e["message"] and "_Config" in e["message"], e
        assert "BcpSaveShardedStrategy(allow_pickle=True)" in e["message"], e


def test_every_way_of_asking_for_bcp_writes_bcp_and_loads_route_by_the_checkpoint(reports):
    for rank, r in enumerate(_case(reports, "formats")):
        for name in ("tuple", "object", "fully_parallel", "async"):
            assert r[name] == {"backend": "bcp", "bcp": True, "torch_dist": False}, (rank, name, r)
        assert r["torch_dist"]["backend"] == "torch_dist" and r["torch_dist"]["torch_dist"], (rank, r)
        assert not r["torch_dist"]["bcp"]
        assert all(r["loads"].values()) and len(r["loads"]) == 10, (rank, r["loads"])


def test_common_state_loads_on_a_python_that_pickles_enum_members_through_getattr(reports):
    """What Megatron-LM resumes from on Debian 12's Python 3.11.2 (torch_dist's common.pt, written by
    Megatron's own torch.save, cannot be loaded there: tests/test_megatron_lm.py says so)."""
    for rank, r in enumerate(_case(reports, "common_state")):
        assert r["args"] == r["common_args"] == {"mode": PickledByGetattr.MODE, "layers": 2}, (rank, r)
        assert r["w"] == [float(rank)] * 2, (rank, r)


def test_async_save_on_megatrons_queue_is_not_finalized_before_bcp_commits(reports):
    for rank, r in enumerate(_case(reports, "async_queue")):
        for name, got in r.items():
            assert got["early"] == [] and not got["early_metadata_json"], (rank, name, got)
            assert got["late"] == [0], (rank, name, got)
            assert got["metadata_json"] == {"backend": "bcp", "bcp": True, "torch_dist": False}, (rank, name, got)


def test_write_failure_on_one_rank_fails_the_save_on_every_rank_sync_and_async(reports):
    for rank, r in enumerate(_case(reports, "write_error")):
        for mode in ("sync", "async"):
            e = r[mode]
            assert e["megatron"] and e["torch"] and e["cause"] == "SaveError", (rank, mode, e)
            assert "rank 1" in e["message"] and "No space left on device" in e["message"], (rank, mode, e)
            assert not r[f"{mode}_metadata_json"], (rank, mode)  # Megatron never marked it complete
            # saving again into a committed checkpoint, failing: what loads is still that checkpoint, whole
            again = r[f"{mode}_again"]
            assert again["megatron"] and "rank 1" in again["message"], (rank, mode, again)
            assert r[f"{mode}_kept"] == {"common": {"common": {"step": 1}}, "loaded_common": {"step": 1},
                                         "tensors": [1.0], "common_pt": False}, (rank, mode, r[f"{mode}_kept"])


def test_a_state_only_one_rank_gets_wrong_fails_every_rank_at_once(reports):
    for rank, r in enumerate(_case(reports, "one_rank_error")):
        for op, what in (("save", "dtype"), ("load", "shape"), ("load_planning", "local_shape is (3,)")):
            e = r[op]
            assert e.get("raised", True), (rank, op)
            assert what in e["message"] and "waited" not in e["message"], (rank, op, e)
            assert rank == 1 or "rank 1" in e["message"], (rank, op, e)  # rank 0 hears whose part failed
        if "reserved_key" in r:  # up to 0.18 (from 0.19 on the key is Megatron's own)
            e = r["reserved_key"]
            assert e.get("raised", True) and e["megatron"], (rank, e)
            assert "'common_state'" in e["message"] and "waited" not in e["message"], (rank, e)
        assert r["load_planning_kept"] == [7.0, 7.0], rank


def test_local_checkpoints_a_state_only_one_rank_cannot_plan_fails_every_rank_at_once(reports):
    for rank, r in enumerate(_case(reports, "local_checkpoints")):
        assert r["found"] == 3, (rank, r)
        e = r["load_planning"]
        assert e.get("raised", True) and e["megatron"], (rank, e)
        assert "local_shape is (3,)" in e["message"] and "waited" not in e["message"], (rank, e)
        assert rank == 1 or "rank 1" in e["message"], (rank, e)
        assert r["kept"] == [7.0 + rank] * 2, (rank, r)
        assert r["loaded"] == {"w": [1.0 + rank] * 2, "iteration": 3}, (rank, r)


def test_an_earlier_bcp_checkpoint_with_common_pt_loads(reports):
    for rank, r in enumerate(_case(reports, "older_common_pt")):
        assert r == {"common": {"common": {"step": 3}}, "loaded_common": {"step": 3}, "w": [3.0 + rank] * 2}, (rank, r)


# ----------------------------------------------------------------------------- single process

def test_exception_is_both_kinds_and_survives_pickling():
    from megatron.core.dist_checkpointing.core import CheckpointingException
    from torch.distributed.checkpoint import CheckpointException

    from bcp_integrations.megatron.strategy import BcpCheckpointingException
    e = BcpCheckpointingException("bcp load of /x failed on rank 0: boom", {0: (ValueError("boom"), None)})
    assert isinstance(e, CheckpointingException) and isinstance(e, CheckpointException)
    assert isinstance(e, Exception) and str(e) == "bcp load of /x failed on rank 0: boom"
    back = pickle.loads(pickle.dumps(e))
    assert type(back) is BcpCheckpointingException and str(back) == str(e) and list(back.failures) == [0]


def test_sharded_object_values_round_trip_without_pickle(tmp_path):
    from megatron.core.dist_checkpointing import ShardedObject

    import bcp_integrations.megatron as bm
    value = {"set": {3, 1, 2}, "frozen": frozenset({"a", (1, 2)}), "tuple": (1, (2.5, None)), "list": [b"x"],
             "nested": [{frozenset({1})}], 5: "int key"}
    bm.save({"o": ShardedObject("o", value, (1,), (0,))}, str(tmp_path))
    got = bm.load({"o": ShardedObject("o", None, (1,), (0,))}, str(tmp_path))
    assert got["o"] == value and type(got["o"]["frozen"]) is frozenset


def test_unsupported_object_value_is_named_with_its_key_and_type(tmp_path):
    from megatron.core.dist_checkpointing import ShardedObject

    import bcp_core as bcp
    import bcp_integrations.megatron as bm

    class Config:
        pass
    with pytest.raises(bcp.SaveError, match=r"UnsupportedValueError: cfg/shard_0_1: .*Config.*allow_pickle=True"):
        bm.save({"o": ShardedObject("cfg", Config(), (1,), (0,))}, str(tmp_path))


def test_a_megatron_core_without_the_interfaces_the_routing_needs_fails_at_import_naming_them(monkeypatch):
    """A future megatron-core that renamed what the routing wraps or checks: importing (here:
    routing.check_api, which importing bcp_integrations.megatron runs) raises
    UnsupportedFrameworkError naming each missing interface, rather than saving another format."""
    from megatron.core.dist_checkpointing import serialization
    from megatron.core.dist_checkpointing.strategies import fully_parallel

    from bcp_core.errors import BCPError, UnsupportedFrameworkError
    from bcp_integrations.megatron import routing
    routing.check_api()  # the installed release has everything

    def load(sharded_state_dict, checkpoint_dir):  # lost its sharded_strategy parameter
        raise AssertionError("never called")
    monkeypatch.setattr(serialization, "load", load)
    monkeypatch.delattr(fully_parallel, "FullyParallelLoadStrategyWrapper")
    with pytest.raises(UnsupportedFrameworkError) as e:
        routing.check_api()
    assert isinstance(e.value, BCPError)
    message = str(e.value)
    assert "dist_checkpointing.serialization.load(..., sharded_strategy)" in message, message
    assert "fully_parallel.FullyParallelLoadStrategyWrapper" in message and "megatron-core 0.16 to 0.19" in message, \
        message
