"""`bcp report` on a real 4-rank checkpoint in which rank 2 writes slowly: the straggler is named."""

from __future__ import annotations

import os
import time

import pytest
import torch

from bcp_core.tools import cli, report
from dist import run_ranks

SLOW_RANK, DELAY_S = 2, 0.5


class _WriteSpan:
    """A rank other than the straggler: from its first data write to the sync of `data/` that ends
    its writes, it takes `span` seconds; it leaves that number in `<spans>/r<rank>`."""

    def __init__(self, spans: str, rank: int):
        self.path, self.start = os.path.join(spans, f"r{rank}"), None

    def write(self, call) -> None:
        if self.start is None:
            self.start = time.monotonic()

    def synced(self, call) -> None:
        if self.start is not None and not os.path.exists(self.path):
            with open(self.path + ".tmp", "w") as f:
                f.write(repr(time.monotonic() - self.start))
            os.replace(self.path + ".tmp", self.path)


class _Straggler:
    """The straggler's storage: its first write of tensor bytes returns only once every other rank
    has written all it writes, and DELAY_S after the longest of their write spans; so its write
    phase is longer than any other rank's by DELAY_S, however fast or slow the ranks run."""

    def __init__(self, spans: str, world_size: int):
        self.others = [os.path.join(spans, f"r{r}") for r in range(world_size) if r != SLOW_RANK]
        self.done = False

    def write(self, call) -> None:
        if self.done or call.nbytes < 4096:  # a file's header: written before the write phase's clock starts
            return
        entered, deadline = time.monotonic(), time.monotonic() + 120
        while not all(os.path.exists(p) for p in self.others):
            assert time.monotonic() < deadline, "the other ranks never finished writing"
            time.sleep(0.01)
        longest = max(float(open(p).read()) for p in self.others)
        time.sleep(max(0.0, entered + longest + DELAY_S - time.monotonic()))
        self.done = True


def _save_with_straggler(rank, world_size, root):
    import bcp_core as bcp
    from bcp_core.storage.faults import Fault, inject
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    spans = root + "_write_spans"
    os.makedirs(spans, exist_ok=True)
    if rank == SLOW_RANK:  # this rank's storage is slow
        inject(Fault("write", hook=_Straggler(spans, world_size).write))
    else:
        span = _WriteSpan(spans, rank)
        inject(Fault("write", hook=span.write), Fault("sync_dir", hook=span.synced, path="*/data"))
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
    assert rep.busy[(SLOW_RANK, "write")] >= DELAY_S + max(rep.busy[(r, "write")] for r in (0, 1, 3))
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
