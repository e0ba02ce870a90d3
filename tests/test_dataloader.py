"""Dataloader state through bcp.save/load: exactly-once delivery of every token across DP changes.

Every token of the test corpus is unique (source, document and position are encoded in its id), so
"nothing lost, nothing repeated" is an exact multiset comparison. The uninterrupted runs are computed
in this process; checkpoints are saved by 4 gloo ranks holding DP ranks with TP-style duplicates, and
resumed by 4 other ranks at other DP degrees and worker counts.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import random
from collections import Counter
from fractions import Fraction

import numpy as np
import pytest
import torch

import bcp_core as bcp
from bcp_core.shards import ObjectShard
from bcp_core.dataloader import (LoaderStateError, OpaqueLoader, PackedTokenLoader, checkpointable,
                                 unit_overlaps)
from dist import run_ranks

SEQ, BATCH, PAD = 8, 2, -1
WEIGHTS = {"web": 3.0, "code": 1.0, "books": 0.5}


def corpus() -> dict[str, list[list[int]]]:
    """Three sources; token id = source * 10**6 + document * 1000 + position, so every token is unique.
    Some documents are longer than a batch, so token buffers carry tokens across checkpoints."""
    rng = random.Random(1234)
    out = {}
    for s, (name, n) in enumerate([("web", 30), ("code", 17), ("books", 9)]):
        out[name] = [[s * 10 ** 6 + d * 1000 + i for i in range(rng.choice([1, 2, 5, 9, 13, 21, 40]))]
                     for d in range(n)]
    return out


ALL_TOKENS = Counter(t for docs in corpus().values() for d in docs for t in d)


def make(dp_rank, dp_size, workers=0, **kw):
    return PackedTokenLoader(corpus(), SEQ, BATCH, dp_rank=dp_rank, dp_size=dp_size, weights=WEIGHTS,
                             num_workers=workers, seed=7, pad_id=PAD, **kw)


def real(batches) -> list[int]:
    return [t for b in batches for t in np.asarray(b).reshape(-1).tolist() if t != PAD]


def drain(loader, n=None) -> list[list[int]]:
    """n batches (or the rest of the epoch) as lists of token ids."""
    out = []
    for batch in loader:
        assert tuple(batch.shape) == (BATCH, SEQ)
        out.append(batch.reshape(-1).tolist())
        if n is not None and len(out) == n:
            break
    return out


def allow_children():
    # run_ranks makes daemonic processes (so they die with the test runner); a real training rank is
    # not daemonic, and multiprocessing refuses children to daemonic processes.
    mp.current_process()._config["daemon"] = False


# scenario -> (saved DP degree, DP rank of each of the 4 saving ranks, read workers, step saved at)
SAVED = {
    "dp2": (2, [0, 0, 1, 1], 0, 5),
    "dp4": (4, [0, 1, 2, 3], 0, 4),
    "dp3": (3, [0, 1, 2, 2], 0, 6),
    "dp2w2": (2, [0, 0, 1, 1], 2, 6),
}
INTERVAL = 3  # the dp2w2 loaders prefetch their state for every 3rd batch

# resume cases: (scenario, new DP degree, new workers, new DP rank of each of the 4 loading ranks or None)
RESUMES = [
    ("dp2", 4, 0, [0, 1, 2, 3]),
    ("dp2", 3, 0, [0, 1, 2, 2]),       # then saved again and resumed at DP 1 (chain)
    ("dp2", 2, 0, [0, 1, 1, 0]),       # TP/PP change only: copies
    ("dp4", 2, 0, [0, 1, None, None]),
    ("dp4", 3, 0, [0, 1, 2, None]),
    ("dp4", 1, 0, [0, None, None, None]),
    ("dp3", 1, 0, [0, None, None, None]),
    ("dp3", 2, 0, [0, 1, None, None]),
    ("dp3", 4, 0, [0, 1, 2, 3]),
    ("dp2w2", 3, 2, [0, 1, 2, None]),
    ("dp2w2", 2, 2, [0, 1, 1, 0]),     # same layout, workers: copies, identical batches
    ("dp2w2", 4, 1, [0, 1, 2, 3]),     # same number of read units, regrouped
    ("dp2w2", 1, 0, [0, None, None, None]),
]
CHAIN_STEPS = 3


def case_id(c):
    return f"{c[0]}->dp{c[1]}w{c[2]}"


# ----------------------------------------------------------------------------- rank functions

def _save_rank(rank, world_size, root):
    allow_children()
    out = {}
    for name, (dp, ranks, workers, step) in SAVED.items():
        kw = {"checkpoint_interval": INTERVAL} if workers else {}
        loader = make(ranks[rank], dp, workers, **kw)
        before = drain(loader, step)
        bcp.save(os.path.join(root, name), {"dataloader": loader, "step": step}).wait()
        out[name] = {"before": before, "stats": dict(loader.stats)}
        loader.close()

    # torchdata's StatefulDataLoader at the same world size, through OpaqueLoader
    from torchdata.stateful_dataloader import StatefulDataLoader
    data = list(range(rank * 100, rank * 100 + 23))
    live = StatefulDataLoader(data, batch_size=3, shuffle=True, generator=torch.Generator().manual_seed(rank))
    it = iter(live)
    for _ in range(3):
        next(it)
    bcp.save(os.path.join(root, "opaque"), {"dataloader": OpaqueLoader(live, rank, world_size)}).wait()
    expected = [b.tolist() for b in it]
    fresh = StatefulDataLoader(data, batch_size=3, shuffle=True, generator=torch.Generator().manual_seed(99))
    bcp.load(os.path.join(root, "opaque"), {"dataloader": checkpointable(fresh, rank, world_size)})
    out["opaque"] = {"expected": expected, "resumed": [b.tolist() for b in fresh]}
    return out


def _resume_rank(rank, world_size, root):
    allow_children()
    out = {}
    for case in RESUMES:
        name, dp, workers, ranks = case
        if ranks[rank] is None:
            continue
        loader = make(ranks[rank], dp, workers)
        bcp.load(os.path.join(root, name), {"dataloader": loader})
        if name == "dp2" and dp == 3:
            # chain: run on at DP 3 a little, save (all 4 ranks: DP rank 2 twice), resume later at DP 1
            out["chain_mid"] = drain(loader, CHAIN_STEPS)
            bcp.save(os.path.join(root, "chain"), {"dataloader": loader}).wait()
        out[case_id(case)] = drain(loader)
        loader.close()
    return out


# ----------------------------------------------------------------------------- fixtures

def reference(dp, workers) -> list[list[list[int]]]:
    """The uninterrupted run: per DP rank, every batch of the epoch."""
    runs = []
    for r in range(dp):
        loader = make(r, dp, workers)
        runs.append(drain(loader))
        loader.close()
    return runs


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("loader"))
    saved = run_ranks(4, _save_rank, root)
    resumed = run_ranks(4, _resume_rank, root)
    refs = {name: reference(dp, workers) for name, (dp, _, workers, _) in SAVED.items()}
    return root, saved, resumed, refs


def one_rank_per_dp_rank(ranks) -> list[int]:
    """The first rank holding each DP rank: TP/PP peers deliver the same tokens, counted once."""
    return [r for r, d in enumerate(ranks) if d is not None and ranks.index(d) == r]


def _assert_same_tokens(got: Counter, want: Counter, what: str):
    lost, repeated = want - got, got - want
    assert not lost and not repeated, (f"{what}: {sum(lost.values())} tokens lost (e.g. {sorted(lost)[:5]}), "
                                       f"{sum(repeated.values())} extra or repeated (e.g. {sorted(repeated)[:5]})")


# ----------------------------------------------------------------------------- tests

def test_runs_are_deterministic_and_cover_the_corpus_once(runs):
    _, saved, _, refs = runs
    for name, (_, ranks, _, step) in SAVED.items():
        _assert_same_tokens(Counter(real(b for rank in refs[name] for b in rank)), ALL_TOKENS, f"{name} epoch")
        for rank, dp_rank in enumerate(ranks):  # batches before the save match the uninterrupted run
            assert saved[rank][name]["before"] == refs[name][dp_rank][:step], (name, rank)


def test_checkpoint_holds_replicated_part_once_and_one_item_per_dp_rank_and_worker(runs):
    root, *_ = runs
    for name, (dp, _, workers, _) in SAVED.items():
        md = bcp.inspect(os.path.join(root, name))
        assert md.objects["dataloader.layout.dp_size"].encoded == dp
        units = {k: v for k, v in md.sharded_objects.items() if k.startswith("dataloader.units.")}
        assert sorted(units) == [f"dataloader.units.{w}" for w in range(max(workers, 1))]
        for meta in units.values():  # TP duplicates were written once
            assert meta.grid == (dp,) and [p.index for p in meta.shards] == [(d,) for d in range(dp)]
    # the token buffers being split and merged are not trivially empty
    for name in SAVED:
        every = {"dataloader": {"units": {"0": ObjectShard(None, None)}}}
        bcp.load(os.path.join(root, name), every, strict=False)
        reader = every["dataloader"]["units"]["0"].value
        assert sum(len(reader[i]["buffer"]) for i in reader.indices) > 0, name


@pytest.mark.parametrize("case", RESUMES, ids=case_id)
def test_resume_delivers_every_remaining_token_exactly_once(runs, case):
    _, saved, resumed, refs = runs
    name, new_dp, _, ranks = case
    old_dp, _, _, step = SAVED[name]
    want = Counter(real(b for rank in refs[name] for b in rank[step:]))
    got_batches = [b for r in one_rank_per_dp_rank(ranks) for b in resumed[r][case_id(case)]]
    if name == "dp2" and new_dp == 3:
        mid = [b for r in range(3) for b in resumed[r]["chain_mid"]]
        got_batches += mid
        # the chain: the DP-3 job saved again after CHAIN_STEPS batches; resume that at DP 1
        chain = make(0, 1)
        bcp.load(os.path.join(runs[0], "chain"), {"dataloader": chain})
        _assert_same_tokens(Counter(real(mid + drain(chain))), want, "dp2->dp3->dp1 chain")
    _assert_same_tokens(Counter(real(got_batches)), want, f"{case_id(case)} after step {step}")
    before = Counter(real(b for r in one_rank_per_dp_rank(SAVED[name][1]) for b in saved[r][name]["before"]))
    _assert_same_tokens(before + Counter(real(got_batches)), ALL_TOKENS, f"{case_id(case)} whole epoch")


def test_ranks_with_the_same_dp_rank_get_copies_and_continue_identically(runs):
    _, _, resumed, refs = runs
    for case in [c for c in RESUMES if c[1] == SAVED[c[0]][0] and c[2] == SAVED[c[0]][2]]:
        name, _, _, ranks = case
        step = SAVED[name][3]
        for r, dp_rank in enumerate(ranks):
            assert resumed[r][case_id(case)] == refs[name][dp_rank][step:], (case_id(case), r)


def test_workers_prefetch_state_for_the_checkpoint_step(runs):
    _, saved, _, _ = runs
    for rank in range(4):  # step 6 is a multiple of the interval: both workers had it ready
        assert saved[rank]["dp2w2"]["stats"]["prefetched"] == 2
        assert saved[rank]["dp2w2"]["stats"]["on_demand"] == 0


def test_prefetched_state_equals_state_collected_on_demand():
    ahead, asked = make(0, 2, 2, checkpoint_interval=4), make(0, 2, 2)
    try:
        for _ in range(2):
            assert drain(ahead, 4) == drain(asked, 4)
            a, b = ahead.state_dict(), asked.state_dict()
            assert ahead.stats["prefetched"] > 0 and asked.stats["on_demand"] > 0
            for w in ("0", "1"):
                ua, ub = a["units"][w].value, b["units"][w].value
                assert ua["docs"] == ub["docs"] and ua["draws"] == ub["draws"]
                assert np.array_equal(ua["buffer"], ub["buffer"])
    finally:
        ahead.close()
        asked.close()


def test_opaque_loader_restores_at_same_dp_and_refuses_to_reshard(runs):
    root, saved, _, _ = runs
    for rank in range(4):
        assert saved[rank]["opaque"]["resumed"] == saved[rank]["opaque"]["expected"]
        assert saved[rank]["opaque"]["expected"]  # something was left to deliver
    from torchdata.stateful_dataloader import StatefulDataLoader
    other = OpaqueLoader(StatefulDataLoader(list(range(10)), batch_size=2), 0, 2)
    with pytest.raises(LoaderStateError, match="saved at data-parallel degree 4 and this job has 2"):
        bcp.load(os.path.join(root, "opaque"), {"dataloader": other})


def test_loader_state_mismatches_fail_clearly(runs):
    root, *_ = runs
    other_sources = PackedTokenLoader({"web": corpus()["web"]}, SEQ, BATCH, seed=7)
    with pytest.raises(LoaderStateError, match="sources must be the same"):
        bcp.load(os.path.join(root, "dp2"), {"dataloader": other_sources})
    other_seed = PackedTokenLoader(corpus(), SEQ, BATCH, seed=8, weights=WEIGHTS)
    with pytest.raises(LoaderStateError, match="seed=7"):
        bcp.load(os.path.join(root, "dp2"), {"dataloader": other_seed})
    with pytest.raises(LoaderStateError, match="format 'bcp.OpaqueLoader/1'"):
        bcp.load(os.path.join(root, "opaque"), {"dataloader": make(0, 4)})


def test_in_memory_state_dict_round_trip_and_reshard_refusal():
    loader = make(1, 2)
    drain(loader, 3)
    sd = loader.state_dict()
    rest = drain(loader)
    again = make(1, 2)
    again.load_state_dict(sd)
    assert drain(again) == rest
    with pytest.raises(LoaderStateError, match="holds DP rank \\(1,\\) only"):
        make(0, 3).load_state_dict(sd)


@pytest.mark.parametrize("workers", [0, 2])
def test_state_as_of_batches_fetched_ahead_delivers_them_again(workers):
    """A framework that fetched k batches ahead (Lightning prefetches one) saves the state before
    them: the restored loader delivers those k batches again, then the rest, nothing else."""
    loader = make(0, 2, workers)
    try:
        seen = drain(loader, 3)
        with pytest.raises(LoaderStateError, match="at most 3 batches back"):
            loader.state_dict(unconsumed=4)
        for k in (1, 3):
            sd = loader.state_dict(unconsumed=k)
            again = make(0, 2, workers)
            again.load_state_dict(sd)
            try:
                assert drain(again, k) == seen[-k:]
            finally:
                again.close()
        rest = drain(loader)
        again = make(0, 2, workers)
        again.load_state_dict(sd)  # as of before the 3 batches: all of them again, then the rest
        try:
            assert drain(again) == seen + rest and rest
        finally:
            again.close()
    finally:
        loader.close()


def test_loader_state_loaded_before_the_loader_exists(tmp_path):
    """What integrations do when the framework builds its loader only after the checkpoint is read
    (Lightning): load into a plain dict, hand the result to the loader later. A reshardable state
    is resharded then; an opaque one is resolved to this DP rank's state, or refused at another DP."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    from bcp_core.dataloader import MappedLoader, loadable_loader_state, saved_loader_state

    loader, plain = make(0, 1), StatefulDataLoader(list(range(10)), batch_size=2)
    drain(loader, 2)
    next(iter(plain))
    path = str(tmp_path / "ckpt")
    bcp.save(path, {"dataloader": saved_loader_state(loader, loader.state_dict()),
                    "dataloader_1": saved_loader_state(plain, plain.state_dict(), 0, 1)}).wait()
    state: dict = {"dataloader": {}, "dataloader_1": {}}
    bcp.load(path, state)
    halves = [make(r, 2) for r in (0, 1)]
    for h in halves:
        MappedLoader(h, lambda b: b).load_state_dict(loadable_loader_state(state["dataloader"], h.dp_rank, 2))
    resumed = Counter(t for h in halves for t in real(drain(h)))
    assert resumed == Counter(real(drain(loader))) and resumed  # split over 2 ranks: the same tokens
    fresh = StatefulDataLoader(list(range(10)), batch_size=2)
    fresh.load_state_dict(loadable_loader_state(state["dataloader_1"], 0, 1))
    assert [b.tolist() for b in fresh] == [[2, 3], [4, 5], [6, 7], [8, 9]]
    with pytest.raises(LoaderStateError, match="saved at data-parallel degree 1 and this job has 2"):
        loadable_loader_state(state["dataloader_1"], 0, 2)


def test_unit_overlaps_partition_the_saved_units():
    for old_n in range(1, 9):
        for new_n in range(1, 9):
            covered = {u: Fraction(0) for u in range(old_n)}
            last = {u: Fraction(0) for u in range(old_n)}
            for j in range(new_n):
                for u, lo, hi in unit_overlaps(j, old_n, new_n):
                    assert lo == last[u] and lo < hi  # contiguous, in order
                    last[u] = hi
                    covered[u] += hi - lo
            assert all(c == 1 for c in covered.values()), (old_n, new_n)


def test_a_resharding_rank_reads_only_the_saved_units_it_overlaps(runs, monkeypatch):
    from bcp_core.engine import ShardReader
    reads = []
    original = ShardReader.__getitem__

    def counting(self, index):
        reads.append((self.fqn, tuple(index)))
        return original(self, index)

    monkeypatch.setattr(ShardReader, "__getitem__", counting)
    bcp.load(os.path.join(runs[0], "dp4"), {"dataloader": make(1, 2)})  # DP 4 -> 2: rank 1 merges 2 and 3
    assert sorted(reads) == [("dataloader.units.0", (2,)), ("dataloader.units.0", (3,))]
    reads.clear()
    bcp.load(os.path.join(runs[0], "dp2w2"), {"dataloader": make(2, 3, 2)})  # 4 units -> 6: last two
    assert sorted(reads) == [("dataloader.units.0", (1,)), ("dataloader.units.1", (1,))]


def test_next_epoch_covers_the_corpus_again_in_another_order():
    loader = make(0, 1)
    first = drain(loader)
    assert loader.epoch == 0
    second = drain(loader)
    assert loader.epoch == 1
    _assert_same_tokens(Counter(real(second)), ALL_TOKENS, "epoch 1")
    assert real(first) != real(second)


# ----------------------------------------------------------------------------- damaged and crafted states

def _saved_with_model(tmp_path, edit_unit=None, edit_rank=None, workers=0):
    """A loader state (edited) saved beside a model; a fresh model and loader to load it into."""
    from torch import nn
    loader = make(0, 1, workers)
    drain(loader, 3)
    sd = loader.state_dict()
    loader.close()
    if edit_unit is not None:
        sd["units"]["0"] = ObjectShard(edit_unit(dict(sd["units"]["0"].value)), (0,), (1,))
    if edit_rank is not None:
        sd["rank"] = ObjectShard(edit_rank(dict(sd["rank"].value)), (0,), (1,))
    path = str(tmp_path / "ck")
    torch.manual_seed(0)
    bcp.save(path, {"model": nn.Linear(4, 4), "dataloader": sd}).wait()
    torch.manual_seed(1)
    return path, nn.Linear(4, 4), make(0, 1, workers)


@pytest.mark.parametrize("damage", ["2-D buffer", "document twice", "document out of range", "rank state"])
def test_a_malformed_unit_fails_the_load_before_anything_changes(tmp_path, damage):
    """Units restored as they were saved (same layout) are checked while the load reads, like split
    and merged ones: before, a malformed unit failed only when the loader adopted it, after the
    model had been loaded, and a document named twice was delivered twice."""
    web = lambda u, ranges: {**u, "docs": {**u["docs"], "web": ranges}}  # noqa: E731
    edits = {
        "2-D buffer": ({"edit_unit": lambda u: {**u, "buffer": np.zeros((2, 2), dtype=np.int32)}}, "1-D integer"),
        "document twice": ({"edit_unit": lambda u: web(u, u["docs"]["web"] + [[5, 9, 1]])}, "more than once"),
        "document out of range": ({"edit_unit": lambda u: web(u, [[0, 31, 1]])}, "beyond its 30 documents"),
        "rank state": ({"edit_rank": lambda r: {**r, "next_worker": "x"}}, "malformed rank state"),
    }
    kw, message = edits[damage]
    path, model, loader = _saved_with_model(tmp_path, **kw)
    before, position = {k: v.clone() for k, v in model.state_dict().items()}, drain(make(0, 1), 2)
    with pytest.raises(LoaderStateError, match=message):
        bcp.load(path, {"model": model, "dataloader": loader})
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    assert drain(loader, 2) == position  # the loader still at its start


@pytest.mark.parametrize("layout, message", [
    ({"units_per_rank": 1}, r"layout \(dp_size=1, units_per_rank=1\) does not match the units saved"),
    ({"dp_size": 0}, r"layout \(dp_size=0, units_per_rank=2\) does not match"),
    ({"dp_size": 3}, r"read unit 0 was saved at indices \[\(0,\)\] of grid \[1\], but the layout says dp_size=3"),
])
def test_a_layout_that_does_not_match_the_saved_units_is_refused(tmp_path, layout, message):
    """The layout (a replicated value) must name exactly the units saved: before, units_per_rank=1
    over two saved workers loaded worker 0's unit alone (worker 1's documents were never delivered),
    dp_size=0 raised an IndexError, and a huge one hung in the loop over saved units."""
    import json

    from bcp_core.metadata import METADATA_FILE
    loader = make(0, 1, 2)
    drain(loader, 2)
    path = str(tmp_path / "ck")
    bcp.save(path, {"dataloader": loader}).wait()
    loader.close()
    with open(os.path.join(path, METADATA_FILE)) as f:
        raw = json.load(f)
    for key, value in layout.items():
        raw["objects"][f"dataloader.layout.{key}"] = value
    with open(os.path.join(path, METADATA_FILE), "w") as f:
        json.dump(raw, f)
    with pytest.raises(LoaderStateError, match=message):
        bcp.load(path, {"dataloader": make(0, 1)})


@pytest.mark.parametrize("workers", [0, 2])
def test_a_state_saved_after_the_last_batch_ends_the_resumed_loop_first(workers):
    """Saved after the epoch's last batch, before the loop's next call ended the epoch: the resumed
    loop ends at once, as the interrupted one would have, and the next epoch is the uninterrupted
    run's next epoch. Before, the resumed loop went straight into the next epoch (one epoch ahead)."""
    loader, reference = make(0, 1, workers), make(0, 1, workers)
    try:
        n = len(drain(reference))
        it = iter(loader)
        for _ in range(n):
            next(it)
        resumed = make(0, 1, workers)
        resumed.load_state_dict(loader.state_dict())
        try:
            assert next(it, None) is None and drain(resumed) == []
            assert drain(resumed) == drain(reference) and resumed.epoch == 1
        finally:
            resumed.close()
    finally:
        loader.close()
        reference.close()


# ----------------------------------------------------------------------------- read workers

class _Unreadable(list):
    """Documents of which one cannot be read."""

    def __getitem__(self, i):
        if i == 3:
            raise IndexError("document 3 is unreadable")
        return list.__getitem__(self, i)


def test_a_failed_read_worker_is_reported_to_a_state_request_at_once():
    """A worker failing while its batch queue is full (the loop trains, then asks for the state):
    the state request raises the worker's error. Before, the error waited behind the full queue and
    the request ran into its timeout, then reported a silent worker."""
    import time
    loader = PackedTokenLoader({"web": _Unreadable([list(range(d * 100, d * 100 + 7)) for d in range(20)])}, 4, 2,
                               num_workers=1, prefetch_factor=1, shuffle=False, timeout=20)
    try:
        next(iter(loader))
        deadline = time.monotonic() + 10
        while loader._pool._error is None and time.monotonic() < deadline:  # the worker reaches document 3
            time.sleep(0.05)
        with pytest.raises(bcp.errors.ReadWorkerError, match="document 3 is unreadable"):
            loader.state_dict()
    finally:
        with pytest.raises(bcp.errors.ReadWorkerError):
            loader.close()


def test_read_workers_outlive_sigterm_so_a_preempted_job_can_save_their_state():
    """SLURM signals every process of a job step at preemption, the read workers too: they keep
    their units' states, which the training process saves. Before, they died and the save failed."""
    import signal
    import time
    loader = make(0, 1, 2)
    try:
        expected = drain(make(0, 1, 2), 4)
        assert drain(loader, 2) == expected[:2]
        for p in loader._pool.procs:
            os.kill(p.pid, signal.SIGTERM)
        time.sleep(0.5)
        sd = loader.state_dict()
        assert drain(loader, 2) == expected[2:]
        again = make(0, 1, 2)
        again.load_state_dict(sd)
        assert drain(again, 2) == expected[2:]
        again.close()
    finally:
        loader.close()


_EXITING_SCRIPT = """
import os, signal, sys
from bcp_core.dataloader import PackedTokenLoader
LOADER = PackedTokenLoader({"web": [list(range(d * 100, d * 100 + 7)) for d in range(200)]}, 4, 2, num_workers=2)
for i, _ in enumerate(LOADER):
    if i == 2:
        break
print(*(p.pid for p in LOADER._pool.procs), flush=True)
if sys.argv[1] == "killed":
    os.kill(os.getpid(), signal.SIGKILL)
"""


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in "ZX"  # a zombie has ended
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("end", ["exits", "killed"])
def test_a_process_with_read_workers_ends_and_so_do_they(tmp_path, end):
    """A script that ends with its loader's workers running (a module-level loader, never closed)
    exits, and the workers end with it; a training process killed outright leaves no workers
    behind either. Before, the exit hung for good in the loader's __del__ (a queue starting its
    thread during interpreter finalization), and the workers of a killed process ran on forever."""
    import subprocess
    import sys
    import time
    script = tmp_path / "script.py"
    script.write_text(_EXITING_SCRIPT)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    with open(tmp_path / "stderr", "w") as stderr:
        proc = subprocess.Popen([sys.executable, str(script), end], stdout=subprocess.PIPE, stderr=stderr, text=True,
                                env=env)
    workers = [int(pid) for pid in proc.stdout.readline().split()]  # not to EOF: the workers hold the pipe
    try:
        code = proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        code = "still running after 60 s"
    assert len(workers) == 2, (tmp_path / "stderr").read_text()[-3000:]
    deadline = time.monotonic() + 30
    while any(map(_running, workers)) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [pid for pid in workers if _running(pid)]
    for pid in left:
        os.kill(pid, 9)
    proc.stdout.close()
    assert code == (0 if end == "exits" else -9), (tmp_path / "stderr").read_text()[-3000:]
    assert not left, f"read workers {left} outlived their process"
