"""Property-based tests (hypothesis): piece layouts, and the parsers of untrusted input.

1. Random exact tilings of random shapes (made by splitting boxes recursively) are accepted by the
   planner's coverage check and by the metadata parser; each perturbation (a box shifted, grown,
   dropped, duplicated or moved out of bounds) is refused by both with the right error class and
   reason. Identical boxes from two ranks are replicas to the planner, an overlap in metadata.
   Both the pure-Python and the vectorised check run (the box count that switches is patched).
2. Random bytes, and valid metadata files, values, wire records and plan messages mutated at
   random, give either a valid result or a BCPError: never another exception, each example in
   bounded memory. Hostile files (JSON nested 100,000 deep, sparse files of 64 GiB) end in a
   BCPError naming them, or, for the tracker, in a load that reads only its first bytes.
3. Save plans of random layouts (replicas, partial staging, object shards), made on the
   coordinator alone or gathered over a random tree whose leaders merge the requests, follow the
   planner's rules as a plain reference implementation applies them.

Examples are few and small so the file runs in seconds; no example's time is asserted.
"""

from __future__ import annotations

import dataclasses
import json
import math
import resource
import tracemalloc
import types
import typing
from contextlib import contextmanager
from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import bcp_core as bcp
from bcp_core import codec, shards
from bcp_core.metadata import METADATA_FILE, ObjectValue, check_file_sizes, parse_json
from bcp_core.comm import build_tree
from bcp_core.plan_records import (Assignment, ObjectShardKey, PerRankEntry, PlanReply, PlanRequest, RankValueKey,
                                   SaveId, SaveStructure, ShardEntry, TensorBoxKey, TensorEntry, WriteReport,
                                   WrittenPiece)
from bcp_core.save_planner import (global_save_plan, group_entries, merge_plan_messages, plan_message,
                                   read_plan_messages)
from bcp_core.shards import Box, ObjectShard, ShardedView

pytestmark = pytest.mark.timeout(300)

FAST = settings(max_examples=100, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
FEWER = settings(FAST, max_examples=50)  # examples that each run a whole planning
EXAMPLE_BYTES = 64 << 20   # what one example may allocate (traced by tracemalloc), generously
RUN_RSS_BYTES = 1 << 30  # how much the process's peak memory may grow over a test (torch and
#                          tracemalloc's own bookkeeping included; a claim acted on would be TiBs)


# ----------------------------------------------------------------------------- tilings

Boxes = list[tuple[tuple[int, ...], tuple[int, ...]]]


@st.composite
def tilings(draw) -> tuple[tuple[int, ...], Boxes]:
    """A shape (1 to 3 dims, no empty dim) and boxes that tile it exactly, in random order."""
    shape = tuple(draw(st.lists(st.integers(1, 7), min_size=1, max_size=3)))
    boxes: Boxes = [((0,) * len(shape), shape)]
    for _ in range(draw(st.integers(0, 20))):
        i = draw(st.integers(0, len(boxes) - 1))
        off, ln = boxes[i]
        dims = [d for d in range(len(shape)) if ln[d] > 1]
        if not dims:
            continue
        d = draw(st.sampled_from(dims))
        cut = draw(st.integers(1, ln[d] - 1))
        first = (off, ln[:d] + (cut,) + ln[d + 1:])
        second = (off[:d] + (off[d] + cut,) + off[d + 1:], ln[:d] + (ln[d] - cut,) + ln[d + 1:])
        boxes[i:i + 1] = [first, second]
    return shape, draw(st.permutations(boxes))


# what each perturbation breaks, as the words of the refusal
SHIFT, GROW, DROP, DUPLICATE, OUTSIDE = "shift", "grow", "drop", "duplicate", "outside"
REASON = {SHIFT: "overlap|outside", GROW: "overlap|outside", DROP: "cover", DUPLICATE: "overlap", OUTSIDE: "outside"}
# to the planner a box shifted onto another is a replica of it, which leaves the first one's place empty
PLAN_REASON = {**REASON, SHIFT: "overlap|outside|cover"}


@st.composite
def perturbed(draw) -> tuple[tuple[int, ...], Boxes, str]:
    shape, boxes = draw(tilings())
    how = draw(st.sampled_from(sorted(REASON)))
    i = draw(st.integers(0, len(boxes) - 1))
    off, ln = boxes[i]
    d = draw(st.integers(0, len(shape) - 1))

    def with_dim(t, v):
        return t[:d] + (v,) + t[d + 1:]
    if how == SHIFT:  # stays at or above 0, so the metadata parser's integer check does not answer first
        step = draw(st.sampled_from([s for s in (-2, -1, 1, 2) if off[d] + s >= 0]))
        boxes[i] = (with_dim(off, off[d] + step), ln)
    elif how == GROW:
        boxes[i] = (off, with_dim(ln, ln[d] + draw(st.integers(1, 3))))
    elif how == DROP:
        del boxes[i]
    elif how == DUPLICATE:
        boxes.insert(draw(st.integers(0, len(boxes))), boxes[i])
    else:
        boxes[i] = (with_dim(off, shape[d] - ln[d] + draw(st.integers(1, 3))), ln)
    return shape, boxes, how


@contextmanager
def check_path(data):
    """Run the tiling check through the Python sweep or the vectorised one (in small chunks, too)."""
    numpy_from = data.draw(st.sampled_from([1, 1 << 30]), label="numpy from")
    chunk = data.draw(st.sampled_from([3, 1 << 22]), label="pairs per chunk")
    with mock.patch.object(shards, "_NUMPY_BOXES", numpy_from), mock.patch.object(shards, "_PAIRS_PER_CHUNK", chunk):
        yield


def plan(shape, boxes, ranks: list[int]):
    """The coordinator's global plan for ranks holding `boxes` of tensor t (box i on rank ranks[i])."""
    held: list[list] = [[] for _ in range(max(ranks, default=0) + 1)]
    for (off, ln), r in zip(boxes, ranks):
        held[r].append([list(off), list(ln)])
    return global_save_plan([SaveStructure((TensorEntry("t", "float32", list(shape), b).text(),), (), (), ())
                             for b in held])


def metadata(shape, boxes) -> bytes:
    """A metadata file whose tensor t has these boxes as pieces, each with consistent byte fields."""
    pieces, pos = [], 0
    for off, ln in boxes:
        nbytes = math.prod(ln) * 4
        pieces.append({"offsets": list(off), "lengths": list(ln), "file": 0, "byte_offset": pos, "nbytes": nbytes,
                       "checksums": [0], "rank": 0})
        pos += nbytes
    return json.dumps({"format": "bcp", "version": 1, "world_size": 1, "framework": "plain",
                       "checksum": {"algorithm": "xxh3_64", "block_bytes": 4 << 20}, "files": ["data/f.safetensors"],
                       "tensors": {"t": {"dtype": "float32", "shape": list(shape), "pieces": pieces}},
                       "objects": {}, "per_rank": {}}).encode()


@FAST
@given(tilings(), st.data())
def test_exact_tilings_are_accepted(tiling, data):
    shape, boxes = tiling
    ranks = data.draw(st.lists(st.integers(0, 2), min_size=len(boxes), max_size=len(boxes)), label="ranks")
    with check_path(data):
        gplan = plan(shape, boxes, ranks)
        md = bcp.CheckpointMetadata.loads(metadata(shape, boxes))
    assert sum(len(a.boxes) for a in gplan.assignments) == len(boxes)
    assert sorted((p.offsets, p.lengths) for p in md.tensors["t"].pieces) == sorted(boxes)


@FAST
@given(perturbed(), st.data())
def test_every_perturbation_is_refused(case, data):
    shape, boxes, how = case
    ranks = data.draw(st.lists(st.integers(0, 2), min_size=len(boxes), max_size=len(boxes)), label="ranks")
    with check_path(data):
        if how == DUPLICATE:  # the same box on two ranks is a replica: written once
            assert sum(len(a.boxes) for a in plan(shape, boxes, ranks).assignments) == len(boxes) - 1
        else:
            with pytest.raises(bcp.PlanError, match=PLAN_REASON[how]):
                plan(shape, boxes, ranks)
        with pytest.raises(bcp.MetadataError, match=REASON[how]):
            bcp.CheckpointMetadata.loads(metadata(shape, boxes))


@FAST
@given(st.lists(st.tuples(st.lists(st.integers(0, 12), min_size=2, max_size=2),
                          st.lists(st.integers(0, 4), min_size=2, max_size=2)), min_size=2, max_size=40),
       st.sampled_from([3, 1 << 22]))
def test_the_vectorised_overlap_check_agrees_with_the_sweep(boxes, chunk):
    """Any boxes (empty ones included), in memory chunks of a few pairs or of many."""
    boxes = [(tuple(o), tuple(n)) for o, n in boxes]
    off = np.array([b[0] for b in boxes], dtype=np.int64)
    end = off + np.array([b[1] for b in boxes], dtype=np.int64)
    with mock.patch.object(shards, "_PAIRS_PER_CHUNK", chunk):
        slow, fast = shards._first_overlap(boxes), shards._first_overlap_np(off, end)
    assert (slow is None) == (fast is None)
    for pair in (slow, fast):
        if pair is not None:
            assert shards.intersect(*boxes[pair[0]], *boxes[pair[1]]) is not None


# ----------------------------------------------------------------------------- parsers of untrusted input

@contextmanager
def bounded_memory():
    """Each example under `EXAMPLE_BYTES` of Python and numpy allocations, the process's peak
    (torch's allocations included) up by less than `RUN_RSS_BYTES` over the whole test."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    tracemalloc.start()
    try:
        yield
    finally:
        tracemalloc.stop()
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss < RUN_RSS_BYTES


@contextmanager
def one_example():
    tracemalloc.reset_peak()
    yield
    assert tracemalloc.get_traced_memory()[1] < EXAMPLE_BYTES


def either_valid_or_bcp_error(fn, *args):
    """fn(*args), or None where it raised a BCPError; any other exception fails the test."""
    with one_example():
        try:
            return fn(*args)
        except bcp.BCPError:
            return None


AWKWARD_INTS = st.sampled_from([-1, 0, 1, 2, 15, 16, 2**31, 2**48 + 1, 2**62, 2**63, 2**64, -2**63, 10**30])
WORDS = st.sampled_from(["__tuple__", "__dict__", "__float__", "__bytes__", "__dtype__", "__device__", "__tensor__",
                         "__ndarray__", "__pickle__", "record", "fields", "dtype", "shape", "data", "pieces",
                         "offsets", "lengths", "nbytes", "file", "rank", "float32", "<f4", "|O", "nan", "cpu",
                         "AAAA", "PlanRequest", "SaveId", "WrittenPiece", "..", "/etc/passwd", ""])
JSON = st.recursive(
    st.none() | st.booleans() | AWKWARD_INTS | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
    | WORDS | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(WORDS | st.text(max_size=6), inner, max_size=4),
    max_leaves=12)


def _deep(depth: int):
    v: list = []
    for _ in range(depth):
        v = [v]
    return v


def _paths(doc, path=()):
    """Every place in a JSON document: a path of keys and indices."""
    out, stack = [], [(doc, path)]
    while stack:
        v, p = stack.pop()
        out.append(p)
        if type(v) is dict:
            stack.extend((x, p + (k,)) for k, x in v.items())
        elif type(v) is list:
            stack.extend((x, p + (i,)) for i, x in enumerate(v))
    return out


@st.composite
def mutated(draw, doc):
    """A copy of JSON document `doc` with one to three places replaced, removed, duplicated or
    wrapped, or (as text) with bytes flipped, cut or inserted."""
    if draw(st.integers(0, 3), label="as text (0)") == 0:
        text = bytearray(json.dumps(doc).encode())
        for _ in range(draw(st.integers(1, 3))):
            if not text:
                break
            i = draw(st.integers(0, len(text) - 1))
            how = draw(st.sampled_from(["flip", "cut", "insert"]))
            if how == "flip":
                text[i] ^= 1 << draw(st.integers(0, 7))
            elif how == "cut":
                del text[i:i + draw(st.integers(1, 16))]
            else:
                text[i:i] = draw(st.binary(min_size=1, max_size=8) | st.sampled_from([b"[", b"{", b"9" * 30, b"-"]))
        return bytes(text)
    doc = json.loads(json.dumps(doc))
    for _ in range(draw(st.integers(1, 3))):
        paths = _paths(doc)[1:]  # (a document replaced whole is what the random bytes test tries)
        if not paths:
            break
        path = draw(st.sampled_from(paths), label="path")
        parent = doc
        for k in path[:-1]:
            parent = parent[k]
        key = path[-1]
        how = draw(st.sampled_from(["replace", "replace", "remove", "duplicate", "wrap", "deep"]))
        if how == "replace":
            parent[key] = draw(JSON)
        elif how == "remove":
            del parent[key]
        elif how == "duplicate" and type(parent) is list:
            parent.insert(key, parent[key])
        elif how == "wrap":
            parent[key] = [parent[key]] if draw(st.booleans(), label="in a list") else {draw(WORDS): parent[key]}
        else:
            parent[key] = _deep(draw(st.integers(60, 200)))
    return json.dumps(doc).encode()


def _value_state():
    t = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    return {"w": ShardedView((2, 3), torch.float32, [Box((0, 0), (1, 3), t[:1]), Box((1, 0), (1, 3), t[1:])]),
            "cfg": {"lr": 0.1, "betas": (0.9, 0.99), "name": "x", "flags": [True, None, {3: b"\x00\xff"}],
                    "inf": float("inf"), "dt": torch.bfloat16, "dev": torch.device("cpu"),
                    "small": torch.arange(3, dtype=torch.int16), "np": np.arange(4, dtype=np.int32).reshape(2, 2)},
            "loader": {"buf": ObjectShard({"tokens": [1, 2, 3]}, (0,), (1,))},
            "extra_state": {"rng": torch.arange(8, dtype=torch.uint8), "step": 5}}


@pytest.fixture(scope="module")
def valid_metadata(tmp_path_factory) -> dict:
    path = tmp_path_factory.mktemp("fuzz") / "ck"
    bcp.save(str(path), _value_state()).wait()
    return json.loads((path / METADATA_FILE).read_text())


def _parse_and_use(data: bytes):
    """What a reader does with metadata bytes: parse, check the files' sizes, decode every value."""
    md = bcp.CheckpointMetadata.loads(data)
    check_file_sizes(md, lambda rel: 1 << 20)
    for name, o in md.objects.items():
        codec.decode(o.encoded, name)
    for name, pr in md.per_rank.items():
        for v in pr.variants:
            if isinstance(v, ObjectValue):
                codec.decode(v.encoded, name)
    return md


@FAST
@given(st.binary(max_size=512))
def test_random_bytes_are_refused_as_metadata(data):
    with bounded_memory():
        assert either_valid_or_bcp_error(_parse_and_use, data) is None


def test_mutated_metadata_files_give_metadata_or_bcp_errors(valid_metadata):
    assert isinstance(_parse_and_use(json.dumps(valid_metadata).encode()), bcp.CheckpointMetadata)

    @FAST
    @given(mutated(valid_metadata))
    def run(data):
        either_valid_or_bcp_error(_parse_and_use, data)
    with bounded_memory():
        run()


VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=6) | st.binary(max_size=6)
    | st.sampled_from([torch.float16, torch.device("cpu"), torch.arange(3), np.arange(4.0)]),
    lambda inner: st.lists(inner, max_size=3) | st.tuples(inner, inner)
    | st.dictionaries(st.text(max_size=4) | st.integers(), inner, max_size=3),
    max_leaves=10)


def _decode_bytes(data: bytes):
    return codec.decode(parse_json(data, "value"), "value")


@FAST
@given(VALUES, st.data())
def test_mutated_values_decode_or_give_bcp_errors(value, data):
    encoded = codec.encode(value)
    with bounded_memory():
        either_valid_or_bcp_error(_decode_bytes, json.dumps(encoded).encode())
        either_valid_or_bcp_error(_decode_bytes, data.draw(mutated(encoded)))


SAVE = SaveId(4, 10, "/ckpt/step_10")
RECORDS = [
    (PlanRequest(SAVE, "k", None, SaveStructure(
        (TensorEntry("w", "float32", [4, 2], [[[0, 0], [2, 2]]]).text(),), ("cfg",),
        (PerRankEntry("extra_state.rng", "uint8", (8,)),), (ShardEntry("loader.buf", (2,), (1,)),)), ((0, 0),)),
     PlanRequest),
    (PlanReply(SAVE, Assignment(((0, 0), (1, 2)), (0,)), "tok", "plan1"), PlanReply),
    (WriteReport(SAVE, "k", {"cfg": {"lr": 0.1}}, {"extra_state.rng": ["uint8", [8], "00"]}, ("d1",), {"cfg": "d"},
                 (WrittenPiece(TensorBoxKey("w", (0, 0), (2, 2)), "data/a.safetensors", 128, 16, (1, 2)),
                  WrittenPiece(ObjectShardKey("loader.buf", (1,)), "data/a.safetensors", 144, 9, (3,)),
                  WrittenPiece(RankValueKey("extra_state.rng"), "data/a.safetensors", 160, 8, (4,))),
                 ({"phase": "write"},)), WriteReport),
]


def _conforms(v, hint) -> bool:
    """Whether a decoded record field `v` has its annotated type (items of tuples of scalars included)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is typing.Any:
        return True
    if origin is typing.Union or origin is types.UnionType:
        return any(_conforms(v, a) for a in args)
    if hint in (int, str, bool, type(None)):
        return type(v) is hint
    if hint is dict or origin is dict:
        return type(v) is dict
    if hint is tuple or origin is tuple or (isinstance(hint, type) and issubclass(hint, tuple)):
        item = args[0] if len(args) == 2 and args[1] is Ellipsis else None
        return type(v) is tuple and (item not in (int, str) or all(type(x) is item for x in v))
    return type(v) is hint  # a record


def _record_or_bcp_error(raw, expected=None):
    """from_wire(raw), checked field by field against the annotations; None where it raised a BCPError."""
    rec = either_valid_or_bcp_error(codec.from_wire, raw, expected)
    if rec is not None:
        hints = typing.get_type_hints(type(rec))
        bad = [f.name for f in dataclasses.fields(rec) if not _conforms(getattr(rec, f.name), hints[f.name])]
        assert not bad, f"{type(rec).__name__} decoded with fields {bad} of the wrong type: {rec}"
    return rec


@FAST
@given(st.sampled_from(RECORDS), st.data())
def test_mutated_wire_records_give_records_or_bcp_errors(case, data):
    rec, expected = case
    wire = json.loads(json.dumps(codec.to_wire(rec)))
    with bounded_memory():
        assert type(_record_or_bcp_error(wire, expected)) is type(rec)
        raw = data.draw(mutated(wire))
        _record_or_bcp_error(either_valid_or_bcp_error(parse_json, raw, "message"), expected)


@FEWER
@given(st.data())
def test_mutated_plan_messages_merge_and_read_or_give_bcp_errors(data):
    """A subtree's plan message (save_planner.plan_message) mutated: leaders still merge it (never
    raising), and the coordinator reads the result or raises a BCPError."""
    request = RECORDS[0][0]
    parts = [json.loads(json.dumps(plan_message(request, r))) for r in range(2)]
    assert type(read_plan_messages(merge_plan_messages(parts), 2, SAVE).requests[1]) is PlanRequest
    with bounded_memory():
        i = data.draw(st.integers(0, 1), label="part mutated")
        parts[i] = either_valid_or_bcp_error(parse_json, data.draw(mutated(parts[i])), "message")
        merged = json.loads(json.dumps(merge_plan_messages(parts)))
        either_valid_or_bcp_error(read_plan_messages, merged, 2, SAVE)
        merged = either_valid_or_bcp_error(parse_json, data.draw(mutated(merged)), "message")
        either_valid_or_bcp_error(read_plan_messages, merged, 2, SAVE)


@FAST
@given(st.data())
def test_every_record_class_takes_random_fields_or_gives_bcp_errors(data):
    """Every registered record (of every layer: plans, reports, load messages), its fields random JSON."""
    name = data.draw(st.sampled_from(sorted(codec._RECORDS)), label="record")
    n = len(dataclasses.fields(codec._RECORDS[name]))
    fields = data.draw(st.lists(JSON, min_size=n, max_size=n), label="fields")
    with bounded_memory():
        _record_or_bcp_error({"record": name, "fields": fields})


# ----------------------------------------------------------------------------- hostile files

DEEP = 100_000                  # arrays nested this deep: far past any parser's recursion limit
HUGE = 64 << 30                 # a sparse file this long takes no disk; reading it whole would not fit


def _deep_json(depth: int = DEEP) -> bytes:
    return b"[" * depth + b"]" * depth


def _grow(path, head: bytes = b"") -> None:
    """Make `path` a HUGE sparse file starting with `head`."""
    with open(path, "wb") as f:
        f.write(head)
        f.truncate(HUGE)


@pytest.fixture(scope="module")
def hostile_root(tmp_path_factory) -> str:
    """A root of two steps; each holds a sharded object whose one shard is a string of 2*DEEP + 2
    characters (its JSON exactly as long as a DEEP nesting with a space either side)."""
    root = tmp_path_factory.mktemp("hostile") / "root"
    for step in (1, 2):
        bcp.save(str(root), {"w": torch.full((3,), float(step)),
                             "buf": ObjectShard("x" * 2 * DEEP, (0,), (1,))}, step=step).wait()
    return str(root)


@pytest.fixture
def root(hostile_root, tmp_path) -> str:
    import shutil
    return shutil.copytree(hostile_root, tmp_path / "root")


def _targets():
    return {"w": torch.zeros(3), "buf": ObjectShard(None, (0,), (1,))}


def test_a_deeply_nested_object_piece_is_a_metadata_error_naming_its_file(root):
    """The shard's bytes replaced (checksum updated to match) by arrays nested DEEP levels."""
    import xxhash
    ck = f"{root}/step_00000002"
    md = json.loads(open(f"{ck}/{METADATA_FILE}").read())
    piece = md["sharded_objects"]["buf"]["shards"][0]
    hostile = b" " + _deep_json() + b" "
    assert piece["nbytes"] == len(hostile)
    data_file = f"{ck}/{md['files'][piece['file']]}"
    with open(data_file, "r+b") as f:
        f.seek(piece["byte_offset"])
        f.write(hostile)
    piece["checksums"] = [xxhash.xxh3_64_intdigest(hostile)]
    with open(f"{ck}/{METADATA_FILE}", "w") as f:
        json.dump(md, f)
    state = _targets()
    with pytest.raises(bcp.MetadataError, match=rf"shard \[0\] of 'buf' in {data_file}: JSON nested too deeply"):
        bcp.load(root, state)
    assert state["w"].eq(0).all()  # nothing of the state changed


def test_an_object_piece_over_the_json_cap_is_refused_before_it_is_read(root, monkeypatch):
    monkeypatch.setenv("BCP_MAX_METADATA_BYTES", str(2 * DEEP))  # the metadata fits, the shard does not
    with pytest.raises(bcp.MetadataError, match=r"shard \[0\] of 'buf' in .*\.safetensors has 200002 bytes, "
                                                r"more than the 200000 bcp reads"):
        bcp.load(root, _targets())


@pytest.mark.parametrize("head", [b"step_00000001", b"step_00000001\n", b" step_00000001 garbage"])
def test_a_huge_tracker_is_followed_reading_only_its_first_bytes(root, head):
    """A sparse tracker of HUGE bytes naming step 1 (the older: a scan would take step 2)."""
    from bcp_core.layout import TRACKER_READ_BYTES, list_checkpoints
    from bcp_core.storage.faults import Fault, inject
    _grow(f"{root}/latest", head)
    asked = []
    with inject(Fault("read_into", hook=asked.append)):
        state = {"w": torch.zeros(3)}
        bcp.load(root, state, strict=False)
        assert [e.name for e in list_checkpoints(root) if e.latest] == ["step_00000001"]
    assert state["w"].eq(1).all()
    tracker_reads = [call.nbytes for call in asked if call.path == f"{root}/latest"]
    assert tracker_reads and max(tracker_reads) <= TRACKER_READ_BYTES


def test_a_huge_tracker_naming_nothing_falls_back_to_the_newest_step(root):
    _grow(f"{root}/latest")  # NUL bytes only
    state = {"w": torch.zeros(3)}
    bcp.load(root, state, strict=False)
    assert state["w"].eq(2).all()


@pytest.mark.parametrize("content", ["huge", "deep"])
def test_a_hostile_failure_record_still_says_the_save_failed(root, content):
    """bcp_failed.json of a step without metadata: a load's error says the save failed, the record unreadable."""
    import os
    ck = f"{root}/step_00000002"
    os.remove(f"{ck}/{METADATA_FILE}")
    if content == "huge":
        _grow(f"{ck}/bcp_failed.json", b'{"save": "s", "error": "')
        why = rf"has {HUGE} bytes, more than the \d+ bcp reads"
    else:
        with open(f"{ck}/bcp_failed.json", "wb") as f:
            f.write(_deep_json())
        why = "JSON nested too deeply to parse"
    with pytest.raises(bcp.IncompleteCheckpointError, match=rf"its save failed.*bcp_failed.json unreadable: .*{why}"):
        bcp.load(ck, {})


@pytest.mark.parametrize("content", ["huge", "deep"])
def test_a_hostile_metrics_file_is_a_metadata_error_naming_it(root, content):
    from bcp_core.tools.report import read_records
    ck = f"{root}/step_00000002"
    if content == "huge":
        _grow(f"{ck}/bcp_metrics.jsonl", b"{}\n")
        why = rf"bcp_metrics.jsonl has {HUGE} bytes, more than"
    else:
        with open(f"{ck}/bcp_metrics.jsonl", "ab") as f:
            f.write(_deep_json() + b"\n")
        why = r"bcp_metrics.jsonl line \d+: JSON nested too deeply"
    with pytest.raises(bcp.MetadataError, match=why):
        read_records(ck)


@pytest.mark.parametrize("content", ["huge", "deep"])
def test_a_hostile_hf_index_is_refused_naming_it(tmp_path, content):
    from bcp_core.tools.importing import import_checkpoint
    index = tmp_path / "hf" / "model.safetensors.index.json"
    index.parent.mkdir()
    if content == "huge":
        _grow(index, b'{"weight_map": {')
        why = rf"has {HUGE} bytes, more than"
    else:
        index.write_bytes(_deep_json())
        why = "JSON nested too deeply"
    with pytest.raises(bcp.MetadataError, match=rf"{index}.*{why}"):
        import_checkpoint(str(index.parent), str(tmp_path / "out"), "hf")


def test_a_deeply_nested_plan_entry_or_message_is_a_bcp_error():
    from bcp_core import comm
    deep = '["w","float32",' + "[" * DEEP + "]" * DEEP + ',[4],[[[0],[4]]]]'
    with pytest.raises(bcp.PlanError, match="malformed tensor entry"):
        global_save_plan([SaveStructure((deep,), (), (), ())])
    with pytest.raises(bcp.MetadataError, match="bcp message: JSON nested too deeply"):
        comm._decode(_deep_json())


# ----------------------------------------------------------------------------- plans against the rules

def reference_plan(structures, writable=None):
    """The save plan by its rules, computed the plain way: every distinct box once, in the order the
    ranks first hold them; a box one (writable) holder has is that holder's; the others, largest
    first (ties by fqn, offsets, lengths), go to the holder with the fewest bytes so far (ties: the
    lowest rank); object shards to the holder with the fewest shards (ties: the lowest rank)."""
    world = len(structures)
    holders: dict[tuple, list[tuple[int, int, int]]] = {}
    info: dict[str, tuple] = {}
    for r, structure in enumerate(structures):
        for ti, text in enumerate(structure.tensors):
            fqn, dt, shape, boxes = json.loads(text)
            info.setdefault(fqn, (dt, shape))
            for bi, (offs, lens) in enumerate(boxes):
                holders.setdefault((fqn, tuple(offs), tuple(lens)), []).append((r, ti, bi))
    load, writes, replicated = [0] * world, [[] for _ in range(world)], []
    for key, hs in holders.items():
        hs = [(r, ti, bi) for r, ti, bi in hs if writable is None or writable[r] is None or (ti, bi) in writable[r]]
        if not hs:
            raise bcp.PlanError("none staged it")
        nbytes = math.prod(key[2]) * torch.empty((), dtype=getattr(torch, info[key[0]][0])).element_size()
        if len(hs) == 1:
            load[hs[0][0]] += nbytes
            writes[hs[0][0]].append(hs[0][1:])
        else:
            replicated.append((nbytes, key, hs))
    for nbytes, _, hs in sorted(replicated, key=lambda x: (-x[0], x[1])):
        r, ti, bi = min(hs, key=lambda h: (load[h[0]], h[0]))
        load[r] += nbytes
        writes[r].append((ti, bi))
    shard_holders: dict[tuple, list] = {}
    for r, structure in enumerate(structures):
        for i, shard in enumerate(structure.sharded_objects):
            shard_holders.setdefault((shard.fqn, shard.index), []).append((r, i))
    shards = [[] for _ in range(world)]
    for hs in shard_holders.values():
        r, i = min(hs, key=lambda h: (len(shards[h[0]]), h[0]))
        shards[r].append(i)
    return [Assignment(tuple(w), tuple(s)) for w, s in zip(writes, shards)], load


def tree_gathered(structures, nodes, fan_in):
    """What the coordinator reads of the ranks' plan requests gathered over the tree of `nodes`
    (each leader merging, every message through JSON as on the wire)."""
    tree = build_tree(nodes, fan_in)
    sent: dict[int, bytes] = {}
    for r in reversed(range(len(structures))):  # children have higher ranks than their leader
        own = plan_message(PlanRequest(SAVE, f"k{r}", None, structures[r]), r)
        parts = [own] + [json.loads(sent.pop(c)) for level in tree.children[r] for c in level]
        sent[r] = json.dumps(merge_plan_messages(parts)).encode()
    return read_plan_messages(json.loads(sent[0]), len(structures), SAVE)


@st.composite
def plan_cases(draw):
    """Ranks holding boxes of a few tensors (exact tilings, each box on one or more ranks, an
    optimizer-like twin of each tensor sharded alike), object shards, what each rank staged, and a
    tree (node sizes, fan-in)."""
    world = draw(st.integers(1, 6), label="world")
    held: list[dict[str, list]] = [{} for _ in range(world)]
    fqns = []
    for k in range(draw(st.integers(1, 3), label="tensors")):
        shape, boxes = draw(tilings())
        dt = draw(st.sampled_from(["float32", "bfloat16"]))
        for box in boxes:
            for r in draw(st.sets(st.integers(0, world - 1), min_size=1, max_size=world)):
                for fqn in (f"t{k}", f"opt.t{k}.exp_avg"):
                    held[r].setdefault(fqn, []).append([list(box[0]), list(box[1])])
        fqns += [(f"t{k}", dt, shape), (f"opt.t{k}.exp_avg", "float32", shape)]
    structures = []
    for r in range(world):
        order = draw(st.permutations([f for f in fqns if f[0] in held[r]]))
        shards = [ShardEntry("loader", (world,), (d,))
                  for d in sorted(draw(st.sets(st.integers(0, world - 1), max_size=2)))]
        structures.append(SaveStructure(tuple(TensorEntry(f, dt, list(shape), held[r][f]).text()
                                              for f, dt, shape in order), (), (), tuple(shards)))
    writable = None
    if draw(st.booleans(), label="partly staged"):
        writable = [None if draw(st.booleans()) else
                    {(ti, bi) for ti, text in enumerate(s.tensors) for bi in range(len(json.loads(text)[3]))
                     if draw(st.booleans())} for s in structures]
    nodes = sorted(draw(st.lists(st.integers(0, 3), min_size=world, max_size=world)))
    return structures, writable, nodes, draw(st.integers(1, 3), label="fan-in")


@FEWER
@given(plan_cases())
def test_plans_follow_the_rules_gathered_flat_or_over_a_tree(case):
    structures, writable, nodes, fan_in = case
    try:
        expected = reference_plan(structures, writable)
    except bcp.PlanError:
        expected = None
    gathered = tree_gathered(structures, nodes, fan_in)
    assert gathered.entries == group_entries(structures)
    assert [r.structure.tensors for r in gathered.requests] == [()] * len(structures)
    for plan_it in (lambda: global_save_plan(structures, writable),
                    lambda: global_save_plan([r.structure for r in gathered.requests], writable, gathered.entries)):
        if expected is None:
            with pytest.raises(bcp.PlanError, match="none staged it"):
                plan_it()
        else:
            gplan = plan_it()
            assert (list(gplan.assignments), list(gplan.bytes_per_rank)) == expected
