"""`bcp report` on a real 4-rank checkpoint in which rank 2 writes slowly: the straggler is named."""

from __future__ import annotations

import os
import time

import pytest
import torch

from bcp_core.tools import cli, report
from dist import run_ranks

SLOW_RANK, DELAY_S = 2, 0.5


def _save_with_straggler(rank, world_size, root):
    import bcp_core as bcp
    from bcp_core import storage
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    if rank == SLOW_RANK:  # this rank's storage is slow: each data write takes DELAY_S longer
        real = storage.local._LocalWriter.write

        def slow_write(self, data):
            time.sleep(DELAY_S)
            real(self, data)
        storage.local._LocalWriter.write = slow_write
    mesh = init_device_mesh("cpu", (world_size,))
    full = torch.randn(world_size * 256, 256)
    state = {"model": {"w": distribute_tensor(full, mesh, [Shard(0)]), "b": torch.zeros(256)},
             "extra_state": {"rank": rank}}
    bcp.save(root, state, step=1).wait()
    return rank


def make_checkpoint(root: str) -> str:
    run_ranks(4, _save_with_straggler, root)
    return os.path.join(root, "step_00000001")


def test_report_names_the_straggler(tmp_path, capsys):
    ckpt = make_checkpoint(str(tmp_path / "ckpt"))
    rep = report.build(*report.read_records(tmp_path / "ckpt"))  # a root: its latest checkpoint
    assert rep.op == "save" and rep.ranks == [0, 1, 2, 3]
    assert {"plan", "write", "fsync", "commit"} <= set(rep.phases)
    assert rep.busy[(SLOW_RANK, "write")] >= DELAY_S > max(rep.busy[(r, "write")] for r in (0, 1, 3))
    text = report.summary(rep)
    assert f"slowest rank: {SLOW_RANK} " in text and "mostly in 'write'" in text
    assert "most uneven phase: 'write'" in text

    out = str(tmp_path / "out" / "rep")
    assert cli.main(["report", ckpt, "--out", out]) == 0
    printed = capsys.readouterr().out
    assert f"slowest rank: {SLOW_RANK} " in printed and "rep.png" in printed
    with open(out + ".png", "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    with open(out + ".html") as f:
        page = f.read()
    assert "data:image/png;base64," in page and f"slowest rank: {SLOW_RANK} " in page and "<table>" in page
    # the timeline of another rank; a rank that does not exist is a clear error
    assert cli.main(["report", str(tmp_path / "ckpt" / "step_00000001" / "bcp_metrics.jsonl"),
                     "--out", out + "_r0", "--rank", "0"]) == 0
    assert os.path.getsize(out + "_r0.png") > 1000
    assert cli.main(["report", ckpt, "--out", out, "--rank", "7"]) == 1
    assert "rank 7 has no records" in capsys.readouterr().err
    assert cli.main(["report", ckpt, "--text"]) == 0


def test_report_without_metrics_is_a_clear_error(tmp_path):
    import bcp_core as bcp
    bcp.save(str(tmp_path), {"w": torch.ones(3)}).wait()
    os.remove(tmp_path / "bcp_metrics.jsonl")
    with pytest.raises(bcp.BCPError, match="has no bcp_metrics.jsonl"):
        report.read_records(tmp_path)
