"""The load driver: resolve -> metadata -> plan -> read -> hand over, for `bcp_core.load`.

    st = layout.resolve(path)                      # the checkpoint, or a root's latest
    md = read_metadata(st)                         # validated before anything is allocated
    targets = flatten.load_targets(state, ...)     # what the live state wants, via its adapter
    plan = load_planner.plan_load(md, targets)     # values to set, byte ranges to read
    engine.read_all(...) / shared_reads...         # read, verify, copy in place
    finishers                                      # optimizers, stateful objects take their state
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from datetime import timedelta

from . import metrics
from .adapters import resolve_framework
from .comm import DEFAULT_TIMEOUT, Comm, comm_for
from .engine import ShardReader, read_all
from .errors import KeyMismatchError
from .flatten import load_targets
from .layout import resolve
from .load_planner import plan_load, set_target
from .metadata import METADATA_FILE, CheckpointMetadata
from .shared_reads import read_all_shared, worth_sharing
from .storage import Storage
from .utils import gc_paused, this_rank

log = logging.getLogger("bcp")


@dataclass
class LoadResult:
    path: str
    missing: list[str] = field(default_factory=list)     # requested but not in the checkpoint
    unexpected: list[str] = field(default_factory=list)  # in the checkpoint under a requested module/optimizer
    metrics: list[dict] = field(default_factory=list)     # this rank's phase records (docs/monitoring.md)


@metrics.timed("metadata")
@gc_paused
def read_metadata(st: Storage) -> CheckpointMetadata:
    return CheckpointMetadata.loads(st.read_bytes(METADATA_FILE), source=st.join(METADATA_FILE))


@metrics.recorded("load", rank=lambda *_, process_group=None, **__: this_rank(process_group))
def load_checkpoint(path: str | os.PathLike, state: dict, framework: str = "auto", strict: bool = True, *,
                    process_group=None, allow_pickle: bool = False, verify_checksums: bool = True,
                    num_threads: int = 4, share_reads: bool | None = None,
                    timeout: timedelta = DEFAULT_TIMEOUT) -> LoadResult:
    """`bcp_core.load` (see there)."""
    st = resolve(path)
    md = read_metadata(st)
    targets = load_targets(state, md, resolve_framework(state, framework))
    plan = plan_load(md, targets, this_rank(process_group), allow_pickle,
                     lambda fqn: ShardReader(st, md, fqn, allow_pickle, verify_checksums))
    result = LoadResult(st.root, plan.missing, plan.unexpected)
    if strict and (result.missing or result.unexpected):
        raise KeyMismatchError(_key_report(st.root, result))

    for assign in plan.assign:
        assign()
    if share_reads or (share_reads is None and
                       worth_sharing(st, process_group, (t.tensor for t in targets.targets.values()))):
        comm, op = _load_op(process_group)
        read_all_shared(st, md.files, md.checksum_block_bytes, plan.items, verify_checksums, num_threads,
                        process_group, comm, op, timeout)
    else:
        read_all(st, md.files, md.checksum_block_bytes, plan.items, verify_checksums, num_threads)
    for target, t in plan.late:
        set_target(target, t)
    for finish in targets.finishers:
        finish()
    if result.missing or result.unexpected:
        log.warning("bcp: %s", _key_report(st.root, result))
    return result


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
