"""Lightning + BCPCheckpointIO end to end: real Trainers, real DDP / FSDP2 processes on gloo.

Runs recipes/lightning_resume.py in its `--phase run` mode:
  A  DDP, 2 ranks, 4 steps, bcp checkpoints every 2 steps (also the uninterrupted reference)
  N  DDP, 2 ranks, 2 steps, Lightning's own checkpoints (reference for the 1-process resume)
  then resumes from A's step-2 checkpoint on DDP 2 ranks, on FSDP2 2 ranks, on TP 2 ranks, on FSDP1 2 ranks
  (saving again from FSDP1), on 1 process, and from N's on 1 process. The step-2 checkpoint ends an
  epoch (16 samples, 2 x 4 per step), so the data position is the epoch, which Lightning's loop
  state carries.
"""

from __future__ import annotations

import json
import os

import pytest

pytest.importorskip("lightning")
import torch  # noqa: E402

import bcp_core as bcp  # noqa: E402
from bcp_core import codec  # noqa: E402
from dist import run_recipe  # noqa: E402




def _run(nproc: int, *args: str) -> None:
    run_recipe("lightning_resume.py", nproc, *args, timeout=240, torchrun_for_one=False)


def _losses(d) -> dict[int, float]:
    with open(os.path.join(d, "losses.json")) as f:
        return {int(k): v for k, v in json.load(f).items()}


def _assert_same_state(a: dict, b: dict, rng: bool = True) -> None:
    assert a["model"].keys() == b["model"].keys()
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    sa, sb = a["optimizer"]["state"], b["optimizer"]["state"]
    assert sa.keys() == sb.keys() and len(sa) == len(a["model"])
    for fqn in sa:
        for name in sa[fqn]:
            assert torch.equal(torch.as_tensor(sa[fqn][name]), torch.as_tensor(sb[fqn][name])), (fqn, name)
    assert a["optimizer"]["param_groups"] == b["optimizer"]["param_groups"]
    assert a["scheduler"] == b["scheduler"]
    assert a["global_step"] == b["global_step"]
    if rng:
        # b was taken at train start, after the DataLoader iterator drew its base seed: one draw
        g = torch.Generator()
        g.set_state(a["rng"])
        torch.empty((), dtype=torch.int64).random_(generator=g)
        assert torch.equal(g.get_state(), b["rng"]), "torch RNG state not restored"


def _tensors(path) -> dict[str, torch.Tensor]:
    """Model and optimizer tensors of a checkpoint, loaded as plain tensors in this process."""
    state: dict = {"model": {}, "optimizer_0": {}}
    bcp.load(path, state, strict=False)
    out = {}

    def walk(prefix, d):
        for k, v in d.items():
            if isinstance(v, dict):
                walk(f"{prefix}{k}.", v)
            elif isinstance(v, torch.Tensor):
                out[prefix + k] = v
    walk("", state)
    return out


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_lightning_save_resume_across_world_sizes_and_strategies(tmp_path):
    a, n = tmp_path / "a", tmp_path / "n"
    ckpt = str(tmp_path / "ckpt")
    _run(2, "--out", str(a), "--ckpt-dir", ckpt, "--max-steps", "4", "--dump-at-step", "2")
    _run(2, "--native", "--out", str(n), "--ckpt-dir", str(tmp_path / "native"), "--max-steps", "2")
    uninterrupted = _losses(a)
    assert _losses(n) == {1: uninterrupted[1], 2: uninterrupted[2]}  # bcp does not disturb training

    # every_n_train_steps: both checkpoints, each a committed bcp checkpoint written by both ranks
    assert sorted(os.listdir(ckpt)) == ["step=2.ckpt", "step=4.ckpt"]
    for name in os.listdir(ckpt):
        md = bcp.inspect(os.path.join(ckpt, name))
        assert md.world_size == 2 and {p.rank for t in md.tensors.values() for p in t.pieces} == {0, 1}
    # save_top_k=1: the older checkpoint was removed through remove_checkpoint
    assert os.listdir(ckpt + "_newest") == ["newest-step=4.ckpt"]

    step2 = os.path.join(ckpt, "step=2.ckpt")
    saved = torch.load(a / "state_step2.pt", weights_only=False)

    # same world size: state bit-identical after load, losses identical to the uninterrupted run
    _run(2, "--out", str(tmp_path / "r2"), "--resume", step2, "--max-steps", "4")
    r2 = torch.load(tmp_path / "r2" / "state_start.pt", weights_only=False)
    _assert_same_state(saved, r2)
    assert (saved["epoch"], r2["epoch"]) == (0, 1)  # saved at the last batch of epoch 0; resumes in epoch 1
    assert _losses(tmp_path / "r2") == {3: uninterrupted[3], 4: uninterrupted[4]}

    # DDP -> ModelParallelStrategy (FSDP2) on 2 ranks: the same, sharded differently
    _run(2, "--strategy", "fsdp2", "--out", str(tmp_path / "f2"), "--resume", step2, "--max-steps", "4")
    _assert_same_state(saved, torch.load(tmp_path / "f2" / "state_start.pt", weights_only=False))
    assert _losses(tmp_path / "f2") == {3: uninterrupted[3], 4: uninterrupted[4]}

    # DDP -> ModelParallelStrategy with tensor parallelism over both ranks (a different global batch,
    # so only the loaded state is compared)
    _run(2, "--strategy", "tp", "--out", str(tmp_path / "tp"), "--resume", step2, "--max-steps", "3")
    _assert_same_state(saved, torch.load(tmp_path / "tp" / "state_start.pt", weights_only=False))

    # DDP -> FSDPStrategy (FSDP1, flat-parameter shards; on CPU through the recipe's CPUFSDPStrategy):
    # same losses, and the step-4 checkpoint it writes holds exactly the DDP run's step-4 state
    _run(2, "--strategy", "fsdp", "--out", str(tmp_path / "f1"), "--resume", step2, "--max-steps", "4",
         "--ckpt-dir", str(tmp_path / "f1_ckpt"))
    assert _losses(tmp_path / "f1") == {3: uninterrupted[3], 4: uninterrupted[4]}
    assert bcp.inspect(tmp_path / "f1_ckpt" / "step=4.ckpt").framework == "fsdp1"
    ddp4, fsdp4 = _tensors(os.path.join(ckpt, "step=4.ckpt")), _tensors(tmp_path / "f1_ckpt" / "step=4.ckpt")
    assert ddp4.keys() == fsdp4.keys() and len(ddp4) == 6 * 4  # 6 parameters, 3 Adam tensors each
    for k in ddp4:
        assert torch.equal(ddp4[k], fsdp4[k]), k

    # 2 -> 1 process: bit-identical state, and the same losses as Lightning resuming its own
    # checkpoint of the same run on 1 process
    _run(1, "--out", str(tmp_path / "r1"), "--resume", step2, "--max-steps", "6")
    _run(1, "--native", "--out", str(tmp_path / "n1"), "--resume",
         str(tmp_path / "native" / "step=2.ckpt"), "--max-steps", "6")
    r1 = torch.load(tmp_path / "r1" / "state_start.pt", weights_only=False)
    _assert_same_state(saved, r1)
    _assert_same_state(r1, torch.load(tmp_path / "n1" / "state_start.pt", weights_only=False), rng=False)
    assert _losses(tmp_path / "r1") == _losses(tmp_path / "n1")
    assert sorted(_losses(tmp_path / "r1")) == [3, 4, 5, 6]


def test_save_timings_reach_the_trainer_loggers(tmp_path):
    """One process: BCPCheckpointIO hands each save's phase timings to Lightning's loggers."""
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.loggers import CSVLogger
    from torch.utils.data import DataLoader, TensorDataset

    from bcp_integrations.lightning import BCPCheckpointIO

    class Net(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 1)

        def training_step(self, batch, _):
            x, y = batch
            return torch.nn.functional.mse_loss(self.lin(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    torch.manual_seed(0)
    data = DataLoader(TensorDataset(torch.randn(16, 4), torch.randn(16, 1)), batch_size=4)
    logger = CSVLogger(str(tmp_path), name="logs")
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=4, logger=logger, log_every_n_steps=1,
                        enable_progress_bar=False, plugins=[BCPCheckpointIO()],
                        callbacks=[ModelCheckpoint(dirpath=str(tmp_path / "ckpts"), every_n_train_steps=2,
                                                   save_top_k=-1)])
    trainer.fit(Net(), data)
    with open(os.path.join(logger.log_dir, "metrics.csv")) as f:
        header = f.readline()
    assert "bcp/save/write_s" in header and "bcp/save/total_s" in header, header
    assert bcp.inspect(str(tmp_path / "ckpts" / "epoch=0-step=4.ckpt")).tensors


def test_the_first_checkpoint_uses_staging_prepared_after_the_first_step(tmp_path, monkeypatch):
    """One process: after the first optimizer step the mixin prepares the saves
    (`bcp.prepare_save` with the state a save holds, Adam's moments included): the only planning of
    the run, both checkpoints reuse its plan, and the first one stages into the buffers prepared
    (none allocated in its call)."""
    import lightning as L
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint
    from torch.utils.data import DataLoader, TensorDataset

    from bcp_core import staging
    from bcp_core.checkpointer import get_checkpointer
    from bcp_integrations.lightning import BCPCheckpointIO

    class Net(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(64, 64)

        def training_step(self, batch, _):
            x, y = batch
            return torch.nn.functional.mse_loss(self.lin(x), y)

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=0.1)

    prepared, allocated = [], []
    real_prepare, real_buffer = bcp.prepare_save, staging.host_buffer
    monkeypatch.setattr(bcp, "prepare_save", lambda state, **kw: prepared.append(sorted(state)) or
                        real_prepare(state, **kw).result())  # ready before the next step, for the count below
    monkeypatch.setattr(staging, "host_buffer", lambda src: allocated.append(src.shape) or real_buffer(src))

    class Steps(Callback):
        def on_train_batch_end(self, trainer, *args):
            self.at = getattr(self, "at", []) + [(trainer.global_step, len(prepared), len(allocated))]

    steps = Steps()
    torch.manual_seed(0)
    data = DataLoader(TensorDataset(torch.randn(16, 64), torch.randn(16, 64)), batch_size=4)
    cp = get_checkpointer()
    before = dict(cp.stats)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=4, logger=False, enable_progress_bar=False,
                        plugins=[BCPCheckpointIO()], callbacks=[
                            steps, ModelCheckpoint(dirpath=str(tmp_path / "ckpts"), every_n_train_steps=2,
                                                   save_top_k=-1)])
    trainer.fit(Net(), data)
    assert prepared == [["extra_state", "lightning", "model", "optimizer_0"]]
    # prepared after the first step (by a callback after this one), before the first checkpoint
    assert [a[:2] for a in steps.at[:2]] == [(1, 0), (2, 1)]
    staged_by_prepare = steps.at[1][2]
    assert staged_by_prepare > 0 and len(allocated) == staged_by_prepare  # the checkpoints allocated nothing
    assert cp.stats["plans"] - before["plans"] == 1 and cp.stats["cache_hits"] - before["cache_hits"] == 2
    assert bcp.inspect(str(tmp_path / "ckpts" / "epoch=0-step=2.ckpt")).tensors


@pytest.mark.slow  # the default tier stays under 6 minutes; CI runs both
@pytest.mark.timeout(300)
def test_packed_token_loader_state_leaves_the_loop_state_and_is_resharded_2_to_1(tmp_path):
    """bcp's PackedTokenLoader as Lightning's train dataloader (DDP, 2 ranks), checkpointed mid-epoch
    by ModelCheckpoint: its state is saved per DP rank under `dataloader` (not in Lightning's loop
    state), taken as of before the batch Lightning had fetched ahead, and split/merged on resume on
    1 process: the rest of the epoch holds exactly the tokens not trained on before the checkpoint."""
    from collections import Counter

    _run(2, "--packed", "--max-steps", "4", "--every", "2", "--out", str(tmp_path / "a"),
         "--ckpt-dir", str(tmp_path / "ckpt"))
    ckpt = tmp_path / "ckpt" / "step=2.ckpt"
    md = bcp.inspect(ckpt)
    assert md.objects["dataloader.format"].encoded == "bcp.PackedTokenLoader/1"
    assert [s.index for s in md.sharded_objects["dataloader.units.0"].shards] == [(0,), (1,)]
    state: dict = {"lightning": None}
    bcp.load(ckpt, state, strict=False)
    loops = codec.decode(json.loads(state["lightning"]), "lightning", False)["loops"]
    assert loops["fit_loop"]["state_dict"]["combined_loader"] == ["dataloader"]  # a name, not a state
    _run(1, "--packed", "--max-steps", "100", "--out", str(tmp_path / "r1"), "--resume", str(ckpt))

    def tokens(batches) -> Counter:
        return Counter(t for b in batches for row in b for t in row if t != -1)

    before = Counter()
    for rank in (0, 1):
        with open(tmp_path / "a" / f"batches_rank{rank}.json") as f:
            before += tokens(b for step, b in json.load(f) if step <= 2)
    with open(tmp_path / "r1" / "batches_rank0.json") as f:
        resumed = json.load(f)
    after = tokens(b for _, b in resumed)
    assert resumed[0][0] == 3  # continues at global step 3
    # the recipe's documents: "web" i -> 100i .. 100i+2+i%5, "code" i -> 5000+100i .. +1+i%3
    epoch = Counter([t for i in range(24) for t in range(100 * i, 100 * i + 3 + i % 5)]
                    + [t for i in range(12) for t in range(5000 + 100 * i, 5000 + 100 * i + 2 + i % 3)])
    assert before and after
    assert before + after == epoch  # nothing skipped (the batch fetched ahead included), nothing repeated


def test_a_deeply_nested_lightning_value_is_a_metadata_error_naming_it(tmp_path):
    """The trainer's own part of a checkpoint is JSON text inside it: nested 100,000 deep it is refused
    naming the checkpoint, not a RecursionError."""
    from types import SimpleNamespace

    from bcp_integrations.lightning import BCPCheckpointIO
    model = torch.nn.Linear(2, 2)
    bcp.save(str(tmp_path), {"model": model, "lightning": "[" * 100_000 + "]" * 100_000}).wait()
    strategy = SimpleNamespace(model=model, optimizers=[], lightning_module=None)
    with pytest.raises(bcp.MetadataError, match=f"Lightning checkpoint value of {tmp_path}"):
        BCPCheckpointIO().load_all_ranks(strategy, str(tmp_path))
