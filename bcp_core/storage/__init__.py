"""Storage backends, chosen by the path's URL scheme (one class per backend, registered).

- `base`: the `Storage`/`FileWriter` interface, the registry (`register_storage`, `storage_for`)
  and process-wide I/O settings (`configure_storage`, `set_storage_options`);
- `retry`: which failures are transient, and the backoff every remote request goes through;
- `local`: `LocalStorage` (`/dir`, `file:///dir`); `memory`: `MemoryStorage` (`memory://name`, tmpfs);
- `fsspec`: `FsspecStorage`, every other scheme (`s3://`, `gs://`, `hdfs://`, ...);
- `faults`: storage that fails on demand, for tests (`inject(Fault(...))`, docs/reliability.md).

docs/storage.md describes configuration and how to add a backend.
"""

from ..errors import StorageError, StorageFileNotFoundError, TransientStorageError
from .base import (CONFIG, FileWriter, Storage, StorageConfig, configure_storage, register_storage, scheme_of,
                   set_storage_options, storage_for, write_all)
from .fsspec import FsspecStorage
from .local import LocalStorage
from .memory import MemoryStorage, memory_dir
from .retry import is_transient, retry_stats, with_retries

__all__ = [
    "CONFIG", "FileWriter", "FsspecStorage", "LocalStorage", "MemoryStorage", "Storage", "StorageConfig",
    "StorageError", "StorageFileNotFoundError", "TransientStorageError", "configure_storage", "is_transient",
    "memory_dir", "register_storage", "retry_stats", "scheme_of", "set_storage_options", "storage_for",
    "with_retries", "write_all",
]
