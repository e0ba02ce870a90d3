"""A `torch.save` file read without running its pickle: its objects, with each tensor as a place in the file.

`torch.save` writes a zip archive: `<name>/data.pkl` (a pickle of the object tree) and one record
`<name>/data/<key>` per tensor storage, stored uncompressed. `read_archive` unpickles `data.pkl`
with a restricted unpickler that calls nothing a file names: tensors become `TensorRef`s (the
record, dtype, offset, shape, stride; no byte read), known containers become themselves, and any
other class becomes an `Opaque` value that only records what the pickle gave it (its class name,
arguments and state). Loading such a file can therefore never execute code from it. Each record's
byte offset in the file comes from the zip's local header, so a tensor's bytes are a byte range
of the file itself, read by bcp's engine like any data file's.
"""

from __future__ import annotations

import io
import math
import pickle
import struct
import zipfile
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import MetadataError
from ..metadata import MAX_BYTES, MAX_DIMS, MAX_ELEMENTS, MAX_METADATA_BYTES, element_size
from ..storage import Storage


@dataclass(frozen=True)
class TensorRef:
    """A tensor of the archive: `shape` / `stride` elements of `dtype` from element `offset` of storage
    record `record` (its bytes at `byte_offset` of the file once the archive is read)."""

    record: str
    dtype: torch.dtype
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    byte_offset: int = -1

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * element_size(self.dtype)

    def contiguous(self) -> bool:
        expected, step = [], 1
        for n in reversed(self.shape):
            expected.append(step)
            step *= n
        return all(n <= 1 or s == e for n, s, e in zip(self.shape, self.stride, reversed(expected)))


class Opaque:
    """A value of a class bcp does not know, as the pickle described it; never constructed for real."""

    origin = "?"

    def __new__(cls, *args, **kwargs):
        self = object.__new__(cls)
        self.args, self.kwargs, self.state, self.items = args, kwargs, None, []
        return self

    def __init__(self, *args, **kwargs):
        pass

    def __setstate__(self, state):
        self.state = state

    def append(self, v):
        self.items.append(v)

    def extend(self, vs):
        self.items.extend(vs)

    def __setitem__(self, k, v):
        self.items.append((k, v))

    def fields(self) -> dict[str, Any]:
        """The object's attributes as pickled (its state dict, or the slots part of a (dict, slots) pair)."""
        state = self.state
        if isinstance(state, tuple) and len(state) == 2:
            state = {**(state[0] or {}), **(state[1] or {})}
        return dict(state) if isinstance(state, dict) else {}

    def __repr__(self) -> str:
        return f"<{self.origin} {self.args or ''}{self.fields() or ''}>"


# torch's typed storage classes by the name a pickle gives them
_STORAGE_DTYPES = {
    "DoubleStorage": torch.float64, "FloatStorage": torch.float32, "HalfStorage": torch.float16,
    "BFloat16Storage": torch.bfloat16, "LongStorage": torch.int64, "IntStorage": torch.int32,
    "ShortStorage": torch.int16, "CharStorage": torch.int8, "ByteStorage": torch.uint8, "BoolStorage": torch.bool,
    "ComplexDoubleStorage": torch.complex128, "ComplexFloatStorage": torch.complex64,
}


@dataclass(frozen=True)
class _StorageType:
    dtype: torch.dtype


@dataclass(frozen=True)
class _Storage:
    key: str
    dtype: torch.dtype


def _count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _lengths(v: Any, what: str, hi: int) -> tuple[int, ...]:
    """A tensor's size or stride from the pickle: at most MAX_DIMS non-negative ints, each at most `hi`."""
    if not isinstance(v, (tuple, list)) or len(v) > MAX_DIMS or not all(_count(n) and n <= hi for n in v):
        raise MetadataError(f"a tensor of the archive has {what} {v!r:.120}, not at most {MAX_DIMS} non-negative "
                            f"integers of at most {hi}")
    return tuple(v)


def _rebuild_tensor(storage, storage_offset, size, stride, *rest, dtype=None):
    if not isinstance(storage, _Storage):
        raise MetadataError(f"a tensor of the archive refers to {storage!r:.120}, not a storage record")
    if not _count(storage_offset) or storage_offset > MAX_BYTES:
        raise MetadataError(f"a tensor of the archive starts at element {storage_offset!r:.80} of its storage, not "
                            "at a non-negative integer")
    shape = _lengths(size, "size", MAX_ELEMENTS)
    strides = _lengths(stride, "stride", MAX_ELEMENTS)
    if len(strides) != len(shape) or math.prod(n for n in shape if n) > MAX_ELEMENTS:
        raise MetadataError(f"a tensor of the archive has size {shape} and stride {strides}")
    dtype = storage.dtype if dtype is None else dtype
    if not isinstance(dtype, torch.dtype):
        raise MetadataError(f"a tensor of the archive has dtype {dtype!r:.80}, not a torch.dtype")
    return TensorRef(storage.key, dtype, storage_offset, shape, strides)


def _rebuild_tensor_v3(storage, storage_offset, size, stride, requires_grad, hooks, dtype, *rest):
    return _rebuild_tensor(storage, storage_offset, size, stride, dtype=dtype)


def _rebuild_parameter(data, *rest):
    return data


_TENSOR_REBUILDERS = (_rebuild_tensor, _rebuild_tensor_v3, _rebuild_parameter)


def _rebuild_from_type(func, new_type, args, state):
    """A tensor subclass or a tensor with Python attributes: the tensor itself (`func` is what
    `find_class` gave for the inner rebuild, and only a tensor rebuilder is called)."""
    if not any(func is f for f in _TENSOR_REBUILDERS) or not isinstance(args, tuple):
        raise MetadataError(f"a tensor of the archive is rebuilt by {func!r:.80}, not by a tensor rebuilder")
    return func(*args)


def _bytearray(*args):
    """`bytearray` as pickles give it: from bytes (protocol 3+) or from text and its encoding
    (protocols 0-2), so never larger than the pickle itself; never `bytearray(n)`."""
    if not args:
        return bytearray()
    if len(args) == 1 and isinstance(args[0], (bytes, bytearray)):
        return bytearray(args[0])
    if len(args) in (2, 3) and all(isinstance(a, str) for a in args):
        return bytearray(*args)
    raise MetadataError(f"a bytearray of the archive is made from {args!r:.80}, not from bytes or text")


_CALLABLES = {
    ("torch._tensor", "_rebuild_from_type_v2"): _rebuild_from_type,
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor,
    ("torch._utils", "_rebuild_tensor"): _rebuild_tensor,
    ("torch._utils", "_rebuild_tensor_v3"): _rebuild_tensor_v3,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    ("torch._utils", "_rebuild_parameter_with_state"): _rebuild_parameter,
    ("collections", "OrderedDict"): OrderedDict,
    ("torch", "Size"): lambda *a: tuple(*a),
    ("builtins", "set"): set,
    ("builtins", "frozenset"): frozenset,
    ("builtins", "slice"): slice,
    ("builtins", "complex"): complex,
    ("builtins", "bytearray"): _bytearray,
    ("_codecs", "encode"): lambda text, encoding="utf-8": text.encode(encoding),
}

_OPAQUE: dict[tuple[str, str], type] = {}


def _opaque_class(module: str, name: str) -> type:
    key = (module, name)
    if key not in _OPAQUE:
        _OPAQUE[key] = type(name, (Opaque,), {"origin": f"{module}.{name}", "__module__": __name__})
    return _OPAQUE[key]


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) in _CALLABLES:
            return _CALLABLES[(module, name)]
        if module == "torch":
            found = getattr(torch, name, None) if name.isidentifier() else None
            if isinstance(found, torch.dtype):
                return found
            if name in _STORAGE_DTYPES or name == "UntypedStorage":
                return _StorageType(_STORAGE_DTYPES.get(name, torch.uint8))  # named by persistent ids
        return _opaque_class(module, name)

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and len(pid) >= 3 and pid[0] == "storage"):
            raise MetadataError(f"unknown persistent id {pid!r:.80} in a torch archive")
        storage_type, key = pid[1], pid[2]
        if not isinstance(storage_type, _StorageType):
            raise MetadataError(f"storage {key!r} of a torch archive has no known dtype ({storage_type!r:.80})")
        return _Storage(str(key), storage_type.dtype)


class _StorageFile(io.RawIOBase):
    """A file of a bcp Storage as a read-only seekable file (zipfile reads through it)."""

    def __init__(self, st: Storage, relpath: str):
        self.st, self.relpath, self.pos, self.length = st, relpath, 0, st.size(relpath)

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        self.pos = {0: offset, 1: self.pos + offset, 2: self.length + offset}[whence]
        return self.pos

    def tell(self) -> int:
        return self.pos

    def readinto(self, b) -> int:
        n = max(0, min(len(b), self.length - self.pos))
        if n:
            self.st.read_into(self.relpath, self.pos, memoryview(b)[:n])
        self.pos += n
        return n


@dataclass
class Archive:
    """A `torch.save` file: its object tree (`TensorRef`s placed in the file) and its zip, open."""

    relpath: str
    obj: Any
    zip: zipfile.ZipFile
    prefix: str

    def record_name(self, key: str) -> str:
        return f"{self.prefix}data/{key}"


def open_archive(st: Storage, relpath: str) -> Archive:
    """Read the object tree of the `torch.save` file `relpath` of `st` (see the module doc)."""
    where = st.join(relpath)
    try:
        zf = zipfile.ZipFile(io.BufferedReader(_StorageFile(st, relpath), 1 << 20))
    except zipfile.BadZipFile as e:
        raise MetadataError(f"{where}: not a torch.save archive ({e}); files of torch's legacy format are not "
                            "read") from None
    pkl = [n for n in zf.namelist() if n.endswith("/data.pkl") and n.count("/") == 1]
    if len(pkl) != 1:
        raise MetadataError(f"{where}: a torch.save archive has one <name>/data.pkl; found {pkl[:3]}")
    info = zf.getinfo(pkl[0])
    if info.file_size > MAX_METADATA_BYTES:
        raise MetadataError(f"{where}: its pickle is {info.file_size} bytes, more than bcp reads")
    prefix = pkl[0][:-len("data.pkl")]
    try:
        obj = _Unpickler(io.BytesIO(zf.read(info)), encoding="utf-8").load()
    except MetadataError as e:
        raise MetadataError(f"{where}: {e}") from None
    except Exception as e:  # noqa: BLE001 - a damaged or hostile pickle: say where
        raise MetadataError(f"{where}: cannot read its pickle ({type(e).__name__}: {e})") from None
    archive = Archive(relpath, obj, zf, prefix)
    try:
        archive.obj = _Placer(archive, where).placed(obj, 0)
    except MetadataError:
        raise
    except Exception as e:  # noqa: BLE001 - a hostile object tree: say where, keep the cause
        raise MetadataError(f"{where}: cannot place its tensors ({type(e).__name__}: {e})") from e
    return archive


# containers nested deeper than this in an archive's object tree (or a cycle) make it unreadable
MAX_NESTING = 256


class _Placer:
    """Every TensorRef of an archive's object tree given its byte offset in the file (checked
    against its record). Each object is visited once (a tree that shares objects costs its size,
    not the size of its expansion), to at most MAX_NESTING levels (a cycle ends there)."""

    def __init__(self, archive: Archive, where: str):
        self.archive, self.where = archive, where
        self.offsets: dict[str, int] = {}
        self.done: dict[int, Any] = {}
        self.keep: list[Any] = []  # the originals of `done`, so their ids stay theirs

    def placed(self, obj: Any, depth: int) -> Any:
        if isinstance(obj, TensorRef):
            return self.tensor(obj)
        if not isinstance(obj, (dict, list, tuple, Opaque)):
            return obj
        if id(obj) in self.done:
            return self.done[id(obj)]
        if depth >= MAX_NESTING:
            raise MetadataError(f"{self.where}: its objects are nested more than {MAX_NESTING} deep "
                                "(or hold themselves)")
        if isinstance(obj, dict):
            if type(obj) in (dict, OrderedDict):
                out = type(obj)()
                for k, v in obj.items():
                    out[k] = self.placed(v, depth + 1)
            else:
                out = obj
        elif isinstance(obj, (list, tuple)):
            out = [self.placed(v, depth + 1) for v in obj]
            if isinstance(obj, tuple):
                out = tuple(out)
        else:
            obj.state = self.placed(obj.state, depth + 1)
            out = obj
        self.done[id(obj)] = out
        self.keep.append(obj)
        return out

    def tensor(self, ref: TensorRef) -> TensorRef:
        archive = self.archive
        name = archive.record_name(ref.record)
        if name not in self.offsets:
            self.offsets[name] = record_offset(archive, name)
        size = archive.zip.getinfo(name).file_size
        start = ref.offset * element_size(ref.dtype)
        if not ref.contiguous() or start < 0 or ref.nbytes < 0 or start + ref.nbytes > size:
            raise MetadataError(f"{self.where}: tensor of shape {ref.shape} at element {ref.offset} of record "
                                f"{name} is not a contiguous range of its {size} bytes")
        return TensorRef(ref.record, ref.dtype, ref.offset, ref.shape, ref.stride, self.offsets[name] + start)


def record_offset(archive: Archive, name: str) -> int:
    """Where record `name`'s bytes start in the file: after its zip local header."""
    try:
        info = archive.zip.getinfo(name)
    except KeyError:
        raise MetadataError(f"{archive.relpath}: its pickle names storage record {name}, which the archive "
                            "lacks") from None
    if info.compress_type != zipfile.ZIP_STORED:
        raise MetadataError(f"{archive.relpath}: record {name} is compressed; torch.save stores records as they are")
    fp = archive.zip.fp
    fp.seek(info.header_offset)
    header = fp.read(30)
    if len(header) != 30 or header[:4] != b"PK\x03\x04":
        raise MetadataError(f"{archive.relpath}: no zip local header for record {name} at byte {info.header_offset}")
    name_len, extra_len = struct.unpack("<HH", header[26:30])
    return info.header_offset + 30 + name_len + extra_len
