"""Offline tools over checkpoints: inspect, verify, export, import, rename, list/latest/prune.

The `bcp` command line (cli.py) is a thin layer over these functions. Reading
goes through the same path as `load` (planner.box_read_items + engine.read_all,
checksums verified). inspect, verify and the management functions read only
JSON and safetensors headers: they never unpickle anything.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from . import api, codec
from .engine import ShardReader
from .loader import read_metadata
from .engine import _SAFETENSORS_DTYPES, read_all, read_verified
from .errors import BCPError, ChecksumError
from .metadata import (CHECKSUM_ALGORITHM, METADATA_FILE, TRACKER_FILE, CheckpointMetadata, ObjectValue, Piece,
                       TensorMeta, dtype_from_name, element_size, num_blocks)
from .load_planner import ReadItem, box_read_items
from .shards import Box, intersect
from .storage import Storage, storage_for

# Tensors are read in row blocks of about this size: export and verify memory stays near it.
CHUNK_BYTES = 64 << 20
_STEP_RE = re.compile(r"^step_(\d+)$")
_SAFETENSORS_CODE_TO_DTYPE = {code: dt for dt, code in _SAFETENSORS_DTYPES.items()}
DTYPE_ALIASES = {
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
    "half": torch.float16, "fp32": torch.float32, "float32": torch.float32, "float": torch.float32,
    "fp64": torch.float64, "float64": torch.float64,
}


class ToolError(BCPError):
    """A tool was asked for something it cannot do (bad arguments, conflicting keys...)."""


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n} B"


# ----------------------------------------------------------------------------- progress

class Progress:
    """A byte-progress bar on stderr: redrawn in place on a terminal, a line per 10% otherwise."""

    def __init__(self, total: int, desc: str, enabled: bool = True, stream=None):
        self.total, self.desc, self.done = max(0, total), desc, 0
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.tty = enabled and hasattr(self.stream, "isatty") and self.stream.isatty()
        self.start = self.last = time.monotonic()
        self.last_decile = -1

    def update(self, n: int) -> None:
        self.done += n
        if not self.enabled:
            return
        now = time.monotonic()
        if self.tty:
            if now - self.last >= 0.1 or self.done >= self.total:
                self.last = now
                self.stream.write("\r" + self._line(now))
                self.stream.flush()
        else:
            decile = int(10 * self.done / self.total) if self.total else 10
            if decile > max(self.last_decile, 0) and decile < 10:
                self.last_decile = decile
                self.stream.write(self._line(now) + "\n")

    def _line(self, now: float) -> str:
        frac = self.done / self.total if self.total else 1.0
        width = 30
        bar = "#" * int(frac * width) + "." * (width - int(frac * width))
        rate = self.done / max(now - self.start, 1e-6)
        return (f"{self.desc} [{bar}] {100 * frac:5.1f}% {human_bytes(self.done)}/{human_bytes(self.total)} "
                f"{human_bytes(rate)}/s")

    def close(self) -> None:
        if self.enabled:
            end = "\n" if self.tty else ""
            self.stream.write(end + self._line(time.monotonic()) + " done\n")
            self.stream.flush()


# ----------------------------------------------------------------------------- opening

def open_checkpoint(path: str) -> tuple[Storage, CheckpointMetadata]:
    """The checkpoint at `path` (a checkpoint directory, or a root: its latest complete one) and its metadata."""
    st = api.resolve(path)
    return st, read_metadata(st)


def _value_summary(encoded: Any, limit: int = 70) -> str:
    """A short description of a codec value, from its JSON form only (a pickle is never opened)."""
    if isinstance(encoded, dict) and len(encoded) == 1:
        tag, v = next(iter(encoded.items()))
        if tag == "__pickle__":
            return f"<pickled value, {len(v) * 3 // 4} bytes, not decoded>"
        if tag in ("__tensor__", "__ndarray__") and isinstance(v, dict):
            return f"<{tag.strip('_')} {v.get('dtype')} {v.get('shape')}>"
    text = json.dumps(encoded, separators=(",", ":"))
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _sections(keys) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for k in sorted(keys):
        out.setdefault(k.split(".", 1)[0], []).append(k)
    return out


# ----------------------------------------------------------------------------- inspect

def inspect_checkpoint(path: str) -> dict:
    """A JSON-able description of the checkpoint: tensors, pieces and who wrote them, values, files."""
    st, md = open_checkpoint(path)
    per_rank_bytes: dict[int, int] = {}
    per_rank_files: dict[int, set[str]] = {}
    file_bytes = [0] * len(md.files)

    def piece_json(p: Piece) -> dict:
        per_rank_bytes[p.rank] = per_rank_bytes.get(p.rank, 0) + p.nbytes
        per_rank_files.setdefault(p.rank, set()).add(md.files[p.file])
        file_bytes[p.file] += p.nbytes
        return {"offsets": list(p.offsets), "lengths": list(p.lengths), "file": md.files[p.file],
                "byte_offset": p.byte_offset, "nbytes": p.nbytes, "rank": p.rank}

    tensors = {}
    for fqn, tm in sorted(md.tensors.items()):
        tensors[fqn] = {"dtype": str(tm.dtype).removeprefix("torch."), "shape": list(tm.shape),
                        "nbytes": tm.nbytes, "pieces": [piece_json(p) for p in tm.pieces]}
    per_rank = {}
    for fqn, pr in sorted(md.per_rank.items()):
        variants = []
        for v in pr.variants:
            if isinstance(v, TensorMeta):
                variants.append({"tensor": {"dtype": str(v.dtype).removeprefix("torch."), "shape": list(v.shape),
                                            "nbytes": v.nbytes, "pieces": [piece_json(p) for p in v.pieces]}})
            else:
                variants.append({"object": _value_summary(v.encoded)})
        per_rank[fqn] = {"ranks": list(pr.ranks), "variants": variants}
    objects = {k: _value_summary(o.encoded) for k, o in sorted(md.objects.items())}
    sharded = {}
    for fqn, so in sorted(md.sharded_objects.items()):
        for p in so.shards:
            per_rank_bytes[p.rank] = per_rank_bytes.get(p.rank, 0) + p.nbytes
            per_rank_files.setdefault(p.rank, set()).add(md.files[p.file])
            file_bytes[p.file] += p.nbytes
        sharded[fqn] = {"grid": list(so.grid), "shards": [
            {"index": list(p.index), "file": md.files[p.file], "byte_offset": p.byte_offset, "nbytes": p.nbytes,
             "rank": p.rank} for p in so.shards]}
    sections = _sections(md.keys())
    return {
        "path": st.root, "format_version": md.version, "world_size": md.world_size, "framework": md.framework,
        "checksum": {"algorithm": CHECKSUM_ALGORITHM, "block_bytes": md.checksum_block_bytes},
        "total_tensor_bytes": sum(t["nbytes"] for t in tensors.values()),
        "files": [{"path": f, "piece_bytes": b} for f, b in zip(md.files, file_bytes)],
        "ranks": {str(r): {"bytes": per_rank_bytes[r], "files": sorted(per_rank_files[r])}
                  for r in sorted(per_rank_bytes)},
        "sections": {s: len(keys) for s, keys in sections.items()},
        "tensors": tensors, "objects": objects, "per_rank": per_rank, "sharded_objects": sharded,
        "dataloader": sorted(k for k in md.keys() if k.startswith("dataloader.") or k == "dataloader"),
        "extra_state": sorted(k for k in md.keys() if k.startswith("extra_state.") or k == "extra_state"),
        "user": md.user,
    }


def _box_str(offsets, lengths) -> str:
    return "[" + ", ".join(f"{o}:{o + n}" for o, n in zip(offsets, lengths)) + "]"


def format_inspect(rep: dict, show_pieces: bool = False) -> str:
    lines = [
        f"checkpoint   {rep['path']}",
        f"format       bcp v{rep['format_version']}, saved by {rep['world_size']} rank(s), "
        f"framework {rep['framework'] or '?'}",
        f"tensors      {len(rep['tensors'])} ({human_bytes(rep['total_tensor_bytes'])}) in {len(rep['files'])} "
        f"data file(s); {rep['checksum']['algorithm']} per {human_bytes(rep['checksum']['block_bytes'])} block",
        "sections     " + ", ".join(f"{s} ({n})" for s, n in rep["sections"].items()),
        "", "ranks (who wrote what):",
    ]
    for r, info in rep["ranks"].items():
        lines.append(f"  rank {r:>4}  {human_bytes(info['bytes']):>12}  {', '.join(info['files'])}")
    lines += ["", "tensors:"]
    width = max([len(k) for k in rep["tensors"]] + [10])
    for fqn, t in rep["tensors"].items():
        ranks = sorted({p["rank"] for p in t["pieces"]})
        lines.append(f"  {fqn:<{width}}  {t['dtype']:<9} {str(tuple(t['shape'])):<18} {human_bytes(t['nbytes']):>11}"
                     f"  {len(t['pieces'])} piece(s) from rank(s) {','.join(map(str, ranks))}")
        if show_pieces:
            for p in t["pieces"]:
                lines.append(f"      {_box_str(p['offsets'], p['lengths'])} rank {p['rank']} {p['file']}"
                             f" @{p['byte_offset']} ({human_bytes(p['nbytes'])})")
    if rep["objects"]:
        lines += ["", "values:"]
        for k, v in rep["objects"].items():
            lines.append(f"  {k} = {v}")
    if rep["per_rank"]:
        lines += ["", "per-rank values (extra state):"]
        for k, pr in rep["per_rank"].items():
            desc = [f"tensor {v['tensor']['dtype']} {tuple(v['tensor']['shape'])}" if "tensor" in v else v["object"]
                    for v in pr["variants"]]
            lines.append(f"  {k}: {len(pr['variants'])} distinct value(s) over {len(pr['ranks'])} rank(s)"
                         f" (rank->variant {pr['ranks'][:16]}{'...' if len(pr['ranks']) > 16 else ''})")
            for i, d in enumerate(desc[:4]):
                lines.append(f"      [{i}] {d}")
    if rep["sharded_objects"]:
        lines += ["", "sharded values (e.g. dataloader state per DP rank):"]
        for k, so in rep["sharded_objects"].items():
            ranks = sorted({p["rank"] for p in so["shards"]})
            size = sum(p["nbytes"] for p in so["shards"])
            lines.append(f"  {k}: grid {tuple(so['grid'])}, {len(so['shards'])} shard(s), {human_bytes(size)}, "
                         f"written by rank(s) {','.join(map(str, ranks))}")
    for section in ("dataloader", "extra_state"):
        if rep[section]:
            lines += ["", f"{section} entries: " + ", ".join(rep[section][:20])
                      + (" ..." if len(rep[section]) > 20 else "")]
    if rep["user"]:
        lines += ["", "user metadata: " + json.dumps(rep["user"])[:400]]
    return "\n".join(lines)


# ----------------------------------------------------------------------------- reading tensors in chunks

def _row_blocks(shape: tuple[int, ...], esize: int, max_bytes: int) -> list[tuple[tuple, tuple]]:
    """Boxes (offsets, lengths) splitting a tensor along dim 0 into blocks of about max_bytes."""
    if len(shape) == 0 or math.prod(shape) == 0:
        return [((0,) * len(shape), tuple(shape))]
    row = math.prod(shape[1:]) * esize
    rows = max(1, max_bytes // max(row, 1))
    return [((a,) + (0,) * (len(shape) - 1), (min(rows, shape[0] - a),) + tuple(shape[1:]))
            for a in range(0, shape[0], rows)]


def read_blocks(st: Storage, md: CheckpointMetadata, fqn: str, tm: TensorMeta, num_threads: int = 4,
                max_bytes: int = CHUNK_BYTES) -> Iterator[torch.Tensor]:
    """The tensor in C order, as consecutive dim-0 blocks, each read from whatever pieces overlap it."""
    for offsets, lengths in _row_blocks(tuple(tm.shape), element_size(tm.dtype), max_bytes):
        buf = torch.empty(lengths, dtype=tm.dtype)
        read_all(st, md.files, md.checksum_block_bytes, box_read_items(fqn, tm, Box(offsets, lengths, buf)),
                 True, num_threads)
        yield buf


def read_tensor(st: Storage, md: CheckpointMetadata, fqn: str, num_threads: int = 4) -> torch.Tensor:
    return _read_whole(st, md, fqn, md.tensors[fqn], num_threads)


def _read_whole(st: Storage, md: CheckpointMetadata, fqn: str, tm: TensorMeta, num_threads: int) -> torch.Tensor:
    out = torch.empty(tm.shape, dtype=tm.dtype)
    read_all(st, md.files, md.checksum_block_bytes,
             box_read_items(fqn, tm, Box((0,) * len(tm.shape), tuple(tm.shape), out)), True, num_threads)
    return out


# ----------------------------------------------------------------------------- verify

@dataclass
class Fault:
    kind: str      # missing-file, short-file, header, checksum, read, overlap, metadata
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
    return {"_header_bytes": 8 + n, **json.loads(bytes(raw))}


def verify_checkpoint(path: str, num_threads: int = 4, progress: bool = False) -> dict:
    """Check completeness, data file framing, piece layout and every checksum. Never unpickles."""
    faults: list[Fault] = []
    try:
        st, md = open_checkpoint(path)
    except BCPError as e:
        return {"path": str(path), "ok": False, "faults": [Fault("metadata", str(path), str(e)).to_json()],
                "checked_bytes": 0, "pieces": 0}

    # All pieces: tensors and per-rank tensor variants, with their header names.
    pieces: list[tuple[str, str, TensorMeta, Piece]] = []
    for fqn, tm in md.tensors.items():
        for p in tm.pieces:
            pieces.append((fqn, f"{fqn}@{','.join(map(str, p.offsets))}", tm, p))
    for fqn, pr in md.per_rank.items():
        for vid, v in enumerate(pr.variants):
            if isinstance(v, TensorMeta):
                pieces.append((f"{fqn}#{vid}", "", v, v.pieces[0]))  # header name is the writer's business

    # Files: listed once per directory rather than checked one by one.
    listed: dict[str, set[str]] = {}
    bad_files: set[int] = set()
    needed_end = [0] * len(md.files)
    spans = [(p.file, p.byte_offset, p.nbytes) for *_, p in pieces]
    spans += [(p.file, p.byte_offset, p.nbytes) for so in md.sharded_objects.values() for p in so.shards]
    for f, off, n in spans:
        needed_end[f] = max(needed_end[f], off + n)
    headers: dict[int, dict] = {}
    for i, rel in enumerate(md.files):
        d, _, name = rel.rpartition("/")
        if d not in listed:
            listed[d] = set(st.listdir(d))
        if name not in listed[d]:
            faults.append(Fault("missing-file", st.join(rel), "data file listed in the metadata does not exist"))
            bad_files.add(i)
            continue
        size = st.size(rel)
        if size < needed_end[i]:
            faults.append(Fault("short-file", st.join(rel), f"file has {size} bytes but pieces extend to byte "
                                f"{needed_end[i]} (truncated upload?)"))
            bad_files.add(i)
            continue
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

    # Framing: each piece where the file's safetensors header says it is (tensor pieces also under
    # their documented name "<fqn>@<offsets>").
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

    # Layout: pieces of a tensor must not overlap (their element counts were checked on parse).
    for fqn, tm in md.tensors.items():
        ps = sorted(tm.pieces, key=lambda p: p.offsets)
        for i, a in enumerate(ps):
            for b in ps[i + 1:]:
                if len(tm.shape) and b.offsets[0] >= a.offsets[0] + a.lengths[0]:
                    break
                if math.prod(a.lengths) and math.prod(b.lengths) and intersect(a.offsets, a.lengths, b.offsets,
                                                                             b.lengths) is not None:
                    faults.append(Fault("overlap", fqn, f"pieces {_box_str(a.offsets, a.lengths)} and "
                                        f"{_box_str(b.offsets, b.lengths)} overlap"))

    # Checksums: every block of every piece, read in chunks so memory stays bounded.
    block = md.checksum_block_bytes
    total = sum(p.nbytes for _, _, _, p in pieces if p.file not in bad_files)
    bar = Progress(total, "verify", enabled=progress)
    checked = 0
    for key, _, tm, p in pieces:
        if p.file in bad_files:
            continue
        esize = element_size(tm.dtype)
        for offsets, lengths in _row_blocks(tuple(p.lengths), esize, max(CHUNK_BYTES, block)):
            glob = tuple(po + o for po, o in zip(p.offsets, offsets))
            dest = torch.empty(lengths, dtype=tm.dtype)
            try:
                read_all(st, md.files, block, [ReadItem(key, p, glob, lengths, dest)], True, num_threads)
            except BCPError as e:
                kind = "checksum" if isinstance(e, ChecksumError) else "read"
                faults.append(Fault(kind, f"{st.join(md.files[p.file])} (tensor {key!r}, piece "
                                    f"{_box_str(p.offsets, p.lengths)}, rows {_box_str(glob, lengths)})", str(e)))
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
    return {"path": st.root, "ok": not [f for f in faults if f.kind != "stray-file"],
            "faults": [f.to_json() for f in faults], "checked_bytes": checked, "pieces": len(pieces),
            "files": len(md.files), "sharded_object_pieces": sum(len(so.shards) for so in md.sharded_objects.values()),
            "checksum_blocks": sum(num_blocks(p.nbytes, block) for *_, p in pieces)}


# ----------------------------------------------------------------------------- key rules

def parse_rules(rules: list[str] | None) -> list[tuple[re.Pattern, str]]:
    """'REGEX=REPLACEMENT' rules (split at the first '='; write a literal '=' in REGEX as \\x3d)."""
    out = []
    for r in rules or []:
        pat, sep, repl = r.partition("=")
        if not sep or not pat:
            raise ToolError(f"rename rule {r!r} must look like 'REGEX=REPLACEMENT' (e.g. '^module\\.=')")
        try:
            out.append((re.compile(pat), repl))
        except re.error as e:
            raise ToolError(f"rename rule {r!r}: bad regular expression: {e}") from None
    return out


def apply_rules(key: str, rules: list[tuple[re.Pattern, str]]) -> str:
    for pat, repl in rules:
        key = pat.sub(repl, key)
    return key


def _rename_map(keys, rules) -> dict[str, str]:
    new = {k: apply_rules(k, rules) for k in keys}
    seen: dict[str, str] = {}
    for old, n in new.items():
        if not n:
            raise ToolError(f"rename rules turn key {old!r} into an empty key")
        if n in seen:
            raise ToolError(f"rename rules map both {seen[n]!r} and {old!r} to {n!r}")
        seen[n] = old
    return new


# ----------------------------------------------------------------------------- rename

def rename_checkpoint(path: str, rules: list[str], dry_run: bool = False) -> dict[str, str]:
    """Rewrite keys in the metadata only (data files untouched). Returns {old: new} for changed keys.

    Optimizer param_groups list parameters by FQN; where the rules rename the optimizer
    state keys `<opt>.state.<param>.<name>`, the param lists follow.
    """
    st, md = open_checkpoint(path)
    rules_c = parse_rules(rules)
    mapping = _rename_map(md.keys(), rules_c)
    changed = {k: v for k, v in mapping.items() if k != v}
    if dry_run or not changed:
        return changed
    # Parameter FQN renames implied by optimizer state key renames, per optimizer.
    groups_keys = [k for k in md.objects if k.endswith(".param_groups")]
    objects = {}
    for k, o in md.objects.items():
        enc = o.encoded
        if k in groups_keys and isinstance(enc, list):
            opt = k[: -len(".param_groups")]
            params: dict[str, str] = {}
            for old, new in changed.items():
                prefix_old, prefix_new = f"{opt}.state.", f"{mapping[k][: -len('.param_groups')]}.state."
                if old.startswith(prefix_old) and new.startswith(prefix_new):
                    params[old[len(prefix_old): old.rindex(".")]] = new[len(prefix_new): new.rindex(".")]
            enc = [{**g, "params": [params.get(p, p) for p in g["params"]]}
                   if isinstance(g, dict) and isinstance(g.get("params"), list) else g for g in enc]
        objects[mapping[k]] = ObjectValue(enc)
    new_md = CheckpointMetadata(
        world_size=md.world_size, framework=md.framework, files=md.files,
        tensors={mapping[k]: v for k, v in md.tensors.items()}, objects=objects,
        per_rank={mapping[k]: v for k, v in md.per_rank.items()},
        sharded_objects={mapping[k]: v for k, v in md.sharded_objects.items()},
        checksum_block_bytes=md.checksum_block_bytes,
        user=md.user, version=md.version)
    st.write_atomic(METADATA_FILE, new_md.dumps())
    return changed


# ----------------------------------------------------------------------------- export

def parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*", str(text).lower())
    if not m:
        raise ToolError(f"bad size {text!r}; use e.g. 5GB, 500MiB, 1000000")
    unit = (m.group(2) or "").rstrip("b")
    scale = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
             "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}[unit]
    return int(float(m.group(1)) * scale)


def parse_dtype(name: str | None) -> torch.dtype | None:
    if name is None:
        return None
    if name.lower() in DTYPE_ALIASES:
        return DTYPE_ALIASES[name.lower()]
    try:
        return dtype_from_name(name.removeprefix("torch."))
    except BCPError:
        raise ToolError(f"unknown dtype {name!r}; use bf16, fp16, fp32 or a torch dtype name") from None


@dataclass
class ExportEntry:
    name: str        # key in the output
    fqn: str         # key in the checkpoint
    tm: TensorMeta
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.tm.shape) * element_size(self.dtype)


def _select(md: CheckpointMetadata, model_only: bool, rules, dtype: torch.dtype | None) -> list[ExportEntry]:
    keys = sorted(md.tensors)
    if model_only:
        keys = [k for k in keys if k.startswith("model.")]
        if not keys:
            raise ToolError("--model-only: the checkpoint has no keys under 'model.'; sections are "
                            + ", ".join(sorted(_sections(md.keys()))))
    names = _rename_map([k.removeprefix("model.") if model_only else k for k in keys], rules)
    out = []
    for k in keys:
        tm = md.tensors[k]
        cast = dtype if dtype is not None and tm.dtype.is_floating_point else tm.dtype
        out.append(ExportEntry(names[k.removeprefix("model.") if model_only else k], k, tm, cast))
    return out


def _cast_bytes(block: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, memoryview]:
    t = block.to(dtype) if block.dtype != dtype else block
    t = t.contiguous()
    if t.numel() == 0:
        return t, memoryview(b"")
    return t, memoryview(t.reshape(-1).view(torch.uint8).numpy()).cast("B")


def _safetensors_header(entries: list[ExportEntry]) -> bytes:
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    pos = 0
    for e in entries:
        code = _SAFETENSORS_DTYPES.get(e.dtype)
        if code is None:
            raise ToolError(f"tensor {e.fqn!r} has dtype {e.dtype}, which safetensors cannot store; "
                            "export with --to torch or --dtype")
        header[e.name] = {"dtype": code, "shape": list(e.tm.shape), "data_offsets": [pos, pos + e.nbytes]}
        pos += e.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw


def _copy_config(config: str, out: Storage) -> list[str]:
    """Copy a config.json (or every non-weight file of a directory: config, tokenizer...) next to the weights."""
    if os.path.isdir(config):
        names = [n for n in sorted(os.listdir(config)) if os.path.isfile(os.path.join(config, n))
                 and not n.endswith((".safetensors", ".bin", ".pt", ".pth", ".index.json"))]
        sources = [(os.path.join(config, n), n) for n in names]
    else:
        sources = [(config, "config.json")]
    for src, name in sources:
        with open(src, "rb") as f:
            out.write_atomic(name, f.read())
    return [n for _, n in sources]


def export_checkpoint(path: str, out: str, to: str = "hf", model_only: bool | None = None,
                      dtype: str | None = None, rename: list[str] | None = None, shard_size: str = "5GB",
                      config: str | None = None, allow_pickle: bool = False, num_threads: int = 4,
                      progress: bool = False) -> dict:
    """Merge a checkpoint into a Hugging Face directory or a torch.save file, in bounded memory.

    Tensors are read in row blocks of ~64 MiB (from whichever saved pieces cover them) and
    written out as they arrive, so peak memory does not grow with the model.
    """
    st, md = open_checkpoint(path)
    rules = parse_rules(rename)
    cast = parse_dtype(dtype)
    if to == "hf":
        # A Hugging Face directory holds model weights only.
        if model_only is None:
            model_only = any(k.startswith("model.") for k in md.tensors)
        return _export_hf(st, md, out, _select(md, model_only, rules, cast), parse_size(shard_size), config,
                          num_threads, progress)
    if to == "torch":
        return _export_torch(st, md, out, _select(md, bool(model_only), rules, cast), bool(model_only), rules,
                             allow_pickle, num_threads, progress)
    raise ToolError(f"unknown export format {to!r}; use hf or torch")


def _export_hf(st, md, out_path, entries, shard_bytes, config, num_threads, progress) -> dict:
    shards: list[list[ExportEntry]] = [[]]
    size = 0
    for e in entries:
        if shards[-1] and size + e.nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(e)
        size += e.nbytes
    n = len(shards)
    names = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    out = storage_for(out_path)
    out.makedirs()
    total = sum(e.nbytes for e in entries)
    bar = Progress(total, "export", enabled=progress)
    for name, shard in zip(names, shards):
        writer = out.open_writer(name)
        try:
            writer.write(memoryview(_safetensors_header(shard)))
            for e in shard:
                for block in read_blocks(st, md, e.fqn, e.tm, num_threads):
                    t, data = _cast_bytes(block, e.dtype)
                    writer.write(data)
                    bar.update(len(data))
                    del t, block
            writer.close()
        except BaseException:
            writer.abort()
            raise
    bar.close()
    written = list(names)
    if n > 1:
        index = {"metadata": {"total_size": total, "format": "bcp-export"},
                 "weight_map": {e.name: name for name, shard in zip(names, shards) for e in shard}}
        out.write_atomic("model.safetensors.index.json", json.dumps(index, indent=2).encode())
        written.append("model.safetensors.index.json")
    if config:
        written += _copy_config(config, out)
    return {"out": out.root, "files": written, "tensors": len(entries), "bytes": total}


def _export_torch(st, md, out_path, entries, model_only, rules, allow_pickle, num_threads, progress) -> dict:
    """A torch.save file written without holding the model: torch.save writes the file with placeholder
    storages (torch.serialization.skip_data), then the tensor bytes are streamed into their records."""
    import zipfile

    from torch._subclasses.fake_tensor import FakeTensorMode

    if "://" in str(out_path) and not str(out_path).startswith("file://"):
        raise ToolError("--to torch writes a local file; give a local OUT path")
    out_path = str(out_path).removeprefix("file://")
    with FakeTensorMode():
        fakes = {e.name: torch.empty(e.tm.shape, dtype=e.dtype) for e in entries}
    state: dict[str, Any] = dict(fakes)
    if not model_only:
        values = {k: codec.decode(o.encoded, k, allow_pickle) for k, o in md.objects.items()}
        for k, pr in md.per_rank.items():  # values that differ per rank: rank 0's
            v = pr.variant_for(0)
            values[k] = codec.decode(v.encoded, k, allow_pickle) if isinstance(v, ObjectValue) \
                else _read_whole(st, md, k, v, num_threads)
        for k in md.sharded_objects:  # every saved shard, keyed by its grid index
            reader = ShardReader(st, md, k, allow_pickle, True)
            values[k] = {",".join(map(str, i)): reader[i] for i in reader.indices}
        for k, v in _rename_map(values, rules).items():
            if v in state:
                raise ToolError(f"key {v!r} is both a tensor and a value after renaming")
            state[v] = values[k]
    # torch.save numbers storages in the order it pickles them: the tensors first, in dict order, then
    # any tensor inside the values. That order is recomputed here and checked against the record sizes.
    order: list[torch.Tensor] = []
    seen: set[int] = set()

    def walk(v):
        if isinstance(v, torch.Tensor):
            if id(v.untyped_storage()) not in seen:
                seen.add(id(v.untyped_storage()))
                order.append(v)
        elif isinstance(v, dict):
            for x in v.values():
                walk(x)
        elif isinstance(v, (list, tuple)):
            for x in v:
                walk(x)

    walk(state)
    tmp = f"{out_path}.tmp.{os.getpid()}"
    with torch.serialization.skip_data(materialize_fake_tensors=True):
        torch.save(state, tmp)
    reader = torch._C.PyTorchFileReader(tmp)
    with zipfile.ZipFile(tmp) as z:
        sizes = {i.filename.split("/", 1)[1]: i.file_size for i in z.infolist() if "/" in i.filename}
    records = [f"data/{i}" for i in range(len(order))]
    expected = [t.untyped_storage().nbytes() if i >= len(entries) else entries[i].nbytes
                for i, t in enumerate(order)]
    if [sizes.get(r) for r in records] != expected or f"data/{len(order)}" in sizes:
        os.remove(tmp)
        raise ToolError("torch.save laid out the storages in an unexpected order; cannot stream the export "
                        "(values holding tensors in unusual containers?)")
    total = sum(e.nbytes for e in entries)
    bar = Progress(total, "export", enabled=progress)
    fd = os.open(tmp, os.O_WRONLY)
    try:
        for i, e in enumerate(entries):
            pos = reader.get_record_offset(records[i])
            for block in read_blocks(st, md, e.fqn, e.tm, num_threads):
                t, data = _cast_bytes(block, e.dtype)
                while len(data):
                    k = os.pwrite(fd, data, pos)
                    data, pos = data[k:], pos + k
                bar.update(t.numel() * t.element_size())
        for i in range(len(entries), len(order)):  # small tensors inside values
            t = order[i]
            raw = bytes(t.untyped_storage())
            os.pwrite(fd, raw, reader.get_record_offset(records[i]))
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, out_path)
    bar.close()
    return {"out": out_path, "files": [out_path], "tensors": len(entries), "bytes": total}


# ----------------------------------------------------------------------------- import

def _flatten(prefix: str, v: Any, out: dict) -> None:
    if isinstance(v, dict) and all(isinstance(k, str) for k in v):
        for k, x in v.items():
            _flatten(f"{prefix}.{k}" if prefix else k, x, out)
    else:
        out[prefix] = v


def _mmap_safetensors(path: str) -> dict[str, torch.Tensor]:
    """Tensors of a safetensors file as views of a private memory map: nothing is read until saved."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        if n > min(size - 8, 100 << 20):
            raise ToolError(f"{path}: not a safetensors file (header length {n})")
        header = json.loads(f.read(n))
    storage = torch.UntypedStorage.from_file(path, shared=False, nbytes=size)
    flat = torch.empty(0, dtype=torch.uint8).set_(storage)
    base = 8 + n
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dt = _SAFETENSORS_CODE_TO_DTYPE.get(info["dtype"])
        if dt is None:
            raise ToolError(f"{path}: tensor {name!r} has dtype {info['dtype']} that bcp cannot import")
        lo, hi = info["data_offsets"]
        shape = tuple(info["shape"])
        if hi - lo != math.prod(shape) * element_size(dt) or base + hi > size:
            raise ToolError(f"{path}: tensor {name!r} has inconsistent offsets {lo}..{hi}")
        out[name] = flat[base + lo: base + hi].view(dt).view(shape)
    return out


def _hf_files(src: str) -> list[str]:
    if os.path.isfile(src):
        return [src]
    index = os.path.join(src, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
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
    names = _rename_map(flat, parse_rules(rename))
    state = {names[k]: v for k, v in flat.items()}
    tensors = sum(1 for v in state.values() if isinstance(v, torch.Tensor))
    total = sum(v.numel() * v.element_size() for v in state.values() if isinstance(v, torch.Tensor))
    root = {prefix: state} if prefix else state
    api.save(out, root, framework="plain", allow_pickle=allow_pickle,
             user_metadata={"imported_from": {"format": source, "path": os.path.abspath(src)}}).wait()
    return {"out": str(out), "tensors": tensors, "values": len(state) - tensors, "bytes": total}


# ----------------------------------------------------------------------------- ls / latest / prune

def list_checkpoints(root: str) -> list[dict]:
    """step_* checkpoints under root, oldest first, each complete or not, the tracker's marked latest."""
    st = storage_for(root)
    tracker = st.read_bytes(TRACKER_FILE).decode(errors="replace").strip() if st.exists(TRACKER_FILE) else None
    out = []
    for name in st.listdir():
        m = _STEP_RE.match(name)
        if not m:
            continue
        out.append({"name": name, "step": int(m.group(1)), "path": st.join(name),
                    "complete": METADATA_FILE in st.listdir(name), "tracker": name == tracker})
    out.sort(key=lambda c: c["step"])
    if not out and st.exists(METADATA_FILE):  # root is itself one checkpoint
        out.append({"name": "", "step": None, "path": st.root, "complete": True, "tracker": False})
    latest = latest_checkpoint_name(out, tracker)
    for c in out:
        c["latest"] = c["name"] == latest and c["complete"]
    return out


def latest_checkpoint_name(ckpts: list[dict], tracker: str | None) -> str | None:
    complete = [c for c in ckpts if c["complete"]]
    if tracker and any(c["name"] == tracker for c in complete):
        return tracker
    return complete[-1]["name"] if complete else None


def latest_checkpoint(root: str) -> str:
    """Path of the checkpoint `load(root)` would use (raises if there is no complete one)."""
    return api.resolve(root).root


def prune_checkpoints(root: str, keep_last: int, keep_every: int | None = None, dry_run: bool = False) -> dict:
    """Delete complete checkpoints except the newest `keep_last`, every step divisible by `keep_every`,
    and the latest one. Incomplete checkpoints older than the latest complete one are deleted (their
    saves ended long ago); newer ones may be saves in progress and are kept."""
    if keep_last < 1:
        raise ToolError("--keep-last must be at least 1")
    st = storage_for(root)
    ckpts = list_checkpoints(root)
    latest = next((c for c in ckpts if c["latest"]), None)
    complete = [c for c in ckpts if c["complete"] and c["name"]]
    keep = {c["name"] for c in complete[-keep_last:]}
    if keep_every:
        keep |= {c["name"] for c in complete if c["step"] % keep_every == 0}
    if latest:
        keep.add(latest["name"])
    remove, kept = [], []
    for c in ckpts:
        if not c["name"]:
            continue
        if c["complete"]:
            (kept if c["name"] in keep else remove).append(c)
        elif latest is not None and c["step"] < latest["step"]:
            remove.append(c)
        else:
            kept.append(c)
    if not dry_run:
        for c in remove:
            # Metadata first: a deletion cut short leaves an incomplete checkpoint, never a corrupt "complete" one.
            if c["complete"]:
                st.remove(f"{c['name']}/{METADATA_FILE}")
            st.remove(c["name"])
    return {"removed": [c["name"] for c in remove], "kept": [c["name"] for c in kept], "dry_run": dry_run}


__all__ = [
    "inspect_checkpoint", "format_inspect", "verify_checkpoint", "export_checkpoint", "import_checkpoint",
    "rename_checkpoint", "list_checkpoints", "latest_checkpoint", "prune_checkpoints", "read_blocks",
    "read_tensor", "Progress", "ToolError",
]
