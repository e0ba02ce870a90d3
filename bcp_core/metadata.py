"""The global metadata of a checkpoint: frozen dataclasses and their JSON form.

Faithful to docs/format.md. Parsing validates every field before anything is
allocated from it, so a malformed or hostile metadata file fails here.
"""

from __future__ import annotations

import json
import math
import posixpath
from dataclasses import dataclass, field
from typing import Any

import torch

from .errors import FormatVersionError, MetadataError, NotACheckpointError, UnsafePathError

FORMAT_NAME = "bcp"
FORMAT_VERSION = 1
METADATA_FILE = "bcp_metadata.json"
TRACKER_FILE = "latest"
CHECKSUM_BLOCK_BYTES = 4 << 20
CHECKSUM_ALGORITHM = "xxh3_64"

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
        raise MetadataError(f"unknown dtype {name!r} in metadata") from None


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
        return json.dumps(self.to_json(), separators=(",", ":"), allow_nan=False).encode()

    @staticmethod
    def loads(data: bytes, source: str = "metadata") -> CheckpointMetadata:
        try:
            raw = json.loads(data)
        except (ValueError, UnicodeDecodeError) as e:
            raise MetadataError(f"{source}: not valid JSON ({e})") from None
        return _parse(raw, source)


# ----------------------------------------------------------------------------- parsing

def _need(cond: bool, source: str, what: str) -> None:
    if not cond:
        raise MetadataError(f"{source}: {what}")


def _int(v: Any, source: str, what: str, lo: int = 0) -> int:
    _need(type(v) is int and v >= lo, source, f"{what} must be an integer >= {lo}, got {v!r}")
    return v


def _ints(v: Any, source: str, what: str, max_len: int = 64) -> tuple[int, ...]:
    _need(isinstance(v, list) and len(v) <= max_len, source,
          f"{what} must be a list of at most {max_len} integers")
    return tuple(_int(x, source, what) for x in v)


def validate_relative_path(path: Any, source: str) -> str:
    if not isinstance(path, str) or not path:
        raise UnsafePathError(f"{source}: data file path {path!r} is not a non-empty string")
    parts = path.split("/")
    if (path.startswith("/") or "\\" in path or ":" in parts[0]
            or any(p in ("", ".", "..") for p in parts) or posixpath.normpath(path) != path):
        raise UnsafePathError(f"{source}: data file path {path!r} escapes the checkpoint directory "
                              "or is not a plain relative path")
    return path


def _parse_tensor(fqn: str, raw: Any, n_files: int, block: int, source: str) -> TensorMeta:
    where = f"tensor {fqn!r}"
    _need(isinstance(raw, dict), source, f"{where} is not an object")
    dtype = dtype_from_name(raw.get("dtype"))
    shape = _ints(raw.get("shape"), source, f"{where} shape")
    esize = element_size(dtype)
    pieces_raw = raw.get("pieces")
    _need(isinstance(pieces_raw, list), source, f"{where} pieces must be a list")
    pieces = []
    covered = 0
    for i, p in enumerate(pieces_raw):
        pw = f"{where} piece {i}"
        _need(isinstance(p, dict), source, f"{pw} is not an object")
        offsets = _ints(p.get("offsets"), source, f"{pw} offsets")
        lengths = _ints(p.get("lengths"), source, f"{pw} lengths")
        _need(len(offsets) == len(shape) == len(lengths), source,
              f"{pw} has offsets {offsets} / lengths {lengths} that do not match shape {shape}")
        _need(all(o + n <= s for o, n, s in zip(offsets, lengths, shape)), source,
              f"{pw} box offsets={offsets} lengths={lengths} lies outside shape {shape}")
        nbytes = _int(p.get("nbytes"), source, f"{pw} nbytes")
        _need(nbytes == math.prod(lengths) * esize, source,
              f"{pw} nbytes={nbytes} does not match lengths {lengths} of {dtype}")
        crc = _ints(p.get("checksums"), source, f"{pw} checksums", max_len=1 << 30)
        _need(len(crc) == num_blocks(nbytes, block), source,
              f"{pw} has {len(crc)} checksums for {nbytes} bytes in blocks of {block}")
        pieces.append(Piece(offsets, lengths, _int(p.get("file"), source, f"{pw} file"),
                            _int(p.get("byte_offset"), source, f"{pw} byte_offset"), nbytes, crc,
                            _int(p.get("rank"), source, f"{pw} rank")))
        _need(pieces[-1].file < n_files, source, f"{pw} names file index {pieces[-1].file} "
              f"but there are {n_files} files")
        covered += math.prod(lengths)
    _need(covered == math.prod(shape), source,
          f"{where} pieces cover {covered} elements but shape {shape} has {math.prod(shape)}")
    return TensorMeta(dtype, shape, tuple(pieces))


def _parse(raw: Any, source: str) -> CheckpointMetadata:
    if not isinstance(raw, dict) or raw.get("format") != FORMAT_NAME:
        raise NotACheckpointError(f"{source} is not bcp metadata (no \"format\": \"bcp\")")
    version = raw.get("version")
    if type(version) is not int:
        raise MetadataError(f"{source}: version must be an integer, got {version!r}")
    if version > FORMAT_VERSION:
        raise FormatVersionError(
            f"{source} uses format version {version}, newer than the {FORMAT_VERSION} this bcp reads; "
            "upgrade bcp to load it")
    ck = raw.get("checksum")
    _need(isinstance(ck, dict) and ck.get("algorithm") == CHECKSUM_ALGORITHM, source,
          f"checksum.algorithm must be {CHECKSUM_ALGORITHM}")
    block = _int(ck.get("block_bytes"), source, "checksum.block_bytes", lo=16)
    _need(block % 16 == 0, source, "checksum.block_bytes must be a multiple of 16")
    files_raw = raw.get("files")
    _need(isinstance(files_raw, list), source, "files must be a list")
    files = tuple(validate_relative_path(f, source) for f in files_raw)
    _need(len(set(files)) == len(files), source, "files lists a path twice")

    tensors_raw, objects_raw, per_rank_raw = raw.get("tensors"), raw.get("objects"), raw.get("per_rank")
    _need(all(isinstance(x, dict) for x in (tensors_raw, objects_raw, per_rank_raw)), source,
          "tensors, objects and per_rank must be objects")
    tensors = {k: _parse_tensor(k, v, len(files), block, source) for k, v in tensors_raw.items()}
    objects = {k: ObjectValue(v) for k, v in objects_raw.items()}
    per_rank = {}
    for k, v in per_rank_raw.items():
        _need(isinstance(v, dict) and isinstance(v.get("variants"), list), source,
              f"per_rank {k!r} must have a variants list")
        variants = []
        for i, var in enumerate(v["variants"]):
            _need(isinstance(var, dict) and len(var) == 1 and ("tensor" in var or "object" in var),
                  source, f"per_rank {k!r} variant {i} must be {{tensor}} or {{object}}")
            variants.append(_parse_tensor(f"{k}#{i}", var["tensor"], len(files), block, source)
                            if "tensor" in var else ObjectValue(var["object"]))
        ranks = _ints(v.get("ranks"), source, f"per_rank {k!r} ranks", max_len=1 << 24)
        _need(len(ranks) > 0 and all(r < len(variants) for r in ranks), source,
              f"per_rank {k!r} ranks index missing variants")
        per_rank[k] = PerRankMeta(ranks, tuple(variants))
    sharded_raw = raw.get("sharded_objects", {})
    _need(isinstance(sharded_raw, dict), source, "sharded_objects must be an object")
    sharded = {k: _parse_sharded_object(k, v, len(files), block, source) for k, v in sharded_raw.items()}
    sections = [set(tensors), set(objects), set(per_rank), set(sharded)]
    overlap = {k for i, a in enumerate(sections) for b in sections[i + 1:] for k in a & b}
    _need(not overlap, source, f"keys stored twice: {sorted(overlap)[:5]}")
    user = raw.get("user", {})
    _need(isinstance(user, dict), source, "user must be an object")
    return CheckpointMetadata(
        world_size=_int(raw.get("world_size"), source, "world_size", lo=1),
        framework=str(raw.get("framework", "")), files=files, tensors=tensors, objects=objects,
        per_rank=per_rank, sharded_objects=sharded, checksum_block_bytes=block, user=user, version=version)


def _parse_sharded_object(fqn: str, raw: Any, n_files: int, block: int, source: str) -> ShardedObjectMeta:
    where = f"sharded object {fqn!r}"
    _need(isinstance(raw, dict) and isinstance(raw.get("shards"), list), source, f"{where} needs a shards list")
    grid = _ints(raw.get("grid"), source, f"{where} grid")
    shards, seen = [], set()
    for i, p in enumerate(raw["shards"]):
        pw = f"{where} shard {i}"
        _need(isinstance(p, dict), source, f"{pw} is not an object")
        index = _ints(p.get("index"), source, f"{pw} index")
        _need(len(index) == len(grid) and all(x < g for x, g in zip(index, grid)), source,
              f"{pw} index {index} lies outside grid {grid}")
        _need(index not in seen, source, f"{pw} index {index} saved twice")
        seen.add(index)
        nbytes = _int(p.get("nbytes"), source, f"{pw} nbytes")
        crc = _ints(p.get("checksums"), source, f"{pw} checksums", max_len=1 << 30)
        _need(len(crc) == num_blocks(nbytes, block), source, f"{pw} has {len(crc)} checksums for {nbytes} bytes")
        piece = ObjectPiece(index, _int(p.get("file"), source, f"{pw} file"),
                            _int(p.get("byte_offset"), source, f"{pw} byte_offset"), nbytes, crc,
                            _int(p.get("rank"), source, f"{pw} rank"))
        _need(piece.file < n_files, source, f"{pw} names file index {piece.file} but there are {n_files} files")
        shards.append(piece)
    return ShardedObjectMeta(grid, tuple(shards))
