"""`bcp export`: a checkpoint to a Hugging Face directory or a torch.save file (`bcp import`, the
other way: importing.py).

Export reads tensors in row blocks and writes them as they arrive, so memory does not grow
with the model; its output appears whole or not at all.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import math
import os
import re
from dataclasses import dataclass
from typing import Any

import torch

from .. import codec
from ..engine import SAFETENSORS_DTYPES, ShardReader, read_all
from ..errors import BCPError, ToolError
from ..metadata import (CheckpointMetadata, ObjectValue, TensorMeta, check_file_sizes, dtype_from_name, element_size)
from ..storage import Storage, storage_for
from ..storage.base import parse_temp_name, temp_name, temp_writer_gone
from ..storage.local import LocalStorage, local_path
from ..storage.memory import MemoryStorage
from ..shards import Box
from .read import CHUNK_BYTES, open_checkpoint, progress_bar, read_blocks, read_json, read_whole, row_blocks, sections
from .rename import parse_rules, rename_map

log = logging.getLogger(__name__)

_SAFETENSORS_CODE_TO_DTYPE = {code: dt for dt, code in SAFETENSORS_DTYPES.items()}
DTYPE_ALIASES = {
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
    "half": torch.float16, "fp32": torch.float32, "float32": torch.float32, "float": torch.float32,
    "fp64": torch.float64, "float64": torch.float64,
}


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
                            + ", ".join(sorted(sections(md.keys()))))
    names = rename_map([k.removeprefix("model.") if model_only else k for k in keys], rules)
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
        code = SAFETENSORS_DTYPES.get(e.dtype)
        if code is None:
            raise ToolError(f"tensor {e.fqn!r} has dtype {e.dtype}, which safetensors cannot store; "
                            "export with --to torch or --dtype")
        header[e.name] = {"dtype": code, "shape": list(e.tm.shape), "data_offsets": [pos, pos + e.nbytes]}
        pos += e.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw


def _config_sources(config: str) -> list[tuple[str, str]]:
    """(source file, name in OUT) of each file `--config` copies next to the weights: a config.json, or
    every non-weight file of a directory (config, tokenizer...). Each is checked readable, and the
    config.json a JSON object, before the export writes anything."""
    if os.path.isdir(config):
        names = [n for n in sorted(os.listdir(config)) if os.path.isfile(os.path.join(config, n))
                 and not n.endswith((".safetensors", ".bin", ".pt", ".pth", ".index.json"))]
        sources = [(os.path.join(config, n), n) for n in names]
    elif os.path.isfile(config):
        sources = [(config, "config.json")]
    else:
        raise ToolError(f"--config {config}: no such file or directory")
    for src, name in sources:
        try:
            with open(src, "rb"):
                pass
            if name == "config.json" and not isinstance(read_json(src), dict):
                raise ToolError(f"--config: {src} is not a JSON object (a Hugging Face config.json)")
        except OSError as e:
            raise ToolError(f"--config: cannot read {src}: {e.strerror or e}") from None
        except ToolError:
            raise
        except BCPError as e:
            raise ToolError(f"--config: {src} is not a valid config.json: {e}") from None
    return sources


def _copy_config(sources: list[tuple[str, str]], out: Storage) -> list[str]:
    """Copy the files `_config_sources` named into `out`."""
    for src, name in sources:
        with open(src, "rb") as f:
            out.write_atomic(name, f.read())
    return [n for _, n in sources]


MAPPINGS = ("megatron-to-hf",)  # --mapping: declared mappings an export can apply (docs/mapping.md)


def export_checkpoint(path: str, out: str, to: str = "hf", model_only: bool | None = None,
                      dtype: str | None = None, rename: list[str] | None = None, shard_size: str = "5GB",
                      config: str | None = None, allow_pickle: bool = False, num_threads: int = 4,
                      progress: bool = False, mapping: str | None = None, overwrite: bool = False) -> dict:
    """Merge a checkpoint into a Hugging Face directory or a torch.save file, in bounded memory.

    Tensors are read in row blocks of ~64 MiB (from whichever saved pieces cover them) and
    written out as they arrive, so peak memory does not grow with the model.

    `mapping="megatron-to-hf"` (with `config`: the Hugging Face config.json, or its directory)
    writes a Megatron-core checkpoint as the Hugging Face model the config describes: each block of
    a Hugging Face tensor is read from the source regions the declared mapping names (the rows of
    `linear_qkv` for a block of `q_proj`...), padding dropped, tied weights written once; the experts
    of an MoE model one tensor per expert and projection, and multi-token prediction layers as layers
    L + k, as Hugging Face files hold them (bcp_core.mapping.decoder.megatron_to_hf_files).

    A Hugging Face directory appears whole or not at all: it is written into a temporary directory
    beside `out` and renamed into place once complete. An `out` that exists and is not empty is
    refused unless `overwrite`, which replaces it only once the new export is complete (a local
    directory only); every input (`config` included) is checked before anything is written.
    """
    st, md = open_checkpoint(path)
    rules = parse_rules(rename)
    cast = parse_dtype(dtype)
    if mapping is not None:
        if to != "hf" or rules or model_only:
            raise ToolError("--mapping writes a Hugging Face directory: use it with --to hf, without --rename "
                            "or --model-only")
        mapped, entries = _mapped_entries(st, md, mapping, config, cast)
        return _export_hf(st, md, out, entries, parse_size(shard_size), config, num_threads, progress, overwrite,
                          mapped)
    if to == "hf":
        # A Hugging Face directory holds model weights only.
        if model_only is None:
            model_only = any(k.startswith("model.") for k in md.tensors)
        return _export_hf(st, md, out, _select(md, model_only, rules, cast), parse_size(shard_size), config,
                          num_threads, progress, overwrite)
    if to == "torch":
        return _export_torch(st, md, out, _select(md, bool(model_only), rules, cast), bool(model_only), rules,
                             allow_pickle, num_threads, progress)
    raise ToolError(f"unknown export format {to!r}; use hf or torch")


def _mapped_entries(st: Storage, md: CheckpointMetadata, mapping: str, config: str | None,
                    cast: torch.dtype | None) -> tuple[Any, list[ExportEntry]]:
    """The checkpoint seen through the declared mapping, and the Hugging Face tensors to write."""
    from ..mapping import MappingError
    from ..mapping.decoder import megatron_to_hf_files
    if mapping not in MAPPINGS:
        raise ToolError(f"unknown mapping {mapping!r}; declared: {', '.join(MAPPINGS)}")
    if not config:
        raise ToolError("--mapping needs --config: the Hugging Face config.json (or its directory) of the model")
    cfg_file = os.path.join(config, "config.json") if os.path.isdir(config) else config
    try:
        cfg = read_json(cfg_file)
    except (OSError, BCPError) as e:
        raise ToolError(f"cannot read the model config {cfg_file}: {e}") from None
    if md.framework != "megatron":
        raise ToolError(f"--mapping {mapping}: {st.root} was saved by {md.framework!r}, not by Megatron")
    try:
        m = megatron_to_hf_files(cfg, md.tensors)
        mapped = m.bind(md, st, lambda fqn, tm: check_file_sizes(md, st.size, [(f"tensor {fqn!r}", tm.pieces)],
                                                                 st.root), optimizer=False)
    except MappingError as e:
        raise ToolError(str(e)) from None
    entries = []
    for name in sorted(m.targets):
        if name in m.weights_only:  # tied: from_pretrained ties it to the tensor it shares
            continue
        key = m.target_keys.weight_key(name)
        tm = mapped.metadata.tensors[key]
        out_dtype = cast if cast is not None and tm.dtype.is_floating_point else tm.dtype
        entries.append(ExportEntry(name, key, tm, out_dtype))
    return mapped, entries


def _mapped_blocks(st: Storage, md: CheckpointMetadata, mapped, e: ExportEntry, num_threads: int):
    """A mapped tensor in C order, as dim-0 blocks of ~64 MiB, each read from the source regions
    behind it (and zero where no source covers it)."""
    for offsets, lengths in row_blocks(tuple(e.tm.shape), element_size(e.tm.dtype), CHUNK_BYTES):
        buf = torch.empty(lengths, dtype=e.tm.dtype)
        read_all(st, md.files, md.checksum_block_bytes, mapped.box_read_items(e.fqn, Box(offsets, lengths, buf)),
                 True, num_threads)
        mapped.fill_zeros()
        yield buf


def _local_dir(st: Storage) -> str | None:
    """The OS path of a local (or memory://) storage root; None for an object store."""
    if isinstance(st, MemoryStorage):
        return st.local_root
    if isinstance(st, LocalStorage):
        return os.path.abspath(st.root)
    return None


def _sibling(out: Storage, name: str) -> Storage:
    """A storage of the same kind as `out`, at `name` in the directory that holds `out`."""
    if isinstance(out, MemoryStorage):
        return MemoryStorage("memory://" + "/".join([*out.parts[:-1], name]))
    return LocalStorage(os.path.join(os.path.dirname(os.path.abspath(out.root)), name), fsync=out.fsync)


def _check_out_dir(st: Storage, out: Storage, target: str | None, overwrite: bool) -> None:
    """Refuse, before anything is written, an OUT an export must not write into or replace."""
    if target is None:  # an object store: no directory to rename, so the export writes into OUT itself
        if out.listdir():
            raise ToolError(f"{out.root} is not empty; an export writes a new directory"
                            + ("" if not overwrite else " (--overwrite replaces only a local directory: remove "
                               "this one first)"))
        return
    if os.path.islink(target):
        raise ToolError(f"{out.root} is a symbolic link; give the directory itself as OUT")
    if os.path.lexists(target) and not os.path.isdir(target):
        raise ToolError(f"{out.root} exists and is not a directory")
    if not overwrite:
        if os.path.isdir(target) and os.listdir(target):
            raise ToolError(f"{out.root} is not empty; an export writes a new directory (pass --overwrite to "
                            "replace it once the new one is complete)")
        return
    src = _local_dir(st)
    if src is not None:
        src, t = os.path.realpath(src), os.path.realpath(target)
        if src == t or src.startswith(t.rstrip(os.sep) + os.sep):
            raise ToolError(f"--overwrite: {out.root} holds the checkpoint being exported ({st.root}); "
                            "export elsewhere")


def _remove_stale_stages(out: Storage, target: str) -> None:
    """Remove what exports to `target` killed before their end left beside it (their staging
    directory, or the directory a replacement had renamed aside): those whose process, of this host,
    has ended. Another export's in progress stays."""
    parent, base = os.path.split(target)
    for name in os.listdir(parent or "."):
        temp = parse_temp_name(name)
        if temp is not None and temp.target == base and temp_writer_gone(temp):
            try:
                _sibling(out, name).remove("")
                log.info("removed %s, left by an export that ended before its end", os.path.join(parent, name))
            except (OSError, BCPError) as e:
                log.warning("could not remove %s, left by an export that ended: %s", os.path.join(parent, name), e)


def _move_into_place(stage: Storage, stage_dir: str, out: Storage, target: str, overwrite: bool) -> None:
    """Rename the complete export `stage_dir` to `target`. Without `overwrite` the rename itself refuses a
    directory that is not empty (whatever appeared there meanwhile); with it, an existing `target` is
    renamed aside first (and back if the rename fails), then removed: there is always either the old
    directory or the new one, never a mix."""
    stage.sync_dir()
    parent, base = os.path.split(target)
    aside = None
    if overwrite and os.path.lexists(target):
        aside = os.path.join(parent, temp_name(base))
        os.rename(target, aside)
    try:
        os.rename(stage_dir, target)
    except OSError as e:
        if aside is not None:
            os.rename(aside, target)
        if e.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR):
            raise ToolError(f"{out.root} appeared (not empty) during the export; nothing was replaced") from None
        raise
    out.sync_entry()
    if aside is not None:
        try:
            _sibling(out, os.path.basename(aside)).remove("")
        except (OSError, BCPError) as e:
            log.warning("exported to %s, but the directory it replaced, now %s, could not be removed: %s",
                        out.root, aside, e)


def _export_hf(st, md, out_path, entries, shard_bytes, config, num_threads, progress, overwrite=False,
               mapped=None) -> dict:
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
    # Every input is checked before anything is written.
    headers = [_safetensors_header(shard) for shard in shards]  # dtypes safetensors cannot store
    sources = _config_sources(config) if config else []
    out = storage_for(out_path)
    target = _local_dir(out)
    _check_out_dir(st, out, target, overwrite)
    if target is None:
        stage, stage_dir = out, None
    else:  # written beside OUT, renamed into place once complete
        _remove_stale_stages(out, target)
        stage = _sibling(out, temp_name(os.path.basename(target)))
        stage_dir = _local_dir(stage)
    written: list[str] = []
    try:
        stage.makedirs()
        # The config first and the index last: on an object store, whatever marks the directory
        # as a model (model.safetensors, the index) is written after everything it needs.
        written += _copy_config(sources, stage)
        total = sum(e.nbytes for e in entries)
        bar = progress_bar(total, "export", enabled=progress)
        for name, shard, header in zip(names, shards, headers):
            writer = stage.open_writer(name)
            try:
                writer.write(memoryview(header))
                for e in shard:
                    blocks = _mapped_blocks(st, md, mapped, e, num_threads) if mapped is not None else \
                        read_blocks(st, md, e.fqn, e.tm, num_threads)
                    for block in blocks:
                        t, data = _cast_bytes(block, e.dtype)
                        writer.write(data)
                        bar.update(len(data))
                        del t, block
                writer.close()
            except BaseException:
                writer.abort()
                raise
            written.append(name)
        bar.close()
        if n > 1:
            index = {"metadata": {"total_size": total, "format": "bcp-export"},
                     "weight_map": {e.name: name for name, shard in zip(names, shards) for e in shard}}
            stage.write_atomic("model.safetensors.index.json", json.dumps(index, indent=2).encode())
            written.append("model.safetensors.index.json")
        if stage_dir is not None:
            _move_into_place(stage, stage_dir, out, target, overwrite)
    except BaseException:
        with contextlib.suppress(Exception):
            if stage_dir is not None:
                stage.remove("")
            else:
                for name in written:
                    stage.remove(name)
        raise
    files = [x for x in names + ["model.safetensors.index.json"] if x in written] + [n for _, n in sources]
    return {"out": out.root, "files": files, "tensors": len(entries), "bytes": total}


def _export_torch(st, md, out_path, entries, model_only, rules, allow_pickle, num_threads, progress) -> dict:
    """A torch.save file written without holding the model: torch.save writes the file with placeholder
    storages (torch.serialization.skip_data), then the tensor bytes are streamed into their records.
    Its temporary file is removed if anything fails."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    if "://" in str(out_path) and not str(out_path).startswith("file://"):
        raise ToolError("--to torch writes a local file; give a local OUT path")
    out_path = local_path(str(out_path))
    with FakeTensorMode():
        fakes = {e.name: torch.empty(e.tm.shape, dtype=e.dtype) for e in entries}
    state: dict[str, Any] = dict(fakes)
    if not model_only:
        values = {k: codec.decode(o.encoded, k, allow_pickle) for k, o in md.objects.items()}
        for k, pr in md.per_rank.items():  # values that differ per rank: rank 0's
            v = pr.variant_for(0)
            values[k] = codec.decode(v.encoded, k, allow_pickle) if isinstance(v, ObjectValue) \
                else read_whole(st, md, k, v, num_threads)
        for k in md.sharded_objects:  # every saved shard, keyed by its grid index
            reader = ShardReader(st, md, k, allow_pickle, True)
            values[k] = {",".join(map(str, i)): reader[i] for i in reader.indices}
        for k, v in rename_map(values, rules).items():
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
    tmp = os.path.join(os.path.dirname(os.path.abspath(out_path)), temp_name(os.path.basename(out_path)))
    try:
        total = _write_torch(st, md, tmp, out_path, state, entries, order, num_threads, progress)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
    return {"out": out_path, "files": [out_path], "tensors": len(entries), "bytes": total}


def _write_torch(st, md, tmp, out_path, state, entries, order, num_threads, progress) -> int:
    """torch.save `state` to `tmp` with placeholder storages, stream the tensor bytes into their records
    and rename it to `out_path` (the caller removes `tmp` if this fails)."""
    import zipfile

    with torch.serialization.skip_data(materialize_fake_tensors=True):
        torch.save(state, tmp)
    reader = torch._C.PyTorchFileReader(tmp)
    with zipfile.ZipFile(tmp) as z:
        sizes = {i.filename.split("/", 1)[1]: i.file_size for i in z.infolist() if "/" in i.filename}
    records = [f"data/{i}" for i in range(len(order))]
    expected = [t.untyped_storage().nbytes() if i >= len(entries) else entries[i].nbytes
                for i, t in enumerate(order)]
    if [sizes.get(r) for r in records] != expected or f"data/{len(order)}" in sizes:
        raise ToolError("torch.save laid out the storages in an unexpected order; cannot stream the export "
                        "(values holding tensors in unusual containers?)")
    total = sum(e.nbytes for e in entries)
    bar = progress_bar(total, "export", enabled=progress)
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
    return total
