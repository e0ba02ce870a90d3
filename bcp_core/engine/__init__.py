"""The engine: executes plans against a Storage.

- `write`: a rank's pieces into data files (`write_items`), each piece hashed as it goes;
- `read`: byte ranges back into tensors, verified (`read_all` for the tools, `VerifiedReads` for a
  load: every byte verified before anything goes into place, `ShardReader` for sharded objects);
- `framing`: the bytes of a data file (safetensors framing, a block's checksum).

docs/format.md describes the data files.
"""

from .framing import SAFETENSORS_DTYPES, checksum, tensor_bytes
from .read import ShardReader, VerifiedReads, read_all, read_verified
from .write import write_items

__all__ = ["SAFETENSORS_DTYPES", "ShardReader", "VerifiedReads", "checksum", "read_all", "read_verified",
           "tensor_bytes", "write_items"]
