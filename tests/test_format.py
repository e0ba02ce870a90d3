"""The on-disk format is what docs/format.md says: JSON metadata, safetensors-framed data files."""

from __future__ import annotations

import json
import math
import os
import threading

import numpy as np
import pytest
import torch
from safetensors import safe_open

import bcp_core as bcp
from bcp_core import codec


def test_metadata_and_data_files_match_the_spec(tmp_path):
    t = {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4), "b": torch.tensor([1, 2], dtype=torch.bfloat16),
         "c": torch.zeros(2, dtype=torch.complex64), "scalar": torch.tensor(5)}
    bcp.save(str(tmp_path), {"t": t, "extra_state": {"i": 1}}, step=3).wait()
    assert (tmp_path / "latest").read_text() == "step_00000003"
    ck = tmp_path / "step_00000003"
    raw = json.loads((ck / "bcp_metadata.json").read_text())
    assert raw["format"] == "bcp" and raw["version"] == bcp.FORMAT_VERSION
    assert raw["checksum"] == {"algorithm": "xxh3_64", "block_bytes": 4 << 20}
    w = raw["tensors"]["t.w"]
    assert w["dtype"] == "float32" and w["shape"] == [3, 4]
    (piece,) = w["pieces"]
    assert piece["offsets"] == [0, 0] and piece["lengths"] == [3, 4] and piece["nbytes"] == 48
    assert raw["per_rank"]["extra_state.i"] == {"ranks": [0], "variants": [{"object": 1}]}
    # safetensors tools open the data file without bcp; unknown dtypes are framed as U8
    path = os.path.join(ck, raw["files"][piece["file"]])
    with safe_open(path, "pt") as f:
        assert torch.equal(f.get_tensor("t.w@0,0"), t["w"])
        assert torch.equal(f.get_tensor("t.b@0"), t["b"])
        assert f.get_tensor("t.c@0").dtype == torch.uint8
        assert f.get_tensor("t.scalar@").shape == ()


def test_large_pieces_start_where_direct_io_takes_them_from_memory(tmp_path):
    """docs/format.md: a data file an asynchronous save writes with direct I/O has its data start
    at a multiple of 4096 and each large host piece at a file offset agreeing with its tensor's
    address (and its staging copy's) modulo 4096, behind zero-byte `__padding_<k>` entries;
    safetensors reads every piece, `bcp verify` passes, and a load gives the tensors back. A
    synchronous save copies through the writer's buffers: no padding."""
    from bcp_core.storage import local_writer
    from bcp_core.tools import cli
    try:
        os.close(os.open(tmp_path / "probe", os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644))
    except (AttributeError, OSError):
        pytest.skip(f"{tmp_path} has no O_DIRECT")
    base = torch.randn(3 << 20)
    # views at element offsets whose addresses differ modulo 4096 (and are not all multiples of 8)
    state = {f"t{i}": base[off:off + (1 << 18) + 1000 * i] for i, off in enumerate((0, 3, 1000, (1 << 20) + 7))}
    state["small"] = torch.arange(10.0)
    bcp.save(str(tmp_path / "ck"), state, async_save=True).wait()
    ck = tmp_path / "ck"
    raw = json.loads((ck / "bcp_metadata.json").read_text())
    for fqn, t in state.items():
        (piece,) = raw["tensors"][fqn]["pieces"]
        if t.numel() * 4 >= 1 << 20:
            assert (piece["byte_offset"] - t.data_ptr()) % local_writer.ALIGN == 0, fqn
    (name,) = raw["files"]
    with open(ck / name, "rb") as f:
        assert (8 + int.from_bytes(f.read(8), "little")) % local_writer.ALIGN == 0
    with safe_open(str(ck / name), "pt") as f:
        pads = [k for k in f.keys() if k.startswith("__padding_")]
        assert pads and all(not f.get_tensor(k).any() for k in pads)
        for fqn, t in state.items():
            assert torch.equal(f.get_tensor(f"{fqn}@0"), t), fqn
    assert cli.main(["verify", str(ck)]) == 0
    out = {k: torch.zeros_like(v) for k, v in state.items()}
    bcp.load(str(ck), out)
    assert all(torch.equal(out[k], state[k]) for k in state)
    # a synchronous save, and a fork snapshot's child (its pages shared with the parent), copy
    # through the writer's buffers: no padding
    bcp.save(str(tmp_path / "sync"), state).wait()
    forked = bcp.save(str(tmp_path / "fork"), state, async_save=True, snapshot="fork", role="fork-layout")
    forked.wait()
    assert any(r["phase"] == "snapshot" for r in forked.metrics)  # it forked (plain tensors: no lazy copy)
    for ck in (tmp_path / "sync", tmp_path / "fork"):
        (name,) = json.loads((ck / "bcp_metadata.json").read_text())["files"]
        with safe_open(str(ck / name), "pt") as f:
            assert not [k for k in f.keys() if k.startswith("__padding_")], ck


def test_staging_copies_sit_at_their_sources_offset_in_a_page():
    """host_buffer: a large host tensor's staging copy starts at the source's address modulo a page
    (a save lays its files out for either, engine.write._arrange), in memory of its own; small ones and
    sources not aligned to their element size get a plain tensor."""
    import mmap

    from bcp_core.host_memory import SAME_PAGE_OFFSET_BYTES, host_buffer
    for off in (0, 1, 17, 1000):
        base = torch.randn(SAME_PAGE_OFFSET_BYTES // 2)
        src = base[off:off + SAME_PAGE_OFFSET_BYTES // 4].view(-1, 16)
        buf = host_buffer(src)
        assert buf.shape == src.shape and buf.dtype == src.dtype and buf.is_contiguous()
        assert (buf.data_ptr() - src.data_ptr()) % mmap.PAGESIZE == 0, off
        buf.copy_(src)
        base.zero_()
        assert buf.count_nonzero() > 0  # not a view of the source
    assert host_buffer(torch.zeros(16)).numel() == 16
    odd = torch.zeros(SAME_PAGE_OFFSET_BYTES + 1, dtype=torch.uint8)[1:].view(torch.uint8)
    assert host_buffer(odd).shape == odd.shape


def test_codec_round_trip():
    value = {"a": (1, 2.5, None), "b": [b"\x00\xff", float("nan"), float("-inf")], 3: "int key",
             "__tag_like__": True, "dt": torch.bfloat16, "dev": torch.device("cpu"),
             "t": torch.arange(4, dtype=torch.int16), "np": np.arange(6, dtype=np.float32).reshape(2, 3),
             "npint": np.int64(7)}
    enc = codec.encode(value)
    json.dumps(enc, allow_nan=False)  # strict JSON
    dec = codec.decode(json.loads(json.dumps(enc)))
    assert dec["a"] == (1, 2.5, None) and dec["b"][0] == b"\x00\xff" and math.isnan(dec["b"][1])
    assert dec["b"][2] == float("-inf") and dec[3] == "int key" and dec["__tag_like__"] is True
    assert dec["dt"] is torch.bfloat16 and dec["dev"] == torch.device("cpu")
    assert torch.equal(dec["t"], value["t"]) and np.array_equal(dec["np"], value["np"]) and dec["npint"] == 7


def test_codec_refuses_object_arrays_and_unknown_tags():
    with pytest.raises(bcp.UnsupportedValueError, match="numpy dtype object refused"):
        codec.decode({"__ndarray__": {"dtype": "|O", "shape": [1], "data": ""}})
    with pytest.raises(bcp.UnsupportedValueError, match="cannot save a value of type builtins.object"):
        codec.encode(object(), "x")


def test_python_and_numpy_rng_state_round_trip(tmp_path):
    import random
    state = {"extra_state": {"py": random.getstate(), "np": np.random.get_state(), "torch": torch.get_rng_state()}}
    bcp.save(str(tmp_path), state).wait()
    out: dict = {"extra_state": {}}
    bcp.load(str(tmp_path), out)
    assert out["extra_state"]["py"] == state["extra_state"]["py"]
    np_saved, np_loaded = state["extra_state"]["np"], out["extra_state"]["np"]
    assert np_loaded[0] == np_saved[0] and np.array_equal(np_loaded[1], np_saved[1])
    assert torch.equal(out["extra_state"]["torch"], state["extra_state"]["torch"])


def test_inspect_reads_no_tensor_bytes(tmp_path):
    bcp.save(str(tmp_path), {"w": torch.ones(1000)}).wait()
    from bcp_core.storage.faults import Fault, inject
    with inject(Fault("read_into", hook=lambda call: pytest.fail(f"tensor bytes read from {call.path}"),
                      path="*/data/*"), Fault("map", hook=lambda call: pytest.fail(f"{call.path} mapped"))):
        md = bcp.inspect(str(tmp_path))
    assert md.tensors["w"].shape == (1000,) and md.tensors["w"].nbytes == 4000


def test_rng_state_helper_round_trips_through_a_checkpoint(tmp_path):
    import random

    from bcp_core.rng import rng_state, set_rng_state
    bcp.save(str(tmp_path), {"extra_state": {"rng": rng_state()}}).wait()
    first = (torch.rand(3), random.random(), np.random.rand())
    out: dict = {"extra_state": {}}
    bcp.load(str(tmp_path), out)
    set_rng_state(out["extra_state"]["rng"])
    again = (torch.rand(3), random.random(), np.random.rand())
    assert torch.equal(first[0], again[0]) and first[1:] == again[1:]


def test_metrics_scalars_for_training_loggers(tmp_path):
    from bcp_core import metrics
    sink = metrics.LatestScalars()
    try:
        bcp.save(str(tmp_path), {"w": torch.ones(1000)}).wait()
        bcp.load(str(tmp_path), {"w": torch.empty(1000)})
        values = sink.pop()
    finally:
        sink.close()
    assert values["bcp/save/write_bytes"] >= 4000 and values["bcp/save/total_s"] > 0
    assert values["bcp/load/read_s"] >= 0 and "bcp/load/total_s" in values
    assert sink.pop() == {}


def test_views_of_one_or_no_element_with_any_strides_round_trip(tmp_path):
    """A tensor of one element or none counts as contiguous whatever its strides, and reshape keeps
    them: saving such views and loading into them (the one-run copy) moves the right bytes and no other."""
    def views(base_f32, base_bf16, base_c64):
        return {"one": base_f32[::2][:1], "none": base_f32[::2][:0],  # shape (1,) / (0,), stride (2,)
                "cell": base_bf16.reshape(1, 4).t()[:1],  # shape (1, 1), strides (1, 4)
                "z": base_c64[::3][1:2]}

    saved = views(torch.arange(8.0), torch.arange(4.0).to(torch.bfloat16), torch.arange(6.0).to(torch.complex64))
    bcp.save(str(tmp_path), saved).wait()
    bases = (torch.full((8,), -1.0), torch.full((4,), -1.0).to(torch.bfloat16), torch.full((6,), -1.0 + 0j))
    before = [b.clone() for b in bases]
    out = views(*bases)
    bcp.load(str(tmp_path), out)
    for k, v in saved.items():
        assert torch.equal(out[k], v), k
    assert torch.equal(bases[0], torch.tensor([0.0, -1, -1, -1, -1, -1, -1, -1]))
    assert torch.equal(bases[1], before[1].index_fill(0, torch.tensor([0]), 0))
    assert torch.equal(bases[2], before[2].index_fill(0, torch.tensor([3]), 3))


@pytest.mark.parametrize("write_bytes,in_place", [(None, False), (1 << 20, False), (3, False), (4096, False),
                                                 (4096, True)])
def test_pieces_are_hashed_per_block_and_written_in_the_parts_the_writer_asks_for(write_bytes, in_place):
    """engine.write._write_hashed: whatever part size the writer asks for (None: the whole piece), every
    byte is written once, in order, in parts of at most that size, and the checksums are those of
    each block of the piece, as docs/format.md defines them (the empty piece: one, of no bytes).
    Given an executor, a chunk the writer takes in place goes whole to `write_in_place`, there."""
    from concurrent.futures import ThreadPoolExecutor

    from bcp_core.engine import checksum
    from bcp_core.engine.write import _write_hashed
    from bcp_core.storage import FileWriter

    beside = ThreadPoolExecutor(1) if in_place else None

    class Writer(FileWriter):
        def __init__(self):
            self.write_bytes, self.parts = write_bytes, []

        def can_write_in_place(self, data):
            return in_place

        def write_in_place(self, data):
            assert threading.current_thread() is not threading.main_thread()
            self.parts.append(bytes(data))

        def write(self, data):
            assert not in_place
            self.parts.append(bytes(data))

        def close(self):
            pass

        def abort(self):
            pass

    rng = np.random.default_rng(0)
    for size, block in [(0, 16), (1, 16), (15, 16), (16, 16), (17, 16), (4097, 1024), ((3 << 20) + 5, 1 << 20)]:
        data = rng.integers(0, 256, size, dtype=np.uint8).tobytes()
        w = Writer()
        sums, _ = _write_hashed(w, (memoryview(data),), block, beside)
        assert b"".join(w.parts) == data, (size, block)
        whole = not write_bytes or in_place
        assert len(w.parts) == (int(size > 0 or in_place) if whole else
                                max(1, math.ceil(size / write_bytes)) if size else 0)
        assert all(len(p) <= (size if whole else write_bytes) for p in w.parts)
        expect = tuple(checksum(data[i:i + block]) for i in range(0, size, block)) or (checksum(b""),)
        assert sums == expect, (size, block)
        # the same piece arriving in chunks (a device tensor through pinned chunks): same bytes, same sums
        cuts = sorted({0, size, *rng.integers(0, size + 1, 3).tolist()})
        w = Writer()
        sums, _ = _write_hashed(w, [memoryview(data)[a:b] for a, b in zip(cuts, cuts[1:])], block, beside)
        assert b"".join(w.parts) == data and sums == expect, (size, block, cuts)


@pytest.mark.parametrize("fused_bytes", [7, 64, 1 << 20])
def test_a_load_verifies_and_copies_a_run_in_one_pass_block_by_block(monkeypatch, fused_bytes):
    """engine.read.copy_verified: the bytes of any box that is one run of its piece (whole piece,
    rows, part of a row, one element) land exactly in a destination that is not the caller's; each
    block is checked once its last part is hashed, so a corrupted block raises ChecksumError naming
    the file and the block's bytes, with the blocks before it copied and none after it; blocks
    another rank verifies (`skip`) are copied unchecked; a box that is not one run is left to the
    two-pass path (False)."""
    from bcp_core.engine import checksum
    from bcp_core.engine import read as read_mod
    from bcp_core.engine.read import copy_from_span, copy_verified
    from bcp_core.errors import ChecksumError
    from bcp_core.metadata import Piece
    from bcp_core.plan_records import ReadItem

    monkeypatch.setattr(read_mod, "FUSED_BYTES", fused_bytes)
    block = 96  # bytes: 24 float32, a row and a half of the piece below
    rows, cols = 10, 16
    data = torch.arange(rows * cols, dtype=torch.float32).reshape(rows, cols) * 1.5 - 7
    raw = data.reshape(-1).view(torch.uint8)
    sums = tuple(checksum(raw[i:i + block].numpy().tobytes()) for i in range(0, raw.numel(), block))
    piece = Piece((0, 0), (rows, cols), 0, 1000, raw.numel(), sums, 0)
    files = ("data/r0_0.safetensors",)

    def item(off, ln):
        return ReadItem("w", piece, off, ln, torch.full(ln, -1.0), fresh=True)

    for off, ln in [((0, 0), (rows, cols)), ((3, 0), (4, cols)), ((9, 0), (1, cols)), ((2, 5), (1, 9)),
                    ((7, 15), (1, 1))]:
        it = item(off, ln)
        assert copy_verified(it, raw, 0, files, block)
        assert torch.equal(it.dest, data[off[0]:off[0] + ln[0], off[1]:off[1] + ln[1]]), (off, ln)
    assert not copy_verified(item((0, 2), (3, 4)), raw, 0, files, block)  # strided: verified, then copied
    it = item((0, 2), (3, 4))
    copy_from_span(it, raw, 0, files, block, verify=True)
    assert torch.equal(it.dest, data[:3, 2:6])

    bad = raw.clone()
    bad[block * 3 + 5] ^= 0x10  # in block 3: rows 4.5 to 6
    it = item((0, 0), (rows, cols))
    with pytest.raises(ChecksumError, match=rf"data/r0_0.safetensors bytes \[{1000 + 3 * block}, {1000 + 4 * block}\)"):
        copy_verified(it, bad, 0, files, block)
    copied = it.dest.reshape(-1).view(torch.uint8)
    assert torch.equal(copied[:3 * block], raw[:3 * block])  # the blocks before: copied
    assert bool((it.dest.reshape(-1)[4 * block // 4:] == -1).all())  # none after the failed block
    it = item((0, 0), (rows, cols))  # that block left to another rank: copied as it is
    assert copy_verified(it, bad, 0, files, block, skip={(files[0], 1000 + 3 * block)})
    assert torch.equal(it.dest.reshape(-1).view(torch.uint8), bad)
    # a span that starts at a later block (piece offset `span_lo`)
    it = item((5, 0), (2, cols))
    lo = 5 * cols * 4 // block * block
    assert copy_verified(it, raw[lo:], lo, files, block)
    assert torch.equal(it.dest, data[5:7])
