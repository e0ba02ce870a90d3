"""`bcp import`: a Hugging Face directory (safetensors), a torch DCP checkpoint or a torch.save file
as a bcp checkpoint. The source is memory-mapped, so nothing is read before it is saved.
"""

from __future__ import annotations

import math
import os
from typing import Any

import torch

from .. import api
from ..engine import SAFETENSORS_DTYPES
from ..errors import ToolError
from ..metadata import element_size, parse_json
from .read import read_json
from .rename import parse_rules, rename_map

_SAFETENSORS_CODE_TO_DTYPE = {code: dt for dt, code in SAFETENSORS_DTYPES.items()}


def _flatten(prefix: str, v: Any, out: dict) -> None:
    if isinstance(v, dict) and all(isinstance(k, str) for k in v):
        for k, x in v.items():
            _flatten(f"{prefix}.{k}" if prefix else k, x, out)
    else:
        out[prefix] = v


def _mmap_safetensors(path: str) -> dict[str, torch.Tensor]:
    """Tensors of a safetensors file as views of a private memory map: nothing is read until saved.

    The header is checked before any view is made: each entry a dict with a known dtype, a shape
    of non-negative integers and data_offsets [lo, hi] inside the data section, holding exactly the
    tensor's bytes; then the safetensors package checks the file as a whole (no overlaps, no gaps)."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        if size < 8 or n > min(size - 8, 100 << 20):
            raise ToolError(f"{path}: not a safetensors file (header length {n}, file size {size})")
        header = parse_json(f.read(n), f"{path}: safetensors header")
    if not isinstance(header, dict):
        raise ToolError(f"{path}: not a safetensors file (its header is a JSON {type(header).__name__}, "
                        "not an object)")
    base = 8 + n
    entries = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        what = f"{path}: tensor {name!r}"
        if not isinstance(info, dict):
            raise ToolError(f"{what}: its header entry is a {type(info).__name__}, not an object")
        code, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        dt = _SAFETENSORS_CODE_TO_DTYPE.get(code) if isinstance(code, str) else None
        if dt is None:
            raise ToolError(f"{what} has dtype {code!r} that bcp cannot import")
        if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
            raise ToolError(f"{what} has shape {shape!r}; expected a list of non-negative integers")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)):
            raise ToolError(f"{what} has data_offsets {offsets!r}; expected [begin, end] integers")
        lo, hi = offsets
        nbytes = math.prod(shape) * element_size(dt)
        if not 0 <= lo <= hi <= size - base:
            raise ToolError(f"{what} has data_offsets {lo}..{hi} outside the file's data section "
                            f"(0..{size - base} bytes)")
        if hi - lo != nbytes:
            raise ToolError(f"{what} has data_offsets {lo}..{hi} ({hi - lo} bytes) but shape {shape} of "
                            f"{code} needs {nbytes} bytes")
        entries.append((name, dt, tuple(shape), lo, hi))
    try:
        from safetensors import SafetensorError, safe_open
    except ImportError:  # a dependency of bcp; the checks above stand without it
        pass
    else:
        try:
            with safe_open(path, framework="pt"):
                pass
        except SafetensorError as e:
            raise ToolError(f"{path}: not a valid safetensors file: {e}") from None
    storage = torch.UntypedStorage.from_file(path, shared=False, nbytes=size)
    flat = torch.empty(0, dtype=torch.uint8).set_(storage)
    out = {}
    for name, dt, shape, lo, hi in entries:
        raw = flat[base + lo: base + hi]
        if (base + lo) % element_size(dt):  # a header not padded to alignment: this tensor is copied
            raw = raw.clone()
        out[name] = raw.view(dt).view(shape)
    return out


def _hf_files(src: str) -> list[str]:
    if os.path.isfile(src):
        return [src]
    index = os.path.join(src, "model.safetensors.index.json")
    if os.path.exists(index):
        files = sorted(set(read_json(index)["weight_map"].values()))
        return [os.path.join(src, x) for x in files]
    single = os.path.join(src, "model.safetensors")
    if os.path.exists(single):
        return [single]
    found = sorted(x for x in os.listdir(src) if x.endswith(".safetensors"))
    if not found:
        raise ToolError(f"{src}: no model.safetensors, no model.safetensors.index.json, no *.safetensors")
    return [os.path.join(src, x) for x in found]


def _read_dcp(src: str) -> dict[str, Any]:
    """Load a DCP checkpoint into fresh CPU tensors. DCP's .metadata is a pickle: unpickled here only
    because the user asked to import this checkpoint."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

    reader = dcp.FileSystemReader(src)
    meta = reader.read_metadata()
    state: dict[str, Any] = {}
    for key, m in meta.state_dict_metadata.items():
        if isinstance(m, TensorStorageMetadata):
            state[key] = torch.empty(tuple(m.size), dtype=m.properties.dtype)
        elif isinstance(m, BytesStorageMetadata):
            state[key] = None
    dcp.load(state, storage_reader=reader, no_dist=True)
    return state


def import_checkpoint(src: str, out: str, source: str, prefix: str | None = None, allow_pickle: bool = False,
                      rename: list[str] | None = None) -> dict:
    """Build a bcp checkpoint at `out` from a HF directory, a DCP checkpoint or a torch.save file.

    Keys are put under `prefix` (default "model" for hf/torch, none for dcp, whose keys already
    carry their top-level names), so that `bcp.load(out, {"model": model})` finds them.
    """
    if source == "hf":
        flat: dict[str, Any] = {}
        for f in _hf_files(src):
            flat.update(_mmap_safetensors(f))
        default_prefix = "model"
    elif source == "torch":
        # weights_only refuses to run code from the file; mmap keeps memory flat for big files.
        obj = torch.load(src, map_location="cpu", mmap=True, weights_only=True)
        if not isinstance(obj, dict):
            raise ToolError(f"{src} holds a {type(obj).__name__}, expected a dict (a state dict)")
        flat = {}
        _flatten("", obj, flat)
        default_prefix = "model"
    elif source == "dcp":
        flat = _read_dcp(src)
        default_prefix = ""
    else:
        raise ToolError(f"unknown import format {source!r}; use hf, dcp or torch")
    prefix = default_prefix if prefix is None else prefix
    names = rename_map(flat, parse_rules(rename))
    state = {names[k]: v for k, v in flat.items()}
    tensors = sum(1 for v in state.values() if isinstance(v, torch.Tensor))
    total = sum(v.numel() * v.element_size() for v in state.values() if isinstance(v, torch.Tensor))
    root = {prefix: state} if prefix else state
    api.save(out, root, framework="plain", allow_pickle=allow_pickle,
             user_metadata={"imported_from": {"format": source, "path": os.path.abspath(src)}}).wait()
    return {"out": str(out), "tensors": tensors, "values": len(state) - tensors, "bytes": total}
