"""bcp_core.memcopy: the compiled copy with non-temporal stores is exact at every length and
alignment, refuses what it cannot copy, and a load into tensors large enough to use it is bit-exact
with it and without it (numpy's copy)."""

from __future__ import annotations

import mmap

import numpy as np
import pytest
import torch

import bcp_core as bcp
from bcp_core import memcopy

native = pytest.mark.skipif(memcopy._memcopy is None, reason="bcp_core._memcopy not built (no C compiler)")


@native
def test_every_length_and_alignment_is_copied_exactly():
    """Lengths around the 16-byte head, the 64-byte rounds and the tail; destination and source at
    every offset within a line; the source a read-only map; the bytes around the destination kept."""
    rng = np.random.default_rng(0)
    with mmap.mmap(-1, (1 << 20) + 256) as area:
        area.write(rng.integers(0, 256, len(area), dtype=np.uint8).tobytes())
        src_all = np.frombuffer(memoryview(area).toreadonly(), np.uint8)
        assert not src_all.flags.writeable
        for n in (0, 1, 15, 16, 17, 63, 64, 65, 127, 128, 129, 4095, 4097, (1 << 20) + 37):
            for dst_off in (0, 1, 7, 15, 16, 33):
                src_off = (dst_off * 5 + 3) % 64
                dst_all = np.full(n + 128, 0xAB, np.uint8)
                dst = dst_all[dst_off:dst_off + n]
                memcopy._memcopy.copy(dst, src_all[src_off:src_off + n])
                assert np.array_equal(dst, src_all[src_off:src_off + n]), (n, dst_off, src_off)
                assert (dst_all[:dst_off] == 0xAB).all() and (dst_all[dst_off + n:] == 0xAB).all(), (n, dst_off)
        del src_all


@native
def test_what_cannot_be_copied_is_refused_naming_it():
    with pytest.raises(ValueError, match="destination has 4 bytes, source 5"):
        memcopy._memcopy.copy(bytearray(4), b"12345")
    with pytest.raises(TypeError):
        memcopy._memcopy.copy(b"read-only", b"read-only")
    with pytest.raises((TypeError, BufferError)):
        memcopy._memcopy.copy(np.zeros((4, 4), np.uint8)[:, 0], b"1234")  # not contiguous


@pytest.mark.parametrize("non_temporal", [True, False], ids=["compiled", "numpy"])
def test_a_load_of_large_tensors_is_bit_exact_with_either_copy(tmp_path, monkeypatch, non_temporal):
    """Tensors over memcopy.STREAM_MIN_BYTES (of odd sizes, bf16 and int8 too) and under it, loaded
    in place; `copy` counted to show which path ran."""
    if non_temporal and memcopy._memcopy is None:
        pytest.skip("bcp_core._memcopy not built (no C compiler)")
    monkeypatch.setattr(memcopy, "NON_TEMPORAL", non_temporal)
    calls = []
    if memcopy._memcopy is not None:
        real = memcopy._memcopy.copy
        monkeypatch.setattr(memcopy._memcopy, "copy", lambda d, s: (calls.append(d.nbytes), real(d, s)))
    g = torch.Generator().manual_seed(1)
    state = {"big": torch.randn(1000, 333, generator=g),
             "bf16": torch.randn(1 << 20, generator=g).to(torch.bfloat16),
             "int8": torch.randint(-128, 127, ((1 << 20) + 13,), dtype=torch.int8, generator=g),
             "small": torch.randn(77, generator=g)}
    bcp.save(str(tmp_path), state)
    out = {k: torch.zeros_like(v) for k, v in state.items()}
    bcp.load(str(tmp_path), out)
    for k, v in state.items():
        assert torch.equal(out[k].view(torch.uint8), v.view(torch.uint8)), k
    big = sorted(v.nbytes for v in state.values() if v.nbytes >= memcopy.STREAM_MIN_BYTES)
    assert sorted(calls) == (big if non_temporal else []), calls
