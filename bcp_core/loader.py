"""The load driver: resolve -> metadata -> plan -> read and verify -> write into place, for `bcp_core.load`.

    st = layout.resolve(path)                      # the checkpoint, or a root's latest
    md = read_metadata(st)                         # validated before anything is allocated
    targets = flatten.load_targets(state, ...)     # what the live state wants, via its adapter
    plan = load_planner.plan_load(md, targets)     # values to set, byte ranges to read
    reads.read_each(...) / read_all_shared(...)   # read and verify (engine.VerifiedReads)
    reads.commit(...), values, finishers           # only then: tensors, values, optimizers, stateful objects

A load is all or nothing for the caller: everything that can be checked without reading (keys,
shapes, dtypes, strictness, values) is checked first, every byte is read and verified next, and
only then is anything written into the state. In a collective load (shared reads) the ranks agree
after reading: if any failed, every rank raises naming it and none has changed its state. A
collective load reads the metadata once per node: the group's rank 0 resolves the path (so every
rank loads the same step while a save moves `latest`) and names the checkpoint to every rank; the
lowest rank of each node reads the metadata file and passes its bytes to the node's other ranks
over a gloo group of the node; each rank parses them.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Any

from . import codec, metrics
from .adapters import resolve_framework
from .comm import DEFAULT_TIMEOUT, Comm, comm_for
from .engine import ShardReader, VerifiedReads
from .errors import KeyMismatchError
from .foreign import open_resolved
from .flatten import LoadTargets, load_targets
from .layout import resolve
from .load_planner import plan_load, set_target
from .metadata import (CHECKSUM_BLOCK_BYTES, METADATA_FILE, CheckpointMetadata, TensorMeta, check_file_sizes,
                       read_metadata_file)
from .plan_records import LoadPlan
from .shared_reads import LoadFailure, group_size, raise_failures, read_all_shared, worth_sharing
from .host_memory import ordered_after_callers
from .staging import finish_lazy_copies
from .storage import Storage, storage_for
from .utils import gc_paused, this_rank

log = logging.getLogger("bcp")


@dataclass
class LoadResult:
    path: str
    missing: list[str] = field(default_factory=list)     # requested but not in the checkpoint
    unexpected: list[str] = field(default_factory=list)  # in the checkpoint under a requested module/optimizer
    metrics: list[dict] = field(default_factory=list)     # this rank's phase records (docs/monitoring.md)
    step: int | None = None                               # a tiered root's: the step loaded
    tier: str | None = None                               # and where from: "memory" or "durable"


@metrics.timed("metadata")
def read_metadata(st: Storage) -> CheckpointMetadata:
    return parse_metadata(st, read_metadata_file(st))


@gc_paused
def parse_metadata(st: Storage, data: bytes) -> CheckpointMetadata:
    return CheckpointMetadata.loads(data, source=st.join(METADATA_FILE))


@codec.record
@dataclass(frozen=True)
class ResolvedCheckpoint:
    """The checkpoint a collective load reads, as the group's rank 0 resolved the path."""

    root: str
    format: str = ""  # a foreign checkpoint's format (bcp_core.foreign), "" for bcp's own


@metrics.recorded("load", rank=lambda *_, process_group=None, **__: this_rank(process_group))
def load_checkpoint(path: str | os.PathLike | Storage, state: dict, framework: str = "auto", strict: bool = True, *,
                    process_group=None, allow_pickle: bool = False, verify_checksums: bool = True,
                    num_threads: int = 4, share_reads: bool | None = None,
                    timeout: timedelta = DEFAULT_TIMEOUT, mapping: Any = None,
                    prefetch: Callable[[tuple, BaseException | None], None] | None = None,
                    metadata: CheckpointMetadata | None = None, failure: Exception | None = None) -> LoadResult:
    """`bcp_core.load` (see there). `prefetch(items, failure)`, if given, is called on every rank once
    the read items are planned (with this rank's planning error, if any), before a byte is read:
    a tiered load brings the ranges they need from other nodes then (tiers/recovery.py). It raises
    on every rank if any rank failed. `metadata`: the checkpoint's, already parsed on every rank
    (a tiered load's), so it is not read and parsed again. `path` may be a Storage: this rank's own
    checkpoint directory, taken as it is (a tiered load passes each node's view of the step, which
    may lie at another path on each node). `failure`: this rank's error in making `state` (an
    integration's own planning: Megatron's shapes of a pipeline stage), raised on every rank of a
    collective load as a planning error is, so that the others do not wait for this one."""
    adapter = resolve_framework(state, framework)
    shared = group_size(process_group) > 1 and (share_reads if share_reads is not None else (
        adapter.loads_together or worth_sharing(_storage(path), process_group, state)))
    if not shared:
        st = path if isinstance(path, Storage) else resolve(path)
        md = metadata if metadata is not None else read_metadata(st)
        reads = VerifiedReads(st, md.files, md.checksum_block_bytes, verify_checksums)
        try:
            if failure is not None:
                raise failure
            plan, targets, values, result = _prepare(st, md, state, adapter, strict, process_group, allow_pickle,
                                                     verify_checksums, mapping)
        except Exception as e:
            if prefetch is not None:
                prefetch((), e)
            raise
        if prefetch is not None:
            prefetch(plan.items, None)
        ordered_after_callers(it.dest for it in plan.items)
        reads.read_each(plan.items, num_threads)
        _check(targets)
    else:
        comm, op = _load_op(process_group)
        st = path if isinstance(path, Storage) else _resolve_for_all(path, comm, op, timeout)
        reads = VerifiedReads(st, (), CHECKSUM_BLOCK_BYTES, verify_checksums)
        try:
            md = metadata
            if md is None:
                with metrics.phase("metadata"):
                    md = parse_metadata(st, comm.node_broadcast(lambda: read_metadata_file(st), f"{op}/metadata",
                                                                "the metadata", timeout))
            reads = VerifiedReads(st, md.files, md.checksum_block_bytes, verify_checksums)
            if failure is not None:
                raise failure
            plan, targets, values, result = _prepare(st, md, state, adapter, strict, process_group, allow_pickle,
                                                     verify_checksums, mapping)
        except Exception as e:  # noqa: BLE001 - every rank must hear of it, or the others wait
            failure, plan, targets = e, LoadPlan(), LoadTargets()
        if prefetch is not None:
            prefetch(plan.items, failure)
        ordered_after_callers(it.dest for it in plan.items)
        read_all_shared(reads, plan.items, num_threads, process_group, comm, op, timeout, failure,
                        check=lambda: _check(targets))
    _commit(reads, plan, targets, values, num_threads)
    if result.missing or result.unexpected:
        log.warning("bcp: %s", _key_report(st.root, result))
    return result


def _prepare(st: Storage, md: CheckpointMetadata, state: dict, adapter, strict: bool, process_group,
             allow_pickle: bool, verify_checksums: bool,
             mapping: Any = None) -> tuple[LoadPlan, LoadTargets, list, LoadResult]:
    """Everything decided and checked before a byte of a tensor is read; nothing of the state changes.
    With a mapping, the targets see the checkpoint through it (target keys, assembled from the
    source's pieces: bcp_core.mapping)."""
    check_files = _file_checker(st, md)
    saved, reads, mapped = md, None, None
    if mapping is not None:
        from .mapping import resolve_mapping
        mapping = resolve_mapping(mapping, md, state, adapter)
    if mapping is not None:
        mapped = mapping.bind(md, st, check_files)
        md, reads = mapped.metadata, mapped.read_items
    targets = load_targets(state, md, adapter, check_files)
    if mapped is not None:
        targets = replace(targets, targets={k: replace(t, optional=True) if k in mapped.optional else t
                                            for k, t in targets.targets.items()},
                          finishers=[mapped.fill_zeros, *targets.finishers])  # before optimizers take their new state
    plan = plan_load(md, targets, this_rank(process_group), allow_pickle,
                     lambda fqn: ShardReader(st, saved, fqn, allow_pickle, verify_checksums), check_files, reads)
    result = LoadResult(st.root, list(plan.missing), list(plan.unexpected))
    if strict and (result.missing or result.unexpected):
        raise KeyMismatchError(_key_report(st.root, result))
    values = [(v, v.fetch()) for v in plan.values]  # decoded (or read) and checked, not handed over yet
    if targets.read_first:  # objects that read what they need now: their values go into dicts of the load's own
        own = tuple(f"{fqn}." for fqn in targets.read_first)
        for v, value in values:
            if v.fqn.startswith(own):
                v.hand_over(value)
        values = [(v, value) for v, value in values if not v.fqn.startswith(own)]
        for read in targets.reads:
            read()
    return plan, targets, values, result


def _file_checker(st: Storage, md: CheckpointMetadata) -> Callable[[str, TensorMeta], None]:
    """`check_file_sizes` for one tensor's pieces, each data file's size asked for once."""
    sizes: dict[str, int] = {}

    def size_of(rel: str) -> int:
        if rel not in sizes:
            sizes[rel] = st.size(rel)
        return sizes[rel]
    return lambda fqn, tm: check_file_sizes(md, size_of, [(f"tensor {fqn!r}", tm.pieces)], st.root)


def _check(targets: LoadTargets) -> None:
    """The adapters' checks of what was read into tensors made for this load."""
    for check in targets.checks:
        check()


def _commit(reads: VerifiedReads, plan: LoadPlan, targets: LoadTargets, values: list[tuple[Any, Any]],
            num_threads: int) -> None:
    """Every byte is read and verified (on every rank of a collective load): write the state."""
    finish_lazy_copies()  # an asynchronous save in flight takes its lazy snapshot before the state changes
    # on CUDA that ordered the caller's streams after the snapshot's copies: the load's own copies
    # (host_memory.Bounce, on streams of their own) wait for them here
    ordered_after_callers(it.dest for it in plan.items)
    reads.commit(num_threads)
    for target, t in plan.late:
        set_target(target, t)
    for v, value in values:
        v.hand_over(value)
    for finish in targets.finishers:
        finish()


def _storage(path: str | os.PathLike | Storage) -> Storage:
    return path if isinstance(path, Storage) else storage_for(path)


def _resolve_for_all(path: str | os.PathLike, comm: Comm, op: str, timeout: timedelta) -> Storage:
    """The checkpoint a collective load reads, resolved once by the group's rank 0 (module doc)."""
    own, message, st = None, None, None
    if comm.is_coordinator:
        try:
            st = resolve(path)
            message = ResolvedCheckpoint(st.root, getattr(getattr(st, "format", None), "name", ""))
        except Exception as e:  # noqa: BLE001 - every rank raises it
            own, message = e, LoadFailure.of(comm.rank, e)
        message = codec.to_wire(message)
    received = codec.from_wire(comm.broadcast(message, f"{op}/checkpoint", timeout), (ResolvedCheckpoint, LoadFailure))
    if isinstance(received, LoadFailure):
        raise_failures([received], own)
    return st if comm.is_coordinator else open_resolved(storage_for(received.root), received.format)


_LOADS: dict[int, int] = {}  # collective loads so far, per Comm


def _load_op(process_group) -> tuple[Comm, str]:
    """The Comm of collective loads over this group and the name of this load's operations: every
    rank of the group takes part in the same collective loads in the same order."""
    comm = comm_for(process_group, "load")
    n = _LOADS[id(comm)] = _LOADS.get(id(comm), 0) + 1
    return comm, f"l{n}"


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
