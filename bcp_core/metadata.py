"""The global metadata of a checkpoint: frozen dataclasses and their JSON form.

Faithful to docs/format.md. Parsing validates every field before anything is
allocated from it, so a malformed or hostile metadata file fails here.
"""

from __future__ import annotations

import json
import math
import os
import posixpath
import reprlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from .errors import (BCPError, FormatVersionError, MetadataError, NotACheckpointError, StorageError,
                     StorageFileNotFoundError, UnsafePathError, UnsupportedValueError)
from .shards import tiling_fault

FORMAT_NAME = "bcp"
FORMAT_VERSION = 1
METADATA_FILE = "bcp_metadata.json"
TRACKER_FILE = "latest"
FAILED_FILE = "bcp_failed.json"  # in a checkpoint directory whose save failed on every rank (docs/format.md)
CHECKSUM_BLOCK_BYTES = 4 << 20
CHECKSUM_ALGORITHM = "xxh3_64"

# Caps on what a metadata file may claim (docs/format.md, "Limits"). The file is untrusted input: the
# caps keep a corrupted or hostile one from making bcp allocate, read or loop over absurd amounts, and
# lie far beyond any real job.
MAX_WORLD_SIZE = 1 << 24          # ranks of the saving job (a piece's rank is below the world size)
MAX_DIMS = 64                     # dimensions of a tensor or of a sharded object's grid
MAX_ELEMENTS = 1 << 48            # one dimension's length, and the product of a shape's non-zero lengths
MAX_BYTES = 1 << 56               # a byte offset or byte count in a data file
MAX_CHECKSUM_BLOCK_BYTES = 1 << 30
MAX_VALUE_DEPTH = 64              # lists, tuples and dicts nested in one value, or in `user`
MAX_METADATA_BYTES = 1 << 30      # the metadata file's size, unless the environment says otherwise:
MAX_METADATA_BYTES_ENV = "BCP_MAX_METADATA_BYTES"
_CHECKSUM_MAX = (1 << 64) - 1     # checksums are unsigned 64-bit

_DTYPES: dict[str, torch.dtype] = {
    name: dt
    for name in (
        "float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8",
        "bool", "complex64", "complex128", "uint16", "uint32", "uint64",
        "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
    )
    if isinstance(dt := getattr(torch, name, None), torch.dtype)
}


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise MetadataError(f"dtype {dtype} is not supported by the bcp format")
    return name


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except (KeyError, TypeError):
        raise MetadataError(f"unknown dtype {brief(name)} in metadata") from None


def num_blocks(nbytes: int, block: int) -> int:
    """Checksum blocks of a piece; an empty piece still has one (of zero bytes)."""
    return max(1, -(-nbytes // block))


def element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class Piece:
    """One saved n-D box of a tensor: where it sits (ShardMeta) and where its bytes are (ByteMeta)."""

    offsets: tuple[int, ...]
    lengths: tuple[int, ...]
    file: int
    byte_offset: int
    nbytes: int
    checksums: tuple[int, ...]
    rank: int

    def to_json(self) -> dict:
        return {
            "offsets": list(self.offsets), "lengths": list(self.lengths), "file": self.file,
            "byte_offset": self.byte_offset, "nbytes": self.nbytes, "checksums": list(self.checksums),
            "rank": self.rank,
        }


@dataclass(frozen=True)
class TensorMeta:
    """A logical tensor in its global shape, and the pieces that cover it (BasicMeta + pieces)."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    pieces: tuple[Piece, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * element_size(self.dtype)

    def to_json(self) -> dict:
        return {"dtype": dtype_name(self.dtype), "shape": list(self.shape),
                "pieces": [p.to_json() for p in self.pieces]}


@dataclass(frozen=True)
class PerRankMeta:
    """Values that differ per rank. ranks[r] indexes the variant saved by rank r."""

    ranks: tuple[int, ...]
    variants: tuple[Any, ...]  # each a TensorMeta or an ObjectValue

    def variant_for(self, rank: int) -> Any:
        return self.variants[self.ranks[rank] if rank < len(self.ranks) else self.ranks[0]]


@dataclass(frozen=True)
class ObjectValue:
    """A non-tensor value, kept in its codec (JSON) form until a load decodes it."""

    encoded: Any


@dataclass(frozen=True)
class ObjectPiece:
    """One saved shard of a sharded object: its grid index and where its JSON bytes are."""

    index: tuple[int, ...]
    file: int
    byte_offset: int
    nbytes: int
    checksums: tuple[int, ...]
    rank: int

    def to_json(self) -> dict:
        return {"index": list(self.index), "file": self.file, "byte_offset": self.byte_offset,
                "nbytes": self.nbytes, "checksums": list(self.checksums), "rank": self.rank}


@dataclass(frozen=True)
class ShardedObjectMeta:
    """A non-tensor value sharded over `grid`; each saved index is one piece (the paper's LoaderShardtoByteMap)."""

    grid: tuple[int, ...]
    shards: tuple[ObjectPiece, ...]

    def shard(self, index: tuple[int, ...]) -> ObjectPiece | None:
        return next((p for p in self.shards if p.index == tuple(index)), None)

    def to_json(self) -> dict:
        return {"grid": list(self.grid), "shards": [p.to_json() for p in self.shards]}


@dataclass(frozen=True)
class CheckpointMetadata:
    world_size: int
    framework: str
    files: tuple[str, ...]
    tensors: dict[str, TensorMeta]
    objects: dict[str, ObjectValue]
    per_rank: dict[str, PerRankMeta]
    sharded_objects: dict[str, ShardedObjectMeta] = field(default_factory=dict)
    checksum_block_bytes: int = CHECKSUM_BLOCK_BYTES
    user: dict = field(default_factory=dict)
    version: int = FORMAT_VERSION

    def keys(self) -> set[str]:
        return set(self.tensors) | set(self.objects) | set(self.per_rank) | set(self.sharded_objects)

    def to_json(self) -> dict:
        def variant_json(v):
            return {"tensor": v.to_json()} if isinstance(v, TensorMeta) else {"object": v.encoded}

        return {
            "format": FORMAT_NAME,
            "version": self.version,
            "world_size": self.world_size,
            "framework": self.framework,
            "checksum": {"algorithm": CHECKSUM_ALGORITHM, "block_bytes": self.checksum_block_bytes},
            "files": list(self.files),
            "tensors": {k: t.to_json() for k, t in self.tensors.items()},
            "objects": {k: o.encoded for k, o in self.objects.items()},
            "per_rank": {k: {"ranks": list(p.ranks), "variants": [variant_json(v) for v in p.variants]}
                         for k, p in self.per_rank.items()},
            "sharded_objects": {k: o.to_json() for k, o in self.sharded_objects.items()},
            "user": self.user,
        }

    def dumps(self) -> bytes:
        if _nests_deeper(self.user, MAX_VALUE_DEPTH):  # a checkpoint is written only if it will load
            raise UnsupportedValueError(f"user metadata nests lists and dicts deeper than {MAX_VALUE_DEPTH} levels")
        return json.dumps(self.to_json(), separators=(",", ":"), allow_nan=False).encode()

    @staticmethod
    def loads(data: bytes, source: str = "metadata") -> CheckpointMetadata:
        check_metadata_size(len(data), source)
        return _parse(parse_json(data, source), source)


def parse_json(data: bytes | str, source: str) -> Any:
    """JSON text from a checkpoint or another rank, untrusted: MetadataError naming `source` if it is
    not valid JSON or nests too deeply for the parser (which stops at the interpreter's recursion
    limit, at once: nesting 100,000 deep costs no more than 1,000). Every JSON text bcp reads goes
    through here."""
    try:
        return json.loads(data)
    except ValueError as e:  # UnicodeDecodeError included
        raise MetadataError(f"{source}: not valid JSON ({e})") from None
    except RecursionError:
        raise MetadataError(f"{source}: JSON nested too deeply to parse") from None


# ----------------------------------------------------------------------------- reading
#
# Every file of a checkpoint that bcp reads whole (the metadata, a failure record, the metrics) is
# read by `read_capped`, its size checked first; the tracker is read by `read_prefix`, which never
# reads past a bound however large the file. Values in data files are read by their pieces, whose
# sizes `check_metadata_size` bounds alike.

def max_metadata_bytes() -> int:
    """The largest metadata file bcp reads: MAX_METADATA_BYTES, or the BCP_MAX_METADATA_BYTES variable."""
    value = os.environ.get(MAX_METADATA_BYTES_ENV, "")
    if not value:
        return MAX_METADATA_BYTES
    try:
        limit = int(value)
    except ValueError:
        limit = 0
    if limit <= 0:
        raise BCPError(f"environment variable {MAX_METADATA_BYTES_ENV}={value!r} is not a positive number of bytes")
    return limit


def check_metadata_size(nbytes: int, source: str) -> None:
    """Refuse a JSON text of `nbytes` from a checkpoint (the metadata, a value's piece, a failure
    record, the metrics) larger than max_metadata_bytes(), before it is read: MetadataError naming
    `source`."""
    limit = max_metadata_bytes()
    if nbytes > limit:
        raise MetadataError(f"{source} has {nbytes} bytes, more than the {limit} bcp reads as metadata (or as any "
                            f"JSON text of a checkpoint); if it really is this checkpoint's, raise "
                            f"{MAX_METADATA_BYTES_ENV}")


def read_capped(st: Any, relpath: str) -> bytes:
    """The whole of file `relpath` of storage `st` (a bcp Storage), a JSON text of the checkpoint: its
    size is checked before it is read (`check_metadata_size`), so a huge or sparse file is refused
    without reading it."""
    check_metadata_size(st.size(relpath), st.join(relpath))
    return st.read_bytes(relpath)


def read_prefix(st: Any, relpath: str, nbytes: int) -> bytes:
    """At most the first `nbytes` bytes of file `relpath` of storage `st`: what follows is never read."""
    buf = bytearray(min(st.size(relpath), nbytes))
    st.read_into(relpath, 0, memoryview(buf))
    return bytes(buf)


def read_metadata_file(st: Any) -> bytes:
    """The metadata file of the checkpoint in storage `st` (a bcp Storage), its size checked before it
    is read: a huge file is refused without reading it."""
    return read_capped(st, METADATA_FILE)


@dataclass(frozen=True)
class FileExtent:
    """How far into a data file the metadata places bytes: `end`, the byte after the last piece's,
    and `piece`, that piece in words."""

    end: int
    piece: str


# Pieces to check against their files, named by what they belong to ("tensor 'w'").
NamedPieces = Iterable[tuple[str, Iterable[Any]]]


def all_pieces(md: CheckpointMetadata) -> NamedPieces:
    """Every piece of `md`: of tensors, per-rank tensors and sharded objects."""
    yield from ((f"tensor {fqn!r}", tm.pieces) for fqn, tm in md.tensors.items())
    yield from ((f"per-rank tensor {fqn!r}", v.pieces) for fqn, pr in md.per_rank.items() for v in pr.variants
                if isinstance(v, TensorMeta))
    yield from ((f"sharded object {fqn!r}", so.shards) for fqn, so in md.sharded_objects.items())


def file_extents(md: CheckpointMetadata, pieces: NamedPieces | None = None) -> dict[int, FileExtent]:
    """The extent of each data file (by index into `md.files`) that `pieces` (default: all) use."""
    last: dict[int, tuple[int, str, Any]] = {}
    for owner, owned in all_pieces(md) if pieces is None else pieces:
        for p in owned:
            end = p.byte_offset + p.nbytes
            if end > last.get(p.file, (0,))[0]:
                last[p.file] = (end, owner, p)
    return {i: FileExtent(end, _piece_words(owner, p)) for i, (end, owner, p) in last.items()}


def file_pieces(md: CheckpointMetadata) -> dict[int, list[tuple[int, int, tuple[int, ...]]]]:
    """Each data file's pieces (by index into `md.files`): (byte offset, bytes, checksums)."""
    out: dict[int, list[tuple[int, int, tuple[int, ...]]]] = {}
    for _, owned in all_pieces(md):
        for p in owned:
            out.setdefault(p.file, []).append((p.byte_offset, p.nbytes, p.checksums))
    return out


def _piece_words(owner: str, p: Any) -> str:
    where = f"index {list(p.index)}" if isinstance(p, ObjectPiece) else f"offsets {list(p.offsets)}"
    return f"the piece of {owner} at {where} (bytes [{p.byte_offset}, {p.byte_offset + p.nbytes}))"


def check_file_sizes(md: CheckpointMetadata, size_of: Callable[[str], int], pieces: NamedPieces | None = None,
                     source: str = "metadata") -> None:
    """Refuse metadata that places a piece beyond the end of its data file (a truncated file, or a
    claim of more bytes than exist), before anything is allocated from its shapes: StorageError
    naming the file and the piece (StorageFileNotFoundError for a file that does not exist).

    `size_of(path)`: the size of a data file, its path relative to the checkpoint (`Storage.size`);
    called once per file the pieces use. `pieces`: the pieces to check, named by what they belong
    to (default: `all_pieces(md)`; a reader of one tensor passes `[(f"tensor {fqn!r}", tm.pieces)]`).
    """
    for i, ext in sorted(file_extents(md, pieces).items()):
        try:
            size = size_of(md.files[i])
        except FileNotFoundError:  # StorageFileNotFoundError included
            raise StorageFileNotFoundError(f"{source}: data file {md.files[i]} listed in the metadata does not "
                                           "exist") from None
        except OSError as e:
            raise StorageError(f"{source}: cannot find the size of data file {md.files[i]}: {e}") from None
        if size < ext.end:
            raise StorageError(f"{source}: data file {md.files[i]} has {size} bytes, but {ext.piece} ends at byte "
                               f"{ext.end}: the file is truncated, or the metadata claims bytes that do not exist")


# ----------------------------------------------------------------------------- parsing

_BRIEF = reprlib.Repr()
_BRIEF.maxlevel, _BRIEF.maxstring, _BRIEF.maxother = 3, 60, 60


def brief(value: Any) -> str:
    """A short repr of untrusted input for a message: bounded however large or deep the value."""
    return _BRIEF.repr(value)


def _fail(source: str, what: str) -> MetadataError:
    return MetadataError(f"{source}: {what}")


def _need(cond: bool, source: str, what: str) -> None:
    if not cond:
        raise _fail(source, what)


def _int(v: Any, source: str, what: str, lo: int = 0, hi: int = MAX_BYTES) -> int:
    if type(v) is not int or not lo <= v <= hi:
        raise _fail(source, f"{what} must be an integer in [{lo}, {hi}], got {brief(v)}")
    return v


def _ints(v: Any, source: str, what: str, max_len: int = MAX_DIMS, hi: int = MAX_ELEMENTS) -> tuple[int, ...]:
    if type(v) is list and len(v) <= max_len and all(type(x) is int and 0 <= x <= hi for x in v):
        return tuple(v)
    if type(v) is not list or len(v) > max_len:
        raise _fail(source, f"{what} must be a list of at most {max_len} integers, got {brief(v)}")
    bad = next(x for x in v if not (type(x) is int and 0 <= x <= hi))
    raise _fail(source, f"{what} must hold integers in [0, {hi}], got {brief(bad)}")


def parse_shape(v: Any, source: str, what: str) -> tuple[int, ...]:
    """A shape (or grid) within the caps: at most MAX_DIMS lengths, each at most MAX_ELEMENTS, and the
    product of the non-zero ones at most MAX_ELEMENTS (so strides and sizes fit 64 bits, even when a
    zero length leaves no elements)."""
    shape = _ints(v, source, what)
    if math.prod(n for n in shape if n) > MAX_ELEMENTS:
        raise _fail(source, f"{what} {list(shape)} has more than {MAX_ELEMENTS} elements")
    return shape


def _nests_deeper(value: Any, limit: int) -> bool:
    """Whether lists and dicts nest deeper than `limit` levels in JSON value `value` (without recursion)."""
    stack = [(value, 1)] if type(value) is dict or type(value) is list else []
    while stack:
        v, depth = stack.pop()
        if depth > limit:
            return True
        items = v.values() if type(v) is dict else v
        kinds = set(map(type, items))  # at C speed: most lists (an RNG state's) hold numbers only
        if dict in kinds or list in kinds:
            stack.extend((x, depth + 1) for x in items if type(x) is dict or type(x) is list)
    return False


def _check_depth(value: Any, source: str, what: str) -> Any:
    if _nests_deeper(value, MAX_VALUE_DEPTH):
        raise _fail(source, f"{what} nests lists and dicts deeper than {MAX_VALUE_DEPTH} levels")
    return value


def validate_relative_path(path: Any, source: str) -> str:
    if not isinstance(path, str) or not path:
        raise UnsafePathError(f"{source}: data file path {brief(path)} is not a non-empty string")
    parts = path.split("/")
    if any(ord(c) < 0x20 or c == "\x7f" for c in path):  # a NUL ends a path in the OS; none names a file of bcp's
        raise UnsafePathError(f"{source}: data file path {path!r} holds a control character")
    if (path.startswith("/") or "\\" in path or ":" in parts[0]
            or any(p in ("", ".", "..") for p in parts) or posixpath.normpath(path) != path):
        raise UnsafePathError(f"{source}: data file path {path!r} escapes the checkpoint directory "
                              "or is not a plain relative path")
    return path


@dataclass(frozen=True)
class _Context:
    """What every piece of a metadata file is checked against."""

    source: str
    n_files: int
    block: int
    world_size: int


def _byte_range(p: dict, ctx: _Context, where: str) -> tuple[int, int, int, tuple[int, ...], int]:
    """A piece's file, byte_offset, nbytes, checksums and rank, checked."""
    source = ctx.source
    file = p.get("file")
    if not (type(file) is int and 0 <= file < ctx.n_files):
        raise _fail(source, f"{where} names file index {brief(file)} but there are {ctx.n_files} files")
    byte_offset = _int(p.get("byte_offset"), source, f"{where} byte_offset")
    nbytes = _int(p.get("nbytes"), source, f"{where} nbytes")
    sums = _ints(p.get("checksums"), source, f"{where} checksums", max_len=1 << 40, hi=_CHECKSUM_MAX)
    if len(sums) != num_blocks(nbytes, ctx.block):
        raise _fail(source, f"{where} has {len(sums)} checksums for {nbytes} bytes in blocks of {ctx.block}")
    rank = _int(p.get("rank"), source, f"{where} rank", hi=ctx.world_size - 1)
    return file, byte_offset, nbytes, sums, rank


def _parse_tensor(fqn: str, raw: Any, ctx: _Context) -> TensorMeta:
    source, where = ctx.source, f"tensor {fqn!r}"
    _need(type(raw) is dict, source, f"{where} is not an object")
    dtype = dtype_from_name(raw.get("dtype"))
    shape = parse_shape(raw.get("shape"), source, f"{where} shape")
    esize = element_size(dtype)
    pieces_raw = raw.get("pieces")
    _need(type(pieces_raw) is list, source, f"{where} pieces must be a list")
    pieces = []
    for i, p in enumerate(pieces_raw):
        pw = f"{where} piece {i}"
        _need(type(p) is dict, source, f"{pw} is not an object")
        offsets = _ints(p.get("offsets"), source, f"{pw} offsets")
        lengths = _ints(p.get("lengths"), source, f"{pw} lengths")
        if not len(offsets) == len(lengths) == len(shape):
            raise _fail(source, f"{pw} has offsets {list(offsets)} / lengths {list(lengths)} that do not match "
                        f"shape {list(shape)}")
        file, byte_offset, nbytes, sums, rank = _byte_range(p, ctx, pw)
        if nbytes != math.prod(lengths) * esize:
            raise _fail(source, f"{pw} nbytes={nbytes} does not match lengths {list(lengths)} of {dtype}")
        pieces.append(Piece(offsets, lengths, file, byte_offset, nbytes, sums, rank))
    # in metadata every piece is saved once: two identical pieces overlap
    fault = tiling_fault(shape, [(p.offsets, p.lengths) for p in pieces])
    if fault is not None:
        named = " and ".join(f"piece {i} (offsets {list(pieces[i].offsets)} lengths {list(pieces[i].lengths)})"
                             for i in fault.at)
        raise _fail(source, f"{where} {named or 'pieces'} {fault.problem}: the pieces must tile the tensor exactly")
    return TensorMeta(dtype, shape, tuple(pieces))


def _parse(raw: Any, source: str) -> CheckpointMetadata:
    if type(raw) is not dict or raw.get("format") != FORMAT_NAME:
        raise NotACheckpointError(f"{source} is not bcp metadata (no \"format\": \"bcp\")")
    version = raw.get("version")
    if type(version) is not int or version < 1:
        raise MetadataError(f"{source}: version must be a positive integer, got {brief(version)}")
    if version > FORMAT_VERSION:
        raise FormatVersionError(
            f"{source} uses format version {version}, newer than the {FORMAT_VERSION} this bcp reads; "
            "upgrade bcp to load it")
    world_size = _int(raw.get("world_size"), source, "world_size", lo=1, hi=MAX_WORLD_SIZE)
    framework = raw.get("framework", "")
    _need(type(framework) is str, source, f"framework must be a string, got {brief(framework)}")
    ck = raw.get("checksum")
    _need(type(ck) is dict and ck.get("algorithm") == CHECKSUM_ALGORITHM, source,
          f"checksum.algorithm must be {CHECKSUM_ALGORITHM}")
    block = _int(ck.get("block_bytes"), source, "checksum.block_bytes", lo=16, hi=MAX_CHECKSUM_BLOCK_BYTES)
    _need(block % 16 == 0, source, "checksum.block_bytes must be a multiple of 16")
    files_raw = raw.get("files")
    _need(type(files_raw) is list, source, "files must be a list")
    files = tuple(validate_relative_path(f, source) for f in files_raw)
    _need(len(set(files)) == len(files), source, "files lists a path twice")
    ctx = _Context(source, len(files), block, world_size)

    tensors_raw, objects_raw, per_rank_raw = raw.get("tensors"), raw.get("objects"), raw.get("per_rank")
    _need(all(type(x) is dict for x in (tensors_raw, objects_raw, per_rank_raw)), source,
          "tensors, objects and per_rank must be objects")
    tensors = {k: _parse_tensor(k, v, ctx) for k, v in tensors_raw.items()}
    objects = {k: ObjectValue(_check_depth(v, source, f"value {k!r}")) for k, v in objects_raw.items()}
    per_rank = {k: _parse_per_rank(k, v, ctx) for k, v in per_rank_raw.items()}
    sharded_raw = raw.get("sharded_objects", {})
    _need(type(sharded_raw) is dict, source, "sharded_objects must be an object")
    sharded = {k: _parse_sharded_object(k, v, ctx) for k, v in sharded_raw.items()}
    sections = [set(tensors), set(objects), set(per_rank), set(sharded)]
    overlap = {k for i, a in enumerate(sections) for b in sections[i + 1:] for k in a & b}
    _need(not overlap, source, f"keys stored twice: {sorted(overlap)[:5]}")
    user = raw.get("user", {})
    _need(type(user) is dict, source, "user must be an object")
    return CheckpointMetadata(
        world_size=world_size, framework=framework, files=files, tensors=tensors, objects=objects,
        per_rank=per_rank, sharded_objects=sharded, checksum_block_bytes=block,
        user=_check_depth(user, source, "user"), version=version)


def _parse_per_rank(fqn: str, raw: Any, ctx: _Context) -> PerRankMeta:
    source, where = ctx.source, f"per_rank {fqn!r}"
    _need(type(raw) is dict and type(raw.get("variants")) is list and len(raw["variants"]) > 0, source,
          f"{where} must have a non-empty variants list")
    variants = []
    for i, var in enumerate(raw["variants"]):
        _need(type(var) is dict and len(var) == 1 and ("tensor" in var or "object" in var),
              source, f"{where} variant {i} must be {{tensor}} or {{object}}")
        if "object" in var:
            variants.append(ObjectValue(_check_depth(var["object"], source, f"{where} variant {i}")))
            continue
        tm = _parse_tensor(f"{fqn}#{i}", var["tensor"], ctx)
        whole = (tuple([0] * len(tm.shape)), tm.shape)
        _need(len(tm.pieces) == 1 and (tm.pieces[0].offsets, tm.pieces[0].lengths) == whole, source,
              f"{where} variant {i} must be one piece covering its whole shape {list(tm.shape)}")
        variants.append(tm)
    ranks = _ints(raw.get("ranks"), source, f"{where} ranks", max_len=MAX_WORLD_SIZE)
    _need(all(r < len(variants) for r in ranks), source, f"{where} ranks index missing variants")
    _need(len(ranks) == ctx.world_size, source,
          f"{where} ranks lists {len(ranks)} ranks, but the world size is {ctx.world_size}")
    return PerRankMeta(ranks, tuple(variants))


def _parse_sharded_object(fqn: str, raw: Any, ctx: _Context) -> ShardedObjectMeta:
    source, where = ctx.source, f"sharded object {fqn!r}"
    _need(type(raw) is dict and type(raw.get("shards")) is list, source, f"{where} needs a shards list")
    grid = parse_shape(raw.get("grid"), source, f"{where} grid")
    shards, seen = [], set()
    for i, p in enumerate(raw["shards"]):
        pw = f"{where} shard {i}"
        _need(type(p) is dict, source, f"{pw} is not an object")
        index = _ints(p.get("index"), source, f"{pw} index")
        _need(len(index) == len(grid) and all(x < g for x, g in zip(index, grid)), source,
              f"{pw} index {list(index)} lies outside grid {list(grid)}")
        _need(index not in seen, source, f"{pw} index {list(index)} saved twice")
        seen.add(index)
        shards.append(ObjectPiece(index, *_byte_range(p, ctx, pw)))
    return ShardedObjectMeta(grid, tuple(shards))
