"""Exceptions raised by bcp. Each names what is wrong: the key, shape, file or rank."""


class BCPError(Exception):
    """Base class of every error bcp raises on purpose."""


class NotACheckpointError(BCPError):
    """The path holds no bcp checkpoint (complete or partial)."""


class IncompleteCheckpointError(BCPError):
    """The path is a checkpoint whose save never committed."""


class FormatVersionError(BCPError):
    """The checkpoint was written by a newer bcp format version."""


class MetadataError(BCPError):
    """The metadata file is malformed, inconsistent or unsafe."""


class UnsafePathError(MetadataError):
    """A path in the metadata escapes the checkpoint directory."""


class ChecksumError(BCPError):
    """Bytes read from storage do not match the recorded checksum. `file`: the data file where this
    process found them (its path in the checkpoint), where known."""

    def __init__(self, message: str = "", file: str | None = None):
        super().__init__(message)
        self.file = file


class DamagedStepError(ChecksumError):
    """A tiered load found a step's copies in memory damaged and set them aside, which left the step
    incomplete there (`bcp.load` of the tiers then loads the newest whole step)."""


class KeyMismatchError(BCPError):
    """Requested keys missing from the checkpoint, or unexpected ones (strict load)."""


class ShapeMismatchError(BCPError):
    """A tensor's global shape or dtype differs between checkpoint and target."""


class MappingError(BCPError):
    """A declared mapping between two models does not fit the checkpoint or the target: a source
    missing or of another shape than declared, a target of another shape (names key and shapes)."""


class UnsupportedValueError(BCPError):
    """A value in the state cannot be saved with the safe codec."""


class PickleNotAllowedError(BCPError):
    """The checkpoint holds pickled data and the caller did not opt in."""


class PlanError(BCPError):
    """The ranks' local plans are inconsistent (shapes, dtypes, coverage)."""


class SaveError(BCPError):
    """A save failed on one or more ranks; nothing was committed."""


class PreviousSaveError(SaveError):
    """An earlier asynchronous save failed, and neither `wait()` nor a later save had raised it yet.

    Raised by the next `save` once that save is under way (every rank takes part in every save,
    so saves never drift apart): `handle` is the new save's handle."""

    def __init__(self, message: str, handle=None):
        super().__init__(message)
        self.handle = handle


class CommitCallbackError(BCPError):
    """The checkpoint was committed, but the `on_commit` callback raised on this rank."""


class StorageError(BCPError):
    """A storage operation failed permanently."""


class TransientStorageError(StorageError):
    """A storage failure that may succeed when tried again (a backend raises it to ask for a retry)."""


class StorageFileNotFoundError(StorageError, FileNotFoundError):
    """The file does not exist (never retried)."""


class CommTimeoutError(BCPError):
    """Ranks did not arrive at a bcp synchronisation point in time."""


class LoaderStateError(BCPError):
    """A dataloader state cannot be restored here: wrong format, other sources, or a resharding the
    loader cannot do."""


class ReadWorkerError(BCPError):
    """A dataloader read worker process failed or died."""


class ToolError(BCPError):
    """A tool was asked for something it cannot do (bad arguments, conflicting keys...)."""


class MissingExtraError(BCPError, ImportError):
    """An optional dependency is not installed; the message is one line naming the extra to install
    (``pip install "bcp-checkpoint[<extra>]"``). Also an ImportError, so ``except ImportError`` works."""

    def __init__(self, message: str = "", *, module: str = "", extra: str = "", feature: str = ""):
        ImportError.__init__(self, message, name=module)
        self.module = module
        self.extra = extra
        self.feature = feature


class UnsupportedFrameworkError(BCPError, ImportError):
    """An installed framework lacks an interface the integration relies on (a release it does not
    support yet); raised at import, never by falling back to another format. Also an ImportError."""
