"""bcp: fast, parallelism-agnostic checkpoints for PyTorch training.

    import bcp_core as bcp
    handle = bcp.save(path, state)            # collective; async_save=True for background writes
    handle.wait()
    bcp.prepare_save(state, async_save=True)  # optional: first async save stalls like later ones
    bcp.load(path, state)                     # in place, at any world size / sharding
    tiers = bcp.Tiers("memory://run", durable="/shared/run", replicas=1, persist_every=4)
    bcp.save(tiers, state, step=n, async_save=True)   # memory + a replica on another node; disk every 4th
    bcp.load(tiers, state)                    # the newest whole step, from memory, peers or disk
    bcp.inspect(path)                         # metadata only
    preemption = bcp.handle_preemption()      # SIGTERM -> last checkpoint at an agreed step -> exit

The map of the package is docs/architecture.md.
"""

from . import mapping, rng
from .api import inspect, load, mutating, prepare_save, resolve, save
from .save_queue import SaveHandle
from .errors import (BCPError, ChecksumError, CommitCallbackError, CommTimeoutError, DamagedStepError,
                     FormatVersionError, IncompleteCheckpointError, KeyMismatchError, MappingError, MetadataError,
                     MissingExtraError, NotACheckpointError, PickleNotAllowedError, PlanError, PreviousSaveError,
                     SaveError, ShapeMismatchError, StorageError, UnsafePathError, UnsupportedValueError)
from .loader import LoadResult
from .metadata import FORMAT_VERSION, CheckpointMetadata, Piece, TensorMeta
from .preemption import Preemption, handle_preemption
from .storage import LocalStorage, Storage, register_storage, storage_for
from .tiers import Tiers

__version__ = "0.1.0"

__all__ = [
    "save", "prepare_save", "load", "inspect", "resolve", "mutating", "rng", "mapping", "handle_preemption",
    "Preemption", "Tiers",
    "SaveHandle", "LoadResult", "CheckpointMetadata", "TensorMeta", "Piece", "FORMAT_VERSION",
    "Storage", "LocalStorage", "register_storage", "storage_for",
    "BCPError", "ChecksumError", "CommitCallbackError", "CommTimeoutError", "DamagedStepError", "FormatVersionError",
    "IncompleteCheckpointError", "KeyMismatchError", "MappingError", "MetadataError", "MissingExtraError",
    "NotACheckpointError",
    "PickleNotAllowedError", "PlanError", "PreviousSaveError", "SaveError", "ShapeMismatchError", "StorageError",
    "UnsafePathError", "UnsupportedValueError",
]
