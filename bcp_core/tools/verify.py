"""`bcp verify`: completeness, data-file sizes and framing, every checksum. Never unpickles.

The piece layout (every tensor tiled exactly by its pieces) and the caps on every field are checked
when the metadata is parsed: a checkpoint whose metadata fails them has one fault, "metadata".
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..engine import read_all, read_verified
from ..errors import BCPError, ChecksumError
from ..load_planner import ReadItem
from ..metadata import CheckpointMetadata, Piece, TensorMeta, element_size, file_extents, num_blocks, parse_json
from ..storage import Storage
from ..foreign import foreign_format
from .read import CHUNK_BYTES, box_str, open_checkpoint, progress_bar, row_blocks


@dataclass
class Fault:
    kind: str      # missing-file, short-file, header, checksum, read, metadata
    where: str     # file and byte range, or key
    detail: str

    def to_json(self) -> dict:
        return {"kind": self.kind, "where": self.where, "detail": self.detail}


def _header_of(st: Storage, rel: str) -> dict:
    head = bytearray(8)
    st.read_into(rel, 0, memoryview(head))
    n = int.from_bytes(head, "little")
    if n > 100 << 20:
        raise ValueError(f"safetensors header length {n} is implausible")
    raw = bytearray(n)
    st.read_into(rel, 8, memoryview(raw))
    return {"_header_bytes": 8 + n, **parse_json(bytes(raw), st.join(rel))}


# A piece to check: (key for messages, its name in the file's header or "", its tensor, the piece).
PieceRef = tuple[str, str, TensorMeta, Piece]


def verify_checkpoint(path: str, num_threads: int = 4, progress: bool = False) -> dict:
    """Check completeness, the metadata (layout and caps), data file sizes and framing, and every checksum.
    Never unpickles."""
    try:
        st, md = open_checkpoint(path)
    except BCPError as e:
        return {"path": str(path), "ok": False, "faults": [Fault("metadata", str(path), str(e)).to_json()],
                "checked_bytes": 0, "pieces": 0}
    faults: list[Fault] = []
    pieces = _pieces(md)
    bad_files, headers = _check_files(st, md, pieces, faults)
    _check_framing(st, md, pieces, headers, faults)
    checked = _check_checksums(st, md, pieces, bad_files, num_threads, progress, faults)
    return {"path": st.root, "ok": not [f for f in faults if f.kind != "stray-file"],
            "faults": [f.to_json() for f in faults], "checked_bytes": checked, "pieces": len(pieces),
            "files": len(md.files), "sharded_object_pieces": sum(len(so.shards) for so in md.sharded_objects.values()),
            "checksum_blocks": sum(num_blocks(p.nbytes, md.checksum_block_bytes) for *_, p in pieces)}


def _pieces(md: CheckpointMetadata) -> list[PieceRef]:
    """Every tensor piece: of tensors (named "<fqn>@<offsets>" in their file) and of per-rank variants."""
    pieces: list[PieceRef] = []
    for fqn, tm in md.tensors.items():
        for p in tm.pieces:
            pieces.append((fqn, f"{fqn}@{','.join(map(str, p.offsets))}", tm, p))
    for fqn, pr in md.per_rank.items():
        for vid, v in enumerate(pr.variants):
            if isinstance(v, TensorMeta):
                pieces.append((f"{fqn}#{vid}", "", v, v.pieces[0]))  # header name is the writer's business
    return pieces


def _check_files(st: Storage, md: CheckpointMetadata, pieces: list[PieceRef],
                 faults: list[Fault]) -> tuple[set[int], dict[int, dict]]:
    """Each data file exists, is long enough and has a readable header; stray data files are noted.
    Returns the indices of files not to read further, and the headers read."""
    listed: dict[str, set[str]] = {}  # a directory listed once rather than each file checked
    bad_files: set[int] = set()
    extents = file_extents(md)
    headers: dict[int, dict] = {}
    for i, rel in enumerate(md.files):
        d, _, name = rel.rpartition("/")
        if d not in listed:
            listed[d] = set(st.listdir(d))
        if name not in listed[d]:
            faults.append(Fault("missing-file", st.join(rel), "data file listed in the metadata does not exist"))
            bad_files.add(i)
            continue
        size, ext = st.size(rel), extents.get(i)
        if ext is not None and size < ext.end:
            faults.append(Fault("short-file", st.join(rel), f"file has {size} bytes but {ext.piece} ends at byte "
                                f"{ext.end} (truncated upload?)"))
            bad_files.add(i)
            continue
        if foreign_format(st) is not None:
            continue  # another system's file (a torch.save zip): its records were CRC-checked when read
        try:
            headers[i] = _header_of(st, rel)
        except Exception as e:  # noqa: BLE001 - reported as a fault
            faults.append(Fault("header", st.join(rel), f"unreadable safetensors header: {e}"))
    referenced = set(md.files)
    for d, names in listed.items():
        for n in sorted(names):
            rel = f"{d}/{n}" if d else n
            if rel not in referenced and n.endswith(".safetensors"):
                faults.append(Fault("stray-file", st.join(rel), "data file not referenced by the metadata "
                                    "(left over from an aborted save?); harmless, but not part of this checkpoint"))
    return bad_files, headers


def _check_framing(st: Storage, md: CheckpointMetadata, pieces: list[PieceRef], headers: dict[int, dict],
                   faults: list[Fault]) -> None:
    """Each piece is where its file's safetensors header says it is (tensor pieces also under their
    documented name "<fqn>@<offsets>")."""
    spans_in_header: dict[int, dict[tuple[int, int], str]] = {}
    for i, h in headers.items():
        spans_in_header[i] = {}
        for hname, entry in h.items():
            if isinstance(entry, dict) and isinstance(entry.get("data_offsets"), list):
                lo, hi = entry["data_offsets"]
                spans_in_header[i][(h["_header_bytes"] + lo, h["_header_bytes"] + hi)] = hname
    framed = [(key, name, p) for key, name, _, p in pieces]
    framed += [(f"{fqn}@{list(p.index)}", "", p) for fqn, so in md.sharded_objects.items() for p in so.shards]
    for key, name, p in framed:
        if p.file not in spans_in_header:
            continue
        found = spans_in_header[p.file].get((p.byte_offset, p.byte_offset + p.nbytes))
        where = f"{st.join(md.files[p.file])} bytes [{p.byte_offset}, {p.byte_offset + p.nbytes})"
        if found is None:
            faults.append(Fault("header", where, f"no entry of the file's safetensors header frames the piece of "
                                f"{key!r} (metadata and data file disagree)"))
        elif name and found != name:
            faults.append(Fault("header", where, f"header names the piece {found!r}, expected {name!r}"))


def _check_checksums(st: Storage, md: CheckpointMetadata, pieces: list[PieceRef], bad_files: set[int],
                     num_threads: int, progress: bool, faults: list[Fault]) -> int:
    """Every checksum block of every piece, read in row blocks so memory stays bounded; returns the
    bytes checked."""
    block = md.checksum_block_bytes
    bar = progress_bar(sum(p.nbytes for *_, p in pieces if p.file not in bad_files), "verify", enabled=progress)
    checked = 0
    for key, _, tm, p in pieces:
        if p.file in bad_files:
            continue
        esize = element_size(tm.dtype)
        for offsets, lengths in row_blocks(tuple(p.lengths), esize, max(CHUNK_BYTES, block)):
            glob = tuple(po + o for po, o in zip(p.offsets, offsets))
            dest = torch.empty(lengths, dtype=tm.dtype)
            try:
                read_all(st, md.files, block, [ReadItem(key, p, glob, lengths, dest)], True, num_threads)
            except BCPError as e:
                kind = "checksum" if isinstance(e, ChecksumError) else "read"
                faults.append(Fault(kind, f"{st.join(md.files[p.file])} (tensor {key!r}, piece "
                                    f"{box_str(p.offsets, p.lengths)}, rows {box_str(glob, lengths)})", str(e)))
            n = math.prod(lengths) * esize
            checked += n
            bar.update(n)
    for fqn, so in md.sharded_objects.items():
        for p in so.shards:
            if p.file in bad_files:
                continue
            try:
                read_verified(st, md.files[p.file], p.byte_offset, p.nbytes, p.checksums, block,
                              f"shard {list(p.index)} of {fqn!r}")
            except BCPError as e:
                kind = "checksum" if isinstance(e, ChecksumError) else "read"
                faults.append(Fault(kind, f"{st.join(md.files[p.file])} (sharded value {fqn!r} index "
                                    f"{list(p.index)})", str(e)))
            checked += p.nbytes
    bar.close()
    return checked
