"""The bytes of a data file: safetensors framing (docs/format.md), a tensor's bytes, the checksum of a block."""

from __future__ import annotations

import json

import torch
import xxhash

from ..host_memory import byte_view
from ..plan_records import WriteItem

SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}
for _name, _code in (("uint16", "U16"), ("uint32", "U32"), ("uint64", "U64"),
                     ("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2")):
    if hasattr(torch, _name):
        SAFETENSORS_DTYPES[getattr(torch, _name)] = _code

def tensor_bytes(t: torch.Tensor) -> memoryview:
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(byte_view(t).numpy()).cast("B")

def checksum(data) -> int:
    """XXH3-64 of a block (releases the GIL; about memory speed)."""
    return xxhash.xxh3_64_intdigest(data)

def safetensors_header(items: list[WriteItem], align: int = 8) -> bytes:
    """The safetensors header of a file holding `items` in this order, space padded so that the
    data starts at a multiple of `align` (a multiple of 8, as safetensors wants)."""
    header: dict = {"__metadata__": {"format": "bcp"}}
    pos = 0
    for it in items:
        n = it.tensor.numel() * it.tensor.element_size()
        code = SAFETENSORS_DTYPES.get(it.tensor.dtype)
        shape = list(it.tensor.shape) if code else [n]
        header[it.name] = {"dtype": code or "U8", "shape": shape, "data_offsets": [pos, pos + n]}
        pos += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * ((-8 - len(raw)) % align)
    return len(raw).to_bytes(8, "little") + raw
