"""Corruption is detected: flipped bits, truncated or missing data files, edited metadata.

Every corruption below must make `load` raise an error naming the file (and byte range and
tensor for data corruption); none may return wrong values. The counts are asserted so that the
suite visibly covers what it claims.
"""

from __future__ import annotations

import json
import os
import random
import shutil

import pytest
import torch

import bcp_core as bcp
from bcp_core.metadata import METADATA_FILE
from bcp_core.shards import ObjectShard

N_BIT_FLIPS = 40


def _state():
    torch.manual_seed(0)
    return {"model": {"a": torch.randn(300, 70), "b": torch.randn(5000, dtype=torch.float64),
                      "c": torch.randint(0, 100, (9, 9, 9), dtype=torch.int16)},
            "loader": {"buf": ObjectShard({"tokens": list(range(500))}, (0,), (1,))},
            "extra_state": {"rng": torch.get_rng_state(), "step": 3}}


def _target():
    return {"model": {"a": torch.empty(300, 70), "b": torch.empty(5000, dtype=torch.float64),
                      "c": torch.empty(9, 9, 9, dtype=torch.int16)},
            "loader": {"buf": ObjectShard(None, (0,), (1,))}, "extra_state": {}}


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("pristine") / "ck")
    bcp.save(path, _state(), num_threads=2).wait()
    return path


@pytest.fixture()
def ck(pristine, tmp_path):
    path = str(tmp_path / "ck")
    shutil.copytree(pristine, path)
    return path


def _ranges(path):
    """(file, start, end, what) of every saved piece."""
    md = bcp.inspect(path)
    out = []
    for fqn, t in md.tensors.items():
        out += [(md.files[p.file], p.byte_offset, p.byte_offset + p.nbytes, fqn) for p in t.pieces]
    for fqn, pr in md.per_rank.items():
        for v in pr.variants:
            if isinstance(v, bcp.TensorMeta):
                out += [(md.files[p.file], p.byte_offset, p.byte_offset + p.nbytes, fqn) for p in v.pieces]
    for fqn, so in md.sharded_objects.items():
        out += [(md.files[p.file], p.byte_offset, p.byte_offset + p.nbytes, fqn) for p in so.shards]
    return out


def test_every_flipped_bit_is_detected(pristine, tmp_path):
    rng = random.Random(0)
    ranges = _ranges(pristine)
    detected = 0
    for i in range(N_BIT_FLIPS):
        path = str(tmp_path / f"flip{i}")
        shutil.copytree(pristine, path)
        file, lo, hi, what = rng.choice(ranges)
        pos = rng.randrange(lo, hi)
        with open(os.path.join(path, file), "r+b") as f:
            f.seek(pos)
            byte = f.read(1)[0]
            f.seek(pos)
            f.write(bytes([byte ^ (1 << rng.randrange(8))]))
        with pytest.raises(bcp.ChecksumError, match=rf"checksum mismatch in {file} bytes \[\d+, \d+\) of .*{what}"):
            bcp.load(path, _target())
        detected += 1
        shutil.rmtree(path)
    assert detected == N_BIT_FLIPS


def test_truncated_and_missing_data_files_are_detected(ck):
    md = bcp.inspect(ck)
    tried = 0
    for file in md.files:
        full = os.path.join(ck, file)
        data = open(full, "rb").read()
        with open(full, "wb") as f:
            f.write(data[: len(data) // 2])
        with pytest.raises(bcp.StorageError, match=rf"{file}.*(truncated|ends at byte)"):
            bcp.load(ck, _target())
        os.remove(full)
        with pytest.raises(bcp.StorageError, match=rf"{file}"):
            bcp.load(ck, _target())
        with open(full, "wb") as f:
            f.write(data)
        tried += 2
    assert tried == 2 * len(md.files) and tried >= 2


EDITS = {
    "shape grown": (lambda r: r["tensors"]["model.a"].__setitem__("shape", [301, 70]), "cover"),
    "shape huge": (lambda r: r["tensors"]["model.a"].__setitem__("shape", [1 << 40, 1 << 20]), "more than .* elem"),
    "dtype changed": (lambda r: r["tensors"]["model.b"].__setitem__("dtype", "float32"), "nbytes"),
    "dtype unknown": (lambda r: r["tensors"]["model.b"].__setitem__("dtype", "object"), "unknown dtype"),
    "nbytes edited": (lambda r: r["tensors"]["model.a"]["pieces"][0].__setitem__("nbytes", 12), "nbytes"),
    "box outside": (lambda r: r["tensors"]["model.a"]["pieces"][0].__setitem__("offsets", [1, 0]), "outside"),
    "negative offset": (lambda r: r["tensors"]["model.a"]["pieces"][0].__setitem__("byte_offset", -1),
                        r"byte_offset must be an integer in \[0, "),
    "file index": (lambda r: r["tensors"]["model.a"]["pieces"][0].__setitem__("file", 99), "file index 99"),
    "checksums dropped": (lambda r: r["tensors"]["model.a"]["pieces"][0].__setitem__("checksums", []), "checksums"),
    "path escapes": (lambda r: r["files"].__setitem__(0, "../../etc/passwd"), "escapes"),
    "absolute path": (lambda r: r["files"].__setitem__(0, "/etc/passwd"), "escapes"),
    "duplicate file": (lambda r: r["files"].append(r["files"][0]), "twice"),
    "algorithm": (lambda r: r["checksum"].__setitem__("algorithm", "none"), "algorithm"),
    "grid index": (lambda r: r["sharded_objects"]["loader.buf"]["shards"][0].__setitem__("index", [4]), "outside"),
    "per-rank index": (lambda r: r["per_rank"]["extra_state.step"].__setitem__("ranks", [5]), "variants"),
    "not json": (None, "not valid JSON"),
    "key twice": (lambda r: r["objects"].__setitem__("model.a", 1), "stored twice"),
}


@pytest.mark.parametrize("name", sorted(EDITS))
def test_edited_metadata_is_rejected_before_reading(ck, name):
    edit, message = EDITS[name]
    mpath = os.path.join(ck, METADATA_FILE)
    if edit is None:
        with open(mpath, "ab") as f:
            f.write(b"}{")
    else:
        raw = json.load(open(mpath))
        edit(raw)
        json.dump(raw, open(mpath, "w"))
    with pytest.raises(bcp.MetadataError, match=message):
        bcp.load(ck, _target())


def test_pristine_copy_loads(ck):
    out = _target()
    bcp.load(ck, out)
    assert torch.equal(out["model"]["a"], _state()["model"]["a"])
    assert out["loader"]["buf"].value == {"tokens": list(range(500))}
