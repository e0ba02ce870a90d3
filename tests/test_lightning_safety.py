"""What a failed Lightning save or load through BCPCheckpointIO leaves behind, one process, real Trainers:

- `trainer.save_checkpoint(p)` again at the same global step, failing (ENOSPC): `p` still holds the
  first checkpoint, committed; a re-save that succeeds replaces it;
- a load that cannot succeed (a pickled value without `allow_pickle`, an opaque loader's state at
  another DP degree) raises before anything is loaded: the model and optimizer stay as they were;
- with tiers, a weights-only save of a step first (`ModelCheckpoint(save_weights_only=True)`) does
  not make the full save of the same step be skipped: resuming from the tiers restores the optimizer.
"""

from __future__ import annotations

import errno
import os
import pathlib

import pytest

pytest.importorskip("lightning")

import lightning as L  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.callbacks import Callback, ModelCheckpoint  # noqa: E402
from torch import nn  # noqa: E402

import bcp_core as bcp  # noqa: E402
from bcp_core.errors import LoaderStateError  # noqa: E402
from bcp_core.storage.faults import Fault, inject  # noqa: E402
from bcp_integrations.lightning import BCPCheckpointIO  # noqa: E402


class Net(L.LightningModule):
    def __init__(self, extra=None):
        super().__init__()
        if extra is not None:
            self.save_hyperparameters({"extra": extra})
        self.net = nn.Linear(4, 1)

    def training_step(self, batch, _):
        return self.net(batch[0]).pow(2).mean()

    def configure_optimizers(self):
        opt = torch.optim.Adam(self.parameters(), lr=0.1)
        return [opt], [{"scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5), "interval": "step"}]

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(16, 4, generator=g)),
                                           batch_size=4)


def _trainer(root, io, steps: int = 2, callbacks=()) -> L.Trainer:
    return L.Trainer(default_root_dir=str(root), max_steps=steps, plugins=[io], callbacks=list(callbacks),
                     enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks), logger=False,
                     enable_progress_bar=False, enable_model_summary=False, accelerator="cpu", devices=1,
                     num_sanity_val_steps=0)


def _values(module: L.LightningModule, trainer: L.Trainer) -> dict:
    return {"model": {k: v.clone() for k, v in module.state_dict().items()},
            "optimizer": {i: {k: v.clone() for k, v in s.items()}
                          for i, s in trainer.optimizers[0].state_dict()["state"].items()}}


def _assert_equal(a: dict, b: dict) -> None:
    assert a["model"].keys() == b["model"].keys()
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    assert a["optimizer"].keys() == b["optimizer"].keys() and a["optimizer"]
    for i in a["optimizer"]:
        for k in a["optimizer"][i]:
            assert torch.equal(a["optimizer"][i][k], b["optimizer"][i][k]), (i, k)


class _AtStart(Callback):
    """The model's and optimizer's values once a fit's checkpoint is restored."""

    def on_train_start(self, trainer, module):
        self.values = _values(module, trainer)
        self.global_step = trainer.global_step


def _resumed(root, path) -> _AtStart:
    at = _AtStart()
    torch.manual_seed(99)  # other initial values than the saved ones
    _trainer(root, BCPCheckpointIO(async_save=False), steps=3, callbacks=[at]).fit(Net(), ckpt_path=path)
    return at


@pytest.mark.timeout(120)
def test_a_failed_resave_of_the_same_step_leaves_the_previous_checkpoint(tmp_path):
    """`trainer.save_checkpoint(p)` twice at global step 2, the second failing (ENOSPC): `p` still
    holds the first, committed and whole (before the fix the second save wrote into the first one's
    step directory, dropping its metadata first, and its failure then removed `p`). A third save,
    succeeding, replaces it: `p` holds one checkpoint, the newest."""
    torch.manual_seed(0)
    module = Net()
    trainer = _trainer(tmp_path, BCPCheckpointIO(async_save=False))
    trainer.fit(module)
    saved = _values(module, trainer)
    path = str(tmp_path / "final.ckpt")
    trainer.save_checkpoint(path)
    first = bcp.resolve(path).root
    full = Fault("write", error=OSError(errno.ENOSPC, "No space left on device"), path=f"{path}/*")
    with inject(full), pytest.raises(bcp.SaveError, match="No space left on device"):
        trainer.save_checkpoint(path)
    assert bcp.resolve(path).root == first
    at = _resumed(tmp_path, path)
    assert at.global_step == 2
    _assert_equal(saved, at.values)

    trainer.save_checkpoint(path)  # the same step again, succeeding: it replaces the first
    again = bcp.resolve(path).root
    assert again != first and bcp.inspect(path).keys() >= {"model.net.weight", "optimizer_0.state.net.weight.exp_avg"}
    assert sorted(os.listdir(path)) == sorted(["latest", os.path.basename(again)])
    at = _resumed(tmp_path, path)
    assert at.global_step == 2
    _assert_equal(saved, at.values)


class _Untouched:
    """A model's values before a fit, and its optimizer as configured (Net keeps it)."""

    def __init__(self, module: L.LightningModule):
        self.module, self.before = module, {k: v.clone() for k, v in module.state_dict().items()}

    def check(self, opt: torch.optim.Optimizer | None) -> None:
        after = self.module.state_dict()
        assert [k for k, v in self.before.items() if not torch.equal(v, after[k])] == []
        assert opt is not None and len(opt.state) == 0  # no Adam state loaded into it


@pytest.mark.timeout(120)
def test_a_load_refused_for_a_pickled_value_leaves_the_model_and_optimizer_untouched(tmp_path):
    """A checkpoint whose hparams needed `allow_pickle=True`, resumed with the default: the load raises
    PickleNotAllowedError before anything is read into the model and optimizer (before the fix, bcp
    had loaded them and only Lightning's value then raised)."""

    class Kept(Net):
        def configure_optimizers(self):
            self.opt = torch.optim.Adam(self.parameters(), lr=0.1)
            return self.opt

    torch.manual_seed(0)
    trainer = _trainer(tmp_path, BCPCheckpointIO(async_save=False, allow_pickle=True))
    trainer.fit(Kept(extra=pathlib.PurePosixPath("/x")))
    path = str(tmp_path / "pickled.ckpt")
    trainer.save_checkpoint(path)

    torch.manual_seed(1)
    fresh = Kept(extra=pathlib.PurePosixPath("/x"))
    untouched = _Untouched(fresh)
    with pytest.raises(bcp.PickleNotAllowedError, match="hyper_parameters"):
        _trainer(tmp_path, BCPCheckpointIO(async_save=False), steps=4).fit(fresh, ckpt_path=path)
    untouched.check(fresh.opt)


@pytest.mark.slow  # the default tier stays under 6 minutes; CI runs both
@pytest.mark.timeout(300)
def test_a_load_refused_for_an_opaque_loader_at_another_dp_degree_leaves_the_model_untouched(tmp_path):
    """A StatefulDataLoader's state, saved mid-epoch by 2 DDP ranks (torchrun), resumed on 1 process:
    LoaderStateError (bcp cannot split an opaque loader state) before anything is read into the
    model and optimizer (before the fix it was raised after bcp had loaded them)."""
    pytest.importorskip("torchdata")
    from dist import Job
    from jobs.lightning_opaque_loader import OpaqueNet, loader

    job = Job("lightning_opaque_loader.py", 2, "--ckpt-dir", str(tmp_path / "ckpt"))
    assert job.finish(timeout=240) == 0, job.output[-4000:]
    path = str(tmp_path / "ckpt" / "step=2.ckpt")
    assert bcp.inspect(path).objects["dataloader.format"].encoded == "bcp.OpaqueLoader/1"

    torch.manual_seed(1)
    fresh = OpaqueNet()
    untouched = _Untouched(fresh)
    with pytest.raises(LoaderStateError, match="data-parallel degree 2 and this job has 1"):
        _trainer(tmp_path, BCPCheckpointIO(async_save=False), steps=4).fit(fresh, loader(), ckpt_path=path)
    untouched.check(fresh.opt)


@pytest.mark.timeout(120)
def test_a_weights_only_save_of_a_tiered_step_does_not_drop_its_full_save(tmp_path, monkeypatch):
    """BCPCheckpointIO(tiers=...) with two ModelCheckpoints at step 2, the first `save_weights_only`:
    the tiers take the full save after the weights-only one (before the fix the second save of a
    step was skipped whatever it held), so resuming from the tiers restores the optimizer and the
    scheduler; further saves of the step holding no more are skipped."""
    (tmp_path / "mem").mkdir()
    monkeypatch.setenv("BCP_MEMORY_DIR", str(tmp_path / "mem"))
    tiers = bcp.Tiers("memory://lightning-weights-first", replicas=0)
    saves = []
    real_save = bcp.save
    monkeypatch.setattr(bcp, "save", lambda path, state, **kw: saves.append(sorted(state)) or
                        real_save(path, state, **kw))

    def every_2(name, **kw):
        return ModelCheckpoint(dirpath=str(tmp_path / name), every_n_train_steps=2, save_top_k=-1, **kw)

    torch.manual_seed(0)
    module = Net()
    trainer = _trainer(tmp_path, BCPCheckpointIO(tiers=tiers), callbacks=[  # (modes: distinct state keys)
        every_2("weights", save_weights_only=True, mode="max"), every_2("full", mode="min")])
    trainer.fit(module)
    saved = _values(module, trainer)
    assert saves == [["extra_state", "lightning", "model"], ["extra_state", "lightning", "model", "optimizer_0"]]
    trainer.save_checkpoint(str(tmp_path / "again.ckpt"))  # the same step, holding no more: skipped
    trainer.save_checkpoint(str(tmp_path / "again.ckpt"), weights_only=True)
    assert len(saves) == 2

    at = _AtStart()
    torch.manual_seed(99)
    resumed = _trainer(tmp_path, BCPCheckpointIO(tiers=tiers), steps=3, callbacks=[at])
    resumed.fit(Net(), ckpt_path=tiers)
    assert at.global_step == 2
    _assert_equal(saved, at.values)
    assert resumed.lr_scheduler_configs[0].scheduler.state_dict()["last_epoch"] == 3  # 2 restored, then a step


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_failed_resave_on_one_of_2_ranks_leaves_the_previous_checkpoint(tmp_path):
    """tests/jobs/lightning_resave.py (DDP, 2 ranks, torchrun, asynchronous saves): the same global
    step saved to one path three times, the second failing on rank 1 (ENOSPC). Both ranks get the
    SaveError and still resolve the path to the first checkpoint; the third save replaces it; the
    path then holds one checkpoint, with the model's values."""
    from dist import Job

    job = Job("lightning_resave.py", 2, "--root", str(tmp_path), env={"BCP_TEST_FAULT": "write:rank=1:save=2"})
    assert job.finish(timeout=240) == 0, job.output[-4000:]
    path = str(tmp_path / "final.ckpt")
    for rank in (0, 1):
        assert "No space left on device" in (tmp_path / f"second_rank{rank}.txt").read_text()
        first = (tmp_path / f"after_failure_rank{rank}.txt").read_text()
        assert first == f"{path}/step_00000002"
    last = bcp.resolve(path).root
    assert last != first and sorted(os.listdir(path)) == sorted(["latest", os.path.basename(last)])
    torch.manual_seed(99)
    model = nn.Module()
    model.net = nn.Linear(4, 1)
    bcp.load(path, {"model": model}, strict=False)
    reference = torch.load(tmp_path / "reference.pt")
    assert model.state_dict().keys() == reference.keys()
    for k, v in reference.items():
        assert torch.equal(model.state_dict()[k], v), k
