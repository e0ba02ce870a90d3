"""Public entry points: save, prepare_save, load, inspect, resolve.

Each checks what it is given and delegates: saves to the role's `Checkpointer` (checkpointer.py),
loads to the load driver (loader.py), paths to the root layout (layout.py).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import Future
from datetime import timedelta

from . import layout, staging
from .checkpointer import get_checkpointer
from .comm import DEFAULT_TIMEOUT
from .loader import LoadResult, load_checkpoint, read_metadata
from .save_queue import SaveHandle
from .metadata import CheckpointMetadata
from .storage import Storage
from .tiers import Tiers
from .tiers.recovery import load_tiered
from .utils import load_threads


# ----------------------------------------------------------------------------- save

def save(path: str | os.PathLike, state: dict, framework: str = "auto", async_save: bool = False, *,
         step: int | None = None, role: str = "default", process_group=None, allow_pickle: bool = False,
         fsync: bool = True, num_threads: int | None = None, user_metadata: dict | None = None,
         on_commit: Callable[[str], None] | None = None, snapshot: str = "lazy", keep: int | None = None,
         timeout: timedelta = DEFAULT_TIMEOUT) -> SaveHandle:
    """Save `state` from every rank into the checkpoint at `path`. Collective: call on all ranks.

    With `step`, `path` is a root: the checkpoint goes to `path/step_<step>` and the root's `latest`
    tracker points at it once committed. Without, `path` is the checkpoint directory itself. With
    `keep=K` (and a step), once this checkpoint is committed only the newest K complete ones of the
    root are kept; nothing is deleted before that commit, so a failed save leaves the previous one
    loadable. After each commit to a root, leftovers of failed saves older than it are removed.

    With `async_save=True` the call returns at once; writing and committing continue in the
    background. What the checkpoint holds is the state as of the call (`snapshot`):

    - "lazy" (default): parameters and optimizer state are copied into reused staging buffers in
      the background while training runs forward and backward; the next optimizer step waits
      until they are copied. Everything else is copied before the call returns. State written in
      place outside an optimizer step must be written inside `with bcp.mutating(): ...`
      (docs/async.md has the exact rule).
    - "copy": everything is copied before the call returns.
    - "fork" (CPU state, local or memory:// paths): a save that would copy into staging buffers
      not yet allocated (the first of a structure) forks instead; the child process keeps the
      state as of the call, copy-on-write, and writes it, while the staging buffers are allocated
      in the background for the next save. Pages training modifies before the child is done are
      copied by the kernel then (README, "Speed").

    The first asynchronous save of a structure plans it (a collective round) and allocates its
    staging buffers (pinned, for CUDA state) in its call: on one H100, 0.6 s for 4 GiB, a first
    checkpoint step of 7 normal steps. Call `prepare_save(state)` once the state has its final
    structure (after the first optimizer step) to do both in the background beforehand; the
    integrations (HF callback, Lightning's `BCPCheckpointIO`, Accelerate's `register`) call it
    themselves after the first optimizer step.

    `handle.wait()` blocks until the checkpoint is durable and committed. A save that fails on any
    rank is committed by none and raises on every rank, naming the failing rank: from `wait()`,
    and if no `wait()` raised it, from the next `save` of the same `role` (`PreviousSaveError`,
    raised once that next save is under way: saves never drift apart between ranks).
    `on_commit(path)` runs on every rank once the checkpoint is committed (an exception it raises
    is `wait()`'s `CommitCallbackError`; the checkpoint stays committed). Every wait is bounded by
    `timeout`. Each `role` (e.g. "actor", "critic") has its own plan cache, staging buffers and
    queue.

    `path` may be a `bcp.Tiers` (with a step): the checkpoint goes to each node's own memory, is
    replicated to other nodes and committed there once every piece has its copies, and every
    `persist_every`-th step is drained to durable storage in the background (docs/tiers.md).
    A save whose structure is unchanged on every rank reuses the cached plan: one small exchange
    confirms it, no planning. `num_threads`: files this rank writes at once (default: its
    share of the host's cores, at most 4, so that background writes leave training its cores).
    """
    return get_checkpointer(role).save(
        path, state, framework, async_save, step=step, process_group=process_group, allow_pickle=allow_pickle,
        fsync=fsync, num_threads=num_threads, user_metadata=user_metadata, on_commit=on_commit,
        snapshot=snapshot, keep=keep, timeout=timeout)


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


def mutating():
    """Context manager around code that writes saved parameters or optimizer state in place
    outside an optimizer step (an EMA kept in a module's parameters, weight surgery,
    `load_state_dict`): lazy snapshots of saves in flight are completed first."""
    return staging.mutating()


# ----------------------------------------------------------------------------- load / inspect

def load(path: str | os.PathLike, state: dict, framework: str = "auto", strict: bool = True, *,
         process_group=None, allow_pickle: bool = False, verify_checksums: bool = True,
         num_threads: int | None = None, share_reads: bool | None = None,
         timeout: timedelta = DEFAULT_TIMEOUT, mapping=None) -> LoadResult:
    """Load the checkpoint at `path` (or the latest under a root) into `state`, in place.

    Works at any world size and sharding: each rank reads the parts of the saved pieces that
    overlap what it holds. Does not need a process group. With `strict=False`, loads what matches
    and returns the `missing` and `unexpected` keys in the `LoadResult` instead of raising.

    All or nothing: every key, shape and value is checked and every byte read and verified before
    anything of `state` changes; a load that raises leaves `state` exactly as it was (an error
    raised by an object's own `load_state_dict` while handing over is the one exception). A load
    into modules first lets an asynchronous save in flight take its lazy snapshot.

    `share_reads`: the group's ranks split the work they would repeat (collective: every rank of
    the group calls load). From remote storage or across hosts, each byte range is read once and
    passed to the other ranks that need it; on one host reading local files, each checksum block
    is verified by one rank only. Default (None): on for remote storage, multi-node jobs and states
    holding DTensors laid out over the whole group; otherwise off, so that a subset of the ranks
    may load plain tensors on its own. A collective load reads the metadata once per node and fails
    on every rank, naming the rank, if any rank fails. `num_threads`: threads reading, verifying and
    copying (default: this rank's share of the host's cores, 4 to 8). Every wait (exchanges,
    transfers) is bounded by `timeout`.

    `path` may be a `bcp.Tiers`: the newest step whose every piece survives in the nodes' memory,
    their replicas or durable storage is loaded, its missing pieces fetched from the nodes that hold
    them (collective; `LoadResult.step` and `.tier` say which; docs/tiers.md).

    `mapping`: load a checkpoint of another model family or framework (a `bcp_core.mapping.Mapping`,
    e.g. `bcp.mapping.megatron_to_hf(hf_model.config)`), or "auto" to pick the declared mapping from
    the framework the checkpoint records and the target's model config (none if they agree). Each
    target tensor is assembled from boxes of the source's tensors, read as any resharded load is;
    optimizer state and the step counter follow their parameters (docs/mapping.md).
    """
    if isinstance(path, Tiers):
        return load_tiered(path, state, framework, strict, process_group=process_group, allow_pickle=allow_pickle,
                           verify_checksums=verify_checksums, num_threads=num_threads or load_threads(),
                           share_reads=share_reads, timeout=timeout, mapping=mapping)
    return load_checkpoint(path, state, framework, strict, process_group=process_group, allow_pickle=allow_pickle,
                           verify_checksums=verify_checksums, num_threads=num_threads or load_threads(),
                           share_reads=share_reads, timeout=timeout, mapping=mapping)


def resolve(path: str | os.PathLike) -> Storage:
    """The storage of the checkpoint at `path`: the directory itself or, for a root, its latest complete one."""
    return layout.resolve(path)


def inspect(path: str | os.PathLike) -> CheckpointMetadata:
    """The checkpoint's metadata; no tensor bytes are read."""
    return read_metadata(layout.resolve(path))
