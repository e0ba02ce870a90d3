"""Untrusted checkpoints: loading never runs code unless the caller opts in.

A pickle payload that would create a file is planted in every place a value can live: a
replicated value, a per-rank value, a sharded object's bytes, nested inside a list. Loading
refuses each one, with a message on how to opt in, and the payload never runs.
"""

from __future__ import annotations

import base64
import json
import os
import pickle

import pytest
import torch

import bcp_core as bcp
from bcp_core.metadata import METADATA_FILE
from bcp_core.shards import ObjectShard


class _Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _tagged(marker):
    return {"__pickle__": base64.b64encode(pickle.dumps(_Payload(marker))).decode()}


@pytest.fixture()
def ck(tmp_path):
    path = str(tmp_path / "ck")
    state = {"w": torch.ones(3), "cfg": {"lr": 0.1, "names": ["a", "b"]},
             "loader": {"buf": ObjectShard({"x": 1}, (0,), (1,))}, "extra_state": {"step": 1}}
    bcp.save(path, state).wait()
    return path


def _plant(ck, where, marker):
    mpath = os.path.join(ck, METADATA_FILE)
    raw = json.load(open(mpath))
    if where == "replicated value":
        raw["objects"]["cfg.lr"] = _tagged(marker)
    elif where == "nested in a list":
        raw["objects"]["cfg.names"] = ["a", _tagged(marker)]
    elif where == "per-rank value":
        raw["per_rank"]["extra_state.step"]["variants"][0] = {"object": _tagged(marker)}
    elif where == "sharded object bytes":
        md = bcp.inspect(ck)
        p = md.sharded_objects["loader.buf"].shards[0]
        blob = json.dumps(_tagged(marker)).encode()
        data_path = os.path.join(ck, md.files[p.file])
        with open(data_path, "ab") as f:
            offset = f.tell()
            f.write(blob)
        from bcp_core.engine import checksum
        shard = raw["sharded_objects"]["loader.buf"]["shards"][0]
        shard.update(byte_offset=offset, nbytes=len(blob), checksums=[checksum(blob)])
    json.dump(raw, open(mpath, "w"))


PLACES = ["replicated value", "nested in a list", "per-rank value", "sharded object bytes"]


@pytest.mark.parametrize("where", PLACES)
def test_pickle_payload_is_refused_everywhere(ck, tmp_path, where):
    marker = str(tmp_path / "pwned")
    _plant(ck, where, marker)
    target = {"w": torch.empty(3), "cfg": {}, "loader": {"buf": ObjectShard(None, (0,), (1,))},
              "extra_state": {}}
    with pytest.raises(bcp.PickleNotAllowedError, match="allow_pickle=True"):
        bcp.load(ck, target)
    assert not os.path.exists(marker)
    bcp.inspect(ck)  # reading metadata alone never decodes values
    assert not os.path.exists(marker)


def test_opting_in_runs_it(ck, tmp_path):
    """The opt-in is real (so the refusal above is what protects)."""
    marker = str(tmp_path / "ran")
    _plant(ck, "replicated value", marker)
    bcp.load(ck, {"cfg": {}}, allow_pickle=True, strict=False)
    assert os.path.exists(marker)


def test_numpy_object_arrays_are_refused(ck):
    mpath = os.path.join(ck, METADATA_FILE)
    raw = json.load(open(mpath))
    raw["objects"]["cfg.lr"] = {"__ndarray__": {"dtype": "|O", "shape": [1], "data": ""}}
    json.dump(raw, open(mpath, "w"))
    with pytest.raises(bcp.UnsupportedValueError, match="object arrays could run code"):
        bcp.load(ck, {"cfg": {}})
