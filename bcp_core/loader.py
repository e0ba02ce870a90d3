"""The load driver: resolve -> metadata -> plan -> read and verify -> write into place, for `bcp_core.load`.

    st = layout.resolve(path)                      # the checkpoint, or a root's latest
    md = read_metadata(st)                         # validated before anything is allocated
    targets = flatten.load_targets(state, ...)     # what the live state wants, via its adapter
    plan = load_planner.plan_load(md, targets)     # values to set, byte ranges to read
    staging.stage_all(...) / read_all_shared(...)  # read into staging and verify
    staging.commit(...), values, finishers         # only then: tensors, values, optimizers, stateful objects

A load is all or nothing for the caller: everything that can be checked without reading (keys,
shapes, dtypes, strictness, values) is checked first, every byte is read and verified next, and
only then is anything written into the state. In a collective load (shared reads) the ranks agree
after reading: if any failed, every rank raises naming it and none has changed its state. A
collective load reads the metadata once (the group's rank 0 resolves the path and reads the file)
and passes its text to the other ranks through the Comm; each parses it.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from . import codec, metrics
from .adapters import resolve_framework
from .comm import DEFAULT_TIMEOUT, Comm, comm_for
from .engine import LoadStaging, ShardReader
from .errors import KeyMismatchError
from .flatten import LoadTargets, load_targets
from .layout import resolve
from .load_planner import LoadPlan, plan_load, set_target
from .metadata import METADATA_FILE, CheckpointMetadata
from .shared_reads import LoadFailure, group_size, raise_failures, read_all_shared, worth_sharing
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


@metrics.timed("metadata")
def read_metadata(st: Storage) -> CheckpointMetadata:
    return parse_metadata(st, st.read_bytes(METADATA_FILE))


@gc_paused
def parse_metadata(st: Storage, data: bytes) -> CheckpointMetadata:
    return CheckpointMetadata.loads(data, source=st.join(METADATA_FILE))


@codec.record
@dataclass(frozen=True)
class CheckpointText:
    """The checkpoint a collective load reads, as the group's rank 0 resolved it, and the text of its
    metadata file (bytes that are not UTF-8 travel as surrogate escapes, and come back unchanged)."""

    root: str
    metadata: str


@metrics.recorded("load", rank=lambda *_, process_group=None, **__: this_rank(process_group))
def load_checkpoint(path: str | os.PathLike, state: dict, framework: str = "auto", strict: bool = True, *,
                    process_group=None, allow_pickle: bool = False, verify_checksums: bool = True,
                    num_threads: int = 4, share_reads: bool | None = None,
                    timeout: timedelta = DEFAULT_TIMEOUT) -> LoadResult:
    """`bcp_core.load` (see there)."""
    adapter = resolve_framework(state, framework)
    shared = group_size(process_group) > 1 and (
        share_reads if share_reads is not None else worth_sharing(storage_for(path), process_group, state))
    if not shared:
        st = resolve(path)
        md = read_metadata(st)
        staging = LoadStaging(st, md.files, md.checksum_block_bytes, verify_checksums)
        plan, targets, values, result = _prepare(st, md, state, adapter, strict, process_group, allow_pickle,
                                                 verify_checksums)
        staging.stage_all(plan.items, num_threads)
        _check(targets)
    else:
        comm, op = _load_op(process_group)
        st, md = _shared_metadata(path, comm, op, timeout)
        staging = LoadStaging(st, md.files, md.checksum_block_bytes, verify_checksums)
        failure: Exception | None = None
        try:
            plan, targets, values, result = _prepare(st, md, state, adapter, strict, process_group, allow_pickle,
                                                     verify_checksums)
        except Exception as e:  # noqa: BLE001 - every rank must hear of it, or the others wait
            failure, plan = e, LoadPlan()
        read_all_shared(staging, plan.items, num_threads, process_group, comm, op, timeout, failure,
                        check=lambda: _check(targets))
    _commit(staging, plan, targets, values, num_threads)
    if result.missing or result.unexpected:
        log.warning("bcp: %s", _key_report(st.root, result))
    return result


def _prepare(st: Storage, md: CheckpointMetadata, state: dict, adapter, strict: bool, process_group,
             allow_pickle: bool, verify_checksums: bool) -> tuple[LoadPlan, LoadTargets, list, LoadResult]:
    """Everything decided and checked before a byte of a tensor is read; nothing of the state changes."""
    targets = load_targets(state, md, adapter)
    plan = plan_load(md, targets, this_rank(process_group), allow_pickle,
                     lambda fqn: ShardReader(st, md, fqn, allow_pickle, verify_checksums))
    result = LoadResult(st.root, plan.missing, plan.unexpected)
    if strict and (result.missing or result.unexpected):
        raise KeyMismatchError(_key_report(st.root, result))
    values = [(v, v.fetch()) for v in plan.values]  # decoded (or read) and checked, not handed over yet
    return plan, targets, values, result


def _check(targets: LoadTargets) -> None:
    """The adapters' checks of what was read into tensors made for this load."""
    for check in targets.checks:
        check()


def _commit(staging: LoadStaging, plan: LoadPlan, targets: LoadTargets, values: list[tuple[Any, Any]],
            num_threads: int) -> None:
    """Every byte is read and verified (on every rank of a collective load): write the state."""
    finish_lazy_copies()  # an asynchronous save in flight takes its lazy snapshot before the state changes
    staging.commit(num_threads)
    for target, t in plan.late:
        set_target(target, t)
    for v, value in values:
        v.hand_over(value)
    for finish in targets.finishers:
        finish()


def _shared_metadata(path: str | os.PathLike, comm: Comm, op: str, timeout: timedelta) \
        -> tuple[Storage, CheckpointMetadata]:
    """A collective load's checkpoint and metadata: rank 0 of the group resolves `path` and reads the
    metadata file, every rank gets its text through the Comm and parses it. All ranks load the same
    checkpoint, even while a save moves a root's `latest`."""
    message, st, own = None, None, None
    with metrics.phase("metadata"):
        if comm.is_coordinator:
            try:
                st = resolve(path)
                message = CheckpointText(st.root, st.read_bytes(METADATA_FILE).decode("utf-8", "surrogateescape"))
            except Exception as e:  # noqa: BLE001 - every rank raises it
                own, message = e, LoadFailure.of(comm.rank, e)
            message = codec.to_wire(message)
        received = codec.from_wire(comm.broadcast(message, f"{op}/metadata", timeout), (CheckpointText, LoadFailure))
        if isinstance(received, LoadFailure):
            raise_failures([received], own)
        st = st or storage_for(received.root)
        return st, parse_metadata(st, received.metadata.encode("utf-8", "surrogateescape"))


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
