"""Public entry points: save, load, inspect."""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch

from . import codec, metrics
from .checkpointer import SaveHandle, get_checkpointer
from .comm import DEFAULT_TIMEOUT, Comm
from .engine import read_all, read_verified
from .errors import (BCPError, IncompleteCheckpointError, KeyMismatchError, MetadataError,
                     NotACheckpointError, ShapeMismatchError)
from .metadata import METADATA_FILE, TRACKER_FILE, CheckpointMetadata, ObjectValue
from .planner import ReadItem, box_read_items, gc_paused, read_items
from .shards import Box
from .shared_reads import read_all_shared, worth_sharing
from .state import LoadTarget, load_targets, resolve_framework
from .storage import Storage, storage_for

log = logging.getLogger("bcp")

_STEP_RE = re.compile(r"^step_(\d+)$")


# ----------------------------------------------------------------------------- save

def save(path: str | os.PathLike, state: dict, framework: str = "auto", async_save: bool = False, *,
         step: int | None = None, role: str = "default", process_group=None, allow_pickle: bool = False,
         fsync: bool = True, num_threads: int = 4, user_metadata: dict | None = None,
         on_commit: Callable[[str], None] | None = None, snapshot: str = "copy",
         timeout: timedelta = DEFAULT_TIMEOUT) -> SaveHandle:
    """Save `state` from every rank into the checkpoint at `path`. Collective: call on all ranks.

    With `step`, `path` is a root: the checkpoint goes to `path/step_<step>` and the root's `latest`
    tracker points at it once committed. Without, `path` is the checkpoint directory itself.

    With `async_save=True` the call returns once this rank's share is copied into reused staging
    buffers; writing and committing continue in the background. `handle.wait()` blocks until the
    checkpoint is durable and committed; a background failure is raised by `wait()` and, at the
    latest, by the next `save` of the same `role`. `on_commit(path)` runs on every rank once the
    checkpoint is committed. Each `role` (e.g. "actor", "critic") has its own plan cache, staging
    buffers and queue. A second save whose structure is unchanged reuses the cached plan and
    performs no planning collective.

    `snapshot="fork"` (async saves of CPU state to a local or memory:// path): a save that would
    copy into staging buffers not yet allocated (the first of a structure) forks instead; the
    child process keeps the state as of the call, copy-on-write, and writes it, while the staging
    buffers are allocated in the background for the next save. The stall is the fork; pages that
    training modifies before the child is done are copied by the kernel then (README, "Speed").
    """
    return get_checkpointer(role).save(
        path, state, framework, async_save, step=step, process_group=process_group, allow_pickle=allow_pickle,
        fsync=fsync, num_threads=num_threads, user_metadata=user_metadata, on_commit=on_commit,
        snapshot=snapshot, timeout=timeout)


def prepare_save(state: dict, framework: str = "auto", async_save: bool = True, *, role: str = "default",
                 process_group=None, allow_pickle: bool = False, timeout: timedelta = DEFAULT_TIMEOUT) -> Future:
    """Get the saves of `state` ready before the first one: plan them now (collective: call on all
    ranks) and, for asynchronous saves, allocate and touch this rank's staging buffers in a
    background thread. The first save of this structure then stalls no longer than later ones: no
    planning collective and no page faults in fresh memory (README, "Speed").

    Call it once the state has the structure it will be saved with, e.g. after the first optimizer
    step (optimizers create their state then); a different structure at save time is planned
    again, as without preparing. The returned future is done once the buffers are ready; a save
    that comes earlier waits for them. Holds the staging memory (this rank's share of the state)
    from now on, which async saves hold anyway from their first save.
    """
    return get_checkpointer(role).prepare(state, framework, async_save, process_group=process_group,
                                          allow_pickle=allow_pickle, timeout=timeout)


# ----------------------------------------------------------------------------- resolve / inspect

def resolve(path: str | os.PathLike) -> Storage:
    """The storage of the checkpoint at `path`: the directory itself or, for a root, its latest complete one."""
    st = storage_for(path)
    if st.exists(METADATA_FILE):
        return st
    if st.exists(TRACKER_FILE):
        name = st.read_bytes(TRACKER_FILE).decode(errors="replace").strip()
        if _STEP_RE.match(name) and st.exists(f"{name}/{METADATA_FILE}"):
            return st.child(name)
        log.warning("bcp: tracker %s/%s names %r, which is not a complete checkpoint; scanning",
                    st.root, TRACKER_FILE, name)
    steps = sorted(((int(m.group(1)), n) for n in st.listdir() if (m := _STEP_RE.match(n))), reverse=True)
    incomplete = []
    for _, n in steps:
        if st.exists(f"{n}/{METADATA_FILE}"):
            if incomplete:
                log.warning("bcp: skipping incomplete checkpoints %s under %s", incomplete, st.root)
            return st.child(n)
        incomplete.append(n)
    if incomplete:
        raise IncompleteCheckpointError(f"{st.root}: no complete checkpoint; incomplete (never committed): "
                                        f"{', '.join(incomplete)}")
    if st.exists("data"):
        raise IncompleteCheckpointError(f"{st.root} holds data files but no {METADATA_FILE}: the save that "
                                        "wrote it never committed")
    raise NotACheckpointError(f"{st.root} is not a bcp checkpoint (no {METADATA_FILE}, no {TRACKER_FILE})")


@metrics.timed("metadata")
@gc_paused
def read_metadata(st: Storage) -> CheckpointMetadata:
    return CheckpointMetadata.loads(st.read_bytes(METADATA_FILE), source=st.join(METADATA_FILE))


def inspect(path: str | os.PathLike) -> CheckpointMetadata:
    """The checkpoint's metadata; no tensor bytes are read."""
    return read_metadata(resolve(path))


# ----------------------------------------------------------------------------- load

@dataclass
class LoadResult:
    path: str
    missing: list[str] = field(default_factory=list)     # requested but not in the checkpoint
    unexpected: list[str] = field(default_factory=list)  # in the checkpoint under a requested module/optimizer
    metrics: list[dict] = field(default_factory=list)     # this rank's phase records (docs/monitoring.md)


@metrics.recorded("load", rank=lambda *_, process_group=None, **__: _rank(process_group))
def load(path: str | os.PathLike, state: dict, framework: str = "auto", strict: bool = True, *,
         process_group=None, allow_pickle: bool = False, verify_checksums: bool = True,
         num_threads: int = 4, share_reads: bool | None = None,
         timeout: timedelta = DEFAULT_TIMEOUT) -> LoadResult:
    """Load the checkpoint at `path` (or the latest under a root) into `state`, in place.

    Works at any world size and sharding: each rank reads the parts of the saved pieces that
    overlap what it holds. Does not need a process group.

    `share_reads`: the group's ranks split the work they would repeat (collective: every rank of
    the group calls load). From remote storage or across hosts, each byte range is read once and
    passed to the other ranks that need it; on one host reading local files, each checksum block
    is verified by one rank only. Default (None): on for remote storage, multi-node jobs and states
    holding DTensors laid out over the whole group; otherwise off, so that a subset of the ranks
    may load plain tensors on its own.
    """
    st = resolve(path)
    md = read_metadata(st)
    adapter = resolve_framework(state, framework)
    rank = _rank(process_group)
    lt = load_targets(state, md, adapter)
    result = LoadResult(st.root)

    # Keys the checkpoint has below a plain dict but the dict lacks are added to it.
    saved = md.keys()
    extra = _fill_containers(lt, saved)
    for t in extra:
        lt.targets[t.fqn] = t
    result.missing = sorted(k for k, t in lt.targets.items() if k not in saved and not t.optional)
    covered = tuple(f"{p}." for p in lt.structured)
    result.unexpected = sorted(k for k in saved if k.startswith(covered) and k not in lt.targets)
    if strict and (result.missing or result.unexpected):
        raise KeyMismatchError(_key_report(st.root, result))

    items: list[ReadItem] = []
    late: list[tuple[LoadTarget, torch.Tensor]] = []  # new tensors handed over after reading
    for fqn, target in lt.targets.items():
        if fqn not in saved:
            continue
        if fqn in md.objects:
            _set(target, codec.decode(md.objects[fqn].encoded, fqn, allow_pickle))
        elif fqn in md.sharded_objects:
            reader = ShardReader(st, md, fqn, allow_pickle, verify_checksums)
            if target.shard is None:
                _set(target, reader)
            elif target.shard.index is None:
                target.shard.value, target.shard.grid = reader, reader.grid
            else:
                if target.shard.grid and tuple(target.shard.grid) != tuple(reader.grid):
                    raise ShapeMismatchError(
                        f"sharded object {fqn!r}: the checkpoint's grid is {tuple(reader.grid)}, the target asks "
                        f"for index {tuple(target.shard.index)} of grid {tuple(target.shard.grid)}; read it "
                        "with index=None and reshard")
                target.shard.value = reader[target.shard.index]
        elif fqn in md.per_rank:
            v = md.per_rank[fqn].variant_for(rank)
            if isinstance(v, ObjectValue):
                _set(target, codec.decode(v.encoded, fqn, allow_pickle))
            else:
                t = target.tensor
                if t is None or tuple(t.shape) != v.shape or t.dtype != v.dtype:
                    t = torch.empty(v.shape, dtype=v.dtype)
                    late.append((target, t))
                items.extend(box_read_items(fqn, v, Box((0,) * len(v.shape), v.shape, t)))
        else:
            tm = md.tensors[fqn]
            if target.tensor is None:
                if target.set_value is None:
                    raise ShapeMismatchError(f"{fqn!r} is a tensor in the checkpoint but not in the target")
                t = torch.empty(tm.shape, dtype=tm.dtype)
                late.append((target, t))
                items.extend(box_read_items(fqn, tm, Box((0,) * len(tm.shape), tm.shape, t)))
            else:
                items.extend(read_items(fqn, tm, target.tensor))
    if share_reads or (share_reads is None and
                       worth_sharing(st, process_group, (t.tensor for t in lt.targets.values()))):
        read_all_shared(st, md.files, md.checksum_block_bytes, items, verify_checksums, num_threads,
                        process_group, _load_comm(process_group, timeout))
    else:
        read_all(st, md.files, md.checksum_block_bytes, items, verify_checksums, num_threads)
    for target, t in late:
        _set(target, t)
    for finish in lt.finishers:
        finish()
    if result.missing or result.unexpected:
        log.warning("bcp: %s", _key_report(st.root, result))
    return result


class ShardReader:
    """Reads the saved shards of one sharded object on demand: `reader[index]`, `reader.indices`."""

    def __init__(self, st: Storage, md: CheckpointMetadata, fqn: str, allow_pickle: bool, verify: bool):
        self._st, self._md, self.fqn = st, md, fqn
        self._meta = md.sharded_objects[fqn]
        self._allow_pickle, self._verify = allow_pickle, verify
        self.grid = self._meta.grid
        self.indices = [p.index for p in self._meta.shards]

    def __contains__(self, index) -> bool:
        return self._meta.shard(tuple(index)) is not None

    def __getitem__(self, index) -> Any:
        p = self._meta.shard(tuple(index))
        if p is None:
            raise KeyMismatchError(f"sharded object {self.fqn!r} has no shard at index {tuple(index)} "
                                   f"(grid {self.grid}, saved {len(self.indices)} shards)")
        what = f"shard {list(p.index)} of {self.fqn!r}"
        data = read_verified(self._st, self._md.files[p.file], p.byte_offset, p.nbytes, p.checksums,
                             self._md.checksum_block_bytes, what, self._verify)
        try:
            raw = json.loads(data)
        except ValueError as e:
            raise MetadataError(f"{what} in {self._md.files[p.file]} is not valid JSON: {e}") from None
        return codec.decode(raw, self.fqn, self._allow_pickle)


_LOAD_COMMS: dict = {}


def _load_comm(process_group, timeout) -> Comm:
    """One Comm per group for loads: its operation numbers keep growing, so keys never repeat."""
    key = (id(process_group), timeout)
    if key not in _LOAD_COMMS:
        _LOAD_COMMS[key] = Comm(process_group, timeout, tag="load")
    return _LOAD_COMMS[key]


def _set(target: LoadTarget, value: Any) -> None:
    if target.set_value is None:
        raise BCPError(f"cannot set {target.fqn!r}")
    target.set_value(value)


def _fill_containers(lt, saved: set[str]) -> list[LoadTarget]:
    """Targets for saved keys below plain dicts of the state that the dicts do not have yet."""
    out = []
    containers = sorted(lt.containers, key=lambda c: -len(c[0]))
    for k in sorted(saved - set(lt.targets)):
        for prefix, d in containers:
            if k.startswith(prefix + "."):
                parts = k[len(prefix) + 1:].split(".")
                node = d
                for p in parts[:-1]:
                    nxt = node.get(p)
                    if not isinstance(nxt, dict):
                        nxt = node[p] = {}
                    node = nxt

                def setter(v, node=node, key=parts[-1]):
                    node[key] = v
                out.append(LoadTarget(k, False, set_value=setter))
                break
    return out


def _key_report(root: str, r: LoadResult) -> str:
    parts = [f"load from {root}:"]
    if r.missing:
        parts.append(f"{len(r.missing)} requested keys missing from the checkpoint: {_few(r.missing)}")
    if r.unexpected:
        parts.append(f"{len(r.unexpected)} checkpoint keys have no place in the target: {_few(r.unexpected)}")
    parts.append("(pass strict=False to load the rest)")
    return " ".join(parts)


def _few(keys: list[str], n: int = 8) -> str:
    return ", ".join(keys[:n]) + (f", ... (+{len(keys) - n})" if len(keys) > n else "")


def _rank(process_group) -> int:
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(process_group)
    return 0
