"""Sharded objects: one value per grid index, written once across ranks, read by index on load."""

from __future__ import annotations

import pytest

import bcp_core as bcp
from bcp_core.shards import ObjectShard
from dist import run_ranks


def _save(rank, world_size, root):
    dp = rank // 2  # 4 ranks = 2 DP ranks x 2 TP ranks holding identical loader shards
    state = {"loader": {"epoch": 3, "buf": ObjectShard({"tokens": list(range(dp * 5)), "dp": dp}, (dp,), (2,))}}
    bcp.save(root, state, step=1).wait()
    return rank


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("sharded_objects"))
    run_ranks(4, _save, path)
    return path


def test_each_index_written_once_and_balanced(root):
    meta = bcp.inspect(root).sharded_objects["loader.buf"]
    assert meta.grid == (2,)
    assert [p.index for p in meta.shards] == [(0,), (1,)]
    assert len({p.rank for p in meta.shards}) == 2  # not both on the coordinator


def test_load_by_index_and_by_reader(root):
    one = {"loader": {"buf": ObjectShard(None, (1,), (2,))}}
    bcp.load(root, one)
    assert one["loader"]["buf"].value == {"tokens": [0, 1, 2, 3, 4], "dp": 1}
    assert one["loader"]["epoch"] == 3

    every = {"loader": {"buf": ObjectShard(None, None)}}
    bcp.load(root, every)
    reader = every["loader"]["buf"].value
    assert every["loader"]["buf"].grid == (2,) and reader.indices == [(0,), (1,)]
    assert reader[(0,)] == {"tokens": [], "dp": 0}
    with pytest.raises(bcp.KeyMismatchError, match=r"no shard at index \(5,\)"):
        reader[(5,)]


def test_ranks_disagreeing_on_a_shard_fail_clearly(tmp_path):
    with pytest.raises(AssertionError, match="hold different values for the same shard"):
        run_ranks(2, _disagree, str(tmp_path))


def _disagree(rank, world_size, root):
    bcp.save(root, {"x": ObjectShard({"rank": rank}, (0,), (1,))}).wait()


def test_index_target_of_another_grid_is_refused(root):
    with pytest.raises(bcp.ShapeMismatchError, match=r"grid is \(2,\).*grid \(3,\)"):
        bcp.load(root, {"loader": {"buf": ObjectShard(None, (1,), (3,))}})


def _differing_values(rank, world_size, root):
    import logging
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("bcp").addHandler(handler)
    bcp.save(root, {"cursor": {"position": rank * 7}, "same": 1}).wait()
    return [r.getMessage() for r in records]


def test_replicated_value_differing_between_ranks_is_reported(tmp_path):
    logs = run_ranks(2, _differing_values, str(tmp_path))
    assert any("cursor.position (ranks [1])" in m for m in logs[0]), logs
    assert not any("same" in m for m in logs[0])
