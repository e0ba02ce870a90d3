"""Trust in metadata and in the codec (issue 22, items 4, 5 and the codec part of 13).

Each test reproduces a way a checkpoint's metadata, a value or a message between ranks used to be
taken on trust: pieces that overlap and leave a gap loaded stale values, a tensor claiming far
more bytes than its file holds was allocated, absurd block sizes and shapes were accepted, deep
nesting ended in a raw RecursionError, a multi-GiB "metadata" file was read whole, and malformed
values raised TypeError, ValueError or binascii.Error. Every one now fails with a BCPError naming
what is wrong, before anything is allocated from the claim.
"""

from __future__ import annotations

import base64
import json
import os
import shutil

import pytest
import torch

import bcp_core as bcp
from bcp_core import codec
from bcp_core.metadata import METADATA_FILE, num_blocks
from bcp_core.plan_records import PlanRequest, SaveId, SaveStructure, TensorEntry
from bcp_core.save_planner import global_save_plan
from bcp_core.shards import Box, ObjectShard, ShardedView
from bcp_core.storage import storage_for
from bcp_core.storage.faults import Fault, inject
from bcp_core.tools.verify import verify_checkpoint


def _state():
    t = torch.arange(12, dtype=torch.float32).reshape(4, 3)
    return {"w": ShardedView((4, 3), torch.float32, [Box((0, 0), (2, 3), t[:2]), Box((2, 0), (2, 3), t[2:])]),
            "e": torch.empty(0, 3), "cfg": {"lr": 0.1}, "loader": {"buf": ObjectShard({"x": 1}, (0,), (1,))},
            "extra_state": {"rng": torch.arange(16, dtype=torch.uint8)}}


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("pristine") / "ck")
    bcp.save(path, _state()).wait()
    return path


@pytest.fixture()
def ck(pristine, tmp_path):
    path = str(tmp_path / "ck")
    shutil.copytree(pristine, path)
    return path


def _edit(path, fn):
    mpath = os.path.join(path, METADATA_FILE)
    with open(mpath) as f:
        raw = json.load(f)
    fn(raw)
    with open(mpath, "w") as f:
        json.dump(raw, f)


def _nested(depth: int, leaf=0):
    """`depth` lists, one inside the other, built without recursion."""
    v = leaf
    for _ in range(depth):
        v = [v]
    return v


# ----------------------------------------------------------------------------- exact coverage

def test_pieces_that_overlap_and_leave_a_gap_are_refused_at_load(ck):
    """Rows 1 (twice) and 3 (never) of w: the element count still matches. Before, this loaded,
    leaving the caller's row 3 as it was."""
    _edit(ck, lambda raw: raw["tensors"]["w"]["pieces"][1].__setitem__("offsets", [1, 0]))
    target = {"w": torch.full((4, 3), -1.0)}
    with pytest.raises(bcp.MetadataError, match=r"tensor 'w' piece 0 .* and piece 1 .* overlap"):
        bcp.load(ck, target, strict=False)
    assert torch.equal(target["w"], torch.full((4, 3), -1.0))


def test_a_piece_saved_twice_is_an_overlap_in_metadata(ck):
    _edit(ck, lambda raw: raw["tensors"]["w"]["pieces"].append(raw["tensors"]["w"]["pieces"][0]))
    with pytest.raises(bcp.MetadataError, match=r"piece 0 .* and piece 2 .* overlap"):
        bcp.inspect(ck)


def test_boxes_outside_the_shape_are_refused_when_planning():
    """Rank 1's box ends past the tensor while covering as many elements as the gap it leaves: the
    element count matched, so the planner accepted it before."""
    def structure(offsets, lengths):
        return SaveStructure((TensorEntry("w", "float32", [4], [[offsets, lengths]]).text(),), (), (), ())
    with pytest.raises(bcp.PlanError, match=r"tensor 'w' of shape \(4,\): boxes offsets \[3\] lengths \[2\] "
                                            r"\(ranks \[1\]\) lies outside shape \(4,\)"):
        global_save_plan([structure([0], [2]), structure([3], [2])])
    assert global_save_plan([structure([0], [2]), structure([2], [2]), structure([2], [2])]).bytes_per_rank == (8, 8, 0)


@pytest.mark.parametrize("text", [
    '["w","float32",[4],[[[0],[2.5]]]]',            # not an integer
    '["w","float32",[4],[[[-1],[2]]]]',             # negative
    '["w","float32",[4],[[[[0]],[2]]]]',            # nested too deep
    '["w","float32",[4],[[[0],[4]]],[1]]',          # a fifth field
    '["w",7,[4],[[[0],[4]]]]',                      # dtype not a string
    '["w","float32",[4],[[[0],[4]]]',               # cut short
    '{"w":1}', "", 7])
def test_malformed_tensor_entries_are_refused_when_planning(text):
    """Entries travel as JSON text and only the distinct ones are parsed: every malformed one, alone or
    beside well-formed ones, is a PlanError naming it, never another exception or a wrong plan."""
    good = TensorEntry("v", "float32", [2], [[[0], [2]]]).text()
    for tensors in ((text,), (good, text)):
        with pytest.raises(bcp.PlanError, match="malformed tensor entry"):
            global_save_plan([SaveStructure(tensors, (), (), ()), SaveStructure((good,), (), (), ())])


def test_a_per_rank_tensor_is_one_whole_piece(ck):
    def split(raw):
        tm = raw["per_rank"]["extra_state.rng"]["variants"][0]["tensor"]
        a, b = (dict(tm["pieces"][0]) for _ in range(2))
        a.update(lengths=[8], nbytes=8)
        b.update(offsets=[8], lengths=[8], nbytes=8, byte_offset=a["byte_offset"] + 8)
        tm["pieces"] = [a, b]
    _edit(ck, split)
    with pytest.raises(bcp.MetadataError, match=r"per_rank 'extra_state.rng' variant 0 must be one piece covering "
                                                r"its whole shape \[16\]"):
        bcp.inspect(ck)


# ----------------------------------------------------------------------------- bounded trust

def _huge_tensor(raw):
    """A 4 TiB float32 tensor whose one piece claims bytes its 500-byte data file does not have."""
    nbytes = 4 << 40
    raw["checksum"]["block_bytes"] = 1 << 30  # (within the cap; keeps the checksum list short)
    raw["tensors"]["huge"] = {"dtype": "float32", "shape": [1 << 40], "pieces": [{
        "offsets": [0], "lengths": [1 << 40], "file": 0, "byte_offset": 0, "nbytes": nbytes,
        "checksums": [0] * num_blocks(nbytes, 1 << 30), "rank": 0}]}


def test_a_tensor_larger_than_its_file_is_refused_before_allocation(ck, monkeypatch):
    from bcp_core.metadata import check_file_sizes
    from bcp_core.tools import read_tensor
    from bcp_core.tools.read import open_checkpoint
    _edit(ck, _huge_tensor)
    st, md = open_checkpoint(ck)  # parsing alone allocates nothing from the claim
    file = md.files[0]
    message = rf"data file {file} has \d+ bytes, but the piece of tensor 'huge' at offsets \[0\] .* ends at byte "
    with pytest.raises(bcp.StorageError, match=message + str(4 << 40)):
        check_file_sizes(md, st.size)
    check_file_sizes(md, st.size, [("tensor 'w'", md.tensors["w"].pieces)])  # only the pieces asked for
    real_empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **k: pytest.fail("allocated") if a and a[0] == (1 << 40,)
                        else real_empty(*a, **k))
    with pytest.raises(bcp.StorageError, match=message):
        read_tensor(st, md, "huge")
    rep = verify_checkpoint(ck)
    assert not rep["ok"] and [f["kind"] for f in rep["faults"]] == ["short-file"]
    assert "tensor 'huge'" in rep["faults"][0]["detail"]


def test_load_refuses_a_tensor_larger_than_its_file(ck):
    """The load checks the data files' sizes before it allocates a tensor from the metadata."""
    _edit(ck, _huge_tensor)
    out: dict = {"huge": None}  # a slot the load fills with a tensor it makes from the metadata's shape
    with pytest.raises(bcp.StorageError, match=r"the piece of tensor 'huge' .* ends at byte"):
        bcp.load(ck, out, strict=False)
    assert out == {"huge": None}


EDITS = {
    "block size 2**62": (lambda r: r["checksum"].__setitem__("block_bytes", 1 << 62),
                         r"checksum.block_bytes must be an integer in \[16, 1073741824\]"),
    "shape [2**62, 0]": (lambda r: r["tensors"]["e"].update(shape=[1 << 62, 0]) or r["tensors"]["e"]["pieces"][0]
                         .update(offsets=[0, 0], lengths=[1 << 62, 0]),
                         r"tensor 'e' shape must hold integers in \[0, 281474976710656\], got 4611686018427387904"),
    "zero-size shape whose strides overflow": (
        lambda r: r["tensors"]["e"].update(shape=[1 << 40, 1 << 40, 0]) or r["tensors"]["e"]["pieces"][0]
        .update(offsets=[0, 0, 0], lengths=[1 << 40, 1 << 40, 0]), r"tensor 'e' shape .* has more than \d+ elements"),
    "world size": (lambda r: r.__setitem__("world_size", 1 << 30), r"world_size must be an integer in \[1, 16777216\]"),
    "rank beyond the world": (lambda r: r["tensors"]["w"]["pieces"][1].__setitem__("rank", 1),
                              r"tensor 'w' piece 1 rank must be an integer in \[0, 0\], got 1"),
    "shard rank beyond the world": (lambda r: r["sharded_objects"]["loader.buf"]["shards"][0].__setitem__("rank", 7),
                                    r"sharded object 'loader.buf' shard 0 rank must be an integer in \[0, 0\]"),
    "byte offset beyond any file": (lambda r: r["tensors"]["w"]["pieces"][0].__setitem__("byte_offset", 1 << 60),
                                    r"byte_offset must be an integer in \[0, 72057594037927936\]"),
    "checksum beyond 64 bits": (lambda r: r["tensors"]["w"]["pieces"][0].__setitem__("checksums", [1 << 64]),
                                r"checksums must hold integers in \[0, 18446744073709551615\]"),
    "per-rank ranks for another world": (lambda r: r["per_rank"]["extra_state.rng"].__setitem__("ranks", [0, 0]),
                                         "ranks lists 2 ranks, but the world size is 1"),
    "framework not a string": (lambda r: r.__setitem__("framework", {"a": [1]}), "framework must be a string"),
    "user nested 65 deep": (lambda r: r.__setitem__("user", {"u": _nested(64)}),
                            "user nests lists and dicts deeper than 64 levels"),
    "value nested 65 deep": (lambda r: r["objects"].__setitem__("cfg.lr", _nested(65)),
                             "value 'cfg.lr' nests lists and dicts deeper than 64 levels"),
}


@pytest.mark.parametrize("name", sorted(EDITS))
def test_absurd_claims_are_refused_naming_the_field(ck, name):
    edit, message = EDITS[name]
    _edit(ck, edit)
    with pytest.raises(bcp.MetadataError, match=message):
        bcp.load(ck, {}, strict=False)


def test_json_nested_too_deep_to_parse_is_a_metadata_error(ck):
    mpath = os.path.join(ck, METADATA_FILE)
    text = open(mpath).read()
    with open(mpath, "w") as f:
        f.write(text[:-1] + ', "user2": ' + "[" * 100_000 + "]" * 100_000 + "}")
    with pytest.raises(bcp.MetadataError, match="nested too deeply to parse"):
        bcp.inspect(ck)


_METADATA_READ = Fault("read_bytes", hook=lambda call: pytest.fail(f"{call.path} was read"))


def test_an_oversized_metadata_file_is_refused_without_reading_it(ck):
    from bcp_core.metadata import MAX_METADATA_BYTES, read_metadata_file
    os.truncate(os.path.join(ck, METADATA_FILE), MAX_METADATA_BYTES + 1)  # sparse: takes no disk
    refused = rf"has {MAX_METADATA_BYTES + 1} bytes, more than the {MAX_METADATA_BYTES} bcp reads as metadata"
    with inject(_METADATA_READ):
        with pytest.raises(bcp.MetadataError, match=refused + ".*BCP_MAX_METADATA_BYTES"):
            read_metadata_file(storage_for(ck))
        rep = verify_checkpoint(ck)
    assert [f["kind"] for f in rep["faults"]] == ["metadata"] and "BCP_MAX_METADATA_BYTES" in rep["faults"][0]["detail"]


def test_load_refuses_an_oversized_metadata_file_without_reading_it(ck, monkeypatch):
    """Needs the load driver to read the metadata through bcp_core.metadata.read_metadata_file."""
    monkeypatch.setenv("BCP_MAX_METADATA_BYTES", "100")
    with inject(_METADATA_READ), pytest.raises(bcp.MetadataError, match=r"more than the 100 bcp reads as metadata"):
        bcp.load(ck, {}, strict=False)


def test_the_metadata_cap_follows_the_environment(ck, monkeypatch):
    monkeypatch.setenv("BCP_MAX_METADATA_BYTES", "100")
    with pytest.raises(bcp.MetadataError, match=r"more than the 100 bcp reads as metadata"):
        bcp.CheckpointMetadata.loads(open(os.path.join(ck, METADATA_FILE), "rb").read())
    monkeypatch.setenv("BCP_MAX_METADATA_BYTES", "lots")
    with pytest.raises(bcp.BCPError, match="BCP_MAX_METADATA_BYTES='lots' is not a positive number of bytes"):
        bcp.CheckpointMetadata.loads(b"{}")
    monkeypatch.setenv("BCP_MAX_METADATA_BYTES", str(1 << 20))
    out = {"w": torch.zeros(4, 3)}
    bcp.load(ck, out, strict=False)
    assert torch.equal(out["w"], torch.arange(12, dtype=torch.float32).reshape(4, 3))


# ----------------------------------------------------------------------------- the codec

def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


MALFORMED_VALUES = {
    "bad base64": ({"__bytes__": "not base64!"}, "invalid base64"),
    "non-ASCII base64": ({"__bytes__": "é"}, "invalid base64"),
    "tuple of a number": ({"__tuple__": 5}, "__tuple__ must be a list"),
    "dict of numbers": ({"__dict__": [1, 2]}, r"where a \[key, value\] pair belongs"),
    "unhashable dict key": ({"__dict__": [[{"a": 1}, 2]]}, "cannot be a dict key"),
    "float of a list": ({"__float__": [1]}, '__float__ must be "nan"'),
    "bad device": ({"__device__": "warp-drive:0"}, "invalid device"),
    "device of a number": ({"__device__": 3}, "__device__ must be a str"),
    "tensor shape negative": ({"__tensor__": {"dtype": "float32", "shape": [-1], "data": _b64(b"\0" * 4)}},
                              r"inline tensor shape must hold integers in \[0, "),
    "tensor claims more than its data": ({"__tensor__": {"dtype": "float32", "shape": [1 << 18], "data": ""}},
                                         r"0 characters of base64 data do not hold the 1048576 bytes"),
    "tensor over the inline cap": ({"__tensor__": {"dtype": "float32", "shape": [1 << 40], "data": ""}},
                                   r"inline tensor of shape \[1099511627776\] would take 4398046511104 bytes"),
    "tensor shape [2**62, 0]": ({"__tensor__": {"dtype": "float32", "shape": [1 << 62, 0], "data": ""}},
                                r"inline tensor shape must hold integers"),
    "tensor body a list": ({"__tensor__": [1]}, "__tensor__ must be a dict"),
    "ndarray dtype a number": ({"__ndarray__": {"dtype": 5, "shape": [1], "data": ""}}, "dtype must be a str"),
    "ndarray dtype unknown": ({"__ndarray__": {"dtype": "<q9", "shape": [1], "data": ""}}, "invalid numpy dtype"),
    "ndarray claims more than its data": ({"__ndarray__": {"dtype": "<f8", "shape": [3], "data": _b64(b"\0" * 8)}},
                                          "do not hold the 24 bytes"),
    "nested 65 deep": (_nested(65), "nest deeper than 64 levels"),
    "nested 100000 deep": (_nested(100_000), "nest deeper than 64 levels"),
    "unpicklable pickle": ({"__pickle__": _b64(b"\x80\x04garbage")}, "cannot be unpickled"),
}


@pytest.mark.parametrize("name", sorted(MALFORMED_VALUES))
def test_malformed_values_raise_metadata_errors(name):
    raw, message = MALFORMED_VALUES[name]
    with pytest.raises(bcp.MetadataError, match=message):
        codec.decode(raw, "v", allow_pickle=True)


def test_values_nest_at_most_64_levels_both_ways():
    assert codec.decode(json.loads(json.dumps(codec.encode(_nested(64, "x"))))) == _nested(64, "x")
    with pytest.raises(bcp.UnsupportedValueError, match=r"v\[0\]\[0\].*deeper than 64 levels"):
        codec.encode(_nested(65), "v")
    loop: list = []
    loop.append(loop)
    with pytest.raises(bcp.UnsupportedValueError, match="or contains itself"):
        codec.encode({"a": loop}, "v")
    tuples = 0
    for _ in range(33):
        tuples = (tuples,)
    with pytest.raises(bcp.UnsupportedValueError, match="deeper than 64 levels"):
        codec.encode(tuples, "v")  # a tuple takes two levels of JSON: {"__tuple__": [...]}


def test_records_with_wrong_field_types_raise_metadata_errors():
    good = codec.to_wire(PlanRequest(SaveId(3, 7, "/ck"), "key", None, None))
    assert codec.from_wire(good, PlanRequest) == PlanRequest(SaveId(3, 7, "/ck"), "key", None, None)
    cases = [
        ({**good, "fields": [5, "key", None, None, None, None]}, r"PlanRequest field 'save' must be SaveId, got 5"),
        ({**good, "fields": [{"record": "SaveId", "fields": ["3", 7, "/ck"]}, "key", None, None, None, None]},
         r"SaveId field 'number' must be int, got '3'"),
        ({**good, "fields": [good["fields"][0], "key", None, None, 5, None]},
         r"field 'writable' must be tuple\[tuple\[int, int\], \.\.\.\] \| None"),
        ({**good, "fields": [good["fields"][0], "key", None, {"tensors": []}, None, None]},
         r"field 'structure' must be SaveStructure \| None"),
        ({"record": ["PlanRequest"], "fields": []}, "expected a bcp record"),
        ({"record": "PlanRequest", "fields": "abc"}, "expected 6 fields"),
        ({"record": "WriteReport", "fields": []}, "expected a record of type PlanRequest, got WriteReport"),
    ]
    for raw, message in cases:
        with pytest.raises(bcp.MetadataError, match=message):
            codec.from_wire(raw, PlanRequest)
