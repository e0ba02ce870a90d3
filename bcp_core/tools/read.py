"""What the tools share: opening a checkpoint, reading a tensor in bounded memory, progress bars.

Reading goes through the same path as `load` (load_planner.box_read_items + engine.read_all,
checksums verified).
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Iterator
from typing import Any

import torch
from tqdm.auto import tqdm

from .. import layout
from ..engine import read_all
from ..load_planner import box_read_items
from ..loader import parse_metadata
from ..metadata import (CheckpointMetadata, TensorMeta, check_file_sizes, element_size, parse_json, read_capped,
                        read_metadata_file)
from ..shards import Box
from ..storage import Storage, storage_for

# Tensors are read in row blocks of about this size: export and verify memory stays near it.
CHUNK_BYTES = 64 << 20


def progress_bar(total: int, desc: str, enabled: bool = True) -> tqdm:
    """A byte-progress bar on stderr (tqdm: TQDM_DISABLE and the other TQDM_* settings, notebooks)."""
    # `disable` is passed only to switch the bar off: passed at all, it would override TQDM_DISABLE.
    off = {} if enabled else {"disable": True}
    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, file=sys.stderr,
                dynamic_ncols=True, mininterval=0.1 if sys.stderr.isatty() else 10.0,  # a log: a line per 10 s
                **off)


def open_checkpoint(path: str) -> tuple[Storage, CheckpointMetadata]:
    """The checkpoint at `path` (a checkpoint directory, or a root: its latest complete one) and its
    metadata, validated (a metadata file over the size cap is refused without being read)."""
    st = layout.resolve(path)
    return st, parse_metadata(st, read_metadata_file(st))


def sections(keys) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for k in sorted(keys):
        out.setdefault(k.split(".", 1)[0], []).append(k)
    return out


def box_str(offsets, lengths) -> str:
    return "[" + ", ".join(f"{o}:{o + n}" for o, n in zip(offsets, lengths)) + "]"


def row_blocks(shape: tuple[int, ...], esize: int, max_bytes: int) -> list[tuple[tuple, tuple]]:
    """Boxes (offsets, lengths) splitting a tensor along dim 0 into blocks of about max_bytes."""
    if len(shape) == 0 or math.prod(shape) == 0:
        return [((0,) * len(shape), tuple(shape))]
    row = math.prod(shape[1:]) * esize
    rows = max(1, max_bytes // max(row, 1))
    return [((a,) + (0,) * (len(shape) - 1), (min(rows, shape[0] - a),) + tuple(shape[1:]))
            for a in range(0, shape[0], rows)]


def read_blocks(st: Storage, md: CheckpointMetadata, fqn: str, tm: TensorMeta, num_threads: int = 4,
                max_bytes: int = CHUNK_BYTES) -> Iterator[torch.Tensor]:
    """The tensor in C order, as consecutive dim-0 blocks, each read from whatever pieces overlap it
    (a block is at least one row: the tensor's files are checked to hold its bytes first)."""
    check_file_sizes(md, st.size, [(f"tensor {fqn!r}", tm.pieces)], st.root)
    for offsets, lengths in row_blocks(tuple(tm.shape), element_size(tm.dtype), max_bytes):
        buf = torch.empty(lengths, dtype=tm.dtype)
        read_all(st, md.files, md.checksum_block_bytes, box_read_items(fqn, tm, Box(offsets, lengths, buf)),
                 True, num_threads)
        yield buf


def read_tensor(st: Storage, md: CheckpointMetadata, fqn: str, num_threads: int = 4) -> torch.Tensor:
    return read_whole(st, md, fqn, md.tensors[fqn], num_threads)


def read_whole(st: Storage, md: CheckpointMetadata, fqn: str, tm: TensorMeta, num_threads: int) -> torch.Tensor:
    """The tensor, in one new tensor: allocated only once its files are known to hold its bytes."""
    check_file_sizes(md, st.size, [(f"tensor {fqn!r}", tm.pieces)], st.root)
    out = torch.empty(tm.shape, dtype=tm.dtype)
    read_all(st, md.files, md.checksum_block_bytes,
             box_read_items(fqn, tm, Box((0,) * len(tm.shape), tuple(tm.shape), out)), True, num_threads)
    return out


def read_json(path: str) -> Any:
    """The JSON document of local file `path` (an HF config or index): read only within the cap of
    every JSON text bcp reads (`read_capped`), parsed by `parse_json`."""
    return parse_json(read_capped(storage_for(os.path.dirname(path) or "."), os.path.basename(path)), path)
