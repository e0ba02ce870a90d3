"""Metrics: every save and load records its phases per rank, with bytes; the coordinator writes
all ranks' records beside the metadata; sinks and handles receive them."""

from __future__ import annotations

import json
import logging
import os
import threading

import torch

import bcp_core as bcp
from bcp_core import metrics
from dist import run_ranks


def test_parallel_intervals_count_once_and_stay_bounded():
    rec = metrics.Recorder("save", 0)
    rec.add("write", 10.0, 12.0, 5)
    rec.add("write", 11.0, 13.0, 7)   # overlaps: another thread writing at the same time
    rec.add("write", 20.0, 21.0, 1)
    (r,) = rec.records()
    assert (r["start"], r["end"], r["bytes"], r["count"]) == (10.0, 21.0, 13, 3)
    assert r["busy"] == 4.0 and r["intervals"] == [[10.0, 13.0], [20.0, 21.0]]
    for k in range(200):  # many separate intervals: the timeline keeps at most MAX_INTERVALS
        rec.add("read", 100.0 + k, 100.5 + k, 1)
    read = next(x for x in rec.records() if x["phase"] == "read")
    assert len(read["intervals"]) == metrics.MAX_INTERVALS and read["count"] == 200
    assert read["intervals"][0][0] == 100.0 and read["intervals"][-1][1] == 299.5
    assert "intervals" not in rec.records(intervals=False)[0]


def test_phase_helpers_record_only_under_an_active_recorder():
    with metrics.phase("write", 3):  # no recorder: nothing happens, nothing fails
        pass
    rec = metrics.Recorder("load", 1)

    @metrics.timed("copy", nbytes=lambda result, n: n)
    def work(n):
        with metrics.phase("read", 2 * n):
            return n

    def in_thread(out):
        out.append(work(5))
    rec.run(work, 4)
    out: list = []
    t = threading.Thread(target=metrics.bind(in_thread), args=(out,))  # bind: unbound here, nothing recorded
    t.start(), t.join()
    t = threading.Thread(target=rec.run, args=(metrics.bind(in_thread), out))
    t.start(), t.join()
    got = {r["phase"]: (r["bytes"], r["count"]) for r in rec.records()}
    assert got == {"copy": (9, 2), "read": (18, 2)}


def _save_and_load(rank, world_size, root, sink_file):
    os.environ["BCP_METRICS_FILE"] = sink_file
    seen = []
    metrics.add_sink(seen.append)
    # one tensor sharded by rows: each rank writes its own 16 KiB
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh
    mesh = init_device_mesh("cpu", (world_size,))
    full = torch.arange(world_size * 64 * 64, dtype=torch.float32).reshape(world_size * 64, 64)
    state = {"w": distribute_tensor(full, mesh, [Shard(0)]), "extra_state": {"rank": rank}}
    sync = bcp.save(os.path.join(root, "sync"), state)
    sync.wait()
    handle = bcp.save(os.path.join(root, "async"), state, async_save=True)
    handle.wait()
    target = {"w": distribute_tensor(torch.zeros_like(full), mesh, [Shard(0)]), "extra_state": {"rank": -1}}
    result = bcp.load(os.path.join(root, "async"), target)
    assert torch.equal(target["w"].full_tensor(), full)
    metrics.remove_sink(seen.append)
    del os.environ["BCP_METRICS_FILE"]
    return {"sync": sync.metrics, "async": handle.metrics, "load": result.metrics, "sink": seen}


def _by_phase(records):
    return {r["phase"]: r for r in records}


def test_save_and_load_record_every_phase(tmp_path):
    sink_file = str(tmp_path / "metrics_r{rank}.jsonl")
    results = run_ranks(2, _save_and_load, str(tmp_path), sink_file)
    shard_bytes = 64 * 64 * 4
    for rank, res in enumerate(results):
        sync, asy, load = _by_phase(res["sync"]), _by_phase(res["async"]), _by_phase(res["load"])
        assert {"plan", "serialise", "checksum", "write", "fsync", "commit"} <= set(sync)
        assert "stage" not in sync and asy["stage"]["bytes"] == shard_bytes  # the async copy: its own shard
        # rank r wrote exactly its shard (its per-rank extra state is a JSON value, not a tensor)
        assert sync["write"]["bytes"] == shard_bytes and asy["write"]["bytes"] == shard_bytes
        assert all(r["rank"] == rank and r["op"] == "save" and r["end"] >= r["start"] for r in res["sync"])
        assert {"metadata", "plan", "read", "checksum"} <= set(load)
        assert load["read"]["bytes"] == shard_bytes and load["read"]["op"] == "load"
        # sinks got the three operations, in order, with the same records as the handles
        assert [recs[0]["op"] for recs in res["sink"]] == ["save", "save", "load"]
        with open(sink_file.replace("{rank}", str(rank))) as f:
            assert [json.loads(line)["op"] for line in f].count("load") == len(res["load"])
    # the coordinator wrote every rank's records beside the metadata
    with open(tmp_path / "async" / metrics.METRICS_FILE) as f:
        lines = [json.loads(line) for line in f]
    assert sorted({r["rank"] for r in lines}) == [0, 1]
    for rank in (0, 1):
        phases = {r["phase"] for r in lines if r["rank"] == rank}
        assert {"plan", "stage", "write", "fsync"} <= phases
    assert {r["phase"] for r in lines if r["rank"] == 0} >= {"commit"}
    # optional: the checkpoint is complete and loads without it
    os.remove(tmp_path / "async" / metrics.METRICS_FILE)
    out = {"w": torch.zeros(128, 64)}
    bcp.load(str(tmp_path / "async"), out, strict=False)
    assert torch.equal(out["w"], torch.arange(128 * 64, dtype=torch.float32).reshape(128, 64))


def test_a_metrics_failure_never_fails_the_save(tmp_path, caplog):
    def broken(records):
        raise RuntimeError("logger is down")
    metrics.add_sink(broken)
    # a directory where the metrics file goes: it cannot be written, the checkpoint must still commit
    os.makedirs(tmp_path / metrics.METRICS_FILE / "x")
    try:
        with caplog.at_level(logging.WARNING, logger="bcp"):
            h = bcp.save(str(tmp_path), {"w": torch.ones(8)})
    finally:
        metrics.remove_sink(broken)
    h.wait()
    assert os.path.exists(tmp_path / "bcp_metadata.json") and os.path.isdir(tmp_path / metrics.METRICS_FILE)
    assert "could not write bcp_metrics.jsonl" in caplog.text and "logger is down" in caplog.text
    out = {"w": torch.zeros(8)}
    bcp.load(str(tmp_path), out)
    assert torch.equal(out["w"], torch.ones(8))
